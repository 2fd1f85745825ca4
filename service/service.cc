#include "service/service.h"

#include <pthread.h>
#include <openssl/crypto.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include <spdlog/spdlog.h>

#include "effects/clock.h"
#include "effects/http/checkpoint_reload.h"
#include "effects/http/ipc_transfer.h"
#include "effects/http/sequence_transfer.h"
#include "effects/http/weight_digest.h"
#include "encoding/sha256.h"
#include "effects/nccl/weight_source.h"
#include "journal/json.h"
#include "service/api_parse.h"
#include "service/engine_startup.h"
#include "service/http_util.h"
#include "service/nccl_transfer.h"
#include "service/service_internal.h"
#include "statemachine/hex.h"
#include "statemachine/text.h"

namespace rc::service {
namespace {

using namespace internal;  // NOLINT: the service's own helpers

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Shutdown: after the grace deadline, cancelled proxied calls get this long to be recorded
// aborted (their finish is durable before the journal closes), and the workers this long to exit.
inline constexpr std::uint64_t kShutdownSettleMs = 2000;
inline constexpr std::uint64_t kShutdownPollMs = 5;  // how often Shutdown looks at what is left
// How often Shutdown looks again at how long a running plan may still take.
inline constexpr std::uint64_t kShutdownPlanPollMs = 50;
// The steps of a plan after its mutation (each cache reset, the validation, the resume), each one
// engine call: what a plan gets at shutdown once its mutation ended, call_timeout_ms each.
inline constexpr std::uint64_t kStepsAfterMutation = kCacheKinds + 2;
inline constexpr std::uint64_t kIoThreadsAutoMax = 4;
// Trainer API calls queued or running per blocking thread, beyond which they are answered 503.
inline constexpr std::size_t kBlockingQueuePerThread = 16;
// Descriptors serve opens once its connection limit is fitted, beside those open then: each
// event loop's epoll, eventfd and timerfd, and the listener.
inline constexpr std::uint64_t kDescriptorsPerLoop = 3;
inline constexpr std::uint64_t kListenerDescriptors = 1;
// Per engine: the monitor's, the control's and a transfer's connections (libcurl keeps a few per
// handle) and a name lookup's socket.
inline constexpr std::uint64_t kDescriptorsPerEngine = 16;
// Beside the journal's own (journal::Options::OpenFilesMax): the trajectories file's rotation and
// the logs.
inline constexpr std::uint64_t kFilesDescriptorsReserve = 16;
// The fewest client connections serve starts with (http_connections_max's lower bound).
inline constexpr std::uint64_t kConnectionsFitMin = 4;
// The destructor waits this long for blocking handlers (an update) to return. Every wait a
// handler makes ends at one of serve's deadlines; a plan chains a few of them (drain, transfer,
// the steps after it), each far below a day in any configuration a run uses: one still running
// a day into the teardown is stuck, not slow.
inline constexpr std::uint64_t kHandlersDrainMsMax = 24ull * 3600 * 1000;

// A prefix no other executor (or restart of this one) gives its rollouts: "px-<48 random bits>-".
std::string RandomRolloutPrefix() {
  std::random_device rd;
  char prefix[32];
  const int n = std::snprintf(prefix, sizeof(prefix), "px-%08x%04x-", static_cast<unsigned>(rd()),
                              static_cast<unsigned>(rd() & 0xffff));
  RC_CHECK(n > 0 && static_cast<std::size_t>(n) < sizeof(prefix));
  RC_CHECK(std::string_view(prefix).rfind(kGeneratedRolloutIdPrefix, 0) == 0);
  return prefix;
}

Clock::time_point SettleDeadline() {
  return Clock::now() + std::chrono::milliseconds(kShutdownSettleMs);
}

// Returns once no blocking handler runs and the pool is joined: the first Stop of `http`, or a
// later one after a Stop (Shutdown's) that left handlers running. A handler still running after
// kHandlersDrainMsMax is stuck past every deadline it has: serve ends here rather than free what
// it uses under it.
void JoinBlockingHandlers(HttpServer* http) {
  if (http == nullptr || http->Stop(kHandlersDrainMsMax)) return;
  spdlog::critical(
      "serve: a trainer API handler still runs {} ms into serve's teardown, past every deadline "
      "it has; aborting rather than destroy what it uses",
      kHandlersDrainMsMax);
  spdlog::default_logger()->flush();
  std::abort();
}

Lifecycle ReadLifecycle(const journal::Journal& journal) {
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  journal.ReadState([&lifecycle](const State& st) { lifecycle = st.lifecycle; });
  return lifecycle;
}

// ---- the client connection limit fitted to the open-file limit ----

// Raises RLIMIT_NOFILE's soft limit to the hard one, before the journal opens its files.
void RaiseOpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max) return;
  const rlim_t soft = lim.rlim_cur;
  lim.rlim_cur = lim.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    spdlog::warn("serve: could not raise the open-file limit from {} to {}: {}",
                 static_cast<std::uint64_t>(soft), static_cast<std::uint64_t>(lim.rlim_max),
                 std::strerror(errno));
  }
}

// Descriptors open now: /proc/self/fd's entries, or (without /proc) those below `limit` that are
// open.
std::uint64_t OpenDescriptors(std::uint64_t limit) {
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    std::uint64_t n = 0;
    while (const dirent* e = ::readdir(dir)) n += e->d_name[0] != '.' ? 1 : 0;
    ::closedir(dir);
    return n > 0 ? n - 1 : 0;  // not the directory's own
  }
  std::uint64_t n = 0;
  for (std::uint64_t fd = 0; fd < std::min<std::uint64_t>(limit, 1 << 20); ++fd) {
    n += ::fcntl(static_cast<int>(fd), F_GETFD) != -1 ? 1 : 0;
  }
  return n;
}

struct DescriptorBudget {
  std::uint64_t limit = 0;  // RLIMIT_NOFILE's soft limit
  std::uint64_t open = 0;   // open at the fit (the journal's files, the engine clients')
  // `open` and what serve opens besides client and engine sockets; the journal's files open at the
  // fit are counted in `open` and again in its bound (OpenFilesMax), which errs on the safe side.
  std::uint64_t reserved = 0;
  std::uint64_t engines = 1;
  std::uint64_t loops = 1;
};

// How serve opens its journal (the descriptor budget reserves what these options may hold).
journal::Options JournalOptionsOf(const ServeConfig& c, rocksdb::Env* env) {
  journal::Options jo;
  jo.sync = c.journal_sync;
  jo.env = env;
  jo.commit_stall_timeout_ms = c.journal_commit_stall_timeout_ms;
  jo.commit_window_us = c.journal_commit_window_us;
  return jo;
}

DescriptorBudget BudgetOf(const ServeConfig& c, std::uint64_t loops) {
  DescriptorBudget b;
  rlimit lim{};
  b.limit = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 ? static_cast<std::uint64_t>(lim.rlim_cur)
                                                  : std::numeric_limits<std::uint64_t>::max();
  b.open = OpenDescriptors(b.limit);
  b.engines = std::max<std::uint64_t>(1, c.engines.size());
  b.loops = loops;
  b.reserved = b.open + loops * kDescriptorsPerLoop + kListenerDescriptors +
               b.engines * kDescriptorsPerEngine + JournalOptionsOf(c, nullptr).OpenFilesMax() +
               kFilesDescriptorsReserve;
  return b;
}

// Descriptors the client and engine connections take at most with `connections` client
// connections and `engine_idle` idle engine connections kept per engine: every client socket the
// server holds (SocketsMaxFor: refused and lingering ones included), an engine socket per
// proxied request, and each engine pool's idle ones (ceil(idle / loops) per loop).
std::uint64_t ConnectionDescriptors(const DescriptorBudget& b, std::uint64_t connections,
                                    std::uint64_t engine_idle) {
  const std::uint64_t idle_per_pool = b.loops * ((engine_idle + b.loops - 1) / b.loops);
  return SocketsMaxFor(connections) + connections + b.engines * idle_per_pool;
}

bool Fits(const DescriptorBudget& b, std::uint64_t connections, std::uint64_t engine_idle) {
  return b.reserved <= b.limit &&
         ConnectionDescriptors(b, connections, engine_idle) <= b.limit - b.reserved;
}

// The largest connection limit up to `configured` that fits, its engine pools keeping no more
// idle connections than there can be proxied requests; 0 when none fits.
std::uint64_t FittedConnections(const DescriptorBudget& b, std::uint64_t configured,
                                std::uint64_t engine_idle) {
  const auto fits = [&](std::uint64_t n) { return Fits(b, n, std::min(engine_idle, n)); };
  std::uint64_t lo = 0, hi = configured;  // the answer is in [lo, hi]
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  RC_CHECK(lo <= configured && (lo == 0 || fits(lo)));
  return lo;
}

// Clients must never take the descriptors the engine monitor, the engine calls and the journal
// need (out of them, the monitor journals the engine unreachable and /readyz fails): when the
// configured limits do not fit the open-file limit, http_connections_max becomes the largest
// that does and engine_connections_max at most that; fewer than kConnectionsFitMin is an error.
Status FitConnectionsToOpenFiles(ServeConfig& c, std::uint64_t loops) {
  const DescriptorBudget b = BudgetOf(c, loops);
  const std::uint64_t configured = c.http_connections_max, idle = c.engine_connections_max;
  if (Fits(b, configured, idle)) return Status::OK();
  const std::uint64_t needed = b.reserved + ConnectionDescriptors(b, configured, idle);
  const std::uint64_t fitted = FittedConnections(b, configured, idle);
  const std::string why = fmt::format(
      "the open-file limit is {} (ulimit -n); {} descriptors are open (the journal's files and "
      "the engine clients' among them) and {} more are kept for the event loops, the listener, "
      "the engine monitor and calls, and the journal's new files; each connection takes a client "
      "socket and an engine socket, with a margin of sockets for refused connections, and the "
      "engine pool's idle connections count too",
      b.limit, b.open, b.reserved - b.open);
  if (fitted < kConnectionsFitMin) {
    const std::uint64_t least =
        b.reserved +
        ConnectionDescriptors(b, kConnectionsFitMin, std::min(idle, kConnectionsFitMin));
    return Status::Unavailable(fmt::format(
        "{}: no room for {} client connections; raise the open-file limit to at least {} ({} "
        "for the configured http_connections_max and engine_connections_max)",
        why, kConnectionsFitMin, least, needed));
  }
  c.http_connections_max = fitted;
  c.engine_connections_max = std::min(idle, fitted);
  spdlog::warn(
      "serve: http_connections_max lowered to {} (configured {}) and engine_connections_max to {} "
      "(configured {}): {}; connections beyond it are answered 503 or wait to be accepted; the "
      "configured values need an open-file limit of at least {}",
      c.http_connections_max, configured, c.engine_connections_max, idle, why, needed);
  RC_CHECK(Fits(b, c.http_connections_max, c.engine_connections_max));
  return Status::OK();
}

// One event loop per core by default, at most 4: on a 16-core host 4 loops served the most
// requests at both 16 and 256 connections, and each loop past that cost CPU per request (fewer
// events per wake-up) without adding throughput (bench/proxy/RESULTS.md).
std::size_t IoThreadsOf(const ServeConfig& c) {
  const std::uint64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return c.io_threads != 0 ? c.io_threads : std::min<std::uint64_t>(cores, kIoThreadsAutoMax);
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

// Also the path of a crash in tests (no Shutdown), and of a Shutdown that left a handler running
// (its Stop not drained): the event loops stop and every blocking handler returns first, the pool
// joined, then the engine connections and the journal go, and only then the io_context that
// journal callbacks post to (they are queued, never run).
Service::~Service() {
  StopBackground();
  JoinBlockingHandlers(http_.get());
  upstream_.reset();
  for (auto& [name, m] : fleet_members_) m->upstream.reset();
  fleet_runner_.reset();
  runner_.reset();
  journal_.reset();
}

void Service::StopBackground() {
  {
    std::lock_guard<std::mutex> lock(bg_mu_);
    bg_stop_ = true;
  }
  bg_cv_.notify_all();
  for (std::thread* t : MonitorThreads()) {
    if (t->joinable() && t->get_id() != std::this_thread::get_id()) t->join();
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
  // Threads still driving a plan (a fleet update's members) check only the journal: failing it
  // stops their next intent, so nothing mutates after the fail-stop.
  if (journal_ != nullptr) journal_->Stop(Status::Unavailable("serve fail-stopped: " + why));
  spdlog::critical(
      "serve: FAIL-STOP: {}; refusing admissions and updates, stopping effects; "
      "the process must exit and restart to recover from what is durable ({})",
      Esc(failure()), ReplayHint(config_.journal_path));
  failed_cv_.notify_all();
  lifecycle_cv_.notify_all();
  bg_cv_.notify_all();  // the monitor and lease threads stop at their next look
  RC_CHECK(failed());
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

// An Init that fails returns here: `s` goes, and its destructor stops and joins the threads
// Init started and closes what it opened.
Result<std::unique_ptr<Service>> Service::Open(const ServeConfig& config, rocksdb::Env* journal_env,
                                               effects::ThreadStarter thread_starter) {
  RC_RETURN_IF_ERROR(ValidateConfig(config));
  RaiseOpenFileLimit();
  std::unique_ptr<Service> s(new Service(config));
  s->journal_env_ = journal_env;
  s->thread_starter_ = std::move(thread_starter);
  RC_RETURN_IF_ERROR(s->Init());
  return s;
}

Status Service::StartBackgroundThread(std::string_view what, std::function<void()> body,
                                      std::thread& slot) {
  RC_CHECK(!slot.joinable());
  Result<std::thread> started = effects::StartThread(what, std::move(body), thread_starter_);
  if (!started.ok()) return started.status();
  slot = std::move(started).value();
  return Status::OK();
}

// The one engine's monitor and the lease expiry; a refused one fails the start (the destructor
// joins the one that started).
Status Service::StartEngineThreads() {
  RC_RETURN_IF_ERROR(StartBackgroundThread(
      "the engine monitor thread",
      [this] {
        RunGuarded("engine monitor", [this] { MonitorLoop({"", *control_client_, watch_}); });
      },
      monitor_thread_));
  return StartBackgroundThread(
      "the lease expiry thread", [this] { LeaseLoop(); }, lease_thread_);
}

// Opens everything the executor runs on, in the order each needs the one before: the journal,
// the trajectories file, the engine clients (once the engine answers GET /version), the weight
// transfer and the runner; then, under update_mu_, recovers or bootstraps the journal, seeds the
// durable view and starts the monitor and lease threads.
Status Service::Init() {
  RC_CHECK(journal_ == nullptr && runner_ == nullptr);  // once, from Open
  // A build without CUDA, or a host without the configured device, is refused with nothing
  // opened.
  RC_RETURN_IF_ERROR(CheckNcclDevice(config_));
  rollout_prefix_ = RandomRolloutPrefix();
  RC_RETURN_IF_ERROR(OpenJournal());
  RC_RETURN_IF_ERROR(OpenTrajectories());
  if (is_fleet()) return InitFleet();
  RC_RETURN_IF_ERROR(OpenEngineClients());
  // Nothing below is decided before the engine answers GET /version: it may still be loading.
  RC_RETURN_IF_ERROR(AwaitEngineVersion());
  Result<TransferInit> init_transfer = MakeTransfer();
  if (!init_transfer.ok()) return init_transfer.status();
  MakeRunner();
  std::lock_guard<std::timed_mutex> lock(update_mu_);
  RC_RETURN_IF_ERROR(RecoverJournal());
  RC_RETURN_IF_ERROR(BootstrapIfUninitialized());
  // nccl: a failure here is a startup error (no update could ever succeed without the
  // communicator); the journal keeps what Recover/Bootstrap recorded, which a restart resumes.
  RC_RETURN_IF_ERROR((*init_transfer)());
  SeedDurableView();
  RenewSurvivingLeases(durable_.state);
  RC_RETURN_IF_ERROR(StartEngineThreads());
  RC_CHECK(control_client_ && http_control_ && transfer_ && runner_ && !rollout_prefix_.empty());
  return Status::OK();
}

Status Service::OpenJournal() {
  auto opened =
      journal::Journal::Open(config_.journal_path, JournalOptionsOf(config_, journal_env_));
  if (!opened.ok()) return opened.status();
  if ((*opened)->is_fleet() && !is_fleet()) {
    // One engine configured: the fleet's engines would be neither driven nor watched.
    return Status::InvalidArgument("journal at " + config_.journal_path +
                                   " holds a fleet of named engines; serve it with `engines` "
                                   "(--fleet-engine NAME=URL), not engine_url");
  }
  if (is_fleet() && !(*opened)->is_fleet() && (*opened)->head_seq() > 0) {
    return Status::InvalidArgument("journal at " + config_.journal_path +
                                   " holds one unnamed engine; serve it with engine_url, or "
                                   "start the fleet on a new journal");
  }
  journal_ = std::move(opened.value());
  durable_waits_ = std::make_unique<DurableWaits>(*journal_);
  LogRecovery(journal_->recovery());
  RC_CHECK(journal_ != nullptr);
  return Status::OK();
}

// trajectories_path, or <journal>.trajectories.jsonl beside the journal's directory: named after
// the journal, so two journals in one parent directory never share a file.
std::string DefaultTrajectoriesPath(const std::string& journal_path) {
  std::filesystem::path p(journal_path);
  if (!p.has_filename()) p = p.parent_path();
  return p.string() + ".trajectories.jsonl";
}

Status Service::OpenTrajectories() {
  const std::string path = config_.trajectories_path.empty()
                               ? DefaultTrajectoriesPath(config_.journal_path)
                               : config_.trajectories_path;
  return trajectories_.Open(path, config_.trajectories_bytes_max, {}, thread_starter_);
}

Status Service::OpenEngineClients() {
  control_client_ =
      std::make_unique<effects::EngineClient>(config_.engine_url, ControlDeadlines(config_));
  Result<UpstreamTarget> target = ParseEngineUrl(config_.engine_url);
  if (!target.ok()) return target.status();
  engine_target_ = std::move(target.value());
  // The runner drains locally before pausing (effects/runner.cc), so the plain HTTP control.
  http_control_ = std::make_unique<effects::HttpEngineControl>(*control_client_);
  RC_CHECK(!engine_target_.host.empty() && engine_target_.port != 0);
  return Status::OK();
}

Status Service::AwaitEngineVersion() {
  RC_CHECK(control_client_ != nullptr);
  const EngineVersionWait waited =
      WaitForEngineVersion(*control_client_, config_.engine_url, config_.engine_startup_timeout_ms);
  if (!waited.status.ok()) return waited.status;
  engine_version_ = waited.version;
  return Status::OK();
}

// The weight transfer `transfer` names, and what initialises it with the engine once the journal
// is recovered or bootstrapped.
Result<Service::TransferInit> Service::MakeTransfer() {
  RC_CHECK(control_client_ != nullptr && transfer_ == nullptr);
  if (config_.transfer == "nccl") return MakeOneNcclTransfer();
  auto transfer = MakeGpuFreeTransfer(config_, *control_client_, engine_version_);
  if (!transfer.ok()) return transfer.status();
  transfer_ = std::move(transfer.value());
  if (config_.transfer != "http") return TransferInit([] { return Status::OK(); });
  const effects::EngineProtocol protocol = effects::detect_protocol(engine_version_);
  return TransferInit([this, protocol]() -> Status {
    if (ReadLifecycle(*journal_) == Lifecycle::kReady) {
      InitHttpWeightTransfer(*control_client_, protocol, config_);
    }
    return Status::OK();
  });
}

Service::TransferInit Service::MakeOneNcclTransfer() {
  auto rendezvous = ParseHostPort(config_.rendezvous);
  RC_CHECK(rendezvous.ok());  // ValidateConfig requires a well-formed one for nccl
  NcclTransfer nccl =
      MakeNcclTransfer(*control_client_, config_, {"", config_.engine_url, *rendezvous});
  transfer_ = std::move(nccl.transfer);
  return std::move(nccl.init);
}

void Service::MakeRunner() {
  RC_CHECK(journal_ && http_control_ && transfer_ && runner_ == nullptr);
  auto done = std::make_shared<EngineMutations>();
  gated_control_ = GateControl(*http_control_, mutation_gate_, config_.call_timeout_ms, done);
  gated_transfer_ = GateTransfer(*transfer_, mutation_gate_, done);
  runner_ = std::make_unique<effects::Runner>(*journal_, *gated_control_, *gated_transfer_,
                                              effects::system_clock(), RunnerOptionsOf(config_));
  runner_->set_stop_waiting([this] { return mutation_gate_.closed(); });
  runner_->set_digest_schedule(DigestScheduleOf(watch_));
  runner_->set_observer([this](std::uint64_t seq, const Event& e) {
    if (!IsDecision(e)) return;
    LogDecision("", seq, e);
    NotifyLifecycle(seq);
  });
}

// Every lifecycle transition and every update's outcome, with its reason; taints at error level
// with the command that explains them.
void Service::LogDecision(const std::string& engine, std::uint64_t seq, const Event& e) const {
  const std::string who = engine.empty() ? "" : "engine " + Esc(engine) + ": ";
  if (const auto* c = std::get_if<StateChanged>(&e)) {
    if (c->to == Lifecycle::kTainted) {
      spdlog::error(
          "serve: {}seq {}: {} -> TAINTED ({}): {}; no rollouts are admitted to it until an "
          "operator intervenes; {}",
          who, seq, lifecycle_name(c->from), cause_name(c->cause), Esc(c->detail),
          ReplayHint(config_.journal_path));
    } else {
      spdlog::info("serve: {}seq {}: {} -> {} ({}): {}", who, seq, lifecycle_name(c->from),
                   lifecycle_name(c->to), cause_name(c->cause), Esc(c->detail));
    }
  } else if (const auto* u = std::get_if<UpdateEnded>(&e)) {
    if (u->outcome == UpdateOutcome::kCommitted) {
      spdlog::info("serve: {}seq {}: update '{}' committed: {}", who, seq, Esc(u->update_id),
                   Esc(u->reason));
    } else {
      spdlog::warn("serve: {}seq {}: update '{}' {}: {}; {}", who, seq, Esc(u->update_id),
                   update_outcome_name(u->outcome), Esc(u->reason),
                   ReplayHint(config_.journal_path));
    }
  }
}

// An interrupted update goes on only once clients can reach the executor (Start): its drain may
// wait for leased rollouts whose holders must be able to finish them. Anything else recovers now.
Status Service::RecoverJournal() {
  RC_CHECK(runner_ != nullptr && !interrupted_update_);
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  std::optional<UpdatePlan> update;
  journal_->ReadState([&](const State& st) {
    lifecycle = st.lifecycle;
    update = st.update;
  });
  spdlog::info("serve: journal {} opened at seq {}: {}{}", Esc(config_.journal_path),
               journal_->head_seq(), lifecycle_name(lifecycle),
               update ? " (update '" + Esc(update->update_id) + "' interrupted)" : "");
  // What the open found (a torn WAL tail above all) is recorded, not only logged: once this
  // process writes on, the WAL no longer shows it, and replay and audit read it from the record.
  const journal::Recovery opened = journal_->recovery();
  if (update) {
    interrupted_update_ = update;
    Status begun = runner_->BeginRecovery(opened);
    if (!begun.ok()) return RecoveryFailed(begun);
  } else if (Status recovered = runner_->Recover(opened); !recovered.ok()) {
    return RecoveryFailed(recovered);
  }
  return Status::OK();
}

Status Service::BootstrapIfUninitialized() {
  if (ReadLifecycle(*journal_) != Lifecycle::kUninitialized) return Status::OK();
  Result<WeightIdentity> id = BootstrapIdentity(*transfer_);
  if (!id.ok()) return id.status();
  const effects::BootstrapOptions bo = BootstrapOptionsOf();
  spdlog::info("serve: bootstrapping engine {} as '{}'{}", Esc(config_.engine_url),
               Esc(config_.initial_label), config_.adopt_engine ? " (adopt)" : "");
  Status booted = runner_->Bootstrap(config_.initial_label, *id, bo);
  return booted.ok() ? booted : BootstrapFailed(booted);
}

// The declared initial identity; its manifest digest computed from initial_source when only
// the source was given.
effects::BootstrapOptions Service::BootstrapOptionsOf() const {
  effects::BootstrapOptions bo;
  bo.adopt = config_.adopt_engine;
  bo.require_digest = config_.require_weight_digest;
  bo.startup_timeout_ms = config_.engine_startup_timeout_ms;
  bo.progress = [](const std::string& line) { spdlog::info("serve: bootstrap: {}", Esc(line)); };
  return bo;
}

Result<WeightIdentity> Service::BootstrapIdentity(effects::WeightTransfer& transfer) {
  WeightIdentity id;
  id.manifest_digest = config_.initial_manifest_digest;
  id.checkpoint = config_.initial_checkpoint;
  id.run = config_.initial_run;
  id.step = config_.initial_step;
  if (!id.manifest_digest.empty() || config_.initial_source.empty()) return id;
  PreflightObserved p =
      transfer.Preflight(effects::TransferTarget{"bootstrap", {}, {}, config_.initial_source});
  if (p.source_manifest_digest.empty()) {
    return Status::InvalidArgument("initial_source '" + Esc(config_.initial_source) +
                                   "': no manifest (" + Esc(p.detail) + ")");
  }
  id.manifest_digest = p.source_manifest_digest;
  return id;
}

// vLLM 0.25.x keeps the label only in the worker extension: when no route ever gave a label,
// that is the likely fix (not when the engine answered with the wrong one).
Status Service::BootstrapFailed(const Status& booted) const {
  RC_CHECK(!booted.ok());
  std::string msg = "bootstrap of engine " + config_.engine_url + " as '" + config_.initial_label +
                    "' failed: " + booted.message();
  if (engine_version_.rfind("0.25", 0) == 0 &&
      control_client_->label_route() == effects::LabelRoute::kUnknown &&
      msg.find("worker-extension-cls") == std::string::npos) {
    msg += " (engine version " + engine_version_ +
           ": is vLLM started with --worker-extension-cls "
           "rolloutcore.vllm_ext.RolloutCoreWorkerExtension?)";
  }
  return Status(booted.code(), msg);
}

// Nothing else runs yet and the runner synced before it returned: all of the journal is durable.
void Service::SeedDurableView() {
  RC_CHECK(durable_.head.seq == 0);  // seeded once, before any route reads it
  durable_.state = journal_->state();
  durable_.head = DurableHead{journal_->head_seq(), journal_->head_hash()};
  durable_.decision_seq = journal_->head_seq();
  NotifyLifecycle(journal_->head_seq());
  const State& s = durable_.state;
  if (s.lifecycle == Lifecycle::kTainted) {
    LogTaint(s.taint, "starting on a TAINTED journal");
  } else {
    spdlog::info(
        "serve: journal {} at seq {}, state {}, committed '{}' (generation {}), {} "
        "leased rollout(s) kept",
        Esc(config_.journal_path), journal_->head_seq(), lifecycle_name(s.lifecycle),
        Esc(s.committed.label), s.committed.generation, s.active.size());
  }
}

// Leased rollouts that survived the restart get a full lease from now.
void Service::RenewSurvivingLeases(const State& s) {
  std::lock_guard<std::mutex> g(lease_mu_);
  const std::int64_t now_ms = effects::system_clock().now_ms();
  for (const auto& [rid, r] : s.active) {
    if (r.lease_ms > 0) lease_deadline_ms_[rid] = now_ms + r.lease_ms;
  }
  RC_CHECK(lease_deadline_ms_.size() <= s.active.size());
}

// What the open found: a torn WAL tail after a crash is named (what was acknowledged is intact:
// nothing is acknowledged before its sync), so an operator can tell it from a clean restart.
void Service::LogRecovery(const journal::Recovery& r) const {
  if (!r.torn_tail.empty()) {
    spdlog::warn("serve: journal {}: {} (unacknowledged writes of the crashed process)",
                 Esc(config_.journal_path), Esc(r.torn_tail));
  } else if (!r.clean_close && r.head_seq > 0) {
    spdlog::info("serve: journal {} was not closed cleanly; recovering from seq {}",
                 Esc(config_.journal_path), r.head_seq);
  }
}

void Service::LogTaint(const std::optional<TaintRecord>& taint, const char* context) const {
  if (!taint) {
    spdlog::error("serve: {}: TAINTED without a taint record; {}", context,
                  ReplayHint(config_.journal_path));
    return;
  }
  spdlog::error(
      "serve: {}: engine is TAINTED since {} of update '{}' ({}): {}; no rollouts are "
      "admitted and /readyz answers 503; {}",
      context, lifecycle_name(taint->from), Esc(taint->update_id), cause_name(taint->cause),
      Esc(taint->detail), ReplayHint(config_.journal_path));
}

// The engine monitor: while READY (and while SLEEPING, without weight digests: a sleeper's
// weights are not mapped), probes the engine every engine_monitor_interval_ms and
// journals EngineMonitored only when it changes something (reachability toggles, another engine
// process, another label, paused behind our back, or a pending recheck now confirmed), so the
// journal does not grow with time. The fold decides what it means (docs/lifecycle.md).
// One engine's probes, every engine_monitor_interval_ms until Shutdown or a fail-stop (a fleet
// runs one loop per member, so an engine that hangs delays no other's).
void Service::MonitorLoop(const MonitorTarget& target) {
  pthread_setname_np(pthread_self(), "rc-monitor");
  const auto interval = std::chrono::milliseconds(config_.engine_monitor_interval_ms);
  while (WaitBackgroundTick(interval)) {
    if (journal_->failed()) {
      FailStop(journal_->failure().ToString());
      return;
    }
    if (!MonitorOnce(target)) return;
  }
}

std::vector<std::thread*> Service::MonitorThreads() {
  std::vector<std::thread*> out{&monitor_thread_};
  for (std::thread& t : fleet_monitor_threads_) out.push_back(&t);
  return out;
}

// False when the background threads are to stop (Shutdown, or a fail-stop).
bool Service::WaitBackgroundTick(std::chrono::milliseconds interval) {
  std::unique_lock<std::mutex> lock(bg_mu_);
  bg_cv_.wait_for(lock, interval, [&] { return bg_stop_ || failed(); });
  return !bg_stop_ && !failed();
}

// The state the engine monitor decides on, read under the journal's lock without the maps that
// grow with the journal (active rollouts, committed labels): engine_matches and the monitor read
// only the lifecycle, the committed version, the engine's fields and the counters.
State Service::MonitorView(const std::string& engine) const {
  State view;
  auto copy = [&view](const State& st) {
    view.lifecycle = st.lifecycle;
    view.committed = st.committed;
    view.committed_identity = st.committed_identity;
    view.update = st.update;
    view.taint = st.taint;
    view.engine_instance = st.engine_instance;
    view.engine_reachable = st.engine_reachable;
    view.engine_recheck = st.engine_recheck;
    view.fold_rules = st.fold_rules;
    view.counters = st.counters;
    view.committed_digest = st.committed_digest;
  };
  if (engine.empty()) {
    journal_->ReadState(copy);
  } else {
    journal_->ReadFleetState([&](const FleetState& f) { copy(engine_state(f, engine)); });
  }
  return view;
}

// One probe, compared with the state read before it; false once the executor fail-stopped.
bool Service::MonitorOnce(const MonitorTarget& t) {
  const State before = MonitorView(t.engine);
  const bool asleep = before.lifecycle == Lifecycle::kSleeping;
  // A plan in flight: the runner owns the engine, unless the plan stalled there.
  if (before.update.has_value()) return RetryStalledPlan(t);
  if (before.lifecycle != Lifecycle::kReady && !asleep) return true;
  const EngineProbe probe = ProbeEngine(t, asleep ? 0 : DigestIntervalMs(before));
  const EngineMonitored& p = probe.seen;
  const bool ok = p.http.ok_2xx();
  // The fold's own rule decides what matches; only a change is journaled.
  const bool matches = ok && engine_matches(before, p.reported_label, p.is_paused_known,
                                            p.is_paused, p.engine_instance);
  const bool vouched = ok && engine_vouched(before, p.reported_label, p.is_paused_known,
                                            p.is_paused, p.engine_instance);
  if (vouched) t.watch.last_ok_wall_ms.store(probe.wall_ms);
  const bool drift = ok && WeightsDrifted(t.watch, before, p.digest, probe.wall_ms);
  // An engine verified before instances were read adopts the first one that vouches.
  const bool adopts = vouched && before.engine_instance.empty() && !p.engine_instance.empty();
  const bool changes = look_changes_reachability(before, p) || (ok && !matches) || drift ||
                       look_clears_recheck(before, p) || adopts;
  if (!changes) return true;
  EngineMonitored m = p;
  // Weights can have changed any time since the last digest that matched (label and instance
  // checks cannot see it): the audit's window of suspect rollouts opens there.
  m.last_ok_wall_ms =
      drift ? t.watch.last_digest_match_wall_ms.load() : t.watch.last_ok_wall_ms.load();
  m.updates_seen = monitor_epoch(before);  // the fold's own definition, never restated
  return JournalEngineChange(t.engine, m, probe.wall_ms);
}

// Whether a digest the monitor took shows weights other than the committed ones; counts the
// check for /metrics either way.
bool Service::WeightsDrifted(EngineWatch& watch, const State& before, const WeightDigest& d,
                             std::int64_t now_wall_ms) {
  if (!d.present() && d.error.empty()) return false;  // no check this tick
  if (!d.present()) {
    metrics_.digest_checks_unavailable++;
    return false;
  }
  const bool drifted = !weights_match(before, d);
  (drifted ? metrics_.digest_checks_drift : metrics_.digest_checks_match)++;
  if (!drifted) watch.last_digest_match_wall_ms.store(now_wall_ms);
  return drifted;
}

// A check is due every interval_ms since the last one answered (0: never). Taking the read
// first, then asking, makes the two one step: of a monitor tick and a look before a plan that ask
// at once, one at most reads, and nobody reads while a read is in flight.
bool EngineWatch::TakeDigestCheck(std::uint64_t interval_ms, std::int64_t now_wall_ms) {
  if (interval_ms == 0) return false;
  bool idle = false;
  if (!digest_reading.compare_exchange_strong(idle, true)) return false;
  const std::int64_t last = last_digest_check_wall_ms.load();
  const bool due = last == 0 || now_wall_ms - last >= static_cast<std::int64_t>(interval_ms);
  const std::uint64_t backoff_ms = digest_backoff_ms.load();
  const std::int64_t since_failed_ms = now_wall_ms - digest_failed_wall_ms.load();
  const bool waited = backoff_ms == 0 || since_failed_ms >= static_cast<std::int64_t>(backoff_ms);
  if (due && waited) return true;
  digest_reading.store(false);
  return false;
}

// A read that failed is no check, but the next waits a backoff counted from its end (a timeout
// included), so an engine that cannot answer is asked once per backoff, not at every tick.
void EngineWatch::DigestRead(bool answered, std::uint64_t interval_ms, std::int64_t now_wall_ms) {
  RC_CHECK(digest_reading.load());  // only the taker of the read reports it
  const std::uint64_t backoff_ms = digest_backoff_ms.load();
  if (answered) {
    last_digest_check_wall_ms.store(now_wall_ms);
    digest_backoff_ms.store(0);
  } else {
    const std::uint64_t next_ms = backoff_ms == 0 ? kDigestRetryBackoffMsMin : 2 * backoff_ms;
    digest_backoff_ms.store(std::min(next_ms, interval_ms));
    digest_failed_wall_ms.store(now_wall_ms);
  }
  digest_reading.store(false);  // last: the next taker sees what this read left
}

// Whether this tick (or look before a plan) also digests the weights; true takes the read, which
// DigestCheckDone reports.
// While a re-verification is pending, only a digest equal to the committed one lifts it (fold
// rules 1) and the engine admits nothing: the monitor asks for one every few seconds, whatever
// weight_digest_check_interval_ms says (0 included), its failures backed off as ever.
constexpr std::uint64_t kRecheckDigestIntervalMs = 2000;

std::uint64_t Service::DigestIntervalMs(const State& before) const {
  const std::uint64_t configured = config_.weight_digest_check_interval_ms;
  if (!before.engine_recheck) return configured;
  return configured == 0 ? kRecheckDigestIntervalMs
                         : std::min(configured, kRecheckDigestIntervalMs);
}

bool Service::DigestCheckDue(EngineWatch& watch, std::int64_t now_wall_ms,
                             std::uint64_t interval_ms) const {
  return watch.TakeDigestCheck(interval_ms, now_wall_ms);
}

// A digest check is done once the engine answered it: a digest, or why it computes none (no
// extension, an answer the parser refused), which asking again soon would not change. A read
// that failed (unreachable, a timeout, a 5xx), or a look that never got to make it, proves
// nothing: it is asked again after the backoff, not a whole weight_digest_check_interval_ms
// later.
void Service::DigestCheckDone(EngineWatch& watch, const WeightDigest& d, std::int64_t now_wall_ms,
                              std::uint64_t interval_ms) const {
  const bool answered =
      d.present() || (!d.error.empty() && d.error.rfind(effects::kDigestReadFailedPrefix, 0) != 0);
  watch.DigestRead(answered, interval_ms, now_wall_ms);
}

// The runner's looks before a plan follow the monitor's schedule of `watch`'s engine.
effects::Runner::DigestSchedule Service::DigestScheduleOf(EngineWatch& watch) {
  const std::uint64_t interval_ms = config_.weight_digest_check_interval_ms;
  return {[this, &watch, interval_ms] { return DigestCheckDue(watch, wall_ms(), interval_ms); },
          [this, &watch, interval_ms](const WeightDigest& d) {
            DigestCheckDone(watch, d, wall_ms(), interval_ms);
          }};
}

// GET the engine's view once; what it saw is kept for /metrics and /readyz.
Service::EngineProbe Service::ProbeEngine(const MonitorTarget& t,
                                          std::uint64_t digest_interval_ms) {
  EngineProbe probe{t.client.Monitor(), wall_ms()};
  if (probe.seen.http.ok_2xx() && DigestCheckDue(t.watch, probe.wall_ms, digest_interval_ms)) {
    probe.seen.digest = effects::ReadWeightDigest(t.client);
    DigestCheckDone(t.watch, probe.seen.digest, wall_ms(), digest_interval_ms);  // when it ended
  }
  const EngineMonitored& p = probe.seen;
  metrics_.engine_probes++;
  t.watch.last_probe_wall_ms.store(probe.wall_ms);
  const bool ok = p.http.ok_2xx();
  t.watch.up.store(ok);
  if (!ok) metrics_.engine_probe_failures++;
  if (ok) {
    std::lock_guard<std::mutex> g(t.watch.seen_mu);
    t.watch.instance_seen = p.engine_instance;
    t.watch.label_seen = p.reported_label;
  }
  RC_CHECK(metrics_.engine_probe_failures.load() <= metrics_.engine_probes.load());
  return probe;
}

// Submits the monitor's record and waits until it is durable; false once the executor
// fail-stopped. A refusal that is not a journal failure is a stale look (an update or recovery
// began after it, or the engine is no longer READY): the next tick looks again.
bool Service::JournalEngineChange(const std::string& engine, const EngineMonitored& m,
                                  std::int64_t now_wall_ms) {
  journal::Ticket ticket;
  std::vector<Event> decisions;
  if (engine.empty()) {
    auto submitted = journal_->Submit(m, now_wall_ms);
    if (!submitted.ok())
      return !IsJournalFailure(submitted.status()) || MonitorRefused(submitted.status());
    ticket = submitted->ticket;
    decisions = std::move(submitted->decisions);
  } else {
    auto submitted = journal_->SubmitFleet(FleetEvent{engine, m}, now_wall_ms);
    if (!submitted.ok())
      return !IsJournalFailure(submitted.status()) || MonitorRefused(submitted.status());
    ticket = submitted->ticket;
    for (FleetEvent& d : submitted->decisions) decisions.push_back(std::move(d.event));
  }
  Status waited = journal_->Wait(ticket);
  if (!waited.ok()) {
    FailStop("commit of the engine monitor's record failed: " + waited.ToString());
    return false;
  }
  metrics_.engine_monitor_submits++;
  LogEngineChange(engine, m, ticket.result.first_seq, decisions);
  RC_CHECK(ticket.result.last_seq == ticket.result.first_seq + decisions.size());
  NotifyLifecycle(ticket.result.last_seq);
  return true;
}

bool Service::MonitorRefused(const Status& st) {
  FailStop("the engine monitor's record was refused: " + st.ToString());
  return false;
}

void Service::LogEngineChange(const std::string& engine, const EngineMonitored& m,
                              std::uint64_t first_seq, const std::vector<Event>& decisions) {
  const std::string who = engine.empty() ? "engine" : "engine " + Esc(engine);
  const bool ok = m.http.ok_2xx();
  std::uint64_t seq = first_seq;
  spdlog::log(ok ? spdlog::level::warn : spdlog::level::err,
              "serve: seq {}: {} monitor: {} (label '{}', instance '{}', paused {})", seq, who,
              ok ? "engine answers" : "engine unreachable: " + Esc(m.http.error),
              Esc(m.reported_label), Esc(m.engine_instance),
              m.is_paused_known ? (m.is_paused ? "yes" : "no") : "unknown");
  for (const Event& d : decisions) {
    ++seq;
    if (const auto* c = std::get_if<StateChanged>(&d)) {
      spdlog::error("serve: seq {}: {}: {} -> {} ({}): {}; {}", seq, who, lifecycle_name(c->from),
                    lifecycle_name(c->to), cause_name(c->cause), Esc(c->detail),
                    ReplayHint(config_.journal_path));
    }
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

std::shared_ptr<const State> Service::AdmitView() {
  std::lock_guard<std::mutex> lock(view_mu_);
  // The epoch is read before the state: the copy is at least as new as the epoch it is filed
  // under, so a decision journaled after this read bumps the epoch and forces the next refresh.
  const std::uint64_t epoch = lifecycle_epoch_.load(std::memory_order_acquire);
  if (view_ != nullptr && view_epoch_ == epoch) return view_;
  view_ = std::make_shared<const State>(journal_->state());
  view_epoch_ = epoch;
  RC_CHECK(view_epoch_ <= lifecycle_epoch_.load(std::memory_order_acquire));
  return view_;
}

std::string Service::NextRolloutId() {
  return rollout_prefix_ + std::to_string(rollout_counter_.fetch_add(1) + 1);
}

HttpServerOptions Service::ServerOptions() const {
  HttpServerOptions o;
  o.host = config_.listen_host;
  o.port = config_.listen_port;
  o.io_threads = IoThreadsOf(config_);
  o.connections_max = config_.http_connections_max;
  o.header_bytes_max = config_.header_bytes_max;
  o.body_bytes_max = config_.body_bytes_max;
  o.body_memory_bytes_max = config_.body_memory_bytes_max;
  o.idle_timeout_ms = config_.idle_timeout_ms;
  o.header_timeout_ms = config_.header_timeout_ms;
  o.body_timeout_ms = config_.body_timeout_ms;
  o.write_timeout_ms = config_.write_timeout_ms;
  o.blocking_threads = static_cast<std::size_t>(config_.http_threads);
  o.blocking_queue_max = kBlockingQueuePerThread * static_cast<std::size_t>(config_.http_threads);
  o.thread_starter = thread_starter_;
  RC_CHECK(o.io_threads >= 1 && o.blocking_threads >= 1 &&
           o.blocking_queue_max >= o.blocking_threads);  // ValidateConfig's bounds
  return o;
}

Result<std::unique_ptr<UpstreamPool>> Service::MakeUpstream(const UpstreamTarget& target) {
  RC_CHECK(http_ != nullptr);  // the pool's sockets live on the server's loops
  // A host that does not resolve now is a mistake in the URL, reported at start; the pool starts
  // from these addresses and looks the name up again as upstream.h says.
  Result<std::vector<boost::asio::ip::tcp::endpoint>> endpoints =
      ResolveEngineHost(target.host, target.port);
  if (!endpoints.ok()) return endpoints.status();
  auto pool = std::make_unique<UpstreamPool>(target.host, target.port,
                                             config_.engine_connections_max, http_->loop_count());
  pool->SeedAddresses(std::move(endpoints.value()));
  return pool;
}

Status Service::Listen() {
  Result<int> port = http_->Start();
  if (!port.ok()) return port.status();
  port_ = *port;
  RC_CHECK(port_ > 0);
  spdlog::info("serve: listening on {}", Esc(url()));
  return Status::OK();
}

Status Service::Start() {
  RC_CHECK(!http_ && !upstream_);
  RC_RETURN_IF_ERROR(FitConnectionsToOpenFiles(config_, IoThreadsOf(config_)));
  http_ = std::make_unique<HttpServer>(ServerOptions(), is_fleet() ? FleetRoutes() : Routes());
  if (is_fleet()) return StartFleet();
  auto pool = MakeUpstream(engine_target_);
  if (!pool.ok()) return pool.status();
  upstream_ = std::move(pool.value());
  RC_RETURN_IF_ERROR(Listen());
  return FinishInterruptedUpdate();
}

Status Service::RecoveryFailed(const Status& st) const {
  return Status(st.code(),
                "recovery of journal " + config_.journal_path + " failed: " + st.message());
}

// The second half of a recovery that found an update interrupted (Init journaled RecoveryStarted):
// driven while listening, so leased rollouts can finish and the drain can complete.
Status Service::FinishInterruptedUpdate() {
  if (!interrupted_update_) return Status::OK();
  const UpdatePlan before = *interrupted_update_;
  interrupted_update_.reset();
  std::lock_guard<std::timed_mutex> lock(update_mu_);
  spdlog::info(
      "serve: going on with the interrupted update '{}' now that clients can reach "
      "the executor",
      Esc(before.update_id));
  const Status driven =
      DrivePlan("interrupted update", before.update_id, [this] { return runner_->Drive(); });
  if (!driven.ok()) {
    FailStop("recovery of the interrupted update failed: " + driven.ToString());
    return RecoveryFailed(driven);
  }
  LogInterruptedUpdateEnd(before);
  return Status::OK();
}

// How this restart ended the update it found interrupted, as the journal now says.
void Service::LogInterruptedUpdateEnd(const UpdatePlan& update) const {
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  WeightVersion committed;
  std::optional<TaintRecord> taint;
  journal_->ReadState([&](const State& st) {
    lifecycle = st.lifecycle;
    committed = st.committed;
    taint = st.taint;
  });
  if (lifecycle == Lifecycle::kReady && committed == update.target) {
    spdlog::warn(
        "serve: this restart COMPLETED the interrupted update '{}': the engine now "
        "serves '{}' (generation {}); a trainer that was told otherwise should re-POST "
        "it to read the recorded outcome; {}",
        Esc(update.update_id), Esc(committed.label), committed.generation,
        ReplayHint(config_.journal_path));
  } else {
    spdlog::warn("serve: this restart ended the interrupted update '{}' in {}; {}",
                 Esc(update.update_id), lifecycle_name(lifecycle),
                 ReplayHint(config_.journal_path));
  }
  if (lifecycle == Lifecycle::kTainted) LogTaint(taint, "after recovery");
}

bool Service::Shutdown(std::uint64_t grace_ms, const ShutdownExtended& extended) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(grace_ms);
  // From here no new mutation of an engine starts; a running plan that has not begun one ends
  // refused at the gate, and the engine resumes on its committed weights. Closed first: whoever
  // sees the shutdown (/readyz, a plan's answer) sees the gate closed.
  mutation_gate_.Close();
  shutting_down_.store(true);
  lifecycle_cv_.notify_all();
  CancelFleetUpdateAtShutdown();
  const RolloutsEnded rollouts = EndProxiedRollouts(deadline);
  if (rollouts == RolloutsEnded::kStillRunning) {
    // The exit is unclean either way; a mutation in flight still gets its deadline, so that the
    // restart does not find it half done.
    WaitForMutationsAtShutdown(deadline, extended);
    return false;
  }
  if (!TookPlanSlotAtShutdown(deadline, extended)) return false;
  StopBackground();
  Status closed = Status::OK();
  if (!StopServing(closed)) {
    // A worker is still inside a handler: everything it uses must outlive it, so nothing is
    // torn down (the caller exits; everything acknowledged is already durable).
    update_mu_.unlock();
    spdlog::warn(
        "serve: HTTP workers still busy after the shutdown deadline; exiting without "
        "closing the journal");
    return false;
  }
  update_mu_.unlock();
  if (!closed.ok()) {
    spdlog::error(
        "serve: the journal could not be closed cleanly ({}); everything acknowledged is durable, "
        "and the next start recovers it as after a crash",
        Esc(closed.ToString()));
  }
  return rollouts == RolloutsEnded::kInGrace && closed.ok();
}

// The fleet's own cancel: members not started are skipped (the gate refuses their mutations
// too); those already updating end by their own deadlines, and the update is answered.
void Service::CancelFleetUpdateAtShutdown() {
  if (!is_fleet() || fleet_runner_ == nullptr || journal_ == nullptr || failed()) return;
  std::optional<std::string> open;
  journal_->ReadFleetState([&open](const FleetState& f) {
    if (f.update && !f.update->cancelled) open = f.update->request.update_id;
  });
  if (!open) return;
  const Status st = fleet_runner_->Cancel(*open, kShutdownCancelReason);
  if (IsJournalFailure(st)) {
    FailStop("cancel of fleet update '" + *open + "' at shutdown: " + st.ToString());
  } else if (st.ok()) {
    spdlog::warn("serve: fleet update '{}' cancelled: serve is shutting down", Esc(*open));
  }
}

// Takes the plan slot (update_mu_) for the rest of Shutdown: false while a plan still runs at its
// bound. A plan gets the grace period; one whose mutation passed the gate before it closed gets
// that mutation's own deadline and then the steps after it, so the grace period never cuts a
// transfer short and leaves the engine TAINTED.
bool Service::TookPlanSlotAtShutdown(Clock::time_point grace_deadline,
                                     const ShutdownExtended& extended) {
  Clock::time_point announced = grace_deadline;
  for (;;) {
    const Clock::time_point until = PlanBoundAtShutdown(grace_deadline);
    if (until > announced) {
      announced = until;
      spdlog::warn(
          "serve: a plan's mutation of the engine is in flight: shutdown waits for it up to its "
          "own deadline and the steps after it ({} ms from now) rather than cut it short",
          std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
      if (extended) extended(until);
    }
    const Clock::time_point now = Clock::now();
    // Tried once even past the bound: with no plan running the slot is free at once.
    const auto slice = std::min(until, now + std::chrono::milliseconds(kShutdownPlanPollMs));
    if (update_mu_.try_lock_until(std::max(slice, now))) return true;
    if (Clock::now() >= until) break;
  }
  LogPlanLeftRunning();
  return false;
}

// For an exit that cannot be clean: waits for the running plan to end (its slot free) within the
// bound a mutation in flight gives it, so that the exit does not cut a transfer short, nor leave
// its observation unrecorded.
void Service::WaitForMutationsAtShutdown(Clock::time_point grace_deadline,
                                         const ShutdownExtended& extended) {
  if (TookPlanSlotAtShutdown(grace_deadline, extended)) update_mu_.unlock();
}

// The grace deadline, or later while a mutation that passed the gate binds its plan.
Clock::time_point Service::PlanBoundAtShutdown(Clock::time_point grace_deadline) const {
  const std::optional<Clock::time_point> busy = mutation_gate_.BusyUntil();
  if (!busy) return grace_deadline;
  const auto after = std::chrono::milliseconds(kStepsAfterMutation * config_.call_timeout_ms);
  return std::max(grace_deadline, *busy + after);
}

// Why serve exits with a plan still running, and what the restart makes of it.
void Service::LogPlanLeftRunning() const {
  std::string id;
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    id = running_update_id_;
  }
  if (mutation_gate_.in_flight() > 0) {
    spdlog::error(
        "serve: plan '{}' still changes the engine past its own deadline: its OUTCOME IS "
        "AMBIGUOUS; exiting without closing the journal: the restart records it TAINTED if its "
        "transfer may have landed; {}",
        Esc(id), ReplayHint(config_.journal_path));
    return;
  }
  spdlog::warn(
      "serve: plan '{}' still runs at the shutdown deadline with no mutation of the engine in "
      "flight (waiting for rollouts to end, or for the engine); exiting without closing the "
      "journal: the restart recovers it from what is durable and goes on with it, and a re-POST "
      "of its id then reads its outcome",
      Esc(id));
}

// Proxied rollouts get until `deadline`; then their engine calls are cancelled (each is finished
// as aborted by its worker) and they get kShutdownSettleMs more.
Service::RolloutsEnded Service::EndProxiedRollouts(Clock::time_point deadline) {
  if (WaitProxiedRollouts(deadline)) return RolloutsEnded::kInGrace;
  const std::size_t n = in_flight_calls_.CancelAll();
  spdlog::warn("serve: cancelled {} proxied rollout(s) at the shutdown deadline", n);
  if (WaitProxiedRollouts(SettleDeadline())) return RolloutsEnded::kCancelled;
  spdlog::warn(
      "serve: proxied rollouts did not end after cancel; exiting without closing "
      "the journal");
  return RolloutsEnded::kStillRunning;
}

// True once no proxied rollout is in flight or being admitted; false at `until`.
bool Service::WaitProxiedRollouts(Clock::time_point until) {
  auto busy = [this] {
    return metrics_.proxy_in_flight.load() > 0 || admissions_in_progress_.load() > 0;
  };
  while (busy() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kShutdownPollMs));
  }
  RC_CHECK(metrics_.proxy_in_flight.load() >= 0);  // each admitted rollout leaves exactly once
  RC_CHECK(admissions_in_progress_.load() >= 0);
  return !busy();
}

// Stops serving, then closes what the handlers used, the journal last but one (its close's answer
// in `closed`); false (nothing torn down) when an HTTP worker is still inside a handler after
// kShutdownSettleMs.
bool Service::StopServing(Status& closed) {
  const auto settle = SettleDeadline();
  const auto left_ms = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(settle - Clock::now()).count());
  if (http_ && !http_->Stop(left_ms)) return false;
  upstream_.reset();  // its sockets belong to http_'s io_context
  for (auto& [name, m] : fleet_members_) m->upstream.reset();
  fleet_runner_.reset();
  runner_.reset();
  trajectories_.Close();
  closed = journal_ != nullptr ? journal_->Close() : Status::OK();
  journal_.reset();  // late commit callbacks only queue on the stopped loops
  http_.reset();
  RC_CHECK(!journal_ && !runner_ && !http_ && !upstream_);
  return true;
}

bool Service::Authorized(const ApiRequest& req, HttpResponse& res) {
  if (config_.auth_token.empty()) return true;
  const std::string h = req.header("Authorization");
  const std::string prefix = "Bearer ";
  if (h.rfind(prefix, 0) != 0) {
    metrics_.unauthorized++;
    SetHeader(res, "WWW-Authenticate", "Bearer");
    SendError(res, 401, "unauthorized", "missing 'Authorization: Bearer <token>'");
    return false;
  }
  const std::string given = h.substr(prefix.size());
  if (given.size() != config_.auth_token.size() ||
      CRYPTO_memcmp(given.data(), config_.auth_token.data(), given.size()) != 0) {
    metrics_.unauthorized++;
    SendError(res, 403, "forbidden", "wrong token");
    return false;
  }
  return true;
}

}  // namespace rc::service
