// Admission and finish: the two journal writes every rollout makes, blocking (trainer API,
// lease expiry) and completion-based (the proxy's event loop never waits on a group commit).
//
// Both forms share one step each (TryAdmit, SubmitFinishFrom): the journal decides every
// admission against its own folded state under its lock, so a stale view can only cost a retry,
// never admit past the start of a drain; a finish is never dropped (a full queue is retried with
// a bounded backoff, and a journal that cannot make it durable fail-stops the executor).
#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <spdlog/spdlog.h>

#include "effects/clock.h"
#include "service/service.h"
#include "service/service_internal.h"
#include "statemachine/text.h"

namespace rc::service {
namespace {

using namespace internal;  // NOLINT: the service's own helpers

using Clock = std::chrono::steady_clock;
namespace asio = boost::asio;

constexpr std::uint32_t kAdmitAttemptsMax = 1000;  // races with the journal's decision
constexpr std::uint64_t kAdmitPollMs = 20;         // a waiting admission looks again this often
constexpr std::uint32_t kFinishBackoffMsMax = 50;

// Called in a catch block: an asynchronous admission's or finish's step threw. A record may be in
// the journal with nobody to own it: the executor fail-stops, and the restart records it.
std::string AsyncStepThrew(Service& svc, const char* what) noexcept {
  try {
    const std::string why = std::string(what) + " threw: " + Esc(CurrentExceptionText());
    spdlog::critical("serve: {}", why);  // FailStop logs nothing when the executor already failed
    svc.FailStop(why);
    return why;
  } catch (...) {  // out of memory, most likely: the fail-stop still happens, its text short
  }
  try {
    svc.FailStop(what);
  } catch (...) {
  }
  return {};
}

}  // namespace

// ---- admission ----

Service::AdmitStep Service::Refused(AdmitRefusal refusal) {
  AdmitStep step;
  step.kind = AdmitStep::kRefused;
  step.refusal = std::move(refusal);
  RC_CHECK(step.refusal.http_status >= 400 && !step.refusal.type.empty());
  return step;
}

// Refusals that do not depend on the lifecycle: the executor failed or is shutting down.
std::optional<AdmitRefusal> Service::ExecutorRefusal() {
  if (failed()) {
    metrics_.admission_rejected_failed++;
    return AdmitRefusal{503, "failed", "the executor has fail-stopped: " + failure(), 0};
  }
  if (!shutting_down_.load()) return std::nullopt;
  metrics_.admission_rejected_shutdown++;
  return AdmitRefusal{503, "shutting_down", "the executor is shutting down", config_.retry_after_s};
}

AdmitRefusal Service::TaintedRefusal(const State& s) {
  RC_CHECK(s.lifecycle == Lifecycle::kTainted);
  metrics_.admission_rejected_tainted++;
  const std::string why = s.taint ? std::string(cause_name(s.taint->cause)) + " during " +
                                        lifecycle_name(s.taint->from) + " of update '" +
                                        s.taint->update_id + "': " + s.taint->detail
                                  : "no taint record";
  return {503, "tainted", "engine is TAINTED; no rollouts are admitted (" + why + ")", 0};
}

// What a journal that did not take the admission means for the client; kAgain when the state
// moved between our read and the journal's decision (look again).
Service::AdmitStep Service::SubmitRefused(const Status& st, const std::string& rollout_id,
                                          const AdmitTries& tries, std::size_t active) {
  RC_CHECK(!st.ok());
  if (st.code() == Code::kBusy) {
    // The group-commit queue is full: back-pressure on admission, never on finishing.
    metrics_.admission_rejected_overloaded++;
    return Refused({503, "overloaded", "journal busy: " + st.message(),
                    std::max<std::uint32_t>(1, config_.retry_after_s)});
  }
  if (IsJournalFailure(st)) {
    FailStop("admission '" + rollout_id + "' refused by the journal: " + st.ToString());
    metrics_.admission_rejected_failed++;
    return Refused({503, "failed", "journal failed: " + st.ToString(), 0});
  }
  if (st.code() == Code::kConflict) return Refused({409, "conflict", st.message(), 0});
  if (st.code() == Code::kInvalidArgument) return Refused({400, "invalid", st.message(), 0});
  if (st.code() != Code::kRejected || tries.races >= kAdmitAttemptsMax ||
      (tries.looks > 0 && active >= kActiveRolloutsMax)) {  // a fresh view's count
    return Refused({503, "unavailable", st.message(), config_.retry_after_s});
  }
  AdmitStep again;
  again.kind = AdmitStep::kAgain;
  return again;
}

Service::AdmitStep Service::TryAdmit(const std::string& rollout_id, std::uint32_t lease_ms,
                                     const AdmitTries& tries,
                                     std::optional<std::uint64_t> affinity_key) {
  RC_CHECK(lease_ms == 0 || (lease_ms >= kRolloutLeaseMsMin && lease_ms <= kRolloutLeaseMsMax));
  if (std::optional<AdmitRefusal> r = ExecutorRefusal()) return Refused(std::move(*r));
  if (is_fleet()) {
    RC_CHECK(lease_ms == 0);  // a fleet admits proxied rollouts only (fleet_api.cc)
    return TryAdmitFleet(rollout_id, tries, affinity_key);
  }
  AdmitStep step;
  bool submit = false;
  std::size_t active = 0;
  auto look = [&](const State& s) {
    if (s.lifecycle == Lifecycle::kTainted) {
      step = Refused(TaintedRefusal(s));
    } else if (!admits(s)) {
      step.kind = AdmitStep::kWait;
      step.waiting_on = std::string("engine is ") + lifecycle_name(s.lifecycle) +
                        (s.update ? " (update '" + s.update->update_id + "')" : "") + ": " +
                        admission_block_reason(s);
    } else {
      step.binding = make_admission(s, rollout_id, lease_ms);
      active = s.active.size();
      submit = true;
    }
  };
  // The first look takes the cached view (no lock). A look after a refusal or a wait reads the
  // fold in place under the journal's lock: thousands of admissions waiting out an update must
  // not each copy the whole state every poll.
  if (tries.looks == 0) {
    look(*AdmitView());
  } else {
    journal_->ReadState(look);
  }
  if (!submit) return step;
  auto submitted = journal_->Submit(step.binding, effects::wall_now_ms());
  if (!submitted.ok()) return SubmitRefused(submitted.status(), rollout_id, tries, active);
  step.kind = AdmitStep::kSubmitted;
  step.ticket = submitted->ticket;
  return step;
}

Service::AdmitResult Service::Admitted(AdmitStep step, const Status& durable,
                                       Clock::time_point t0) {
  RC_CHECK(step.kind == AdmitStep::kSubmitted);
  metrics_.journal_append.ObserveUs(effects::elapsed_us(t0));
  AdmitResult out;
  if (!durable.ok()) {
    if (!step.engine.empty()) EngineCallEnded(step.engine);
    // Durable or not, nobody was told: recovery records it abandoned if it is.
    FailStop("commit of admission '" + step.binding.rollout_id + "' failed: " + durable.ToString());
    metrics_.admission_rejected_failed++;
    out.refusal = {503, "failed", "journal commit failed: " + durable.ToString(), 0};
    return out;
  }
  metrics_.admissions++;
  const journal::AppendResult& r = step.ticket.result;
  RC_CHECK(r.first_seq >= 1 && r.last_seq >= r.first_seq);
  out.admitted = Admission{std::move(step.engine), step.fleet_generation, std::move(step.binding),
                           r.first_seq, DurableHead{r.last_seq, r.last_hash}};
  return out;
}

AdmitRefusal Service::NotAdmittedWithin(const AdmitStep& step, std::uint64_t wait_ms) {
  RC_CHECK(step.kind == AdmitStep::kWait);
  metrics_.admission_rejected_unavailable++;
  return {503, "unavailable",
          step.waiting_on + "; not admitting within " + std::to_string(wait_ms) + " ms",
          config_.retry_after_s};
}

// A blocking admission that waits holds a thread of the blocking pool: at most a quarter of the
// pool waits at once, so that waiting admissions never hold off lease renewals, finishes and
// probes (a lease that cannot be renewed lapses under a live client).
struct Service::AdmitWaitSlot {
  explicit AdmitWaitSlot(Service& s) : svc(s) {}
  ~AdmitWaitSlot() {
    if (held) svc.admits_waiting_--;
  }
  bool Take() {
    if (held) return true;
    const std::size_t waiting_max = std::max<std::size_t>(1, svc.config_.http_threads / 4);
    if (svc.admits_waiting_.fetch_add(1) >= waiting_max) {
      svc.admits_waiting_--;
      return false;
    }
    held = true;
    return true;
  }
  Service& svc;
  bool held = false;
};

Service::AdmitResult Service::Admit(const std::string& rollout_id, std::uint64_t wait_ms,
                                    std::uint32_t lease_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  AdmitWaitSlot slot(*this);
  for (AdmitTries tries;; ++tries.looks) {
    const auto t0 = Clock::now();
    AdmitStep step = TryAdmit(rollout_id, lease_ms, tries);
    switch (step.kind) {
      case AdmitStep::kRefused:
        return AdmitResult{std::nullopt, std::move(step.refusal)};
      case AdmitStep::kAgain:
        ++tries.races;
        continue;
      case AdmitStep::kSubmitted: {
        const Status durable = journal_->Wait(step.ticket);
        return Admitted(std::move(step), durable, t0);
      }
      case AdmitStep::kWait:
        break;
    }
    if (Clock::now() < deadline && !slot.Take()) {
      metrics_.admission_rejected_unavailable++;
      return AdmitResult{
          std::nullopt,
          {503, "overloaded",
           step.waiting_on + "; a quarter of http_threads already wait to be admitted",
           config_.retry_after_s}};
    }
    std::unique_lock<std::mutex> lock(lifecycle_mu_);
    if (Clock::now() >= deadline) {
      return AdmitResult{std::nullopt, NotAdmittedWithin(step, wait_ms)};
    }
    // Woken by every runner decision; the poll cap makes a missed wake-up harmless.
    lifecycle_cv_.wait_until(
        lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(kAdmitPollMs)));
  }
}

// One asynchronous admission: looks, waits on a timer while the engine cannot admit, and hands
// the result to `done` on `executor` once the admission is durable (or refused).
struct Service::AsyncAdmission : std::enable_shared_from_this<AsyncAdmission> {
  AsyncAdmission(Service& s, std::string id, std::uint64_t wait, asio::any_io_executor ex,
                 std::optional<std::uint64_t> key)
      : svc(s),
        rollout_id(std::move(id)),
        affinity_key(key),
        wait_ms(wait),
        executor(std::move(ex)),
        timer(executor),
        deadline(Clock::now() + std::chrono::milliseconds(wait)) {}

  void Step() {
    try {
      TryStep();
    } catch (...) {
      Threw("an admission's step");
    }
  }
  void TryStep() {
    if (abandoned) {
      svc.metrics_.admissions_abandoned++;
      return Done(AdmitResult{
          std::nullopt, AdmitRefusal{499, "client_closed", "client closed the connection", 0}});
    }
    for (;; ++tries.looks) {
      const auto t0 = Clock::now();
      AdmitStep step = svc.TryAdmit(rollout_id, 0, tries, affinity_key);
      switch (step.kind) {
        case AdmitStep::kRefused:
          return Done(AdmitResult{std::nullopt, std::move(step.refusal)});
        case AdmitStep::kAgain:
          ++tries.races;
          continue;
        case AdmitStep::kSubmitted:
          return AwaitDurable(std::move(step), t0);
        case AdmitStep::kWait:
          return WaitForReady(std::move(step));
      }
    }
  }
  void AwaitDurable(AdmitStep step, Clock::time_point t0) {
    const journal::Ticket ticket = step.ticket;
    auto self = shared_from_this();
    svc.durable_waits_->Wait(ticket, executor,
                             [self, step = std::move(step), t0](Status durable) mutable {
                               try {
                                 self->Done(self->svc.Admitted(std::move(step), durable, t0));
                               } catch (...) {
                                 self->Threw("a durable admission's hand-over");
                               }
                             });
  }
  void WaitForReady(AdmitStep step) {
    const auto now = Clock::now();
    if (now >= deadline) {
      return Done(AdmitResult{std::nullopt, svc.NotAdmittedWithin(step, wait_ms)});
    }
    ++tries.looks;
    timer.expires_at(std::min(deadline, now + std::chrono::milliseconds(kAdmitPollMs)));
    waiting = true;
    timer.async_wait([self = shared_from_this()](boost::system::error_code) {
      self->waiting = false;
      self->Step();
    });
  }
  // Only a wait for the engine is cut short: a submitted admission's next step is its durable
  // point, and a step that already ran Done has nothing left to end.
  void Abandon() {
    abandoned = true;
    if (done != nullptr && waiting) timer.cancel();
  }
  void Done(AdmitResult r) {
    RC_CHECK(done != nullptr);  // exactly once
    AdmitDone fn = std::move(done);
    done = nullptr;
    try {
      fn(std::move(r));  // an admitted rollout counts in proxy_in_flight from here
    } catch (...) {
      svc.admissions_in_progress_--;
      throw;
    }
    svc.admissions_in_progress_--;
  }
  // An admission may have reached the journal with nobody to own it: fail-stop (the restart
  // records it), and the caller is refused.
  void Threw(const char* what) {
    const std::string why = AsyncStepThrew(svc, what);
    if (done != nullptr) Done(AdmitResult{std::nullopt, AdmitRefusal{503, "failed", why, 0}});
  }

  Service& svc;
  const std::string rollout_id;
  const std::optional<std::uint64_t> affinity_key;
  const std::uint64_t wait_ms;
  asio::any_io_executor executor;
  asio::steady_timer timer;
  AdmitDone done;
  const Clock::time_point deadline;
  AdmitTries tries;
  bool waiting = false;    // a timer wait is pending (its handler runs Step)
  bool abandoned = false;  // the caller's client left (both only ever touched on `executor`)
};

Service::AdmitAbandon Service::AdmitAsync(const std::string& rollout_id, std::uint64_t wait_ms,
                                          const asio::any_io_executor& executor, AdmitDone done,
                                          std::optional<std::uint64_t> affinity_key) {
  std::shared_ptr<AsyncAdmission> job;
  try {
    job = std::make_shared<AsyncAdmission>(*this, rollout_id, wait_ms, executor, affinity_key);
  } catch (...) {
    const std::string why = AsyncStepThrew(*this, "an admission's start");
    done(AdmitResult{std::nullopt, AdmitRefusal{503, "failed", why, 0}});
    return [] {};
  }
  job->done = std::move(done);  // a job that exists answers `done` exactly once
  // Counted before its first look at shutting_down_: a shutdown that reads no admission in
  // progress and no rollout in flight cannot miss one admitted after it looked.
  admissions_in_progress_++;
  job->Step();
  return [weak = std::weak_ptr<AsyncAdmission>(job)] {
    if (auto j = weak.lock()) j->Abandon();
  };
}

// ---- finish ----

// One of a finish's records, named with its engine in a fleet. The journal's Submitted and
// FleetSubmitted differ only in how they name decisions; a finish needs only the ticket.
Result<journal::Ticket> Service::SubmitFinishRecord(const FinishRecords& f) {
  const Event& record = f.records[f.next];
  if (f.finish_holds && f.next + 1 == f.records.size()) {
    auto submitted = journal_->SubmitFleetIf(FleetEvent{f.engine, record}, effects::wall_now_ms(),
                                             f.finish_holds);
    if (!submitted.ok()) return submitted.status();
    return submitted->ticket;
  }
  if (f.engine.empty()) {
    auto submitted = journal_->Submit(record, effects::wall_now_ms());
    if (!submitted.ok()) return submitted.status();
    return submitted->ticket;
  }
  auto submitted = journal_->SubmitFleet(FleetEvent{f.engine, record}, effects::wall_now_ms());
  if (!submitted.ok()) return submitted.status();
  return submitted->ticket;
}

// Submits records[from..] in order until one meets a full queue (returns kBusy with `from` at
// it), all are enqueued (OK, `ticket` the last one's), or the finish cannot be recorded.
Status Service::SubmitFinishFrom(FinishRecords& f) {
  for (; f.next < f.records.size(); ++f.next) {
    if (failed()) return Status::Unavailable("the executor has fail-stopped: " + failure());
    const bool is_finish = f.next + 1 == f.records.size();
    auto submitted = SubmitFinishRecord(f);
    if (submitted.ok()) {
      f.ticket = *submitted;
      continue;
    }
    const Status& st = submitted.status();
    if (st.code() == Code::kBusy) return st;
    if (IsJournalFailure(st)) {
      FailStop(std::string(is_finish ? "finish" : "trajectory") + " of rollout '" + f.rollout_id +
               "' refused: " + st.ToString());
      return Status::Unavailable("the executor has fail-stopped: " + failure());
    }
    if (is_finish) return st;  // NotFound (not active), InvalidArgument
    // Malformed, or the rollout is not active: the part is lost, the finish is not.
    spdlog::warn("serve: trajectory part of rollout {} not journaled: {}", Esc(f.rollout_id),
                 Esc(st.ToString()));
    if (st.code() == Code::kNotFound) f.next = f.records.size() - 2;  // straight to the finish
  }
  RC_CHECK(f.ticket.has_value());
  return Status::OK();
}

Service::FinishRecords Service::MakeFinish(const std::string& engine, const std::string& rollout_id,
                                           RolloutOutcome outcome, std::uint32_t prompt_tokens,
                                           std::uint32_t completion_tokens,
                                           const std::vector<TrajectoryRecorded>& parts) {
  RC_CHECK(engine.empty() != is_fleet());  // a fleet's records name their engine
  FinishRecords f;
  f.engine = engine;
  f.rollout_id = rollout_id;
  f.outcome = outcome;
  f.t0 = Clock::now();
  f.deadline = f.t0 + std::chrono::milliseconds(config_.finish_retry_ms);
  for (const TrajectoryRecorded& part : parts) {
    RC_CHECK(part.rollout_id == rollout_id);
    f.records.emplace_back(part);
  }
  f.records.emplace_back(RolloutFinished{rollout_id, outcome, prompt_tokens, completion_tokens});
  RC_CHECK(f.records.size() == parts.size() + 1 && f.next == 0);  // the finish last
  return f;
}

// A full queue past finish_retry_ms fail-stops; otherwise the next backoff (1..50 ms).
Status Service::FinishBackoff(FinishRecords& f, const Status& busy) {
  if (Clock::now() >= f.deadline) {
    FailStop("the finish of rollout '" + f.rollout_id + "' stayed un-journaled for " +
             std::to_string(config_.finish_retry_ms) + " ms (" + busy.message() + ")");
    return Status::Unavailable("the executor has fail-stopped: " + failure());
  }
  metrics_.finish_retries++;
  f.backoff_ms = std::min(kFinishBackoffMsMax, std::max<std::uint32_t>(1, f.backoff_ms * 2));
  RC_CHECK(f.backoff_ms >= 1 && f.backoff_ms <= kFinishBackoffMsMax);
  return Status::OK();
}

Status Service::FinishCommitted(FinishRecords& f, const Status& durable) {
  RC_CHECK(f.ticket.has_value() && f.next == f.records.size());  // every record submitted
  metrics_.journal_append.ObserveUs(effects::elapsed_us(f.t0));
  if (!durable.ok()) {
    FailStop("commit of the finish of rollout '" + f.rollout_id +
             "' failed: " + durable.ToString());
    return Status::Unavailable("the executor has fail-stopped: " + failure());
  }
  {
    std::lock_guard<std::mutex> g(lease_mu_);
    lease_deadline_ms_.erase(f.rollout_id);
  }
  if (f.outcome == RolloutOutcome::kCompleted) {
    metrics_.finishes_completed++;
  } else {
    metrics_.finishes_aborted++;
  }
  return Status::OK();
}

Status Service::FinishDurably(const std::string& rollout_id, RolloutOutcome outcome,
                              std::uint32_t prompt_tokens, std::uint32_t completion_tokens,
                              const std::vector<TrajectoryRecorded>& parts) {
  return FinishRecordsDurably(
      MakeFinish("", rollout_id, outcome, prompt_tokens, completion_tokens, parts));
}

Status Service::FinishLeased(const std::string& rollout_id, RolloutOutcome outcome,
                             std::uint32_t prompt_tokens, std::uint32_t completion_tokens) {
  FinishRecords f = MakeFinish("", rollout_id, outcome, prompt_tokens, completion_tokens, {});
  f.finish_holds = [rollout_id](const FleetState& fleet) {
    const State& s = engine_state(fleet, "");
    auto it = s.active.find(rollout_id);
    if (it == s.active.end() || it->second.lease_ms > 0) return Status::OK();
    return Status::Conflict("rollout '" + rollout_id +
                            "' is a proxied rollout: it ends with its HTTP request (the client "
                            "closing the connection aborts it)");
  };
  return FinishRecordsDurably(std::move(f));
}

Status Service::FinishRecordsDurably(FinishRecords f) {
  for (;;) {
    Status st = SubmitFinishFrom(f);
    if (st.ok()) break;
    if (st.code() != Code::kBusy) return st;
    if (Status next = FinishBackoff(f, st); !next.ok()) return next;
    std::this_thread::sleep_for(std::chrono::milliseconds(f.backoff_ms));
  }
  return FinishCommitted(f, journal_->Wait(*f.ticket));
}

struct Service::AsyncFinish : std::enable_shared_from_this<AsyncFinish> {
  AsyncFinish(Service& s, FinishRecords r, asio::any_io_executor ex)
      : svc(s), f(std::move(r)), executor(std::move(ex)), timer(executor) {}

  void Step() {
    try {
      TryStep();
    } catch (...) {
      Threw("a finish's step");
    }
  }
  void TryStep() {
    Status st = svc.SubmitFinishFrom(f);
    if (st.code() == Code::kBusy) return Backoff(st);
    if (!st.ok()) return Done(st);
    svc.durable_waits_->Wait(*f.ticket, executor, [self = shared_from_this()](Status durable) {
      try {
        self->Done(self->svc.FinishCommitted(self->f, durable));
      } catch (...) {
        self->Threw("a durable finish's hand-over");
      }
    });
  }
  void Backoff(const Status& busy) {
    if (Status next = svc.FinishBackoff(f, busy); !next.ok()) return Done(next);
    timer.expires_after(std::chrono::milliseconds(f.backoff_ms));
    timer.async_wait([self = shared_from_this()](boost::system::error_code) { self->Step(); });
  }
  void Done(const Status& st) {
    RC_CHECK(done != nullptr);  // exactly once
    FinishDone fn = std::move(done);
    done = nullptr;
    fn(st);
  }
  // Part of the finish may be in the journal: fail-stop, and the caller is told it is not durable.
  void Threw(const char* what) {
    const std::string why = AsyncStepThrew(svc, what);
    if (done != nullptr) Done(Status::Unavailable("the executor has fail-stopped: " + why));
  }

  Service& svc;
  FinishRecords f;
  asio::any_io_executor executor;
  asio::steady_timer timer;
  FinishDone done;
};

void Service::FinishAsync(const std::string& engine, const std::string& rollout_id,
                          RolloutOutcome outcome, std::uint32_t prompt_tokens,
                          std::uint32_t completion_tokens,
                          const std::vector<TrajectoryRecorded>& parts,
                          const asio::any_io_executor& executor, FinishDone done) {
  std::shared_ptr<AsyncFinish> job;
  try {
    job = std::make_shared<AsyncFinish>(
        *this, MakeFinish(engine, rollout_id, outcome, prompt_tokens, completion_tokens, parts),
        executor);
  } catch (...) {
    const std::string why = AsyncStepThrew(*this, "a finish's start");
    return done(Status::Unavailable("the executor has fail-stopped: " + why));
  }
  job->done = std::move(done);  // a job that exists answers `done` exactly once
  job->Step();
}

}  // namespace rc::service
