// A plan stalls when its engine stopped answering and the runner's attempts ran out (most often:
// the engine died paused and never answered its resume). Until this, only a restart of `serve`
// tried such a plan again, so an engine that came back went unnoticed while its plan sat open.
//
// The engine's monitor thread watches a stalled plan: once the engine answers a probe again, and
// no other plan runs (update_mu_), the engine's runner recovers it as a restart would
// (RecoveryStarted gives the plan its attempts back; the plan is then driven to its end). The
// fold decides what the answer means: the same process resumes (on the target if it was
// validated), another process is TAINTED (engine_replaced). A try that stalls again doubles the
// wait before the next (stalled_plan_retry_ms up to kStalledPlanRetryBackoffMax times it), so a
// flapping engine cannot grow the journal faster than one recovery per wait.
#include <algorithm>

#include <spdlog/spdlog.h>

#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"
#include "statemachine/status.h"

namespace rc::service {

using namespace internal;  // NOLINT: the service's own helpers

namespace {

using SteadyClock = std::chrono::steady_clock;

// RecoveryStarted ends every proxied binding as abandoned (its client was a dead executor's), so
// a plan is tried again in place only while none is bound: a drain that timed out resumes with
// its rollouts still bound, and those end first (their engine is gone). Leased rollouts keep
// their leases either way.
bool NoProxiedBinding(const State& s) {
  return std::none_of(s.active.begin(), s.active.end(),
                      [](const auto& kv) { return kv.second.lease_ms == 0; });
}

std::string Who(const std::string& engine) {
  return engine.empty() ? "the engine" : "engine '" + Esc(engine) + "'";
}

}  // namespace

// The id of the engine's plan when it is stalled; with `retryable`, only when it may be tried
// again now (no proxied binding, and in a fleet not leaving: a leaving engine's stalled plan
// leaves with it).
std::optional<std::string> Service::StalledPlanOf(const std::string& engine, bool retryable) const {
  std::optional<std::string> id;
  auto read = [&id, retryable](const State& s) {
    if (plan_stalled(s) && (!retryable || NoProxiedBinding(s))) id = s.update->update_id;
  };
  if (engine.empty()) {
    journal_->ReadState(read);
  } else {
    journal_->ReadFleetState([&](const FleetState& f) {
      const bool leaving = f.leaving.count(engine) != 0;
      if (f.engines.count(engine) != 0 && !(retryable && leaving)) read(f.engines.at(engine));
    });
  }
  return id;
}

// A plan that stalled leaves the executor in a known state: the plan stays open and visible
// ("stalled" in GET /v1/state) and is tried again once the engine answers. So it is answered
// 503 outcome_unknown (the trainer asks again with the same id) without a fail-stop; false when
// the plan named did not stall (the caller fail-stops).
bool Service::AnsweredStalledPlan(const std::string& what, const std::string& plan_id,
                                  const Status& st, std::atomic<std::uint64_t>& outcome_unknown,
                                  HttpResponse& res) {
  if (failed() || journal_->failed() || StalledPlanOf("", false) != plan_id) return false;
  outcome_unknown++;
  spdlog::warn(
      "serve: {} '{}' stalled ({}): the engine does not answer; it is tried again once the "
      "engine answers",
      what, Esc(plan_id), Esc(st.ToString()));
  SetRetryAfter(res);
  SendError(res, 503, "outcome_unknown",
            "the " + what + " '" + plan_id + "' stalled: " + st.ToString() +
                "; the engine does not answer, and the plan is tried again once it does (every "
                "stalled_plan_retry_ms at most): POST the same id again to read the recorded "
                "outcome");
  return true;
}

effects::Runner* Service::RunnerOf(const std::string& engine) {
  if (engine.empty()) return runner_.get();
  return fleet_runner_ == nullptr ? nullptr : fleet_runner_->runner(engine);
}

// Due when the wait since the last try is over and the engine answers now (the probe is not
// journaled: nothing is recorded while the engine stays away).
bool Service::StalledPlanRetryDue(const MonitorTarget& t) {
  if (SteadyClock::now() < t.watch.stalled_retry_due) return false;
  return ProbeEngine(t, /*digest_interval_ms=*/0).seen.http.ok_2xx();
}

bool Service::RetryStalledPlan(const MonitorTarget& t) {
  if (shutting_down_.load() || !StalledPlanOf(t.engine, true)) return true;
  if (!StalledPlanRetryDue(t)) return true;
  // Another plan (a fleet update, a restore, the start) owns the runners; look again next tick.
  std::unique_lock<std::timed_mutex> lock(update_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return true;
  const std::optional<std::string> plan = StalledPlanOf(t.engine, true);  // again, under the lock
  effects::Runner* runner = RunnerOf(t.engine);
  if (!plan || runner == nullptr || shutting_down_.load()) return true;
  spdlog::warn("serve: {} answers again; trying its stalled plan '{}' again", Who(t.engine),
               Esc(*plan));
  metrics_.stalled_plan_retries++;
  // A throw fail-stops in DrivePlan, so NoteStalledPlanRetry finds the journal failed.
  const Status driven =
      DrivePlan("stalled plan", *plan, [runner] { return runner->RetryStalledPlan(); });
  NotifyLifecycle(journal_->head_seq());
  return NoteStalledPlanRetry(t, *plan, driven);
}

// Logs how the try ended and sets the wait before the next one; false (fail-stopped) when the
// plan is left open with nothing to drive it: the journal failed, or the runner stopped with the
// plan neither ended nor stalled (a refused intent, a full queue).
bool Service::NoteStalledPlanRetry(const MonitorTarget& t, const std::string& plan_id,
                                   const Status& driven) {
  const State s = MonitorView(t.engine);
  const bool open = s.update.has_value() && s.update->update_id == plan_id;
  const bool stalled = StalledPlanOf(t.engine, false) == plan_id;
  if (journal_->failed() || (!driven.ok() && open && !stalled)) {
    FailStop("the stalled plan '" + plan_id + "' was tried again and left open: " +
             (journal_->failed() ? journal_->failure().ToString() : driven.ToString()));
    return false;
  }
  EngineWatch& w = t.watch;
  const std::uint64_t first_ms = config_.stalled_plan_retry_ms;
  w.stalled_retry_wait_ms = stalled ? std::min(first_ms * kStalledPlanRetryBackoffMax,
                                               std::max(first_ms, w.stalled_retry_wait_ms * 2))
                                    : first_ms;
  RC_CHECK(w.stalled_retry_wait_ms >= first_ms &&
           w.stalled_retry_wait_ms <= first_ms * kStalledPlanRetryBackoffMax);
  w.stalled_retry_due = SteadyClock::now() + std::chrono::milliseconds(w.stalled_retry_wait_ms);
  if (stalled) {
    spdlog::warn("serve: the plan '{}' of {} stalled again ({}); next try in {} ms at the earliest",
                 Esc(plan_id), Who(t.engine),
                 driven.ok() ? "its attempts ran out" : Esc(driven.ToString()),
                 w.stalled_retry_wait_ms);
  } else {
    spdlog::warn("serve: the stalled plan '{}' of {} {}: it is {} on '{}'{}", Esc(plan_id),
                 Who(t.engine), open ? "goes on" : "ended", lifecycle_name(s.lifecycle),
                 Esc(s.committed.label),
                 s.taint ? " (" + Esc(s.taint->detail) + ")" : std::string());
  }
  return true;
}

}  // namespace rc::service
