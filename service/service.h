// Service: the long-running executor behind `rolloutcore serve` — one per engine.
//
// It owns the journal, the runner (the only writer of lifecycle inputs) and the weight transfer,
// and serves over HTTP (service/http_server.h, an event loop on Boost.Beast):
//   trainer API   /v1/state, /v1/version, /v1/updates, /v1/rollouts[/<id>[/lease]], /v1/watch,
//                 /v1/events, /v1/manifest, /healthz (liveness), /readyz   (docs/api.md)
//   proxy         /v1/completions, /v1/chat/completions, /inference/v1/generate: each request is
//                 admitted durably under the committed version before it reaches the engine,
//                 salted per version, and finished (or recorded aborted) when its response ends.
//   metrics       /metrics (Prometheus text)
//
// Thread model: io_threads run every connection's event loop (parse, route, the proxy's whole
// request path). Proxy admissions and finishes never block them: they wait on the journal's
// group commit through DurableWaits (one notice per loop per committed batch). Trainer API routes
// that may block (updates, long polls, explicit rollouts) run on a bounded pool (api_threads).
// Runner calls (Recover, Bootstrap, Update) are serialised by update_mu_; every admission is
// decided against the folded state under the journal's lock, so an admission can never slip past
// the start of a drain.
//
// Trust under faults:
//  * fail-stop: any journal write/fsync failure (or a stalled fsync, or a runner error after an
//    update was journaled, or an exception out of a plan or a background thread) calls
//    FailStop(): admissions and updates are refused, the monitor and lease threads stop, /readyz
//    and /healthz answer 503, and `rolloutcore serve` exits non-zero naming the journal and the
//    error, so the next start recovers from what is durable;
//  * a finish is never dropped (FinishDurably); a full group-commit queue is back-pressure on
//    admission only (503 + Retry-After);
//  * what the read routes report (/v1/state, /v1/version, /v1/watch, /v1/events) is durable: a
//    view folded from durable records only (DurableView).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <nlohmann/json.hpp>

#include "effects/engine.h"
#include "effects/fleet_runner.h"
#include "effects/http/engine_client.h"
#include "effects/http/protocol.h"
#include "effects/http/engine_control.h"
#include "effects/runner.h"
#include "effects/thread_start.h"
#include "effects/transfer.h"
#include "journal/journal.h"
#include "service/config.h"
#include "service/durable_waits.h"
#include "service/ended_plans.h"
#include "service/http_server.h"
#include "service/inflight_calls.h"
#include "service/api_parse.h"
#include "service/metrics.h"
#include "service/mutation_gate.h"
#include "service/trajectories.h"
#include "service/upstream.h"
#include "statemachine/fleet.h"
#include "statemachine/state.h"

namespace rocksdb {
class Env;
}

namespace rc::service {

// Why an admission was refused, with the HTTP status a client sees.
struct AdmitRefusal {
  int http_status = 503;
  std::string type;  // "tainted", "unavailable", "shutting_down", "conflict", "invalid"
  std::string message;
  std::uint32_t retry_after_s = 0;  // 0: no Retry-After
};

// A journal head as an acknowledgement carries it (`X-RolloutCore-Head: SEQ:HASH`), so that
// `rolloutcore audit --expect-head SEQ:HASH` can later prove the journal still holds it.
struct DurableHead {
  std::uint64_t seq = 0;
  journal::Hash hash{};
  std::string ToString() const;  // "SEQ:hex(hash)"
};

// The binding a rollout was admitted under (what the response headers carry).
struct Admission {
  std::string engine;  // the fleet's engine it was admitted to; "" when serve drives one engine
  // A fleet's generation of the bound label (the same number on every engine that serves it);
  // binding.version.generation counts that one engine's commits.
  std::uint64_t fleet_generation = 0;
  RolloutAdmitted binding;
  std::uint64_t seq = 0;  // journal seq of the RolloutAdmitted record
  DurableHead head;       // the head the admission made durable (X-RolloutCore-Head)
};

// The wait before the weight digest is read again after a read that failed (no answer, a
// timeout, a 5xx); each failure in a row doubles it, up to weight_digest_check_interval_ms.
inline constexpr std::uint64_t kDigestRetryBackoffMsMin = 1000;

// What the engine monitor keeps of one engine between probes (serve's one engine, or each member
// of a fleet), for /metrics, /readyz and the audit's window of suspect rollouts.
struct EngineWatch {
  std::atomic<bool> up{false};  // the last probe succeeded
  std::atomic<std::int64_t> last_probe_wall_ms{0};
  std::atomic<std::int64_t> last_ok_wall_ms{0};            // the last probe that matched
  std::atomic<std::int64_t> last_digest_check_wall_ms{0};  // the last digest check answered
  std::atomic<std::int64_t> last_digest_match_wall_ms{0};  // ... the last one that matched
  // The weight-digest schedule that the monitor's ticks and the looks before a plan share: a
  // check is due every `interval_ms` since the last one answered; at most one read is in flight,
  // and after a read that failed the next waits out the backoff counted from its end.
  std::atomic<bool> digest_reading{false};  // taken by TakeDigestCheck, left by DigestRead
  std::atomic<std::int64_t> digest_failed_wall_ms{0};  // when the last read failed
  std::atomic<std::uint64_t> digest_backoff_ms{0};     // the wait after it (0: none failed)
  // Whether a check is due now and no read is in flight or backing off; true takes the read
  // (of concurrent askers one at most gets true), and its taker reports it with DigestRead.
  bool TakeDigestCheck(std::uint64_t interval_ms, std::int64_t now_wall_ms);
  // `answered`: the engine gave a digest, or why it computes none (the check is done).
  void DigestRead(bool answered, std::uint64_t interval_ms, std::int64_t now_wall_ms);
  mutable std::mutex seen_mu;
  std::string instance_seen;  // what the last probe that answered reported
  std::string label_seen;
  // The engine's monitor thread only: when its stalled plan may be tried again, and the wait
  // after the next try that stalls (stalled_plan_retry.cc).
  std::chrono::steady_clock::time_point stalled_retry_due{};
  std::uint64_t stalled_retry_wait_ms = 0;
};

// One engine of a fleet, as serve drives it and proxies to it (fleet_service.cc).
struct FleetMember {
  std::string name;
  std::string url;
  std::string version;  // its GET /version at startup ("" for a retiring engine that did not say)
  bool retire = false;  // leaves the fleet at start (FleetEngineConfig::retire)
  std::unique_ptr<effects::EngineClient> client;
  std::unique_ptr<effects::HttpEngineControl> control;
  std::unique_ptr<effects::WeightTransfer> transfer;
  // What its runner drives: control and transfer behind the service's MutationGate.
  std::unique_ptr<effects::EngineControl> gated_control;
  std::unique_ptr<effects::WeightTransfer> gated_transfer;
  // transfer nccl: its communicator's rendezvous, once the journal is recovered (empty otherwise).
  std::function<Status()> transfer_init;
  UpstreamTarget target;
  std::unique_ptr<UpstreamPool> upstream;     // on the HTTP server's loops, made by Start
  std::atomic<std::uint32_t> outstanding{0};  // proxied rollouts admitted to it, not yet ended
  EngineWatch watch;
};

// How many ended plans of each kind (updates, restores, sleeps, wake-ups) are remembered for
// idempotent re-POSTs (older ones are looked up in the journal).
inline constexpr std::size_t kEndedUpdatesMax = 1024;
// Bound on the journal records scanned to find an older update's outcome.
inline constexpr std::uint64_t kUpdateLookupRecordsMax = 10'000'000;

class Service {
 public:
  // Opens the journal, recovers (abandons rollouts of dead clients, reconciles the engine) and
  // bootstraps if the journal is UNINITIALIZED. Does not listen yet.
  // journal_env: the journal's RocksDB Env (tests pass a fault-injecting one; nullptr: default).
  // thread_starter: how every thread of serve's own is started (the trajectories writer, the
  // engine monitors, lease expiry, the fleet's recovery and member drives unless
  // set_member_thread_start says otherwise, the HTTP server's); empty: std::thread. Tests pass
  // one that refuses some, as the system does when out of threads. A thread refused by Open or
  // Start fails it with Unavailable naming the thread; what was started is released by the
  // destructor (threads stopped and joined, the journal closed).
  [[nodiscard]] static Result<std::unique_ptr<Service>> Open(
      const ServeConfig& config, rocksdb::Env* journal_env = nullptr,
      effects::ThreadStarter thread_starter = {});
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Binds listen_host:listen_port (0 = ephemeral) and serves on a background thread.
  [[nodiscard]] Status Start();
  int port() const { return port_; }
  std::string url() const;

  // Graceful stop: refuse new admissions (503) and new plans, close the MutationGate (no new
  // mutation of an engine starts: a running plan that has not begun one ends refused and is
  // answered 503 shutting_down), cancel an open fleet update (members not started are skipped),
  // let in-flight proxied rollouts finish for up to grace_ms, wait for a running plan for what
  // is left of it, stop serving, close the journal. A plan whose mutation is in flight is waited
  // for beyond grace_ms, up to that mutation's own deadline and the steps after it: `extended`
  // (when set) is told each later moment the wait may last until. Returns false when something
  // was still running at the deadline (the journal is then left open for the caller to exit
  // without closing unless every rollout ended once cancelled), or when the journal's clean
  // close failed; everything acknowledged is durable either way.
  using ShutdownExtended = std::function<void(std::chrono::steady_clock::time_point until)>;
  bool Shutdown(std::uint64_t grace_ms, const ShutdownExtended& extended = nullptr);

  // In-process access for tests.
  journal::Journal& journal() { return *journal_; }
  const ServeConfig& config() const { return config_; }
  ServiceMetrics& metrics() { return metrics_; }
  std::int64_t admissions_in_progress() const { return admissions_in_progress_.load(); }
  // True once every trajectory line queued so far is written or dropped; false at the deadline.
  // Lines reach the file after their answers (one writer thread): readers of the file that need
  // the lines of answers already given wait here.
  bool DrainTrajectories(std::uint64_t timeout_ms) { return trajectories_.Drain(timeout_ms); }

  // Admission and finish, as the proxy and the explicit rollout routes use them.
  struct AdmitResult {
    std::optional<Admission> admitted;
    AdmitRefusal refusal;
  };
  // lease_ms 0: bound to the caller's HTTP request (proxied); else an explicit rollout whose
  // client renews its lease (kRolloutLeaseMs{Min,Max}).
  AdmitResult Admit(const std::string& rollout_id, std::uint64_t wait_ms,
                    std::uint32_t lease_ms = 0);
  // Makes a rollout's end durable and never drops it: submits `parts` (its trajectory records,
  // in order), then RolloutFinished, and waits until durable. A full group-commit queue (Busy)
  // is retried with a bounded backoff (1..50 ms) for up to finish_retry_ms; a failed commit, a
  // failed journal or the deadline fail-stops the executor (FailStop), so the restart records
  // the rollout from what is durable. Callable from any thread, any number of times.
  //   OK          the finish is durable
  //   NotFound    the rollout is not active (already finished or abandoned): nothing to record
  //   Unavailable the executor has fail-stopped: the finish is not durable (never acknowledge it)
  //   InvalidArgument  the finish itself is malformed (e.g. kExpired for an unleased rollout)
  // A trajectory part the fold refuses (malformed) is logged and skipped, never the finish.
  [[nodiscard]] Status FinishDurably(const std::string& rollout_id, RolloutOutcome outcome,
                                     std::uint32_t prompt_tokens, std::uint32_t completion_tokens,
                                     const std::vector<TrajectoryRecorded>& parts = {});
  // The trainer API's finish (and a lapsed lease's): FinishDurably, refused with Conflict (nothing
  // written) when the rollout is a proxied one, checked atomically with the finish: a proxied
  // rollout ends only with its HTTP request, even one admitted while this call was under way.
  [[nodiscard]] Status FinishLeased(const std::string& rollout_id, RolloutOutcome outcome,
                                    std::uint32_t prompt_tokens, std::uint32_t completion_tokens);
  // FinishDurably without trajectory parts (kept for existing callers).
  [[nodiscard]] Status Finish(const std::string& rollout_id, RolloutOutcome outcome,
                              std::uint32_t prompt_tokens, std::uint32_t completion_tokens) {
    return FinishDurably(rollout_id, outcome, prompt_tokens, completion_tokens);
  }
  // The same two writes without blocking the caller: `done` runs once on `executor` with what
  // Admit / FinishDurably would have returned (maybe within the call; whatever fails, it runs).
  // Proxied rollouts only (lease_ms 0).
  using AdmitDone = std::function<void(AdmitResult)>;
  // Called on `executor` when the caller no longer wants the rollout (its client left): an
  // admission still waiting for the engine ends at once, refused 499 with nothing journaled; one
  // already submitted goes on (it is durable soon, and its caller finishes it). Idempotent.
  using AdmitAbandon = std::function<void()>;
  // `affinity_key`: a fleet routes by it (fleet_affinity_prefix_bytes), else by load.
  [[nodiscard]] AdmitAbandon AdmitAsync(const std::string& rollout_id, std::uint64_t wait_ms,
                                        const boost::asio::any_io_executor& executor,
                                        AdmitDone done,
                                        std::optional<std::uint64_t> affinity_key = std::nullopt);
  using FinishDone = std::function<void(Status)>;
  // `engine`: the fleet engine the rollout was admitted to ("" with one engine).
  void FinishAsync(const std::string& engine, const std::string& rollout_id, RolloutOutcome outcome,
                   std::uint32_t prompt_tokens, std::uint32_t completion_tokens,
                   const std::vector<TrajectoryRecorded>& parts,
                   const boost::asio::any_io_executor& executor, FinishDone done);
  // A fleet's proxied rollout on `engine` no longer occupies it (the balancer's count).
  void EngineCallEnded(const std::string& engine);

  // Fail-stop: the journal (or the runner mid-update) failed, so nothing more may be decided or
  // acknowledged. Idempotent; the first reason wins. Logs at critical level, wakes WaitFailed().
  void FailStop(const std::string& why);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string failure() const;  // "" until FailStop
  // Blocks until FailStop (true) or timeout_ms (false). serve_cmd exits non-zero on true.
  bool WaitFailed(std::uint64_t timeout_ms);

  // How a fleet member's drive gets its thread (Open's thread_starter, else std::thread, while
  // none is set). Tests set one that throws, as std::thread's constructor does when the system
  // refuses a thread, to fail a fleet update after its request is journaled.
  using ThreadStart = std::function<std::thread(std::function<void()>)>;
  void set_member_thread_start(ThreadStart start);
  // Runs at named points (none while unset): first in every step of every proxied rollout and
  // read-only pass-through call, and when a trainer API call takes and gives back the plan slot.
  // Tests set one that throws, as an allocation or a library call may in any proxied step, or that
  // sleeps to widen a window a race would need. Set before Start.
  using StepProbe = std::function<void(const char* step)>;
  void set_step_probe(StepProbe probe) { step_probe_ = std::move(probe); }

  // Whether rollouts can be served safely now, and if not why ("" = ready).
  std::string NotReadyReason() const;
  // The durable head, folded up to date (for tests and acknowledgements).
  DurableHead CatchUpDurableHead();

  nlohmann::json StateSummary();  // the durable view
  std::string RenderMetrics() const;

 private:
  explicit Service(ServeConfig config);
  rocksdb::Env* journal_env_ = nullptr;
  effects::ThreadStarter thread_starter_;  // empty: std::thread; fixed by Open
  // Starts `body` on `slot` (empty) through thread_starter_; the background threads so started
  // are joined by StopBackground. Unavailable naming `what` when the system refuses it.
  [[nodiscard]] Status StartBackgroundThread(std::string_view what, std::function<void()> body,
                                             std::thread& slot);
  [[nodiscard]] Status StartEngineThreads();
  // Init's steps, in order (service.cc).
  [[nodiscard]] Status Init();
  [[nodiscard]] Status OpenJournal();
  [[nodiscard]] Status OpenTrajectories();
  [[nodiscard]] Status OpenEngineClients();
  [[nodiscard]] Status AwaitEngineVersion();
  // Initialises the transfer with the engine once the journal is recovered or bootstrapped.
  using TransferInit = std::function<Status()>;
  [[nodiscard]] Result<TransferInit> MakeTransfer();
  TransferInit MakeOneNcclTransfer();
  void MakeRunner();
  void LogDecision(const std::string& engine, std::uint64_t seq, const Event& e) const;
  [[nodiscard]] Status RecoverJournal();
  [[nodiscard]] Status BootstrapIfUninitialized();
  [[nodiscard]] Result<WeightIdentity> BootstrapIdentity(effects::WeightTransfer& transfer);
  effects::BootstrapOptions BootstrapOptionsOf() const;
  Status BootstrapFailed(const Status& booted) const;
  void SeedDurableView();
  void RenewSurvivingLeases(const State& s);
  void NotifyLifecycle(std::uint64_t seq);
  std::string NextRolloutId();
  // The folded state as admissions read it: a copy refreshed only when the runner has journaled
  // a decision since, instead of one O(active rollouts) copy per admission. A stale view is
  // harmless: the journal decides every admission against its own state and refuses one bound to
  // an outdated version (Admit then looks again, at the fold itself).
  std::shared_ptr<const State> AdmitView();

  friend class ProxyExchange;
  friend class PassThrough;
  // One look at whether a rollout can be admitted now (admission.cc).
  struct AdmitStep {
    enum Kind : std::uint8_t { kSubmitted, kRefused, kWait, kAgain } kind = kRefused;
    journal::Ticket ticket;              // kSubmitted: the admission's group
    std::string engine;                  // kSubmitted: the fleet engine ("" with one engine)
    std::uint64_t fleet_generation = 0;  // kSubmitted, a fleet: the bound label's
    RolloutAdmitted binding;             // kSubmitted
    AdmitRefusal refusal;                // kRefused
    std::string waiting_on;              // kWait: why the engine cannot admit now
  };
  // An admission's tries so far: its looks at the state (the first takes the cached view), and
  // its races lost to the journal's decision (bounded: kAdmitAttemptsMax), counted apart so a
  // long wait's polls never use up the races.
  struct AdmitTries {
    std::uint32_t looks = 0;
    std::uint32_t races = 0;
  };
  AdmitStep TryAdmit(const std::string& rollout_id, std::uint32_t lease_ms, const AdmitTries& tries,
                     std::optional<std::uint64_t> affinity_key = std::nullopt);
  static AdmitStep Refused(AdmitRefusal refusal);
  std::optional<AdmitRefusal> ExecutorRefusal();
  AdmitRefusal TaintedRefusal(const State& s);
  AdmitStep SubmitRefused(const Status& st, const std::string& rollout_id, const AdmitTries& tries,
                          std::size_t active);
  AdmitResult Admitted(AdmitStep step, const Status& durable,
                       std::chrono::steady_clock::time_point t0);
  AdmitRefusal NotAdmittedWithin(const AdmitStep& step, std::uint64_t wait_ms);
  struct AsyncAdmission;
  // A finish's records (trajectory parts, then RolloutFinished) and how far they are submitted.
  struct FinishRecords {
    std::string engine;  // "" with one engine
    std::string rollout_id;
    RolloutOutcome outcome = RolloutOutcome::kCompleted;
    std::vector<Event> records;
    std::size_t next = 0;
    std::optional<journal::Ticket> ticket;
    std::chrono::steady_clock::time_point t0, deadline;
    std::uint32_t backoff_ms = 0;
    journal::Journal::Precondition finish_holds;  // checked with the finish record, when set
  };
  [[nodiscard]] Status FinishRecordsDurably(FinishRecords f);
  FinishRecords MakeFinish(const std::string& engine, const std::string& rollout_id,
                           RolloutOutcome outcome, std::uint32_t prompt_tokens,
                           std::uint32_t completion_tokens,
                           const std::vector<TrajectoryRecorded>& parts);
  [[nodiscard]] Result<journal::Ticket> SubmitFinishRecord(const FinishRecords& f);
  [[nodiscard]] Status SubmitFinishFrom(FinishRecords& f);
  [[nodiscard]] Status FinishBackoff(FinishRecords& f, const Status& busy);
  [[nodiscard]] Status FinishCommitted(FinishRecords& f, const Status& durable);
  struct AsyncFinish;

  // Route handlers (service.cc; the proxy's in proxy_exchange.cc).
  HttpRouter Routes();
  HttpServerOptions ServerOptions() const;
  void AddProxyRoutes(HttpRouter& router);  // proxy_exchange.cc
  bool ProxyAuthorized(Exchange& ex);
  void HandleState(const ApiRequest& req, HttpResponse& res);
  void HandleVersion(const ApiRequest& req, HttpResponse& res);
  void HandleUpdate(const ApiRequest& req, HttpResponse& res);
  void HandleRestore(const ApiRequest& req, HttpResponse& res);  // restore_api.cc
  void HandleSleep(const ApiRequest& req, HttpResponse& res);    // sleep_api.cc
  void HandleWake(const ApiRequest& req, HttpResponse& res);     // sleep_api.cc
  void HandleAdmit(const ApiRequest& req, HttpResponse& res);
  void HandleFinish(const ApiRequest& req, HttpResponse& res);
  void HandleWatch(const ApiRequest& req, HttpResponse& res);
  void WatchFor(const ApiRequest& req, HttpResponse& res);
  void HandleEvents(const ApiRequest& req, HttpResponse& res);
  void HandleManifest(const ApiRequest& req, HttpResponse& res);
  void HandleMetrics(const ApiRequest& req, HttpResponse& res);
  void StartLease(const std::string& id, std::int64_t lease_ms);
  std::uint32_t ActiveLeaseMs(const std::string& id);
  void HandleLease(const ApiRequest& req, HttpResponse& res);
  void HandleReadyz(const ApiRequest& req, HttpResponse& res);
  void HandleHealthz(const ApiRequest& req, HttpResponse& res);

  // The durable view: a State folded only from durable records (Journal::Scan stops at the
  // durable head), for every route that reports state. CatchUpDurable folds what became durable
  // since; it fail-stops on a record that does not apply (the journal and this fold disagree).
  struct DurableView {
    State state;       // one engine
    FleetState fleet;  // a fleet (is_fleet())
    DurableHead head;
    std::uint64_t decision_seq = 0;  // seq of the last lifecycle decision folded
  };
  DurableView CatchUpDurable(bool copy_state);
  void SetHeadHeader(HttpResponse& res, const DurableHead& head);

  // Ended updates for idempotent re-POSTs: update_id -> the request and the answer it got.
  struct EndedUpdate {
    UpdateRequested request;
    UpdateEnded ended;
  };
  std::optional<EndedUpdate> FindEndedUpdate(const std::string& update_id);
  void RememberEndedUpdate(const UpdateRequested& request, const UpdateEnded& ended);
  void SendUpdateOutcome(HttpResponse& res, const UpdateRequested& request,
                         const UpdateEnded& ended, bool replayed);
  void SendOutcome(HttpResponse& res, nlohmann::json out, const UpdateEnded& ended, bool replayed);
  // The one plan slot (update_mu_) of a trainer API call, named after its plan from the moment
  // it is taken until it is given back: the name and the lock change together under
  // update_id_mu_, so a retry of the plan that holds the slot (its first answer lost) always
  // finds its name, and waits for it rather than being answered 409 by itself.
  class PlanSlot {
   public:
    explicit PlanSlot(Service& service) : service_(service) {}
    ~PlanSlot() { Release(); }
    PlanSlot(const PlanSlot&) = delete;
    PlanSlot& operator=(const PlanSlot&) = delete;
    bool held() const { return lock_.owns_lock(); }
    void Release();

   private:
    friend class Service;
    Service& service_;
    std::unique_lock<std::timed_mutex> lock_;
  };
  // The slot, or 503 while shutting down, or 409 (counted in `conflicts`) naming the plan that
  // holds it. The caller keeps `slot` until it has answered.
  // `replayed_if_ended` (when set) answers a plan that ended while its retry waited for the slot
  // and another plan took it, or serve began to shut down: its recorded outcome, not 409 or 503.
  [[nodiscard]] bool TookUpdateSlot(
      PlanSlot& slot, std::atomic<std::uint64_t>& conflicts, HttpResponse& res,
      const std::string& id, const std::function<bool(HttpResponse&)>& replayed_if_ended = nullptr);
  // Takes the slot at once, naming it `id` (false); else, when `id` holds the slot or a retry of
  // it waits for it, and the bound allows, counts the caller among its waiters (true).
  bool TookSlotOrWaitsFor(PlanSlot& slot, const std::string& id);
  // Waits a bounded while for the slot (until serve stops), names it `id` if taken, and leaves
  // the waiters.
  void WaitForSlot(PlanSlot& slot, const std::string& id);
  // update_mu_ within `wait_ms`, or not held once serve shuts down or fail-stops.
  std::unique_lock<std::timed_mutex> SlotUnlessStopping(std::uint64_t wait_ms);
  // 503 shutting_down, or the recorded outcome of the plan when `replayed_if_ended` finds it.
  void AnswerShuttingDown(HttpResponse& res,
                          const std::function<bool(HttpResponse&)>& replayed_if_ended);
  bool SamePlanHoldsOrAwaitsSlot(const std::string& id) const;  // under update_id_mu_
  std::size_t SlotWaitersMax() const;
  // How long a retry of the plan that holds the slot waits for it (then 409).
  static constexpr std::uint64_t kSamePlanSlotWaitMs = 5000;
  // How soon that wait sees a shutdown or a fail-stop begin.
  static constexpr std::uint64_t kSlotWaitSliceMs = 10;
  // Names the plan that holds update_mu_ (a 409 names it) while its runner call runs, then
  // restores the name before it: a trainer API call's slot keeps its name until it answers.
  class RunningPlan {
   public:
    RunningPlan(Service& service, const std::string& id)
        : service_(service), before_(service.SwapRunningUpdate(id)) {}
    ~RunningPlan() { (void)service_.SwapRunningUpdate(before_); }
    RunningPlan(const RunningPlan&) = delete;
    RunningPlan& operator=(const RunningPlan&) = delete;

   private:
    Service& service_;
    const std::string before_;
  };
  // Every plan's runner call (an update, restore, sleep, wake-up, fleet update, a stalled plan
  // tried again): what `call` returned, or PlanThrew's error when it threw. Nothing a plan's
  // effects throw reaches the HTTP server's catch-all (a 500 with the plan left open).
  template <class Call>
  auto DrivePlan(const std::string& what, const std::string& id, const Call& call)
      -> decltype(call()) {
    const RunningPlan running(*this, id);
    try {
      return call();
    } catch (...) {
      return PlanThrew(what, id);
    }
  }
  // Called from DrivePlan's catch block only.
  [[nodiscard]] Status PlanThrew(const std::string& what, const std::string& id);
  void NoteTimings();  // the runner's last timings, for /v1/state and /metrics
  // A background thread's body (`role` names it in the failure): an exception out of it
  // fail-stops the executor instead of ending the process through std::terminate.
  void RunGuarded(const char* role, const std::function<void()>& body);

  // HandleUpdate's steps (trainer_api.cc).
  bool RefusedFailStopped(HttpResponse& res);
  // Retry-After on a 503: retry_after_s, at least 1 s.
  void SetRetryAfter(HttpResponse& res) const;
  bool ReplayedIfEnded(const UpdateRequested& request, HttpResponse& res);
  void ReplayEndedUpdate(const UpdateRequested& request, const EndedUpdate& e, HttpResponse& res);
  void RunUpdate(const UpdateRequested& request, HttpResponse& res);
  void AnswerUpdateEnded(const UpdateRequested& request, const UpdateEnded& ended,
                         HttpResponse& res);
  bool AnsweredUnjournaledUpdate(const UpdateRequested& request, const Status& st,
                                 HttpResponse& res);
  void RefuseUnjournaledUpdate(const UpdateRequested& request, const Status& st, HttpResponse& res);
  void AnswerUpdateOutcomeUnknown(const UpdateRequested& request, const Status& st,
                                  HttpResponse& res);

  // HandleRestore's steps (restore_api.cc).
  SourceReader SourceReaderForTransfer() const;
  std::uint64_t RestoresRequested() const;
  bool RestoreSourceUsable(const RestoreRequested& request, HttpResponse& res);
  bool ReplayedIfRestoreEnded(const RestoreRequested& request, HttpResponse& res);
  bool ReplayedRestore(const RestoreRequested& request, std::uint64_t from_seq, HttpResponse& res);
  void ReplayEndedRestore(const RestoreRequested& request,
                          const EndedPlans<RestoreRequested>::Ended& e, HttpResponse& res);
  void RunRestore(const RestoreRequested& request, HttpResponse& res);
  void AnswerRestoreEnded(const RestoreRequested& request, const UpdateEnded& ended,
                          HttpResponse& res);
  void SendRestoreOutcome(HttpResponse& res, const RestoreRequested& request,
                          const UpdateEnded& ended, bool replayed);

  // HandleSleep's and HandleWake's steps (sleep_api.cc): one plan that keeps the version.
  struct SameVersionPlan {
    Event request;       // SleepRequested or WakeRequested
    std::string id;      // its sleep_id or wake_id
    const char* what;    // "sleep" or "wake-up"
    nlohmann::json ids;  // echoed in the answer
    // Answers: committed, refused, tainted, conflict, invalid, replayed, outcome unknown.
    std::atomic<std::uint64_t>* counts[7];
  };
  EndedPlans<Event>& EndedOf(const SameVersionPlan& plan);
  bool ReplayedIfSameVersionEnded(const SameVersionPlan& plan, HttpResponse& res);
  bool ReplayedSameVersion(const SameVersionPlan& plan, std::uint64_t from_seq, HttpResponse& res);
  void ReplayEndedSameVersion(const SameVersionPlan& plan, const EndedPlans<Event>::Ended& e,
                              HttpResponse& res);
  void RunSameVersion(const SameVersionPlan& plan, HttpResponse& res);
  void AnswerUnfinished(const SameVersionPlan& plan, bool journaled, const Status& st,
                        HttpResponse& res);

  // ---- A fleet (config_.engines given): fleet_service.cc, its routes in fleet_api.cc.
  bool is_fleet() const { return !config_.engines.empty(); }
  [[nodiscard]] Status InitFleet();
  [[nodiscard]] Status StartFleetMonitors();
  [[nodiscard]] Status OpenFleetMembers();
  [[nodiscard]] Status CheckMembersAreDistinctEngines();
  [[nodiscard]] Status OpenFleetMember(const FleetEngineConfig& engine, std::size_t index);
  [[nodiscard]] Status MakeMemberTransfer(FleetMember& member, std::size_t index);
  [[nodiscard]] Status InitNcclTransfers();
  void MakeFleetRunner();
  std::thread StartMemberThread(std::function<void()> drive);
  [[nodiscard]] Status JoinFleet();
  [[nodiscard]] Status BootstrapFleetMembers();
  std::vector<std::string> UninitializedMembers() const;
  [[nodiscard]] Status OpenRetiringMember(FleetMember& m);
  [[nodiscard]] Status RetireMembers(bool last_try);
  FleetMember& StayingMember();  // the first configured engine that does not retire
  [[nodiscard]] Status BootstrapFleetMember(const std::string& engine, const std::string& label,
                                            const WeightIdentity& identity,
                                            const std::string& expected_digest);
  void LogFleetStart();
  void InitHttpTransfers();
  // Names the plan that holds update_mu_ ("" for none); returns the name before.
  std::string SwapRunningUpdate(const std::string& update_id);
  [[nodiscard]] Status StartFleet();
  [[nodiscard]] Result<std::unique_ptr<UpstreamPool>> MakeUpstream(const UpstreamTarget& target);
  [[nodiscard]] Status Listen();
  [[nodiscard]] Status FinishInterruptedFleetUpdate();
  AdmitStep TryAdmitFleet(const std::string& rollout_id, const AdmitTries& tries,
                          std::optional<std::uint64_t> affinity_key);
  std::optional<std::string> PickFleetEngine(const FleetState& fleet,
                                             std::optional<std::uint64_t> affinity_key);
  FleetMember& Member(const std::string& engine);
  const UpstreamTarget& TargetOf(const std::string& engine) const;
  UpstreamPool& UpstreamOf(const std::string& engine);
  // The engine a read-only pass-through goes to: "" with one engine; in a fleet the least busy
  // admitting member (else the first configured).
  std::string PassThroughEngine();
  std::string FleetNotReadyReason() const;
  HttpRouter FleetRoutes();
  void HandleFleetState(const ApiRequest& req, HttpResponse& res);
  void HandleFleetUpdate(const ApiRequest& req, HttpResponse& res);
  void HandleFleetCancel(const ApiRequest& req, HttpResponse& res);
  bool AnsweredAlreadyCancelled(const std::string& update_id, HttpResponse& res);
  void HandleFleetRemove(const ApiRequest& req, HttpResponse& res);
  bool AnsweredAlreadyLeaving(const std::string& engine, HttpResponse& res);
  void HandleFleetReadyz(const ApiRequest& req, HttpResponse& res);
  void HandleNotForFleet(const ApiRequest& req, HttpResponse& res);
  bool FleetSourceChecked(const FleetUpdateRequested& request, HttpResponse& res);
  // A re-POST of a fleet update this process saw end or already replayed: its recorded end (or
  // 409 for another body), answered without the plan slot.
  bool ReplayedIfFleetEnded(const FleetUpdateRequested& request, HttpResponse& res);
  void SendFleetOutcome(const FleetUpdateEnded& e, bool replayed, HttpResponse& res);
  bool FleetUpdateJournaled(const std::string& update_id);
  void AnswerFleetUpdate(const FleetUpdateRequested& request, const Result<FleetUpdateEnded>& ended,
                         HttpResponse& res);
  void SendFleetOutcomeUnknown(const std::string& update_id, HttpResponse& res);
  std::string RenderFleetMetrics() const;

  // Engine monitor (see MonitorLoop) and lease expiry; both stop on FailStop and Shutdown.

  bool WaitBackgroundTick(std::chrono::milliseconds interval);
  // The engine one monitor look probes: serve's one engine ("") or a fleet member.
  struct MonitorTarget {
    std::string engine;
    effects::EngineClient& client;
    EngineWatch& watch;
  };
  void MonitorLoop(const MonitorTarget& target);
  std::vector<std::thread*> MonitorThreads();
  bool MonitorOnce(const MonitorTarget& target);
  // A plan stalled at this engine is tried again once the engine answers (stalled_plan_retry.cc);
  // false once the executor fail-stopped.
  bool RetryStalledPlan(const MonitorTarget& target);
  bool StalledPlanRetryDue(const MonitorTarget& target);
  std::optional<std::string> StalledPlanOf(const std::string& engine, bool retryable) const;
  effects::Runner* RunnerOf(const std::string& engine);
  // `outcome_unknown`: the answer counter of the plan's family.
  bool AnsweredStalledPlan(const std::string& what, const std::string& plan_id, const Status& st,
                           std::atomic<std::uint64_t>& outcome_unknown, HttpResponse& res);
  bool NoteStalledPlanRetry(const MonitorTarget& target, const std::string& plan_id,
                            const Status& driven);
  State MonitorView(const std::string& engine) const;
  struct EngineProbe {
    EngineMonitored seen;
    std::int64_t wall_ms = 0;  // when it was seen
  };
  // digest_interval_ms: how often this look may read a digest (DigestIntervalMs; 0: never).
  EngineProbe ProbeEngine(const MonitorTarget& target, std::uint64_t digest_interval_ms);
  std::uint64_t DigestIntervalMs(const State& before) const;
  bool DigestCheckDue(EngineWatch& watch, std::int64_t now_wall_ms,
                      std::uint64_t interval_ms) const;
  void DigestCheckDone(EngineWatch& watch, const WeightDigest& d, std::int64_t now_wall_ms,
                       std::uint64_t interval_ms) const;
  effects::Runner::DigestSchedule DigestScheduleOf(EngineWatch& watch);
  bool WeightsDrifted(EngineWatch& watch, const State& before, const WeightDigest& d,
                      std::int64_t now_wall_ms);
  bool JournalEngineChange(const std::string& engine, const EngineMonitored& m,
                           std::int64_t now_wall_ms);
  bool MonitorRefused(const Status& st);
  void LogEngineChange(const std::string& engine, const EngineMonitored& m, std::uint64_t first_seq,
                       const std::vector<Event>& decisions);
  void LeaseLoop();
  void ExpireLapsedLeases();
  void StopBackground();
  // Shutdown's steps (service.cc).
  enum class RolloutsEnded : std::uint8_t { kInGrace, kCancelled, kStillRunning };
  void CancelFleetUpdateAtShutdown();
  void WaitForMutationsAtShutdown(std::chrono::steady_clock::time_point grace_deadline,
                                  const ShutdownExtended& extended);
  bool TookPlanSlotAtShutdown(std::chrono::steady_clock::time_point grace_deadline,
                              const ShutdownExtended& extended);
  std::chrono::steady_clock::time_point PlanBoundAtShutdown(
      std::chrono::steady_clock::time_point grace_deadline) const;
  void LogPlanLeftRunning() const;
  // A plan of this process that ended refused because of the shutdown (its runner gave it up
  // once the MutationGate closed): answered 503 shutting_down with its recorded outcome.
  bool RefusedAtShutdown(UpdateOutcome outcome) const;
  RolloutsEnded EndProxiedRollouts(std::chrono::steady_clock::time_point deadline);
  bool WaitProxiedRollouts(std::chrono::steady_clock::time_point until);
  bool StopServing(Status& closed);
  void LogRecovery(const journal::Recovery& r) const;
  Status RecoveryFailed(const Status& st) const;
  [[nodiscard]] Status FinishInterruptedUpdate();
  void LogInterruptedUpdateEnd(const UpdatePlan& update) const;
  // False (with a 4xx sent) when the update's source is unreadable or not the declared weights.
  bool SourceUsable(const UpdateRequested& request, HttpResponse& res);
  // Takes the one turn to look a refused source's id up in the journal, or answers 503 (retry).
  [[nodiscard]] bool TookLookupTurn(std::unique_lock<std::mutex>& turn, HttpResponse& res);
  bool ReplayedFromJournal(const UpdateRequested& request, HttpResponse& res,
                           std::uint64_t from_seq = 0);
  bool SourceChecked(const UpdateRequested& request, HttpResponse& refusal) const;
  [[nodiscard]] Result<std::string> ExecutorSourceManifest(const std::string& uri) const;
  std::uint64_t UpdatesRequested() const;
  void LogTaint(const std::optional<TaintRecord>& taint, const char* context) const;
  bool Authorized(const ApiRequest& req, HttpResponse& res);

  ServeConfig config_;
  std::unique_ptr<journal::Journal> journal_;
  std::unique_ptr<DurableWaits> durable_waits_;            // on journal_, made with it
  std::unique_ptr<effects::EngineClient> control_client_;  // runner + transfer
  std::unique_ptr<effects::HttpEngineControl> http_control_;
  std::unique_ptr<effects::WeightTransfer> transfer_;
  // Closed by Shutdown; declared before the wrappers that hold it.
  MutationGate mutation_gate_;
  // What runner_ drives: http_control_ and transfer_ behind mutation_gate_.
  std::unique_ptr<effects::EngineControl> gated_control_;
  std::unique_ptr<effects::WeightTransfer> gated_transfer_;
  std::unique_ptr<effects::Runner> runner_;
  TrajectoryLog trajectories_;
  mutable ServiceMetrics metrics_;
  int port_ = 0;

  std::optional<UpdatePlan> interrupted_update_;  // found by Init, driven by Start
  std::timed_mutex update_mu_;                    // held by the one runner call in progress
  mutable std::mutex update_id_mu_;
  std::string running_update_id_;
  // A refused source's id is looked up in the journal's whole lookup window (up to
  // kUpdateLookupRecordsMax records), one lookup at a time.
  std::mutex refusal_lookup_mu_;
  // Retries waiting for their own plan's slot, by plan, and in all (bounded by SlotWaitersMax):
  // a plan keeps its entry from before its retry waits until the retry has named the slot, so a
  // further retry of it always finds it held or waited for, never a gap answered 409.
  std::map<std::string, std::size_t> slot_waiters_;
  std::size_t slot_waiters_total_ = 0;
  effects::PhaseTimings last_timings_;  // copied under update_id_mu_ after each update

  mutable std::mutex lifecycle_mu_;
  std::condition_variable lifecycle_cv_;
  std::uint64_t lifecycle_seq_ = 0;                // seq of the last decision the runner journaled
  std::atomic<std::uint64_t> lifecycle_epoch_{0};  // bumped on every NotifyLifecycle

  std::mutex view_mu_;
  std::shared_ptr<const State> view_;  // AdmitView's copy
  std::uint64_t view_epoch_ = 0;       // lifecycle_epoch_ when view_ was taken
  std::atomic<bool> shutting_down_{false};

  std::string rollout_prefix_;
  std::atomic<std::uint64_t> rollout_counter_{0};

  // Fail-stop.
  std::atomic<bool> failed_{false};
  mutable std::mutex failed_mu_;
  std::condition_variable failed_cv_;
  std::string failure_;

  std::mutex durable_mu_;
  DurableView durable_;

  std::mutex ended_mu_;
  std::map<std::string, EndedUpdate> ended_updates_;
  std::deque<std::string> ended_order_;  // FIFO eviction at kEndedUpdatesMax
  // The other kinds' ended plans, each kind by its own ids; a sleep's or wake-up's request is kept
  // as the Event it was journaled as.
  EndedPlans<RestoreRequested> ended_restores_{kEndedUpdatesMax};
  EndedPlans<Event> ended_sleeps_{kEndedUpdatesMax};
  EndedPlans<Event> ended_wakes_{kEndedUpdatesMax};
  EndedPlans<FleetUpdateRequested, FleetUpdateEnded> ended_fleet_updates_{kEndedUpdatesMax};

  // Leases of explicit rollouts: id -> steady ms at which it lapses.
  std::mutex lease_mu_;
  std::map<std::string, std::int64_t> lease_deadline_ms_;

  // Background threads (engine monitor, lease expiry).
  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  bool bg_stop_ = false;
  std::thread monitor_thread_;
  std::vector<std::thread> fleet_monitor_threads_;  // one per fleet member
  std::thread lease_thread_;
  std::atomic<std::size_t> watches_{0};         // GET /v1/watch calls waiting
  std::atomic<std::size_t> admits_waiting_{0};  // blocking admissions waiting (Admit)
  struct AdmitWaitSlot;
  std::atomic<std::int64_t> admissions_in_progress_{0};  // AdmitAsync calls not yet answered
  EngineWatch watch_;           // the one engine's (a fleet's members keep their own)
  std::string engine_version_;  // GET /version at startup

  // A fleet: its members by name (the map is fixed after Init) and the executor that updates them.
  std::map<std::string, std::unique_ptr<FleetMember>> fleet_members_;
  std::mutex member_thread_start_mu_;
  ThreadStart member_thread_start_;                         // empty: std::thread
  StepProbe step_probe_;                                    // fixed once serving
  std::unique_ptr<effects::MemberThreads> member_threads_;  // the fleet runner's; outlives it
  std::unique_ptr<effects::FleetRunner> fleet_runner_;
  std::optional<FleetUpdateRequested> interrupted_fleet_update_;  // found by Init, driven by Start

  // ---- the HTTP front and the proxied calls in flight. Declared last so they are destroyed
  // first, while what handlers use lives, in reverse order: the calls in flight (their exchanges
  // hold sessions and engine sockets on http_'s loops), then upstream_, then http_.
  UpstreamTarget engine_target_;
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<UpstreamPool> upstream_;
  InFlightCalls in_flight_calls_;
};

// The cache_salt a proxied request is sent with: a digest of the committed version and identity
// (and the client's own salt, when given), so KV computed under one generation is never reused
// under another while requests of one generation share their prefixes.
std::string DeriveCacheSalt(const RolloutAdmitted& binding, const std::string& client_salt);
// The trajectories file serve writes when trajectories_path is empty: <journal>.trajectories.jsonl.
std::string DefaultTrajectoriesPath(const std::string& journal_path);

}  // namespace rc::service
