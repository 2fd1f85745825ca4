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

// Safe to recover only with no proxied rollout bound to the engine: RecoveryStarted ends those as
// abandoned (their clients were a dead executor's). A stalled plan drained the engine, so none
// is; the check keeps it so if that ever changes.
bool Stalled(const State& s) { return plan_stalled(s) && s.active.empty(); }

std::string Who(const std::string& engine) {
  return engine.empty() ? "the engine" : "engine '" + Esc(engine) + "'";
}

}  // namespace

std::optional<std::string> Service::StalledPlanOf(const std::string& engine) const {
  std::optional<std::string> id;
  auto read = [&id](const State& s) {
    if (Stalled(s)) id = s.update->update_id;
  };
  if (engine.empty()) {
    journal_->ReadState(read);
  } else {
    journal_->ReadFleetState([&](const FleetState& f) {
      if (f.engines.count(engine) != 0) read(f.engines.at(engine));
    });
  }
  return id;
}

// A plan that stalled leaves the executor in a known state: the plan stays open and visible
// ("stalled" in GET /v1/state) and is tried again once the engine answers. So it is answered
// 503 outcome_unknown (the trainer asks again with the same id) without a fail-stop; false when
// the plan named did not stall (the caller fail-stops).
bool Service::AnsweredStalledPlan(const std::string& what, const std::string& plan_id,
                                  const Status& st, HttpResponse& res) {
  if (journal_->failed() || StalledPlanOf("") != plan_id) return false;
  metrics_.updates_outcome_unknown++;
  spdlog::warn(
      "serve: {} '{}' stalled ({}): the engine does not answer; it is tried again once "
      "the engine answers",
      what, Esc(plan_id), Esc(st.ToString()));
  SetHeader(res, "Retry-After", std::to_string(std::max<std::uint32_t>(1, config_.retry_after_s)));
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
  const std::int64_t now_ms = wall_ms();
  if (now_ms < t.watch.stalled_retry_due_ms) return false;
  const EngineProbe probe = ProbeEngine(t, /*digest_allowed=*/false);
  if (probe.seen.http.ok_2xx()) return true;
  t.watch.stalled_retry_due_ms =
      now_ms + static_cast<std::int64_t>(config_.engine_monitor_interval_ms);
  return false;
}

bool Service::RetryStalledPlan(const MonitorTarget& t) {
  if (shutting_down_.load() || !StalledPlanOf(t.engine)) return true;
  if (!StalledPlanRetryDue(t)) return true;
  // Another plan (a fleet update, a restore, the start) owns the runners; look again next tick.
  std::unique_lock<std::timed_mutex> lock(update_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return true;
  const std::optional<std::string> plan = StalledPlanOf(t.engine);  // again, under the lock
  effects::Runner* runner = RunnerOf(t.engine);
  if (!plan || runner == nullptr || shutting_down_.load()) return true;
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_ = *plan;
  }
  spdlog::warn("serve: {} answers again; trying its stalled plan '{}' again", Who(t.engine),
               Esc(*plan));
  metrics_.stalled_plan_retries++;
  const Status driven = runner->Recover();
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    running_update_id_.clear();
  }
  NotifyLifecycle(journal_->head_seq());
  if (journal_->failed()) {
    FailStop(journal_->failure().ToString());
    return false;
  }
  NoteStalledPlanRetry(t, *plan, driven);
  return true;
}

// Logs how the try ended and sets the wait before the next one.
void Service::NoteStalledPlanRetry(const MonitorTarget& t, const std::string& plan_id,
                                   const Status& driven) {
  const std::uint64_t first_ms = config_.stalled_plan_retry_ms;
  EngineWatch& w = t.watch;
  if (StalledPlanOf(t.engine) == plan_id) {
    w.stalled_retry_wait_ms = std::min(first_ms * kStalledPlanRetryBackoffMax,
                                       std::max(first_ms, w.stalled_retry_wait_ms * 2));
    spdlog::warn("serve: the plan '{}' of {} stalled again ({}); next try in {} ms at the earliest",
                 Esc(plan_id), Who(t.engine),
                 driven.ok() ? "its attempts ran out" : Esc(driven.ToString()),
                 w.stalled_retry_wait_ms);
  } else {
    w.stalled_retry_wait_ms = first_ms;
    const State s = MonitorView(t.engine);
    spdlog::warn("serve: the stalled plan '{}' of {} ended: it is {} on '{}'{}", Esc(plan_id),
                 Who(t.engine), lifecycle_name(s.lifecycle), Esc(s.committed.label),
                 s.taint ? " (" + Esc(s.taint->detail) + ")" : std::string());
  }
  RC_CHECK(w.stalled_retry_wait_ms >= first_ms &&
           w.stalled_retry_wait_ms <= first_ms * kStalledPlanRetryBackoffMax);
  w.stalled_retry_due_ms = wall_ms() + static_cast<std::int64_t>(w.stalled_retry_wait_ms);
}

}  // namespace rc::service
