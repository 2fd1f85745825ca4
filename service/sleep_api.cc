// POST /v1/sleep and POST /v1/wake: colocated mode (docs/lifecycle.md, "Colocated mode"). A sleep
// drains the engine and releases its GPU memory to a trainer on the same GPU; a wake-up brings a
// level-1 sleeper back on the weights it holds, validated before it serves. An update from a
// sleeping engine goes through POST /v1/updates. One update, restore, sleep or wake-up runs at a
// time; a re-POST of one that ended answers what the journal recorded, even while another plan
// runs.
#include <algorithm>
#include <mutex>
#include <optional>
#include <variant>

#include <spdlog/spdlog.h>

#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"

namespace rc::service {

using nlohmann::json;
using namespace internal;  // NOLINT: the service's own helpers

namespace {

// Which answer counter an outcome increments: committed, refused, tainted.
std::size_t outcome_slot(UpdateOutcome o) {
  switch (o) {
    case UpdateOutcome::kCommitted:
      return 0;
    case UpdateOutcome::kRefused:
      return 1;
    case UpdateOutcome::kTainted:
      return 2;
  }
  return 2;
}

constexpr std::size_t kRefusedSlot = 1;
constexpr std::size_t kConflictSlot = 3;
constexpr std::size_t kInvalidSlot = 4;
constexpr std::size_t kReplayedSlot = 5;
constexpr std::size_t kUnknownSlot = 6;

// What the engine's workers reported freed by the sleep (null when they did not report).
json FreedBytes(const DeviceMemory& m) {
  if (!m.known) return nullptr;
  return static_cast<std::int64_t>(m.free_bytes_after) -
         static_cast<std::int64_t>(m.free_bytes_before);
}

std::uint64_t Requested(journal::Journal& j, bool sleeps) {
  std::uint64_t n = 0;
  j.ReadState([&](const State& s) {
    n = sleeps ? s.counters.sleeps_requested : s.counters.wakes_requested;
  });
  return n;
}

// The journal's ended request of this id (its request at `from_seq` when not 0), as an Event.
template <class Request, class IdOf>
std::optional<EndedPlans<Event>::Ended> LookUpEnded(journal::Journal& j, const std::string& id,
                                                    std::uint64_t head, std::uint64_t from_seq,
                                                    IdOf id_of) {
  auto found = LookUpRequest<Request>(j, id, head, kUpdateLookupRecordsMax, id_of, from_seq);
  if (!found.ok() || !found->request || !found->ended) return std::nullopt;
  return EndedPlans<Event>::Ended{Event(*found->request), *found->ended};
}

}  // namespace

void Service::HandleSleep(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  Result<SleepRequested> request = ParseSleepBody(req.body());
  if (!request.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, request.status());
    return;
  }
  SameVersionPlan plan{
      *request,
      request->sleep_id,
      "sleep",
      json{{"sleep_id", request->sleep_id}, {"level", request->level}},
      {&metrics_.sleeps_committed, &metrics_.sleeps_refused, &metrics_.sleeps_tainted,
       &metrics_.sleeps_conflict, &metrics_.sleeps_invalid, &metrics_.sleeps_replayed,
       &metrics_.sleeps_outcome_unknown}};
  if (RefusedFailStopped(res) || ReplayedIfSameVersionEnded(plan, res)) return;
  PlanSlot slot(*this);
  if (!TookUpdateSlot(slot, metrics_.sleeps_conflict, res, request->sleep_id,
                      [&](HttpResponse& r) { return ReplayedIfSameVersionEnded(plan, r); })) {
    return;
  }
  // It may have ended while we waited for the slot.
  if (RefusedFailStopped(res) || ReplayedIfSameVersionEnded(plan, res)) return;
  RunSameVersion(plan, res);
}

void Service::HandleWake(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  Result<WakeRequested> request = ParseWakeBody(req.body());
  if (!request.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, request.status());
    return;
  }
  SameVersionPlan plan{*request,
                       request->wake_id,
                       "wake-up",
                       json{{"wake_id", request->wake_id}},
                       {&metrics_.wakes_committed, &metrics_.wakes_refused, &metrics_.wakes_tainted,
                        &metrics_.wakes_conflict, &metrics_.wakes_invalid, &metrics_.wakes_replayed,
                        &metrics_.wakes_outcome_unknown}};
  if (RefusedFailStopped(res) || ReplayedIfSameVersionEnded(plan, res)) return;
  PlanSlot slot(*this);
  if (!TookUpdateSlot(slot, metrics_.wakes_conflict, res, request->wake_id,
                      [&](HttpResponse& r) { return ReplayedIfSameVersionEnded(plan, r); })) {
    return;
  }
  // It may have ended while we waited for the slot.
  if (RefusedFailStopped(res) || ReplayedIfSameVersionEnded(plan, res)) return;
  RunSameVersion(plan, res);
}

// Sleeps and wake-ups have their own ids: each kind its own memory.
EndedPlans<Event>& Service::EndedOf(const SameVersionPlan& plan) {
  return std::holds_alternative<SleepRequested>(plan.request) ? ended_sleeps_ : ended_wakes_;
}

// A re-POST of a sleep or wake-up remembered as ended answers what was recorded, without the plan
// slot: a retry after a lost answer is never told 409 because another plan runs now.
bool Service::ReplayedIfSameVersionEnded(const SameVersionPlan& plan, HttpResponse& res) {
  std::optional<EndedPlans<Event>::Ended> ended = EndedOf(plan).Find(plan.id);
  if (!ended) return false;
  ReplayEndedSameVersion(plan, *ended, res);
  return true;
}

// An id the journal already holds (its request at `from_seq`): its recorded outcome, or 409 for
// another body. Looked up only once the runner found the id journaled: a new id scans nothing.
bool Service::ReplayedSameVersion(const SameVersionPlan& plan, std::uint64_t from_seq,
                                  HttpResponse& res) {
  const std::uint64_t head = CatchUpDurableHead().seq;
  const std::optional<EndedPlans<Event>::Ended> ended =
      std::holds_alternative<SleepRequested>(plan.request)
          ? LookUpEnded<SleepRequested>(*journal_, plan.id, head, from_seq,
                                        [](const SleepRequested& r) { return r.sleep_id; })
          : LookUpEnded<WakeRequested>(*journal_, plan.id, head, from_seq,
                                       [](const WakeRequested& r) { return r.wake_id; });
  if (!ended) return false;
  EndedOf(plan).Remember(plan.id, ended->request, ended->ended);
  ReplayEndedSameVersion(plan, *ended, res);
  return true;
}

// The recorded outcome, or 409 when the id was used for another request.
void Service::ReplayEndedSameVersion(const SameVersionPlan& plan, const EndedPlans<Event>::Ended& e,
                                     HttpResponse& res) {
  RC_CHECK(e.ended.update_id == plan.id && e.request.index() == plan.request.index());
  if (!(e.request == plan.request)) {
    (*plan.counts[kConflictSlot])++;
    SendError(res, 409, "conflict",
              "'" + plan.id + "' was already used for another request; choose a new id");
    return;
  }
  (*plan.counts[kReplayedSlot])++;
  json ids = plan.ids;
  // The memory freed was measured around the first call only: a replay has the field, null.
  if (std::holds_alternative<SleepRequested>(plan.request)) ids["freed_bytes"] = nullptr;
  SendOutcome(res, std::move(ids), e.ended, /*replayed=*/true);
}

// Drives the sleep or wake-up to its end and answers; the caller holds update_mu_.
void Service::RunSameVersion(const SameVersionPlan& plan, HttpResponse& res) {
  const bool sleep = std::holds_alternative<SleepRequested>(plan.request);
  spdlog::info("serve: {} '{}' requested", plan.what, Esc(plan.id));
  const std::uint64_t requested_before = Requested(*journal_, sleep);
  Result<UpdateEnded> ended = DrivePlan(plan.what, plan.id, [&] {
    return sleep ? runner_->Sleep(std::get<SleepRequested>(plan.request))
                 : runner_->Wake(std::get<WakeRequested>(plan.request));
  });
  NoteTimings();
  NotifyLifecycle(journal_->head_seq());
  if (!ended.ok()) {
    const std::uint64_t resubmitted_seq = runner_->resubmitted_seq();
    if (resubmitted_seq != 0 && ReplayedSameVersion(plan, resubmitted_seq, res)) return;
    return AnswerUnfinished(plan, Requested(*journal_, sleep) > requested_before, ended.status(),
                            res);
  }
  RC_CHECK(ended->update_id == plan.id);
  EndedOf(plan).Remember(plan.id, plan.request, *ended);
  (*plan.counts[outcome_slot(ended->outcome)])++;
  if (ended->outcome != UpdateOutcome::kCommitted) {
    spdlog::warn("serve: {} '{}' {}: {}", plan.what, Esc(plan.id),
                 update_outcome_name(ended->outcome), Esc(ended->reason));
  }
  json ids = plan.ids;
  if (sleep) ids["freed_bytes"] = FreedBytes(runner_->last_sleep_memory());
  SendOutcome(res, std::move(ids), *ended, /*replayed=*/false);
}

// Refused before anything was journaled (not READY, not asleep, a level-2 wake-up, bad input):
// the fold's words. Journaled without an end: the outcome is unknown, the executor fail-stops.
void Service::AnswerUnfinished(const SameVersionPlan& plan, bool journaled, const Status& st,
                               HttpResponse& res) {
  RC_CHECK(!st.ok());
  const Code code = st.code();
  if (!journaled &&
      (code == Code::kRejected || code == Code::kConflict || code == Code::kInvalidArgument)) {
    CountUnjournaledRefusal(
        code, {plan.counts[kRefusedSlot], plan.counts[kInvalidSlot], plan.counts[kConflictSlot]});
    spdlog::warn("serve: {} '{}' refused before anything was journaled: {}", plan.what,
                 Esc(plan.id), Esc(st.ToString()));
    SendStatus(res, st);
    return;
  }
  if (AnsweredStalledPlan(plan.what, plan.id, st, *plan.counts[kUnknownSlot], res)) return;
  (*plan.counts[kUnknownSlot])++;
  FailStop(std::string(plan.what) + " '" + plan.id +
           "' did not reach a recorded outcome: " + st.ToString());
  SetRetryAfter(res);
  SendError(res, 503, "outcome_unknown",
            std::string("the outcome of ") + plan.what + " '" + plan.id + "' is unknown (" +
                st.ToString() +
                "); the executor fail-stopped and recovers on restart: re-POST the same id then "
                "to read the recorded outcome");
}

}  // namespace rc::service
