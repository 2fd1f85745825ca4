#include "service/service.h"

#include <openssl/crypto.h>

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <random>

#include <spdlog/spdlog.h>

#include "effects/clock.h"
#include "effects/http_transfer.h"
#include "encoding/sha256.h"
#include "effects/nccl/weight_source.h"
#include "journal/json.h"
#include "service/api_parse.h"
#include "service/http_util.h"
#include "statemachine/hex.h"
#include "statemachine/text.h"

#ifdef RC_HAVE_CUDA  // defined (PUBLIC) by the effects target when CUDA and NCCL were found
#include <cuda_runtime.h>

#include "effects/nccl/nccl_sender.h"
#endif

namespace rc::service {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Shutdown: after the grace deadline, cancelled proxied calls get this long to be recorded
// aborted (their finish is durable before the journal closes), and the workers this long to exit.
inline constexpr std::uint64_t kShutdownSettleMs = 2000;

std::int64_t wall_ms() { return effects::wall_now_ms(); }

bool is_decision(const Event& e) { return family_of(e) == Family::kDecision; }

// Outside text (engine bodies, client ids, journal details) as one log line.
std::string esc(const std::string& s) { return rc::text::escape_line(s); }

std::string replay_hint(const std::string& journal_path) {
  return "explain it with: rolloutcore replay " + esc(journal_path);
}

// Journal errors after which nothing more may be decided or acknowledged.
bool is_journal_failure(const Status& st) {
  return st.code() == Code::kIOError || st.code() == Code::kCorruption ||
         st.code() == Code::kInternal || st.code() == Code::kTimeout;
}

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
      refused.duration_us = effects::elapsed_us(t0);
      return refused;
    }
    const std::uint64_t waited_ms = effects::elapsed_us(t0) / 1000;
    if (waited_ms >= deadline_ms) {
      refused.error = "the NCCL sender stayed busy for the whole transfer deadline";
      refused.duration_us = effects::elapsed_us(t0);
      return refused;
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      refused.error = CudaError("cudaSetDevice", e).substr(0, kTextBytesMax);
      refused.duration_us = effects::elapsed_us(t0);
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

struct EngineVersionWait {
  Status status;
  std::string version;
};

// Polls GET /version until the engine answers with a version string, logging progress every
// 5 s, for at most engine_startup_timeout_ms; then fails saying what the last attempt saw.
EngineVersionWait WaitForEngineVersion(effects::EngineClient& client, const ServeConfig& config) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(config.engine_startup_timeout_ms);
  auto next_log = start + std::chrono::seconds(5);
  std::string last;
  for (std::uint32_t attempt = 1;; ++attempt) {
    effects::HttpReply v = client.Version();
    if (v.http.ok_2xx() && v.body.is_object() && v.body.value("version", json()).is_string()) {
      const std::string version = v.body["version"].get<std::string>();
      spdlog::info("serve: engine {} answers GET /version: '{}' (after {} ms, {} attempt(s))",
                   esc(config.engine_url), esc(version), effects::elapsed_us(start) / 1000, attempt);
      return {Status::OK(), version};
    }
    last = v.http.ok_2xx() ? "HTTP " + std::to_string(v.http.http_status) +
                                 " without a 'version' string"
                           : (v.http.http_status != 0
                                  ? "HTTP " + std::to_string(v.http.http_status) + " " + v.http.error
                                  : v.http.error);
    const auto now = Clock::now();
    if (now >= deadline) break;
    if (now >= next_log) {
      spdlog::info("serve: waiting for the engine at {} to answer GET /version ({} s so far, "
                   "up to {} s): {}",
                   esc(config.engine_url), effects::elapsed_us(start) / 1000000,
                   config.engine_startup_timeout_ms / 1000, esc(last));
      next_log = now + std::chrono::seconds(5);
    }
    const auto pause = std::min<Clock::duration>(std::chrono::milliseconds(250), deadline - now);
    std::this_thread::sleep_for(pause);
  }
  return {Status::Unavailable("engine " + esc(config.engine_url) + " did not answer GET /version "
                              "within engine_startup_timeout_ms " +
                              std::to_string(config.engine_startup_timeout_ms) + " ms (last: " +
                              esc(last) + "); is it running and reachable from this host?"),
          ""};
}

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
  const encoding::Sha256Digest digest = encoding::Sha256(material);
  return "rc" + std::to_string(b.version.generation) + "-" +
         hex::encode(std::span<const std::uint8_t>(digest.data(), 16));
}

std::string DurableHead::ToString() const {
  return std::to_string(seq) + ":" + hex::encode(std::span<const std::uint8_t>(hash));
}

Service::Service(ServeConfig config) : config_(std::move(config)) {}

Service::~Service() {
  StopBackground();
  upstream_.reset();
  if (http_) (void)http_->Stop(0);
}

void Service::StopBackground() {
  {
    std::lock_guard<std::mutex> lock(bg_mu_);
    bg_stop_ = true;
  }
  bg_cv_.notify_all();
  if (monitor_thread_.joinable() && monitor_thread_.get_id() != std::this_thread::get_id()) {
    monitor_thread_.join();
  }
  if (lease_thread_.joinable() && lease_thread_.get_id() != std::this_thread::get_id()) {
    lease_thread_.join();
  }
}

void Service::FailStop(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(failed_mu_);
    if (failed_.load()) return;
    failure_ = "journal " + config_.journal_path + ": " + why;
    failed_.store(true, std::memory_order_release);
  }
  spdlog::critical("serve: FAIL-STOP: {}; refusing admissions and updates, stopping effects; "
                   "the process must exit and restart to recover from what is durable ({})",
                   esc(failure()), replay_hint(config_.journal_path));
  failed_cv_.notify_all();
  lifecycle_cv_.notify_all();
  bg_cv_.notify_all();  // the monitor and lease threads stop at their next look
}

std::string Service::failure() const {
  std::lock_guard<std::mutex> lock(failed_mu_);
  return failure_;
}

bool Service::WaitFailed(std::uint64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(failed_mu_);
  return failed_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                             [&] { return failed_.load(); });
}

std::string Service::url() const {
  return "http://" + config_.listen_host + ":" + std::to_string(port_);
}

Result<std::unique_ptr<Service>> Service::Open(const ServeConfig& config,
                                               rocksdb::Env* journal_env) {
  RC_RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<Service> s(new Service(config));
  s->journal_env_ = journal_env;
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
  jo.env = journal_env_;
  jo.commit_stall_timeout_ms = config_.journal_commit_stall_timeout_ms;
  auto opened = journal::Journal::Open(config_.journal_path, jo);
  if (!opened.ok()) return opened.status();
  journal_ = std::move(opened.value());
  LogRecovery(journal_->recovery());

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
  Result<UpstreamTarget> target = ParseEngineUrl(config_.engine_url);
  if (!target.ok()) return target.status();
  engine_target_ = std::move(target.value());
  // The runner drains locally before pausing (effects/runner.cc), so the plain HTTP control.
  http_control_ = std::make_unique<effects::HttpEngineControl>(*control_client_);

  effects::PackingParams packing;
  packing.packed_buffer_size_bytes = config_.packed_buffer_size_bytes;
  packing.packed_num_buffers = config_.packed_num_buffers;
  effects::EngineProtocol protocol = effects::HttpSequenceTransfer::DefaultProtocol();
  // Initialises the transfer with the engine once the journal is bootstrapped (below).
  std::function<Status()> init_transfer;
  // Nothing below is decided before the engine answers GET /version: it may still be loading.
  {
    const EngineVersionWait waited = WaitForEngineVersion(*control_client_, config_);
    if (!waited.status.ok()) return waited.status;
    engine_version_ = waited.version;
  }
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
    // The protocol line comes from the engine's own /version (waited for above), never a guess.
    effects::EngineProtocol detected = effects::detect_protocol(engine_version_);
    if (detected.line == effects::ProtocolLine::kUnknown) {
      return Status::Unavailable("engine " + config_.engine_url + " reports version '" +
                                 esc(engine_version_) +
                                 "', which no protocol line of this build speaks");
    }
    protocol = detected;
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
    if (!is_decision(e)) return;
    // Every lifecycle transition and every update's outcome, with its reason; taints at error
    // level with the command that explains them.
    if (const auto* c = std::get_if<StateChanged>(&e)) {
      if (c->to == Lifecycle::kTainted) {
        spdlog::error("serve: seq {}: {} -> TAINTED ({}): {}; no rollouts are admitted until an "
                      "operator intervenes; {}",
                      seq, lifecycle_name(c->from), cause_name(c->cause), esc(c->detail),
                      replay_hint(config_.journal_path));
      } else {
        spdlog::info("serve: seq {}: {} -> {} ({}): {}", seq, lifecycle_name(c->from),
                     lifecycle_name(c->to), cause_name(c->cause), esc(c->detail));
      }
    } else if (const auto* u = std::get_if<UpdateEnded>(&e)) {
      if (u->outcome == UpdateOutcome::kCommitted) {
        spdlog::info("serve: seq {}: update '{}' committed: {}", seq, esc(u->update_id),
                     esc(u->reason));
      } else {
        spdlog::warn("serve: seq {}: update '{}' {}: {}; {}", seq, esc(u->update_id),
                     update_outcome_name(u->outcome), esc(u->reason),
                     replay_hint(config_.journal_path));
      }
    }
    NotifyLifecycle(seq);
  });

  std::lock_guard<std::timed_mutex> lock(update_mu_);
  const State before = journal_->state();
  spdlog::info("serve: journal {} opened at seq {}: {}{}", esc(config_.journal_path),
               journal_->head_seq(), lifecycle_name(before.lifecycle),
               before.update ? " (update '" + esc(before.update->update_id) + "' interrupted)" : "");
  // An interrupted update goes on only once clients can reach the executor (Start): its drain
  // may wait for leased rollouts whose holders must be able to finish them.
  if (before.update) {
    interrupted_update_ = before.update;
    Status begun = runner_->BeginRecovery();
    if (!begun.ok()) return RecoveryFailed(begun);
  } else if (Status recovered = runner_->Recover(); !recovered.ok()) {
    return RecoveryFailed(recovered);
  }
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
        return Status::InvalidArgument("initial_source '" + esc(config_.initial_source) +
                                       "': no manifest (" + esc(p.detail) + ")");
      }
      id.manifest_digest = p.source_manifest_digest;
    }
    effects::BootstrapOptions bo;
    bo.adopt = config_.adopt_engine;
    bo.startup_timeout_ms = config_.engine_startup_timeout_ms;
    bo.progress = [](const std::string& line) { spdlog::info("serve: bootstrap: {}", esc(line)); };
    spdlog::info("serve: bootstrapping engine {} as '{}'{}", esc(config_.engine_url),
                 esc(config_.initial_label), config_.adopt_engine ? " (adopt)" : "");
    Status booted = runner_->Bootstrap(config_.initial_label, id, bo);
    if (!booted.ok()) {
      std::string msg = "bootstrap of engine " + config_.engine_url + " as '" +
                        config_.initial_label + "' failed: " + booted.message();
      // vLLM 0.25.x keeps the label only in the worker extension: when no route ever gave a
      // label, that is the likely fix (not when the engine answered with the wrong one).
      if (engine_version_.rfind("0.25", 0) == 0 &&
          control_client_->label_route() == effects::LabelRoute::kUnknown &&
          msg.find("worker-extension-cls") == std::string::npos) {
        msg += " (engine version " + engine_version_ +
               ": is vLLM started with --worker-extension-cls "
               "rolloutcore.vllm_ext.RolloutCoreWorkerExtension?)";
      }
      return Status(booted.code(), msg);
    }
  }
  // nccl: a failure here is a startup error (no update could ever succeed without the
  // communicator); the journal keeps what Recover/Bootstrap recorded, which a restart resumes.
  RC_RETURN_IF_ERROR(init_transfer());
  s = journal_->state();
  // Nothing else runs yet and the runner synced before it returned: all of it is durable.
  durable_.state = s;
  durable_.head = DurableHead{journal_->head_seq(), journal_->head_hash()};
  durable_.decision_seq = journal_->head_seq();
  NotifyLifecycle(journal_->head_seq());
  if (s.lifecycle == Lifecycle::kTainted) {
    LogTaint(s, "starting on a TAINTED journal");
  } else {
    spdlog::info("serve: journal {} at seq {}, state {}, committed '{}' (generation {}), {} "
                 "leased rollout(s) kept",
                 esc(config_.journal_path), journal_->head_seq(), lifecycle_name(s.lifecycle),
                 esc(s.committed.label), s.committed.generation, s.active.size());
  }
  // Leased rollouts that survived the restart get a full lease from now.
  {
    std::lock_guard<std::mutex> g(lease_mu_);
    const std::int64_t now_ms = effects::system_clock().now_ms();
    for (const auto& [rid, r] : s.active) {
      if (r.lease_ms > 0) lease_deadline_ms_[rid] = now_ms + r.lease_ms;
    }
  }
  monitor_thread_ = std::thread([this] { MonitorLoop(); });
  lease_thread_ = std::thread([this] { LeaseLoop(); });
  return Status::OK();
}

// What the open found: a torn WAL tail after a crash is named (what was acknowledged is intact:
// nothing is acknowledged before its sync), so an operator can tell it from a clean restart.
void Service::LogRecovery(const journal::Recovery& r) const {
  if (!r.torn_tail.empty()) {
    spdlog::warn("serve: journal {}: {} (unacknowledged writes of the crashed process)",
                 esc(config_.journal_path), esc(r.torn_tail));
  } else if (!r.clean_close && r.head_seq > 0) {
    spdlog::info("serve: journal {} was not closed cleanly; recovering from seq {}",
                 esc(config_.journal_path), r.head_seq);
  }
}

void Service::LogTaint(const State& s, const char* context) const {
  if (!s.taint) {
    spdlog::error("serve: {}: TAINTED without a taint record; {}", context,
                  replay_hint(config_.journal_path));
    return;
  }
  spdlog::error("serve: {}: engine is TAINTED since {} of update '{}' ({}): {}; no rollouts are "
                "admitted and /readyz answers 503; {}",
                context, lifecycle_name(s.taint->from), esc(s.taint->update_id),
                cause_name(s.taint->cause), esc(s.taint->detail),
                replay_hint(config_.journal_path));
}

// The engine monitor: while READY, probes the engine every engine_monitor_interval_ms and
// journals EngineMonitored only when it changes something (reachability toggles, another engine
// process, another label, paused behind our back, or a pending recheck now confirmed), so the
// journal does not grow with time. The fold decides what it means (docs/lifecycle.md).
void Service::MonitorLoop() {
  const auto interval = std::chrono::milliseconds(config_.engine_monitor_interval_ms);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(bg_mu_);
      bg_cv_.wait_for(lock, interval, [&] { return bg_stop_ || failed(); });
      if (bg_stop_ || failed()) return;
    }
    if (journal_->failed()) {
      FailStop(journal_->failure().ToString());
      return;
    }
    const State before = journal_->state();
    if (before.lifecycle != Lifecycle::kReady) continue;  // the runner owns the engine now
    const std::uint64_t updates_seen =
        before.counters.updates_requested + before.counters.recoveries;
    const EngineMonitored p = control_client_->Monitor();
    const std::int64_t now_wall_ms = wall_ms();
    metrics_.engine_probes++;
    engine_last_probe_wall_ms_.store(now_wall_ms);
    const bool ok = p.http.ok_2xx();
    engine_up_.store(ok);
    if (!ok) metrics_.engine_probe_failures++;
    if (ok) {
      std::lock_guard<std::mutex> g(engine_info_mu_);
      engine_instance_seen_ = p.engine_instance;
      engine_label_seen_ = p.reported_label;
    }
    // The fold's own rule decides what matches; only a change is journaled.
    const bool matches = ok && engine_matches(before, p.reported_label, p.is_paused_known,
                                              p.is_paused, p.engine_instance);
    if (matches) engine_last_ok_wall_ms_.store(now_wall_ms);
    const bool changes = (ok != before.engine_reachable) || (ok && !matches) ||
                         (matches && before.engine_recheck);
    if (!changes) continue;
    EngineMonitored m = p;
    m.last_ok_wall_ms = engine_last_ok_wall_ms_.load();
    m.updates_seen = updates_seen;
    auto submitted = journal_->Submit(m, now_wall_ms);
    if (!submitted.ok()) {
      const Status& st = submitted.status();
      if (is_journal_failure(st)) {
        FailStop("the engine monitor's record was refused: " + st.ToString());
        return;
      }
      // Rejected: stale (an update or recovery began after our read) or no longer READY.
      continue;
    }
    Status waited = journal_->Wait(submitted->ticket);
    if (!waited.ok()) {
      FailStop("commit of the engine monitor's record failed: " + waited.ToString());
      return;
    }
    metrics_.engine_monitor_submits++;
    std::uint64_t seq = submitted->ticket.result.first_seq;
    spdlog::log(ok ? spdlog::level::warn : spdlog::level::err,
                "serve: seq {}: engine monitor: {} (label '{}', instance '{}', paused {})", seq,
                ok ? "engine answers" : "engine unreachable: " + esc(p.http.error),
                esc(p.reported_label), esc(p.engine_instance),
                p.is_paused_known ? (p.is_paused ? "yes" : "no") : "unknown");
    for (const Event& d : submitted->decisions) {
      ++seq;
      if (const auto* c = std::get_if<StateChanged>(&d)) {
        spdlog::error("serve: seq {}: {} -> {} ({}): {}; {}", seq, lifecycle_name(c->from),
                      lifecycle_name(c->to), cause_name(c->cause), esc(c->detail),
                      replay_hint(config_.journal_path));
      }
    }
    NotifyLifecycle(submitted->ticket.result.last_seq);
  }
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

// Connections cost descriptors, not threads: each proxied rollout holds a client socket and an
// engine socket. The soft limit is raised to the hard one so http_connections_max can be met.
static void RaiseDescriptorLimit(std::uint64_t connections_max) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &lim);
  }
  const std::uint64_t needed = 2 * connections_max + 256;
  if (lim.rlim_cur < needed) {
    spdlog::warn("serve: the descriptor limit ({}) is below what http_connections_max={} needs "
                 "({}); raise `ulimit -n`", static_cast<std::uint64_t>(lim.rlim_cur),
                 connections_max, needed);
  }
}

HttpServerOptions Service::ServerOptions() const {
  HttpServerOptions o;
  o.host = config_.listen_host;
  o.port = config_.listen_port;
  o.io_threads = config_.io_threads;
  o.connections_max = config_.http_connections_max;
  o.header_bytes_max = config_.header_bytes_max;
  o.body_bytes_max = config_.body_bytes_max;
  o.idle_timeout_ms = config_.idle_timeout_ms;
  o.header_timeout_ms = config_.header_timeout_ms;
  o.body_timeout_ms = config_.body_timeout_ms;
  o.write_timeout_ms = config_.write_timeout_ms;
  o.blocking_threads = static_cast<std::size_t>(config_.http_threads);
  o.blocking_queue_max = 16 * static_cast<std::size_t>(config_.http_threads);
  return o;
}

Status Service::Start() {
  RC_CHECK(!http_ && !upstream_);
  RaiseDescriptorLimit(config_.http_connections_max);
  http_ = std::make_unique<HttpServer>(ServerOptions(), Routes());
  boost::system::error_code ec;
  boost::asio::ip::tcp::resolver resolver(http_->io());
  auto endpoints = resolver.resolve(engine_target_.host, std::to_string(engine_target_.port), ec);
  if (ec || endpoints.empty()) {
    return Status::Unavailable("cannot resolve the engine host '" + engine_target_.host +
                               "': " + ec.message());
  }
  upstream_ = std::make_unique<UpstreamPool>(http_->io(), endpoints.begin()->endpoint(),
                                             config_.engine_connections_max);
  Result<int> port = http_->Start();
  if (!port.ok()) return port.status();
  port_ = *port;
  spdlog::info("serve: listening on {}", url());
  return FinishInterruptedUpdate();
}

Status Service::RecoveryFailed(const Status& st) const {
  return Status(st.code(), "recovery of journal " + config_.journal_path + " failed: " +
                               st.message());
}

// The second half of a recovery that found an update interrupted (Init journaled RecoveryStarted):
// driven while listening, so leased rollouts can finish and the drain can complete.
Status Service::FinishInterruptedUpdate() {
  if (!interrupted_update_) return Status::OK();
  const UpdatePlan before = *interrupted_update_;
  interrupted_update_.reset();
  std::lock_guard<std::timed_mutex> lock(update_mu_);
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_ = before.update_id;
  }
  spdlog::info("serve: going on with the interrupted update '{}' now that clients can reach "
               "the executor", esc(before.update_id));
  if (Status driven = runner_->Drive(); !driven.ok()) {
    FailStop("recovery of the interrupted update failed: " + driven.ToString());
    return RecoveryFailed(driven);
  }
  const State s = journal_->state();
  if (s.lifecycle == Lifecycle::kReady && s.committed == before.target) {
    spdlog::warn("serve: this restart COMPLETED the interrupted update '{}': the engine now "
                 "serves '{}' (generation {}); a trainer that was told otherwise should re-POST "
                 "it to read the recorded outcome; {}",
                 esc(before.update_id), esc(s.committed.label), s.committed.generation,
                 replay_hint(config_.journal_path));
  } else {
    spdlog::warn("serve: this restart ended the interrupted update '{}' in {}; {}",
                 esc(before.update_id), lifecycle_name(s.lifecycle),
                 replay_hint(config_.journal_path));
  }
  if (s.lifecycle == Lifecycle::kTainted) LogTaint(s, "after recovery");
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
  const auto left_ms = [&settle] {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          settle() - Clock::now()).count());
  };
  upstream_.reset();
  if (http_ && !http_->Stop(left_ms())) {
    // A worker is still inside a handler: everything it uses must outlive it, so nothing is
    // torn down (the caller exits; everything acknowledged is already durable).
    update_mu_.unlock();
    spdlog::warn("serve: HTTP workers still busy after the shutdown deadline; exiting without "
                 "closing the journal");
    return false;
  }
  http_.reset();
  runner_.reset();
  trajectories_.Close();
  journal_.reset();  // closes RocksDB
  update_mu_.unlock();
  return rollouts_done;
}

bool Service::Authorized(const ApiRequest& req, HttpResponse& res) {
  if (config_.auth_token.empty()) return true;
  const std::string h = req.header("Authorization");
  const std::string prefix = "Bearer ";
  if (h.rfind(prefix, 0) != 0) {
    metrics_.unauthorized++;
    set_header(res, "WWW-Authenticate", "Bearer");
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

// ---- trainer API ----

Service::DurableView Service::CatchUpDurable(bool copy_state) {
  std::lock_guard<std::mutex> lock(durable_mu_);
  if (!failed()) {
    // Scan stops at the durable head: whatever was only enqueued is not folded here.
    Status st = journal_->Scan(durable_.head.seq + 1, 0, [&](const journal::Record& r) {
      RC_CHECK(r.seq == durable_.head.seq + 1);  // dense seqs, in order
      Status applied = apply(durable_.state, r.event);
      if (!applied.ok()) {
        return Status::Corruption("seq " + std::to_string(r.seq) + " does not apply to the "
                                  "durable view: " + applied.ToString());
      }
      durable_.head = DurableHead{r.seq, r.hash};
      if (is_decision(r.event)) durable_.decision_seq = r.seq;
      return Status::OK();
    });
    if (!st.ok() && st.code() != Code::kInvalidArgument) {
      FailStop("reading the durable journal failed: " + st.ToString());
    }
  }
  DurableView out;
  out.head = durable_.head;
  out.decision_seq = durable_.decision_seq;
  if (copy_state) out.state = durable_.state;
  return out;
}

DurableHead Service::durable_head() { return CatchUpDurable(false).head; }

void Service::SetHeadHeader(HttpResponse& res, const DurableHead& head) {
  set_header(res, "X-RolloutCore-Head", head.ToString());
}

namespace {

json summary_json(const State& s, const DurableHead& head) {
  json j;
  j["lifecycle"] = lifecycle_name(s.lifecycle);
  j["committed"] = journal::WeightVersionToJson(s.committed);
  j["identity"] = journal::WeightIdentityToJson(s.committed_identity);
  j["active_rollouts"] = s.active.size();
  j["head_seq"] = head.seq;
  j["head"] = head.ToString();
  j["engine_reachable"] = s.engine_reachable;
  j["engine_recheck"] = s.engine_recheck;
  j["engine_instance"] = s.engine_instance;
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
                   {"rollouts_expired", s.counters.rollouts_expired},
                   {"updates_requested", s.counters.updates_requested},
                   {"updates_committed", s.counters.updates_committed},
                   {"updates_refused", s.counters.updates_refused},
                   {"recoveries", s.counters.recoveries}};
  return j;
}

}  // namespace

json Service::StateSummary() {
  const DurableView v = CatchUpDurable(true);
  return summary_json(v.state, v.head);
}

void Service::HandleState(const ApiRequest& req, HttpResponse& res) {
  const DurableView v = CatchUpDurable(true);
  SetHeadHeader(res, v.head);
  if (req.query("full").has_value()) {
    json j = journal::StateToJson(v.state);
    j["head_seq"] = v.head.seq;
    j["head"] = v.head.ToString();
    send_json(res, 200, j);
    return;
  }
  send_json(res, 200, summary_json(v.state, v.head));
}

void Service::HandleVersion(const ApiRequest&, HttpResponse& res) {
  const DurableView v = CatchUpDurable(true);
  SetHeadHeader(res, v.head);
  send_json(res, 200,
            {{"lifecycle", lifecycle_name(v.state.lifecycle)},
             {"version", journal::WeightVersionToJson(v.state.committed)},
             {"identity", journal::WeightIdentityToJson(v.state.committed_identity)},
             {"head_seq", v.head.seq}});
}


std::optional<Service::EndedUpdate> Service::FindEndedUpdate(const std::string& update_id) {
  std::lock_guard<std::mutex> lock(ended_mu_);
  auto it = ended_updates_.find(update_id);
  if (it == ended_updates_.end()) return std::nullopt;
  return it->second;
}

void Service::RememberEndedUpdate(const UpdateRequested& request, const UpdateEnded& ended) {
  RC_CHECK(request.update_id == ended.update_id);
  std::lock_guard<std::mutex> lock(ended_mu_);
  if (ended_updates_.emplace(request.update_id, EndedUpdate{request, ended}).second) {
    ended_order_.push_back(request.update_id);
  }
  while (ended_order_.size() > kEndedUpdatesMax) {
    ended_updates_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  RC_CHECK(ended_updates_.size() == ended_order_.size());
}

namespace {

// The journal's record of an update: its request and, once it ended, its outcome. Scans the
// durable journal (bounded by kUpdateLookupRecordsMax records); the fallback when the update
// route's memory no longer holds it (older, or decided before this process started).
struct UpdateLookup {
  std::optional<UpdateRequested> request;
  std::optional<UpdateEnded> ended;
};
Result<UpdateLookup> LookUpUpdate(journal::Journal& j, const std::string& update_id,
                                  std::uint64_t durable_seq) {
  UpdateLookup out;
  const std::uint64_t from =
      durable_seq > kUpdateLookupRecordsMax ? durable_seq - kUpdateLookupRecordsMax + 1 : 1;
  Status st = j.Scan(from, durable_seq, [&](const journal::Record& r) {
    if (const auto* u = std::get_if<UpdateRequested>(&r.event)) {
      if (u->update_id == update_id) out.request = *u;
    } else if (const auto* e = std::get_if<UpdateEnded>(&r.event)) {
      if (e->update_id == update_id) out.ended = *e;
    }
    return Status::OK();
  });
  if (!st.ok()) return st;
  return out;
}

int update_status(UpdateOutcome o) {
  switch (o) {
    case UpdateOutcome::kCommitted: return 200;
    case UpdateOutcome::kRefused: return 422;
    case UpdateOutcome::kTainted: return 500;
  }
  return 500;
}

}  // namespace

void Service::SendUpdateOutcome(HttpResponse& res, const UpdateRequested& request,
                                const UpdateEnded& ended, bool replayed) {
  const DurableView v = CatchUpDurable(true);
  json out;
  out["update_id"] = request.update_id;
  out["outcome"] = update_outcome_name(ended.outcome);
  out["reason"] = ended.reason;
  out["state"] = summary_json(v.state, v.head);
  out["head"] = v.head.ToString();
  out["replayed"] = replayed;
  if (!replayed) {
    std::lock_guard<std::mutex> g(update_id_mu_);
    out["timings"] = timings_json(last_timings_);
  }
  SetHeadHeader(res, v.head);
  send_json(res, update_status(ended.outcome), out);
}

bool Service::SourceMatchesIdentity(const UpdateRequested& request, HttpResponse& res) {
  Result<std::string> digest = effects::nccl::SourceManifestDigest(request.source_uri);
  if (!digest.ok()) {
    metrics_.bad_requests++;
    send_error(res, 400, "invalid_source", "'source': " + digest.status().message());
    return false;
  }
  if (*digest != request.identity.manifest_digest) {
    metrics_.bad_requests++;
    send_error(res, 422, "manifest_mismatch",
               "the source's manifest " + digest->substr(0, 16) +
                   " is not the declared identity.manifest_digest " +
                   request.identity.manifest_digest.substr(0, 16) +
                   " (nothing was journaled; the engine was not touched)");
    return false;
  }
  return true;
}

void Service::HandleUpdate(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  Result<UpdateRequested> request = parse_update_body(req.body());
  if (!request.ok()) {
    metrics_.bad_requests++;
    send_status(res, request.status());
    return;
  }
  if (failed()) {
    send_error(res, 503, "failed", "the executor has fail-stopped: " + failure());
    return;
  }
  // A re-POST of an update that already ended answers what was recorded (idempotent retries).
  auto replay = [&](const EndedUpdate& e) {
    if (!(e.request == *request)) {
      metrics_.updates_conflict++;
      send_error(res, 409, "conflict",
                 "update_id '" + request->update_id +
                     "' was already used for another request (different body); choose a new "
                     "update_id");
      return;
    }
    metrics_.updates_replayed++;
    spdlog::info("serve: update '{}' re-POSTed: answering its recorded outcome ({})",
                 esc(request->update_id), update_outcome_name(e.ended.outcome));
    SendUpdateOutcome(res, e.request, e.ended, /*replayed=*/true);
  };
  if (auto e = FindEndedUpdate(request->update_id)) {
    replay(*e);
    return;
  }
  // What can be checked without the engine is checked before anything is journaled: a source
  // that cannot be read, or whose manifest is not the declared one, never drains the engine.
  if (!SourceMatchesIdentity(*request, res)) return;
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
  if (failed()) {
    send_error(res, 503, "failed", "the executor has fail-stopped: " + failure());
    return;
  }
  if (auto e = FindEndedUpdate(request->update_id)) {  // it ended while we waited for the lock
    replay(*e);
    return;
  }
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_ = request->update_id;
  }
  spdlog::info("serve: update '{}' requested: target '{}', manifest {}, source {}",
               esc(request->update_id), esc(request->target_label),
               esc(request->identity.manifest_digest), esc(request->source_uri));
  const std::uint64_t requested_before = journal_->state().counters.updates_requested;
  Result<UpdateEnded> ended = runner_->Update(*request);
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_.clear();
    last_timings_ = runner_->last_timings();
  }
  NotifyLifecycle(journal_->head_seq());
  if (ended.ok()) {
    RememberEndedUpdate(*request, *ended);
    switch (ended->outcome) {
      case UpdateOutcome::kCommitted: metrics_.updates_committed++; break;
      case UpdateOutcome::kRefused: metrics_.updates_refused++; break;
      case UpdateOutcome::kTainted: metrics_.updates_tainted++; break;
    }
    SendUpdateOutcome(res, *request, *ended, /*replayed=*/false);
    return;
  }
  const Status& st = ended.status();
  const bool journaled = journal_->state().counters.updates_requested > requested_before;
  if (!journaled) {
    // Nothing of this request was journaled: a lifecycle refusal (e.g. TAINTED), a reused
    // update_id with another body (the journal's idempotency: Conflict), bad input, or a
    // duplicate of an update decided before this process remembered it.
    if (st.code() == Code::kRejected || st.code() == Code::kConflict ||
        st.code() == Code::kInvalidArgument) {
      metrics_.updates_conflict++;
      spdlog::warn("serve: update '{}' refused before anything was journaled: {}",
                   esc(request->update_id), esc(st.ToString()));
      send_status(res, st);
      return;
    }
    if (!is_journal_failure(st)) {
      auto found = LookUpUpdate(*journal_, request->update_id, durable_head().seq);
      if (found.ok() && found->request && found->ended) {
        RememberEndedUpdate(*found->request, *found->ended);
        replay(EndedUpdate{*found->request, *found->ended});
        return;
      }
    }
  }
  // The request may be durable and its effects may have run: nobody can say how it ended. The
  // executor stops (a restart recovers from what is durable); the trainer is told "unknown",
  // never "failed", and re-POSTs the same update_id after the restart to read the outcome.
  metrics_.updates_outcome_unknown++;
  FailStop("update '" + request->update_id + "' did not reach a recorded outcome: " +
           st.ToString());
  set_header(res, "Retry-After", std::to_string(std::max<std::uint32_t>(1, config_.retry_after_s)));
  send_error(res, 503, "outcome_unknown",
             "the outcome of update '" + request->update_id +
                 "' is unknown (" + st.ToString() +
                 "); the executor fail-stopped and recovers on restart: re-POST the same "
                 "update_id then to read the recorded outcome");
}

void Service::HandleAdmit(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  Result<AdmitBody> parsed = parse_admit_body(req.body(), config_.admit_wait_ms,
                                              config_.rollout_lease_ms);
  if (!parsed.ok()) {
    metrics_.bad_requests++;
    send_status(res, parsed.status());
    return;
  }
  std::string id = parsed->rollout_id;
  const std::int64_t wait_ms = parsed->wait_ms;
  const std::int64_t lease_ms = parsed->lease_ms;
  if (id.empty()) id = NextRolloutId();
  AdmitResult a = Admit(id, static_cast<std::uint64_t>(wait_ms),
                        static_cast<std::uint32_t>(lease_ms));
  if (!a.admitted) {
    if (a.refusal.retry_after_s > 0) {
      set_header(res, "Retry-After", std::to_string(a.refusal.retry_after_s));
    }
    send_error(res, a.refusal.http_status, a.refusal.type, a.refusal.message);
    return;
  }
  {
    std::lock_guard<std::mutex> g(lease_mu_);
    lease_deadline_ms_[id] = effects::system_clock().now_ms() + lease_ms;
  }
  const RolloutAdmitted& b = a.admitted->binding;
  const DurableHead& head = a.admitted->head;
  RC_CHECK(head.seq >= a.admitted->seq);  // the admission's own group
  SetHeadHeader(res, head);
  send_json(res, 201,
            {{"rollout_id", b.rollout_id},
             {"admission_seq", a.admitted->seq},
             {"version", journal::WeightVersionToJson(b.version)},
             {"identity", journal::WeightIdentityToJson(b.identity)},
             {"cache_salt", DeriveCacheSalt(b, "")},
             {"lease_ms", lease_ms},
             {"head", head.ToString()}});
}

void Service::HandleLease(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  const std::string id = req.captures.at(0);
  Status st = parse_lease_body(req.body());
  if (!st.ok()) {
    metrics_.bad_requests++;
    send_status(res, st);
    return;
  }
  if (failed()) {
    send_error(res, 503, "failed", "the executor has fail-stopped: " + failure());
    return;
  }
  std::uint32_t lease_ms = 0;
  {
    const State s = *AdmitView(false);
    auto it = s.active.find(id);
    if (it != s.active.end()) lease_ms = it->second.lease_ms;
    if (it == s.active.end()) {
      // The view may be older than the admission: look at the journal's own state.
      const State fresh = journal_->state();
      auto f = fresh.active.find(id);
      if (f != fresh.active.end()) lease_ms = f->second.lease_ms;
    }
  }
  std::lock_guard<std::mutex> g(lease_mu_);
  auto it = lease_deadline_ms_.find(id);
  if (it == lease_deadline_ms_.end() || lease_ms == 0) {
    if (lease_ms == 0 && it == lease_deadline_ms_.end()) {
      send_error(res, 404, "not_found",
                 "rollout '" + id + "' holds no lease (not active, finished, expired, or a "
                 "proxied rollout)");
    } else {
      send_error(res, 404, "not_found", "the lease of rollout '" + id + "' has lapsed");
    }
    return;
  }
  it->second = effects::system_clock().now_ms() + lease_ms;
  metrics_.leases_renewed++;
  send_json(res, 200, {{"rollout_id", id}, {"lease_ms", lease_ms}});
}

void Service::LeaseLoop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(bg_mu_);
      bg_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return bg_stop_ || failed(); });
      if (bg_stop_ || failed()) return;
    }
    std::vector<std::string> lapsed;
    {
      std::lock_guard<std::mutex> g(lease_mu_);
      const std::int64_t now_ms = effects::system_clock().now_ms();
      for (auto it = lease_deadline_ms_.begin(); it != lease_deadline_ms_.end();) {
        if (it->second <= now_ms) {
          lapsed.push_back(it->first);
          it = lease_deadline_ms_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const std::string& id : lapsed) {
      Status st = FinishDurably(id, RolloutOutcome::kExpired, 0, 0);
      if (st.ok()) {
        metrics_.leases_expired++;
        spdlog::warn("serve: the lease of rollout {} lapsed (its client stopped renewing): "
                     "recorded expired",
                     esc(id));
      } else if (st.code() != Code::kNotFound) {
        spdlog::error("serve: recording the lapsed lease of rollout {} failed: {}", esc(id),
                      esc(st.ToString()));
      }
    }
  }
}

void Service::HandleFinish(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  const std::string id = req.captures.at(0);
  Result<FinishBody> parsed = parse_finish_body(req.body());
  if (!parsed.ok()) {
    metrics_.bad_requests++;
    send_status(res, parsed.status());
    return;
  }
  const RolloutOutcome outcome = parsed->outcome;
  const std::int64_t pt = parsed->prompt_tokens, ct = parsed->completion_tokens;
  Status done = FinishDurably(id, outcome, static_cast<std::uint32_t>(pt),
                              static_cast<std::uint32_t>(ct));
  if (!done.ok()) {
    if (done.code() == Code::kUnavailable) {
      send_error(res, 503, "failed", done.message());
    } else {
      send_status(res, done);
    }
    return;
  }
  const DurableHead head = durable_head();
  SetHeadHeader(res, head);
  send_json(res, 200, {{"rollout_id", id}, {"outcome", outcome_name(outcome)},
                       {"head", head.ToString()}});
}

void Service::HandleWatch(const ApiRequest& req, HttpResponse& res) {
  auto after = query_u64(req, "after", 0, 0, UINT64_MAX);
  auto timeout = query_u64(req, "timeout_ms", config_.watch_timeout_ms_max, 0,
                           config_.watch_timeout_ms_max);
  if (!after.ok() || !timeout.ok()) {
    metrics_.bad_requests++;
    send_status(res, after.ok() ? timeout.status() : after.status());
    return;
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(*timeout);
  // Only durable decisions are reported: a decision the runner journaled wakes us, and we look
  // again (every 20 ms at most) until it is durable or the deadline passes.
  for (;;) {
    if (CatchUpDurable(false).decision_seq > *after) break;
    std::unique_lock<std::mutex> lock(lifecycle_mu_);
    if (Clock::now() >= deadline || shutting_down_.load() || failed()) break;
    lifecycle_cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(20)),
                             [&] { return lifecycle_seq_ > *after || shutting_down_.load() ||
                                          failed(); });
    if (lifecycle_seq_ > *after) {
      lock.unlock();
      if (CatchUpDurable(false).decision_seq > *after) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  const DurableView v = CatchUpDurable(true);
  json j = summary_json(v.state, v.head);
  j["seq"] = v.decision_seq;
  j["changed"] = v.decision_seq > *after;
  SetHeadHeader(res, v.head);
  send_json(res, 200, j);
}

void Service::HandleEvents(const ApiRequest& req, HttpResponse& res) {
  auto since = query_u64(req, "since", 0, 0, UINT64_MAX - 1);
  auto limit = query_u64(req, "limit", config_.events_page_max, 1, config_.events_page_max);
  if (!since.ok() || !limit.ok()) {
    metrics_.bad_requests++;
    send_status(res, since.ok() ? limit.status() : since.status());
    return;
  }
  // Only durable records: the durable head, never what is merely enqueued.
  const DurableHead head = durable_head();
  json records = json::array();
  std::uint64_t next = *since;
  if (*since < head.seq) {
    const std::uint64_t to = *limit >= head.seq - *since ? head.seq : *since + *limit;
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
  SetHeadHeader(res, head);
  send_json(res, 200, {{"records", records}, {"next_since", next}, {"head_seq", head.seq},
                       {"head", head.ToString()}});
}

void Service::HandleManifest(const ApiRequest& req, HttpResponse& res) {
  // It opens files on this host: only for the trainer, and its errors never quote them.
  if (!Authorized(req, res)) return;
  const std::string source = req.query("source").value_or("");
  Status valid = ValidateSource(source);
  if (!valid.ok()) {
    metrics_.bad_requests++;
    send_status(res, valid);
    return;
  }
  // A preflight sends nothing to the engine; here it only computes the source's manifest.
  PreflightObserved p = transfer_->Preflight(effects::TransferTarget{"manifest", {}, {}, source});
  if (p.source_manifest_digest.empty()) {
    spdlog::warn("serve: /v1/manifest: no manifest for {}: {}", esc(source), esc(p.detail));
    send_error(res, 400, "invalid",
               "no manifest for this source: it is missing, unreadable, busy or not a valid "
               "source of its kind (details in the executor's log)");
    return;
  }
  send_json(res, 200, {{"source", source}, {"manifest_digest", p.source_manifest_digest}});
}

void Service::HandleHealthz(const ApiRequest&, HttpResponse& res) {
  // Liveness: the process serves. After a fail-stop it must be restarted: 503.
  if (failed()) {
    send_json(res, 503, {{"ok", false}, {"reason", "fail-stopped: " + failure()}});
    return;
  }
  send_json(res, 200, {{"ok", true}, {"lifecycle", lifecycle_name(journal_->state().lifecycle)}});
}

std::string Service::NotReadyReason() const {
  if (failed()) return "fail-stopped: " + failure();
  if (shutting_down_.load()) return "shutting down";
  const State s = journal_->state();
  if (s.lifecycle == Lifecycle::kTainted) {
    return "engine is TAINTED" +
           (s.taint ? std::string(" (") + cause_name(s.taint->cause) + ": " + s.taint->detail + ")"
                    : std::string()) +
           "; rolloutcore replay " + config_.journal_path + " explains it";
  }
  if (!admits(s)) return admission_block_reason(s);
  if (!engine_up_.load() && engine_last_probe_wall_ms_.load() != 0) {
    return "the engine did not answer the last probe";
  }
  return "";
}

void Service::HandleReadyz(const ApiRequest&, HttpResponse& res) {
  // Readiness: 200 only while rollouts can be served safely.
  const std::string why = NotReadyReason();
  const State s = journal_->state();
  json j = {{"ready", why.empty()},
            {"lifecycle", lifecycle_name(s.lifecycle)},
            {"engine_reachable", s.engine_reachable},
            {"journal_failed", failed()}};
  if (!why.empty()) j["reason"] = why;
  send_json(res, why.empty() ? 200 : 503, j);
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
  out += "rolloutcore_admissions_refused_total{reason=\"overloaded\"} " +
         std::to_string(metrics_.admission_rejected_overloaded.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"failed\"} " +
         std::to_string(metrics_.admission_rejected_failed.load()) + "\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"expired\"} " +
         std::to_string(s.counters.rollouts_expired) + "\n";
  out += "rolloutcore_updates_total{outcome=\"outcome_unknown\"} " +
         std::to_string(metrics_.updates_outcome_unknown.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"replayed\"} " +
         std::to_string(metrics_.updates_replayed.load()) + "\n";
  gauge("rolloutcore_journal_failed", "1 once the executor fail-stopped on a journal error",
        failed() ? "1" : "0");
  gauge("rolloutcore_engine_up", "1 when the engine monitor's last probe succeeded",
        engine_up_.load() ? "1" : "0");
  gauge("rolloutcore_engine_reachable", "the journaled view: 0 refuses admissions",
        s.engine_reachable ? "1" : "0");
  {
    const std::int64_t probe_ms = engine_last_probe_wall_ms_.load();
    const std::int64_t ok_ms = engine_last_ok_wall_ms_.load();
    gauge("rolloutcore_engine_last_probe_timestamp_seconds", "wall time of the last engine probe",
          format_double(static_cast<double>(probe_ms) / 1e3));
    gauge("rolloutcore_engine_last_ok_timestamp_seconds",
          "wall time of the last successful engine probe",
          format_double(static_cast<double>(ok_ms) / 1e3));
    gauge("rolloutcore_engine_last_probe_age_seconds", "seconds since the last engine probe",
          probe_ms == 0 ? "NaN" : format_double(static_cast<double>(wall_ms() - probe_ms) / 1e3));
    std::string instance, label;
    {
      std::lock_guard<std::mutex> g(engine_info_mu_);
      instance = engine_instance_seen_;
      label = engine_label_seen_;
    }
    out += "# HELP rolloutcore_engine_info the engine process the monitor sees (instance, label)\n"
           "# TYPE rolloutcore_engine_info gauge\n"
           "rolloutcore_engine_info{instance=\"" + escape_label_value(instance) +
           "\",journal_instance=\"" + escape_label_value(s.engine_instance) + "\",label=\"" +
           escape_label_value(label) + "\"} 1\n";
  }
  counter("rolloutcore_finish_retries_total", "finishes retried while the journal queue was full",
          metrics_.finish_retries.load());
  counter("rolloutcore_leases_renewed_total", "explicit rollout leases renewed",
          metrics_.leases_renewed.load());
  counter("rolloutcore_engine_probes_total", "engine monitor probes",
          metrics_.engine_probes.load());
  counter("rolloutcore_engine_probe_failures_total", "engine monitor probes that failed",
          metrics_.engine_probe_failures.load());
  counter("rolloutcore_engine_monitor_events_total", "EngineMonitored events journaled",
          metrics_.engine_monitor_submits.load());
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

void Service::HandleMetrics(const ApiRequest&, HttpResponse& res) {
  SetBody(res, 200, RenderMetrics(), "text/plain; version=0.0.4");
}

HttpRouter Service::Routes() {
  using bhttp::verb;
  HttpRouter r;
  auto bind = [this](void (Service::*fn)(const ApiRequest&, HttpResponse&)) {
    return [this, fn](const ApiRequest& req, HttpResponse& res) { (this->*fn)(req, res); };
  };
  r.Blocking(verb::get, "/healthz", bind(&Service::HandleHealthz));
  r.Blocking(verb::get, "/readyz", bind(&Service::HandleReadyz));
  r.Blocking(verb::post, "/v1/rollouts/*/lease", bind(&Service::HandleLease));
  r.Blocking(verb::get, "/v1/state", bind(&Service::HandleState));
  r.Blocking(verb::get, "/v1/version", bind(&Service::HandleVersion));
  r.Blocking(verb::post, "/v1/updates", bind(&Service::HandleUpdate));
  r.Blocking(verb::post, "/v1/rollouts", bind(&Service::HandleAdmit));
  r.Blocking(verb::delete_, "/v1/rollouts/*", bind(&Service::HandleFinish));
  r.Blocking(verb::get, "/v1/watch", bind(&Service::HandleWatch));
  r.Blocking(verb::get, "/v1/events", bind(&Service::HandleEvents));
  r.Blocking(verb::get, "/v1/manifest", bind(&Service::HandleManifest));
  r.Blocking(verb::get, "/metrics", bind(&Service::HandleMetrics));
  AddProxyRoutes(r);
  return r;
}

}  // namespace rc::service
