#include "service/service.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <sys/socket.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <random>

#include <httplib.h>
#include <spdlog/spdlog.h>

#include "effects/http_transfer.h"
#include "journal/json.h"
#include "service/http_util.h"

#ifdef RC_HAVE_CUDA  // defined (PUBLIC) by the effects target when CUDA and NCCL were found
#include <cuda_runtime.h>

#include "effects/nccl/nccl_sender.h"
#endif

namespace rc::service {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
inline constexpr int kListenBacklog = 4096;

std::uint64_t us_since(Clock::time_point t) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count());
}

// The worker pool that serves connections now lives behind the connection gate
// (connection_gate.h: WorkerPool); nothing here waits on a client's request bytes.
// Shutdown: after the grace deadline, cancelled proxied calls get this long to be recorded
// aborted (their finish is durable before the journal closes), and the workers this long to exit.
inline constexpr std::uint64_t kShutdownSettleMs = 2000;

std::string hex(const unsigned char* p, std::size_t n) {
  static const char* k = "0123456789abcdef";
  std::string s;
  s.reserve(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    s.push_back(k[p[i] >> 4]);
    s.push_back(k[p[i] & 15]);
  }
  return s;
}

std::int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool is_decision(const Event& e) { return family_of(e) == Family::kDecision; }

json timings_json(const effects::PhaseTimings& t) {
  return {{"drain_us", t.drain_us},         {"preflight_us", t.preflight_us},
          {"transfer_us", t.transfer_us},   {"invalidate_us", t.invalidate_us},
          {"validate_us", t.validate_us},   {"resume_us", t.resume_us},
          {"journal_us", t.journal_us},     {"total_us", t.total_us}};
}

#ifdef RC_HAVE_CUDA
std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Checked before the journal is opened, so a host without the configured GPU changes nothing.
Status CheckCudaDevice(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count <= 0) {
    return Status::Unavailable(
        "transfer 'nccl': CUDA device " + std::to_string(device) + " is not usable: " +
        (e != cudaSuccess ? CudaError("cudaGetDeviceCount", e) : std::string("no CUDA device")) +
        " (no GPU or no driver on this host?)");
  }
  if (device >= count) {
    return Status::InvalidArgument("transfer 'nccl': cuda_device " + std::to_string(device) +
                                   " does not exist: this host has " + std::to_string(count) +
                                   " CUDA device(s), 0.." + std::to_string(count - 1));
  }
  e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    return Status::Unavailable("transfer 'nccl': CUDA device " + std::to_string(device) +
                               " is not usable: " + CudaError("cudaSetDevice", e));
  }
  return Status::OK();
}

// The NcclSender as serve calls it: from httplib workers (the runner on the update route,
// /v1/manifest on any worker). The sender needs the communicator's device current on the calling
// thread and is not safe for concurrent calls (its source cache), so every call here makes the
// device current and holds one lock. A manifest preflight waits at most preflight_wait_ms for a
// running transfer, then answers without a digest (the route says why) instead of blocking.
class ServeNcclTransfer final : public effects::WeightTransfer {
 public:
  ServeNcclTransfer(effects::EngineClient& engine, effects::nccl::NcclSenderOptions options,
                    std::uint64_t preflight_wait_ms)
      : device_(options.device),
        preflight_wait_ms_(preflight_wait_ms),
        sender_(engine, std::move(options)) {}

  [[nodiscard]] Status Init(std::uint64_t deadline_ms) {
    std::lock_guard<std::timed_mutex> lock(mu_);
    return sender_.Init(deadline_ms);  // sets this thread's device itself
  }

  PreflightObserved Preflight(const effects::TransferTarget& target) override {
    std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
    if (!lock.try_lock_for(std::chrono::milliseconds(preflight_wait_ms_))) {
      PreflightObserved p;
      p.detail = "the NCCL sender is busy with a transfer (waited " +
                 std::to_string(preflight_wait_ms_) + " ms); try again";
      return p;
    }
    // A failure leaves the thread on another device: the sender's own check then reports it.
    (void)cudaSetDevice(device_);
    return sender_.Preflight(target);
  }

  TransferObserved Transfer(const effects::TransferTarget& target,
                                     std::uint64_t deadline_ms) override {
    const auto t0 = Clock::now();
    TransferObserved refused;  // mutation kNone: nothing reached the engine
    refused.finish_label = target.target.label;
    std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
    if (!lock.try_lock_for(std::chrono::milliseconds(deadline_ms))) {
      refused.error = "the NCCL sender stayed busy for the whole transfer deadline";
      refused.duration_us = us_since(t0);
      return refused;
    }
    const std::uint64_t waited_ms = us_since(t0) / 1000;
    if (waited_ms >= deadline_ms) {
      refused.error = "the NCCL sender stayed busy for the whole transfer deadline";
      refused.duration_us = us_since(t0);
      return refused;
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      refused.error = CudaError("cudaSetDevice", e).substr(0, kTextBytesMax);
      refused.duration_us = us_since(t0);
      return refused;
    }
    return sender_.Transfer(target, deadline_ms - waited_ms);
  }

  const effects::nccl::NcclSender& sender() const { return sender_; }

 private:
  const int device_;
  const std::uint64_t preflight_wait_ms_;
  std::timed_mutex mu_;
  effects::nccl::NcclSender sender_;
};
#endif  // RC_HAVE_CUDA

}  // namespace

std::string DeriveCacheSalt(const RolloutAdmitted& b, const std::string& client_salt) {
  std::string material = "rolloutcore-salt-v1";
  for (const std::string& part :
       {std::to_string(b.version.generation), b.version.label, b.identity.manifest_digest,
        b.identity.content_digest, b.identity.checkpoint, b.identity.run,
        std::to_string(b.identity.step), client_salt}) {
    material += '\x1f';
    material += std::to_string(part.size());
    material += ':';
    material += part;
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(material.data()), material.size(), digest);
  return "rc" + std::to_string(b.version.generation) + "-" + hex(digest, 16);
}

Service::Service(ServeConfig config) : config_(std::move(config)) {}

Service::~Service() {
  if (server_) server_->stop();
  if (server_thread_.joinable()) server_thread_.join();
}

std::string Service::url() const {
  return "http://" + config_.listen_host + ":" + std::to_string(port_);
}

Result<std::unique_ptr<Service>> Service::Open(const ServeConfig& config) {
  RC_RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<Service> s(new Service(config));
  RC_RETURN_IF_ERROR(s->Init());
  return s;
}

// `--transfer nccl` is checked before anything is opened: a build without CUDA, or a host without
// the configured device, is refused with nothing started.
static Status CheckTransferBuildAndDevice(const ServeConfig& config) {
  if (config.transfer != "nccl") return Status::OK();
#ifndef RC_HAVE_CUDA
  return Status::Unavailable(
      "transfer 'nccl' needs CUDA and NCCL, and this rolloutcore was built without them (CMake "
      "found no CUDA toolkit/NCCL when it was configured): rebuild on a host with both, or use "
      "--transfer http");
#else
  return CheckCudaDevice(config.cuda_device);
#endif
}

Status Service::Init() {
  RC_RETURN_IF_ERROR(CheckTransferBuildAndDevice(config_));
  std::random_device rd;
  char prefix[32];
  std::snprintf(prefix, sizeof(prefix), "px-%08x%04x-", static_cast<unsigned>(rd()),
                static_cast<unsigned>(rd() & 0xffff));
  rollout_prefix_ = prefix;

  journal::Options jo;
  jo.sync = config_.journal_sync;
  auto opened = journal::Journal::Open(config_.journal_path, jo);
  if (!opened.ok()) return opened.status();
  journal_ = std::move(opened.value());

  std::string traj = config_.trajectories_path;
  if (traj.empty()) {
    std::filesystem::path p(config_.journal_path);
    if (!p.has_filename()) p = p.parent_path();
    traj = (p.parent_path() / "trajectories.jsonl").string();
  }
  RC_RETURN_IF_ERROR(trajectories_.Open(traj, config_.trajectories_bytes_max));

  effects::EngineDeadlines control_deadlines;
  control_deadlines.connect_timeout_ms = config_.connect_timeout_ms;
  control_deadlines.call_timeout_ms = config_.call_timeout_ms;
  control_deadlines.drain_timeout_ms = config_.drain_timeout_ms;
  control_deadlines.update_timeout_ms = config_.transfer_timeout_ms;
  control_client_ = std::make_unique<effects::EngineClient>(config_.engine_url, control_deadlines);
  effects::EngineDeadlines proxy_deadlines = control_deadlines;
  proxy_deadlines.call_timeout_ms = config_.request_timeout_ms;
  // One pooled handle (and keep-alive connection) per concurrent proxied call: with the default
  // 16, most calls under load paid a TCP connect to the engine (and the engine an accept).
  proxy_client_ = std::make_unique<effects::EngineClient>(config_.engine_url, proxy_deadlines,
                                                          config_.engine_connections_max);
  // The runner drains locally before pausing (effects/runner.cc), so the plain HTTP control.
  http_control_ = std::make_unique<effects::HttpEngineControl>(*control_client_);

  effects::PackingParams packing;
  packing.packed_buffer_size_bytes = config_.packed_buffer_size_bytes;
  packing.packed_num_buffers = config_.packed_num_buffers;
  effects::EngineProtocol protocol = effects::HttpSequenceTransfer::DefaultProtocol();
  // Initialises the transfer with the engine once the journal is bootstrapped (below).
  std::function<Status()> init_transfer;
  if (config_.transfer == "nccl") {
#ifdef RC_HAVE_CUDA
    auto rendezvous = ParseHostPort(config_.rendezvous);
    RC_CHECK(rendezvous.ok());  // ValidateConfig requires a well-formed one for nccl
    effects::nccl::NcclSenderOptions so;
    so.device = config_.cuda_device;
    so.master_address = rendezvous->host;
    so.master_port = rendezvous->port;
    so.world_size = config_.nccl_world_size;
    so.packing = packing;
    so.http_timeout_ms = config_.call_timeout_ms;
    so.abort_reserve_ms = config_.nccl_abort_reserve_ms;
    auto nccl = std::make_unique<ServeNcclTransfer>(*control_client_, so, config_.call_timeout_ms);
    ServeNcclTransfer* sender = nccl.get();
    transfer_ = std::move(nccl);
    init_transfer = [this, sender]() -> Status {
      spdlog::info("serve: NCCL sender: rendezvous with {} (cuda_device {}, rendezvous {}, "
                   "deadline {} ms)", config_.engine_url, config_.cuda_device,
                   config_.rendezvous, config_.nccl_init_timeout_ms);
      Status st = sender->Init(config_.nccl_init_timeout_ms);
      if (!st.ok()) {
        return Status(st.code(), "transfer 'nccl': init with the engine at " + config_.engine_url +
                                     " (cuda_device " + std::to_string(config_.cuda_device) +
                                     ", rendezvous " + config_.rendezvous + ", deadline " +
                                     std::to_string(config_.nccl_init_timeout_ms) +
                                     " ms) failed: " + st.message());
      }
      spdlog::info("serve: NCCL sender ready: engine {} (protocol line of {}), rendezvous {}, "
                   "store port {}, abort reserve {} ms",
                   config_.engine_url, sender->sender().protocol().version,
                   effects::nccl::rendezvous_name(sender->sender().rendezvous()),
                   sender->sender().store_port(), sender->sender().abort_reserve_ms());
      return Status::OK();
    };
#else
    RC_CHECK(false);  // CheckTransferBuildAndDevice refused it before anything was opened
#endif
  } else {
    effects::HttpReply version = control_client_->Version();
    if (version.http.ok_2xx() && version.body.is_object() &&
        version.body.value("version", json()).is_string()) {
      effects::EngineProtocol detected = effects::detect_protocol(version.body["version"]);
      if (detected.line != effects::ProtocolLine::kUnknown) protocol = detected;
    } else {
      spdlog::warn("serve: GET /version failed ({}); assuming the >= 0.28 protocol line",
                   version.http.error);
    }
    transfer_ = std::make_unique<effects::HttpSequenceTransfer>(*control_client_, protocol, packing);
    init_transfer = [this, protocol]() -> Status {
      if (journal_->state().lifecycle == Lifecycle::kReady) InitWeightTransfer(protocol);
      return Status::OK();
    };
  }

  effects::RunnerOptions ro;
  ro.executor_id = config_.executor_id;
  ro.drain_timeout_ms = config_.drain_timeout_ms;
  ro.transfer_timeout_ms = config_.transfer_timeout_ms;
  ro.call_timeout_ms = config_.call_timeout_ms;
  runner_ = std::make_unique<effects::Runner>(*journal_, *http_control_, *transfer_,
                                              effects::system_clock(), ro);
  runner_->set_observer([this](std::uint64_t seq, const Event& e) {
    if (is_decision(e)) NotifyLifecycle(seq);
  });

  std::lock_guard<std::timed_mutex> lock(update_mu_);
  RC_RETURN_IF_ERROR(runner_->Recover());
  State s = journal_->state();
  if (s.lifecycle == Lifecycle::kUninitialized) {
    WeightIdentity id;
    id.manifest_digest = config_.initial_manifest_digest;
    id.checkpoint = config_.initial_checkpoint;
    id.run = config_.initial_run;
    id.step = config_.initial_step;
    if (id.manifest_digest.empty() && !config_.initial_source.empty()) {
      PreflightObserved p = transfer_->Preflight(
          effects::TransferTarget{"bootstrap", {}, {}, config_.initial_source});
      if (p.source_manifest_digest.empty()) {
        return Status::InvalidArgument("initial_source '" + config_.initial_source +
                                       "': no manifest (" + p.detail + ")");
      }
      id.manifest_digest = p.source_manifest_digest;
    }
    RC_RETURN_IF_ERROR(runner_->Bootstrap(config_.initial_label, id));
  }
  // nccl: a failure here is a startup error (no update could ever succeed without the
  // communicator); the journal keeps what Recover/Bootstrap recorded, which a restart resumes.
  RC_RETURN_IF_ERROR(init_transfer());
  s = journal_->state();
  NotifyLifecycle(journal_->head_seq());
  spdlog::info("serve: journal {} at seq {}, state {}, committed '{}' (generation {})",
               config_.journal_path, journal_->head_seq(), lifecycle_name(s.lifecycle),
               s.committed.label, s.committed.generation);
  watcher_ = std::make_unique<DisconnectWatcher>();
  return Status::OK();
}

void Service::InitWeightTransfer(const effects::EngineProtocol& protocol) {
  // The GPU-free transfer has no data plane, but the engine still needs its weight-transfer
  // engine initialised (rendezvous recorded, no NCCL peer joins). Best effort: a failure here
  // surfaces as a refused update, never as a silent success.
  effects::NcclInitParams init;
  auto rv = ParseHostPort(config_.rendezvous.empty() ? "127.0.0.1:29500" : config_.rendezvous);
  RC_CHECK(rv.ok());  // ValidateConfig checked it
  init.master_address = rv->host;
  init.master_port = rv->port;
  effects::HttpReply ws = control_client_->GetWorldSize(true);
  const std::int64_t world =
      ws.http.ok_2xx() && ws.body.value("world_size", json()).is_number_integer()
          ? ws.body["world_size"].get<std::int64_t>()
          : 1;
  init.world_size = static_cast<std::uint32_t>(1 + std::max<std::int64_t>(1, world));
  effects::PackingParams packing;
  packing.packed_buffer_size_bytes = config_.packed_buffer_size_bytes;
  packing.packed_num_buffers = config_.packed_num_buffers;
  auto info = effects::build_init_info(protocol, init, packing);
  if (!info.ok()) {
    spdlog::warn("serve: weight-transfer init skipped: {}", info.status().ToString());
    return;
  }
  effects::HttpReply r = control_client_->InitWeightTransferEngine(*info);
  if (!r.http.ok_2xx()) {
    spdlog::warn("serve: /init_weight_transfer_engine failed: HTTP {} {}", r.http.http_status,
                 r.http.error);
  }
}

void Service::NotifyLifecycle(std::uint64_t seq) {
  {
    std::lock_guard<std::mutex> lock(lifecycle_mu_);
    lifecycle_seq_ = std::max(lifecycle_seq_, seq);
  }
  lifecycle_epoch_.fetch_add(1, std::memory_order_acq_rel);
  lifecycle_cv_.notify_all();
}

std::shared_ptr<const State> Service::AdmitView(bool fresh) {
  std::lock_guard<std::mutex> lock(view_mu_);
  // The epoch is read before the state: the copy is at least as new as the epoch it is filed
  // under, so a decision journaled after this read bumps the epoch and forces the next refresh.
  const std::uint64_t epoch = lifecycle_epoch_.load(std::memory_order_acquire);
  if (!fresh && view_ != nullptr && view_epoch_ == epoch) return view_;
  view_ = std::make_shared<const State>(journal_->state());
  view_epoch_ = epoch;
  return view_;
}

std::string Service::NextRolloutId() {
  return rollout_prefix_ + std::to_string(rollout_counter_.fetch_add(1) + 1);
}

Status Service::Start() {
  RC_CHECK(!server_ && !http_);
  // Routes live on a server that never listens; a separate listener hands each accepted socket
  // to the connection gate, which gives it to one of http_threads workers only once its request
  // head is complete (connection_gate.h).
  server_ = GatedHttpServer::MakeRoutesServer();
  server_->set_payload_max_length(config_.body_bytes_max);
  server_->set_read_timeout(60, 0);
  server_->set_write_timeout(60, 0);
  RegisterRoutes();
  GateOptions gate;
  gate.header_timeout_ms = config_.header_timeout_ms;
  gate.idle_timeout_ms = config_.idle_timeout_ms;
  gate.connections_max = static_cast<std::size_t>(config_.http_connections_max);
  gate.workers = static_cast<std::size_t>(config_.http_threads);
  http_ = std::make_unique<GatedHttpServer>(*server_, gate);
  httplib::Server& listener = http_->listener();
  listener.set_tcp_nodelay(true);  // headers and body are separate writes: no Nagle stall
  listener.set_read_timeout(60, 0);   // SO_RCVTIMEO/SO_SNDTIMEO of accepted sockets
  listener.set_write_timeout(60, 0);
  port_ = http_->Bind(config_.listen_host, config_.listen_port, kListenBacklog);
  if (port_ <= 0) {
    return Status::Unavailable("cannot bind " + config_.listen_host + ":" +
                               std::to_string(config_.listen_port));
  }
  http_->Start();
  spdlog::info("serve: listening on {}", url());
  return Status::OK();
}

bool Service::Shutdown(std::uint64_t grace_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(grace_ms);
  const auto settle = [] { return Clock::now() + std::chrono::milliseconds(kShutdownSettleMs); };
  shutting_down_.store(true);
  lifecycle_cv_.notify_all();
  const auto wait_rollouts = [this](Clock::time_point until) {
    while (metrics_.proxy_in_flight.load() > 0 && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return metrics_.proxy_in_flight.load() == 0;
  };
  const bool rollouts_done = wait_rollouts(deadline);
  if (!rollouts_done) {
    // Grace is over: cancel the engine calls; each is finished as aborted by its worker.
    const std::size_t n = in_flight_calls_.CancelAll();
    spdlog::warn("serve: cancelled {} proxied rollout(s) at the shutdown deadline", n);
    if (!wait_rollouts(settle())) {
      spdlog::warn("serve: proxied rollouts did not end after cancel; exiting without closing "
                   "the journal");
      return false;
    }
  }
  const bool update_done = update_mu_.try_lock_until(std::max(deadline, Clock::now()));
  if (!update_done) {
    spdlog::warn("serve: an update is still running at the shutdown deadline; exiting without "
                 "closing the journal (recovery will classify it)");
    return false;
  }
  StopBackground();
  if (http_ && !http_->Stop(settle())) {
    // A worker is still inside a handler: everything it uses must outlive it, so nothing is
    // torn down (the caller exits; everything acknowledged is already durable).
    update_mu_.unlock();
    spdlog::warn("serve: HTTP workers still busy after the shutdown deadline; exiting without "
                 "closing the journal");
    return false;
  }
  http_.reset();
  server_.reset();
  runner_.reset();
  trajectories_.Close();
  journal_.reset();  // closes RocksDB
  update_mu_.unlock();
  return rollouts_done;
}

bool Service::Authorized(const httplib::Request& req, httplib::Response& res) {
  if (config_.auth_token.empty()) return true;
  const std::string h = req.get_header_value("Authorization");
  const std::string prefix = "Bearer ";
  if (h.rfind(prefix, 0) != 0) {
    metrics_.unauthorized++;
    res.set_header("WWW-Authenticate", "Bearer");
    send_error(res, 401, "unauthorized", "missing 'Authorization: Bearer <token>'");
    return false;
  }
  const std::string given = h.substr(prefix.size());
  if (given.size() != config_.auth_token.size() ||
      CRYPTO_memcmp(given.data(), config_.auth_token.data(), given.size()) != 0) {
    metrics_.unauthorized++;
    send_error(res, 403, "forbidden", "wrong token");
    return false;
  }
  return true;
}

// ---- admission ----

Service::AdmitResult Service::Admit(const std::string& rollout_id, std::uint64_t wait_ms) {
  AdmitResult out;
  const auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  for (std::uint32_t attempt = 0;; ++attempt) {
    if (shutting_down_.load()) {
      metrics_.admission_rejected_shutdown++;
      out.refusal = {503, "shutting_down", "the executor is shutting down",
                     config_.retry_after_s};
      return out;
    }
    // The cached view on the first look; a fresh copy after a refusal or while waiting.
    const std::shared_ptr<const State> view = AdmitView(/*fresh=*/attempt > 0);
    const State& s = *view;
    if (s.lifecycle == Lifecycle::kTainted) {
      metrics_.admission_rejected_tainted++;
      const std::string why = s.taint ? std::string(cause_name(s.taint->cause)) + " during " +
                                            lifecycle_name(s.taint->from) + " of update '" +
                                            s.taint->update_id + "': " + s.taint->detail
                                      : "no taint record";
      out.refusal = {503, "tainted", "engine is TAINTED; no rollouts are admitted (" + why + ")",
                     0};
      return out;
    }
    if (s.lifecycle == Lifecycle::kReady && !s.update.has_value()) {
      const auto t0 = Clock::now();
      RolloutAdmitted binding = make_admission(s, rollout_id);
      auto submitted = journal_->Submit(binding, wall_ms());
      if (submitted.ok()) {
        Status waited = journal_->Wait(submitted->ticket);
        metrics_.journal_append.ObserveUs(us_since(t0));
        if (!waited.ok()) {
          out.refusal = {503, "journal", "journal commit failed: " + waited.ToString(), 0};
          return out;
        }
        metrics_.admissions++;
        out.admitted = Admission{std::move(binding), submitted->ticket.result.first_seq};
        return out;
      }
      const Status& st = submitted.status();
      if (st.code() == Code::kConflict) {
        out.refusal = {409, "conflict", st.message(), 0};
        return out;
      }
      if (st.code() == Code::kInvalidArgument) {
        out.refusal = {400, "invalid", st.message(), 0};
        return out;
      }
      if (st.code() != Code::kRejected || attempt > 1000) {
        out.refusal = {503, "unavailable", st.ToString(), config_.retry_after_s};
        return out;
      }
      if (attempt > 0 && s.active.size() >= kActiveRolloutsMax) {  // a fresh view's count
        out.refusal = {503, "unavailable", st.message(), config_.retry_after_s};
        return out;
      }
      // The state moved between our read and the journal's decision: look again.
      continue;
    }
    std::unique_lock<std::mutex> lock(lifecycle_mu_);
    if (Clock::now() >= deadline) {
      metrics_.admission_rejected_unavailable++;
      out.refusal = {503, "unavailable",
                     std::string("engine is ") + lifecycle_name(s.lifecycle) +
                         (s.update ? " (update '" + s.update->update_id + "')" : "") +
                         "; not READY within " + std::to_string(wait_ms) + " ms",
                     config_.retry_after_s};
      return out;
    }
    // Woken by every runner decision; the 20 ms cap makes a missed wake-up harmless.
    lifecycle_cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(20)));
  }
}

Status Service::Finish(const std::string& rollout_id, RolloutOutcome outcome,
                       std::uint32_t prompt_tokens, std::uint32_t completion_tokens) {
  const auto t0 = Clock::now();
  auto submitted = journal_->Submit(
      RolloutFinished{rollout_id, outcome, prompt_tokens, completion_tokens}, wall_ms());
  if (!submitted.ok()) return submitted.status();
  Status waited = journal_->Wait(submitted->ticket);
  metrics_.journal_append.ObserveUs(us_since(t0));
  if (!waited.ok()) return waited;
  if (outcome == RolloutOutcome::kCompleted) {
    metrics_.finishes_completed++;
  } else {
    metrics_.finishes_aborted++;
  }
  return Status::OK();
}

// ---- trainer API ----

json Service::StateSummary() const {
  const State s = journal_->state();
  json j;
  j["lifecycle"] = lifecycle_name(s.lifecycle);
  j["committed"] = journal::WeightVersionToJson(s.committed);
  j["identity"] = journal::WeightIdentityToJson(s.committed_identity);
  j["active_rollouts"] = s.active.size();
  j["head_seq"] = journal_->head_seq();
  if (s.update) {
    j["update"] = {{"update_id", s.update->update_id},
                   {"target", journal::WeightVersionToJson(s.update->target)}};
  } else {
    j["update"] = nullptr;
  }
  if (s.taint) {
    j["taint"] = {{"from", lifecycle_name(s.taint->from)},
                  {"cause", cause_name(s.taint->cause)},
                  {"update_id", s.taint->update_id},
                  {"target", journal::WeightVersionToJson(s.taint->target)},
                  {"detail", s.taint->detail}};
  } else {
    j["taint"] = nullptr;
  }
  j["counters"] = {{"rollouts_admitted", s.counters.rollouts_admitted},
                   {"rollouts_completed", s.counters.rollouts_completed},
                   {"rollouts_aborted", s.counters.rollouts_aborted},
                   {"rollouts_abandoned", s.counters.rollouts_abandoned},
                   {"updates_requested", s.counters.updates_requested},
                   {"updates_committed", s.counters.updates_committed},
                   {"updates_refused", s.counters.updates_refused},
                   {"recoveries", s.counters.recoveries}};
  return j;
}

void Service::HandleState(const httplib::Request& req, httplib::Response& res) {
  if (req.has_param("full")) {
    json j = journal::StateToJson(journal_->state());
    j["head_seq"] = journal_->head_seq();
    send_json(res, 200, j);
    return;
  }
  send_json(res, 200, StateSummary());
}

void Service::HandleVersion(const httplib::Request&, httplib::Response& res) {
  const State s = journal_->state();
  send_json(res, 200,
            {{"lifecycle", lifecycle_name(s.lifecycle)},
             {"version", journal::WeightVersionToJson(s.committed)},
             {"identity", journal::WeightIdentityToJson(s.committed_identity)}});
}

namespace {

Result<UpdateRequested> parse_update(const json& body) {
  RC_RETURN_IF_ERROR(only_fields(body, {"update_id", "target_label", "identity", "source"}, ""));
  UpdateRequested r;
  auto id = get_string(body, "update_id", true);
  if (!id.ok()) return id.status();
  r.update_id = *id;
  auto label = get_string(body, "target_label", true);
  if (!label.ok()) return label.status();
  r.target_label = *label;
  auto source = get_string(body, "source", true);
  if (!source.ok()) return source.status();
  r.source_uri = *source;
  bool known = false;
  for (const char* p : {"safetensors:", "ipc:", "synthetic:"}) {
    known = known || r.source_uri.rfind(p, 0) == 0;
  }
  if (!known) {
    return Status::InvalidArgument(
        "'source' must start with safetensors:, ipc: or synthetic: (got '" +
        r.source_uri.substr(0, 64) + "')");
  }
  auto it = body.find("identity");
  if (it == body.end() || !it->is_object()) {
    return Status::InvalidArgument("missing object field 'identity'");
  }
  const json& idj = *it;
  RC_RETURN_IF_ERROR(only_fields(
      idj, {"manifest_digest", "content_digest", "checkpoint", "run", "step"}, "identity."));
  auto md = get_string(idj, "manifest_digest", true, "identity.");
  if (!md.ok()) return md.status();
  auto cd = get_string(idj, "content_digest", false, "identity.");
  if (!cd.ok()) return cd.status();
  auto ck = get_string(idj, "checkpoint", false, "identity.");
  if (!ck.ok()) return ck.status();
  auto run = get_string(idj, "run", false, "identity.");
  if (!run.ok()) return run.status();
  auto step = get_int(idj, "step", -1, -1, INT64_MAX, "identity.");
  if (!step.ok()) return step.status();
  r.identity = WeightIdentity{*md, *cd, *ck, *run, *step};
  return r;
}

}  // namespace

void Service::HandleUpdate(const httplib::Request& req, httplib::Response& res) {
  if (!Authorized(req, res)) return;
  auto body = parse_object(req.body, false);
  Result<UpdateRequested> request = body.ok() ? parse_update(*body) : body.status();
  if (!request.ok()) {
    metrics_.bad_requests++;
    send_status(res, request.status());
    return;
  }
  if (shutting_down_.load()) {
    send_error(res, 503, "shutting_down", "the executor is shutting down");
    return;
  }
  std::unique_lock<std::timed_mutex> lock(update_mu_, std::try_to_lock);
  if (!lock.owns_lock()) {
    metrics_.updates_conflict++;
    std::lock_guard<std::mutex> g(update_id_mu_);
    send_error(res, 409, "conflict",
               "update '" + running_update_id_ + "' is running; one update at a time");
    return;
  }
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_ = request->update_id;
  }
  Result<UpdateEnded> ended = runner_->Update(*request);
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_.clear();
    last_timings_ = runner_->last_timings();
  }
  NotifyLifecycle(journal_->head_seq());
  json out;
  out["update_id"] = request->update_id;
  out["state"] = StateSummary();
  out["timings"] = timings_json(runner_->last_timings());
  if (!ended.ok()) {
    const Status& st = ended.status();
    if (st.code() == Code::kRejected || st.code() == Code::kConflict) metrics_.updates_conflict++;
    out["error"] = {{"message", st.message()}, {"type", code_name(st.code())},
                    {"code", http_status_for(st)}};
    out["outcome"] = nullptr;
    send_json(res, http_status_for(st), out);
    return;
  }
  out["outcome"] = update_outcome_name(ended->outcome);
  out["reason"] = ended->reason;
  int status = 200;
  switch (ended->outcome) {
    case UpdateOutcome::kCommitted: metrics_.updates_committed++; break;
    case UpdateOutcome::kRefused: metrics_.updates_refused++; status = 422; break;
    case UpdateOutcome::kTainted: metrics_.updates_tainted++; status = 500; break;
  }
  send_json(res, status, out);
}

void Service::HandleAdmit(const httplib::Request& req, httplib::Response& res) {
  if (!Authorized(req, res)) return;
  auto body = parse_object(req.body, true);
  Status st = body.ok() ? only_fields(*body, {"rollout_id", "wait_ms"}, "") : body.status();
  std::string id;
  std::int64_t wait_ms = 0;
  if (st.ok()) {
    auto r = get_string(*body, "rollout_id", false);
    if (!r.ok()) st = r.status(); else id = *r;
  }
  if (st.ok()) {
    auto w = get_int(*body, "wait_ms", static_cast<std::int64_t>(config_.admit_wait_ms), 0,
                     static_cast<std::int64_t>(config_.admit_wait_ms));
    if (!w.ok()) st = w.status(); else wait_ms = *w;
  }
  if (!st.ok()) {
    metrics_.bad_requests++;
    send_status(res, st);
    return;
  }
  if (id.empty()) id = NextRolloutId();
  AdmitResult a = Admit(id, static_cast<std::uint64_t>(wait_ms));
  if (!a.admitted) {
    if (a.refusal.retry_after_s > 0) {
      res.set_header("Retry-After", std::to_string(a.refusal.retry_after_s));
    }
    send_error(res, a.refusal.http_status, a.refusal.type, a.refusal.message);
    return;
  }
  const RolloutAdmitted& b = a.admitted->binding;
  send_json(res, 201,
            {{"rollout_id", b.rollout_id},
             {"admission_seq", a.admitted->seq},
             {"version", journal::WeightVersionToJson(b.version)},
             {"identity", journal::WeightIdentityToJson(b.identity)},
             {"cache_salt", DeriveCacheSalt(b, "")}});
}

void Service::HandleFinish(const httplib::Request& req, httplib::Response& res) {
  if (!Authorized(req, res)) return;
  const std::string id = req.matches[1];
  auto body = parse_object(req.body, true);
  Status st = body.ok() ? only_fields(*body, {"outcome", "prompt_tokens", "completion_tokens"}, "")
                        : body.status();
  RolloutOutcome outcome = RolloutOutcome::kCompleted;
  std::int64_t pt = 0, ct = 0;
  if (st.ok()) {
    auto o = get_string(*body, "outcome", false);
    if (!o.ok()) {
      st = o.status();
    } else if (*o == "aborted") {
      outcome = RolloutOutcome::kAborted;
    } else if (!o->empty() && *o != "completed") {
      st = Status::InvalidArgument("'outcome' must be 'completed' or 'aborted'");
    }
  }
  if (st.ok()) {
    auto p = get_int(*body, "prompt_tokens", 0, 0, UINT32_MAX);
    auto c = get_int(*body, "completion_tokens", 0, 0, UINT32_MAX);
    if (!p.ok()) st = p.status(); else if (!c.ok()) st = c.status(); else { pt = *p; ct = *c; }
  }
  if (!st.ok()) {
    metrics_.bad_requests++;
    send_status(res, st);
    return;
  }
  Status done = Finish(id, outcome, static_cast<std::uint32_t>(pt), static_cast<std::uint32_t>(ct));
  if (!done.ok()) {
    send_status(res, done);
    return;
  }
  send_json(res, 200, {{"rollout_id", id}, {"outcome", outcome_name(outcome)}});
}

void Service::HandleWatch(const httplib::Request& req, httplib::Response& res) {
  auto after = query_u64(req, "after", 0, 0, UINT64_MAX);
  auto timeout = query_u64(req, "timeout_ms", config_.watch_timeout_ms_max, 0,
                           config_.watch_timeout_ms_max);
  if (!after.ok() || !timeout.ok()) {
    metrics_.bad_requests++;
    send_status(res, after.ok() ? timeout.status() : after.status());
    return;
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(*timeout);
  std::uint64_t seq = 0;
  {
    std::unique_lock<std::mutex> lock(lifecycle_mu_);
    lifecycle_cv_.wait_until(lock, deadline,
                             [&] { return lifecycle_seq_ > *after || shutting_down_.load(); });
    seq = lifecycle_seq_;
  }
  json j = StateSummary();
  j["seq"] = seq;
  j["changed"] = seq > *after;
  send_json(res, 200, j);
}

void Service::HandleEvents(const httplib::Request& req, httplib::Response& res) {
  auto since = query_u64(req, "since", 0, 0, UINT64_MAX - 1);
  auto limit = query_u64(req, "limit", config_.events_page_max, 1, config_.events_page_max);
  if (!since.ok() || !limit.ok()) {
    metrics_.bad_requests++;
    send_status(res, since.ok() ? limit.status() : since.status());
    return;
  }
  const std::uint64_t head = journal_->head_seq();
  json records = json::array();
  std::uint64_t next = *since;
  if (*since < head) {
    const std::uint64_t to = std::min(head, *since + *limit);
    Status st = journal_->Scan(*since + 1, to, [&](const journal::Record& r) {
      records.push_back(journal::RecordToJson(r));
      next = r.seq;
      return Status::OK();
    });
    if (!st.ok()) {
      send_status(res, st);
      return;
    }
  }
  send_json(res, 200, {{"records", records}, {"next_since", next}, {"head_seq", head}});
}

void Service::HandleManifest(const httplib::Request& req, httplib::Response& res) {
  const std::string source = req.get_param_value("source");
  if (source.empty() || source.size() > kTextBytesMax) {
    metrics_.bad_requests++;
    send_error(res, 400, "invalid", "query parameter 'source' is required (<= 4096 bytes)");
    return;
  }
  // A preflight sends nothing to the engine; here it only computes the source's manifest.
  PreflightObserved p = transfer_->Preflight(effects::TransferTarget{"manifest", {}, {}, source});
  if (p.source_manifest_digest.empty()) {
    send_error(res, 400, "invalid", "no manifest for '" + source + "': " + p.detail);
    return;
  }
  send_json(res, 200, {{"source", source}, {"manifest_digest", p.source_manifest_digest}});
}

std::string Service::RenderMetrics() const {
  const State s = journal_->state();
  std::string out;
  auto gauge = [&out](const std::string& name, const std::string& help, const std::string& v) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " gauge\n" + name + " " + v + "\n";
  };
  auto counter = [&out](const std::string& name, const std::string& help, std::uint64_t v) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " counter\n" + name + " " +
           std::to_string(v) + "\n";
  };
  out += "# HELP rolloutcore_lifecycle_state 1 for the current lifecycle state\n"
         "# TYPE rolloutcore_lifecycle_state gauge\n";
  for (std::uint8_t i = 0; i <= kLifecycleMax; ++i) {
    const auto l = static_cast<Lifecycle>(i);
    out += std::string("rolloutcore_lifecycle_state{state=\"") + lifecycle_name(l) + "\"} " +
           (l == s.lifecycle ? "1" : "0") + "\n";
  }
  gauge("rolloutcore_committed_generation", "committed weight generation",
        std::to_string(s.committed.generation));
  gauge("rolloutcore_active_rollouts", "rollouts admitted and not finished (journal)",
        std::to_string(s.active.size()));
  gauge("rolloutcore_proxy_in_flight", "proxied requests in flight",
        std::to_string(metrics_.proxy_in_flight.load()));
  gauge("rolloutcore_journal_head_seq", "last journal seq", std::to_string(journal_->head_seq()));
  counter("rolloutcore_rollouts_admitted_total", "admissions journaled (journal counters)",
          s.counters.rollouts_admitted);
  out += "# HELP rolloutcore_rollouts_finished_total rollouts finished, by outcome (journal)\n"
         "# TYPE rolloutcore_rollouts_finished_total counter\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"completed\"} " +
         std::to_string(s.counters.rollouts_completed) + "\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"aborted\"} " +
         std::to_string(s.counters.rollouts_aborted) + "\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"abandoned\"} " +
         std::to_string(s.counters.rollouts_abandoned) + "\n";
  out += "# HELP rolloutcore_admissions_refused_total proxied/explicit admissions refused\n"
         "# TYPE rolloutcore_admissions_refused_total counter\n";
  out += "rolloutcore_admissions_refused_total{reason=\"tainted\"} " +
         std::to_string(metrics_.admission_rejected_tainted.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"not_ready\"} " +
         std::to_string(metrics_.admission_rejected_unavailable.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"shutting_down\"} " +
         std::to_string(metrics_.admission_rejected_shutdown.load()) + "\n";
  out += "# HELP rolloutcore_updates_total update requests answered, by outcome\n"
         "# TYPE rolloutcore_updates_total counter\n";
  out += "rolloutcore_updates_total{outcome=\"committed\"} " +
         std::to_string(metrics_.updates_committed.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"refused\"} " +
         std::to_string(metrics_.updates_refused.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"tainted\"} " +
         std::to_string(metrics_.updates_tainted.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"conflict\"} " +
         std::to_string(metrics_.updates_conflict.load()) + "\n";
  counter("rolloutcore_bad_requests_total", "requests refused as malformed (4xx)",
          metrics_.bad_requests.load());
  counter("rolloutcore_unauthorized_total", "requests refused for a missing or wrong token",
          metrics_.unauthorized.load());
  counter("rolloutcore_client_disconnects_total", "proxied clients that hung up mid-request",
          metrics_.client_disconnects.load());
  counter("rolloutcore_upstream_errors_total", "proxied requests the engine failed",
          metrics_.upstream_errors.load());
  counter("rolloutcore_trajectories_written_total", "trajectory lines written",
          metrics_.trajectories_written.load());
  counter("rolloutcore_trajectories_dropped_total", "trajectory lines dropped (size or I/O)",
          metrics_.trajectories_dropped.load());
  effects::PhaseTimings t;
  {
    std::lock_guard<std::mutex> g(const_cast<std::mutex&>(update_id_mu_));
    t = last_timings_;
  }
  out += "# HELP rolloutcore_update_phase_seconds phase durations of the last update\n"
         "# TYPE rolloutcore_update_phase_seconds gauge\n";
  for (auto [phase, us] : {std::pair{"drain", t.drain_us}, {"preflight", t.preflight_us},
                           {"transfer", t.transfer_us}, {"invalidate", t.invalidate_us},
                           {"validate", t.validate_us}, {"resume", t.resume_us},
                           {"journal", t.journal_us}, {"total", t.total_us}}) {
    out += std::string("rolloutcore_update_phase_seconds{phase=\"") + phase + "\"} " +
           format_double(static_cast<double>(us) / 1e6) + "\n";
  }
  auto hist = [&out](const Histogram& h, const std::string& name, const std::string& help) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    h.Render(out, name, "");
  };
  hist(metrics_.journal_append, "rolloutcore_journal_append_seconds",
       "admission/finish Submit + durable Wait");
  hist(metrics_.proxy_total, "rolloutcore_proxy_request_seconds", "proxied request end to end");
  hist(metrics_.proxy_upstream, "rolloutcore_proxy_upstream_seconds", "the engine call alone");
  hist(metrics_.proxy_added, "rolloutcore_proxy_added_seconds",
       "what the proxy adds (end to end minus the engine call)");
  return out;
}

void Service::HandleMetrics(const httplib::Request&, httplib::Response& res) {
  res.status = 200;
  res.set_content(RenderMetrics(), "text/plain; version=0.0.4");
}

void Service::RegisterRoutes() {
  httplib::Server& s = *server_;
  auto bind = [this](void (Service::*fn)(const httplib::Request&, httplib::Response&)) {
    return [this, fn](const httplib::Request& req, httplib::Response& res) { (this->*fn)(req, res); };
  };
  s.Get("/healthz", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"ok", true}, {"lifecycle", lifecycle_name(journal_->state().lifecycle)}});
  });
  s.Get("/v1/state", bind(&Service::HandleState));
  s.Get("/v1/version", bind(&Service::HandleVersion));
  s.Post("/v1/updates", bind(&Service::HandleUpdate));
  s.Post("/v1/rollouts", bind(&Service::HandleAdmit));
  s.Delete(R"(/v1/rollouts/([^/]+))", bind(&Service::HandleFinish));
  s.Get("/v1/watch", bind(&Service::HandleWatch));
  s.Get("/v1/events", bind(&Service::HandleEvents));
  s.Get("/v1/manifest", bind(&Service::HandleManifest));
  s.Get("/metrics", bind(&Service::HandleMetrics));
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleProxy(Route::kCompletions, req, res);
  });
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleProxy(Route::kChat, req, res);
  });
  s.Post("/inference/v1/generate", [this](const httplib::Request& req, httplib::Response& res) {
    HandleProxy(Route::kGenerate, req, res);
  });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) {
      send_error(res, 413, "too_large", "request body exceeds body_bytes_max");
    } else if (res.status == 404) {
      send_error(res, 404, "not_found", "no route " + req.method + " " + req.path);
    } else {
      send_error(res, res.status, "error", "HTTP " + std::to_string(res.status));
    }
  });
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, 500, "internal", "internal error: " + what);
  });
}

}  // namespace rc::service
