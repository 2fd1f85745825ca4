// POST /v1/restores: takes a TAINTED engine back to a version committed earlier in this journal,
// with proof (docs/lifecycle.md, "Restore with proof"). One update or restore runs at a time; a
// re-POST of a restore that ended answers what the journal recorded, even while another plan runs.
#include <algorithm>
#include <mutex>
#include <optional>

#include <spdlog/spdlog.h>

#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"

namespace rc::service {

using nlohmann::json;
using namespace internal;  // NOLINT: the service's own helpers

SourceReader Service::SourceReaderForTransfer() const {
  return config_.transfer == "reload" ? SourceReader::kEngine : SourceReader::kExecutor;
}

std::uint64_t Service::RestoresRequested() const {
  std::uint64_t n = 0;
  journal_->ReadState([&n](const State& s) { n = s.counters.restores_requested; });
  return n;
}

void Service::HandleRestore(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  // The source is read only once the id is known not to have ended: a retry answers its recorded
  // outcome even once its source is gone or rewritten.
  Result<RestoreRequested> request = ParseRestoreBody(req.body(), SourceReader::kEngine);
  if (!request.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, request.status());
    return;
  }
  if (RefusedFailStopped(res) || ReplayedIfRestoreEnded(*request, res)) return;
  PlanSlot slot(*this);
  if (!TookUpdateSlot(slot, metrics_.restores_conflict, res, request->restore_id,
                      [&](HttpResponse& r) { return ReplayedIfRestoreEnded(*request, r); })) {
    return;
  }
  // It may have ended while we waited for the slot.
  if (RefusedFailStopped(res) || ReplayedIfRestoreEnded(*request, res)) return;
  if (!RestoreSourceUsable(*request, res)) return;
  RunRestore(*request, res);
}

// A re-POST of a restore remembered as ended answers what was recorded, without the plan slot: a
// retry after a lost answer is never told 409 because another plan runs now.
bool Service::ReplayedIfRestoreEnded(const RestoreRequested& request, HttpResponse& res) {
  std::optional<EndedPlans<RestoreRequested>::Ended> ended =
      ended_restores_.Find(request.restore_id);
  if (!ended) return false;
  ReplayEndedRestore(request, *ended, res);
  return true;
}

// A source that cannot be read is refused (400), unless the restore_id already ended: its
// recorded outcome answers a retry whose source is gone. The journal is scanned only then.
bool Service::RestoreSourceUsable(const RestoreRequested& request, HttpResponse& res) {
  if (request.adopt) return true;
  Status readable = ValidateSource(request.source_uri, SourceReaderForTransfer());
  if (readable.ok()) return true;
  std::unique_lock<std::mutex> turn;
  if (!TookLookupTurn(turn, res) || ReplayedRestore(request, 0, res)) return false;
  metrics_.bad_requests++;
  SendStatus(res, readable);
  return false;
}

// A restore_id the journal already holds (its request at `from_seq` when not 0): its recorded
// outcome, or 409 for another body.
bool Service::ReplayedRestore(const RestoreRequested& request, std::uint64_t from_seq,
                              HttpResponse& res) {
  auto found = LookUpRequest<RestoreRequested>(
      *journal_, request.restore_id, CatchUpDurableHead().seq, kUpdateLookupRecordsMax,
      [](const RestoreRequested& r) { return r.restore_id; }, from_seq);
  if (!found.ok() || !found->request || !found->ended) return false;
  const EndedPlans<RestoreRequested>::Ended ended{*found->request, *found->ended};
  ended_restores_.Remember(request.restore_id, ended.request, ended.ended);
  ReplayEndedRestore(request, ended, res);
  return true;
}

// The recorded outcome, or 409 when the restore_id was used for another request.
void Service::ReplayEndedRestore(const RestoreRequested& request,
                                 const EndedPlans<RestoreRequested>::Ended& e, HttpResponse& res) {
  RC_CHECK(e.request.restore_id == request.restore_id && e.ended.update_id == request.restore_id);
  if (!(e.request == request)) {
    metrics_.restores_conflict++;
    SendError(res, 409, "conflict",
              "restore_id '" + request.restore_id +
                  "' was already used for another request; choose a new restore_id");
    return;
  }
  metrics_.restores_replayed++;
  SendRestoreOutcome(res, request, e.ended, /*replayed=*/true);
}

// Drives the restore to its end and answers; the caller holds update_mu_.
void Service::RunRestore(const RestoreRequested& request, HttpResponse& res) {
  spdlog::warn("serve: restore '{}' requested: back to '{}' {}", Esc(request.restore_id),
               Esc(request.label), request.adopt ? "(adopt)" : "from " + Esc(request.source_uri));
  const std::uint64_t requested_before = RestoresRequested();
  Result<UpdateEnded> ended =
      DrivePlan("restore", request.restore_id, [&] { return runner_->Restore(request); });
  NoteTimings();
  NotifyLifecycle(journal_->head_seq());
  if (ended.ok()) return AnswerRestoreEnded(request, *ended, res);
  const std::uint64_t resubmitted_seq = runner_->resubmitted_seq();
  if (resubmitted_seq != 0 && ReplayedRestore(request, resubmitted_seq, res)) return;
  const bool journaled = RestoresRequested() > requested_before;
  const Code code = ended.status().code();
  if (!journaled &&
      (code == Code::kRejected || code == Code::kConflict || code == Code::kInvalidArgument)) {
    CountUnjournaledRefusal(code, {&metrics_.restores_refused, &metrics_.restores_invalid,
                                   &metrics_.restores_conflict});
    spdlog::warn("serve: restore '{}' refused before anything was journaled: {}",
                 Esc(request.restore_id), Esc(ended.status().ToString()));
    SendStatus(res, ended.status());
    return;
  }
  if (AnsweredStalledPlan("restore", request.restore_id, ended.status(),
                          metrics_.restores_outcome_unknown, res)) {
    return;
  }
  metrics_.restores_outcome_unknown++;
  FailStop("restore '" + request.restore_id +
           "' did not reach a recorded outcome: " + ended.status().ToString());
  SetRetryAfter(res);
  SendError(res, 503, "outcome_unknown",
            "the outcome of restore '" + request.restore_id + "' is unknown (" +
                ended.status().ToString() +
                "); the executor fail-stopped and recovers on restart: re-POST the same "
                "restore_id then to read the recorded outcome");
}

void Service::AnswerRestoreEnded(const RestoreRequested& request, const UpdateEnded& ended,
                                 HttpResponse& res) {
  RC_CHECK(ended.update_id == request.restore_id);
  ended_restores_.Remember(request.restore_id, request, ended);
  switch (ended.outcome) {
    case UpdateOutcome::kCommitted:
      metrics_.restores_committed++;
      spdlog::info("serve: restore '{}' proven: the engine serves '{}' again",
                   Esc(request.restore_id), Esc(request.label));
      break;
    case UpdateOutcome::kRefused:
      metrics_.restores_refused++;
      break;
    case UpdateOutcome::kTainted:
      metrics_.restores_tainted++;
      break;
  }
  if (ended.outcome != UpdateOutcome::kCommitted) {
    spdlog::warn("serve: restore '{}' {}: the engine stays TAINTED: {}", Esc(request.restore_id),
                 update_outcome_name(ended.outcome), Esc(ended.reason));
  }
  SendRestoreOutcome(res, request, ended, /*replayed=*/false);
}

void Service::SendRestoreOutcome(HttpResponse& res, const RestoreRequested& request,
                                 const UpdateEnded& ended, bool replayed) {
  SendOutcome(
      res,
      json{{"restore_id", request.restore_id}, {"label", request.label}, {"adopt", request.adopt}},
      ended, replayed);
}

}  // namespace rc::service
