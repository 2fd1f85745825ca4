// The trainer API: state and version reads, updates, explicit rollouts and their leases, watch,
// events, manifest, health and readiness, and the routing table of the whole server.
#include <pthread.h>
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>

#include "effects/http/ipc_transfer.h"
#include "effects/nccl/weight_source.h"
#include "journal/json.h"
#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"
#include "statemachine/text.h"

namespace rc::service {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace internal;  // NOLINT: the service's own helpers

// ---- trainer API ----

Service::DurableView Service::CatchUpDurable(bool copy_state) {
  std::lock_guard<std::mutex> lock(durable_mu_);
  if (!failed()) {
    // Scan stops at the durable head: whatever was only enqueued is not folded here.
    Status st = journal_->Scan(durable_.head.seq + 1, 0, [&](const journal::Record& r) {
      RC_CHECK(r.seq == durable_.head.seq + 1);  // dense seqs, in order
      Status applied = is_fleet() ? fleet_apply(durable_.fleet, FleetEvent{r.engine, r.event})
                                  : apply(durable_.state, r.event);
      if (!applied.ok()) {
        return Status::Corruption("seq " + std::to_string(r.seq) +
                                  " does not apply to the "
                                  "durable view: " +
                                  applied.ToString());
      }
      durable_.head = DurableHead{r.seq, r.hash};
      if (IsDecision(r.event)) durable_.decision_seq = r.seq;
      return Status::OK();
    });
    if (!st.ok() && st.code() != Code::kInvalidArgument) {
      FailStop("reading the durable journal failed: " + st.ToString());
    }
  }
  DurableView out;
  out.head = durable_.head;
  out.decision_seq = durable_.decision_seq;
  if (copy_state && is_fleet()) out.fleet = durable_.fleet;
  if (copy_state && !is_fleet()) out.state = durable_.state;
  return out;
}

DurableHead Service::CatchUpDurableHead() { return CatchUpDurable(false).head; }

void Service::SetHeadHeader(HttpResponse& res, const DurableHead& head) {
  SetHeader(res, "X-RolloutCore-Head", head.ToString());
}

json SummaryJson(const State& s, const DurableHead& head) {
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
                   {"target", journal::WeightVersionToJson(s.update->target)},
                   {"restore", s.update->restore},
                   {"sleep_level", s.update->sleep_level},
                   {"wake", s.update->wake_only},
                   {"from_sleep", s.update->from_sleep},
                   {"stalled", plan_stalled(s)}};
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
                   {"recoveries", s.counters.recoveries},
                   {"restores_requested", s.counters.restores_requested},
                   {"restores_committed", s.counters.restores_committed},
                   {"sleeps_committed", s.counters.sleeps_committed},
                   {"wakes_committed", s.counters.wakes_committed}};
  j["sleep_level"] = s.sleep_level;
  return j;
}

json Service::StateSummary() {
  const DurableView v = CatchUpDurable(true);
  return SummaryJson(v.state, v.head);
}

void Service::HandleState(const ApiRequest& req, HttpResponse& res) {
  const DurableView v = CatchUpDurable(true);
  SetHeadHeader(res, v.head);
  if (req.query("full").has_value()) {
    json j = journal::StateToJson(v.state);
    j["head_seq"] = v.head.seq;
    j["head"] = v.head.ToString();
    SendJson(res, 200, j);
    return;
  }
  SendJson(res, 200, SummaryJson(v.state, v.head));
}

void Service::HandleVersion(const ApiRequest&, HttpResponse& res) {
  const DurableView v = CatchUpDurable(true);
  SetHeadHeader(res, v.head);
  SendJson(res, 200,
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

void Service::SendUpdateOutcome(HttpResponse& res, const UpdateRequested& request,
                                const UpdateEnded& ended, bool replayed) {
  SendOutcome(res, json{{"update_id", request.update_id}}, ended, replayed);
}

// The answer of an ended update or restore: `out` (its ids) with the outcome, the durable state
// and head, and the phase timings when this process just ran it.
void Service::SendOutcome(HttpResponse& res, json out, const UpdateEnded& ended, bool replayed) {
  const DurableView v = CatchUpDurable(true);
  out["outcome"] = update_outcome_name(ended.outcome);
  out["reason"] = ended.reason;
  out["state"] = SummaryJson(v.state, v.head);
  out["head"] = v.head.ToString();
  out["replayed"] = replayed;
  if (!replayed) {
    std::lock_guard<std::mutex> g(update_id_mu_);
    out["timings"] = TimingsJson(last_timings_);
  }
  SetHeadHeader(res, v.head);
  if (!replayed && RefusedAtShutdown(ended.outcome)) {
    out["error"] = {{"type", "shutting_down"},
                    {"message",
                     "serve is shutting down: this plan ended refused, proven before any "
                     "mutation of the engine, as recorded (`reason` says why, `state` where the "
                     "engine is now); request it again, under a new id, once serve is back"}};
    SetRetryAfter(res);
    SendJson(res, 503, out);
    return;
  }
  SendJson(res, OutcomeHttpStatus(ended.outcome), out);
}

// Refused is the only outcome the gate can cause: one that passed it ends as the engine says. It
// is the shutdown's only when the runner gave the plan up to it (a drain or a wait for rollouts
// cut short, a mutation the gate kept from the engine): a plan refused on its own grounds once
// the gate closed (a source whose manifest is not the declared one, a failed pause) answers as
// any refusal does.
bool Service::RefusedAtShutdown(UpdateOutcome outcome) const {
  return outcome == UpdateOutcome::kRefused && mutation_gate_.closed() && runner_ != nullptr &&
         runner_->plan_stopped();
}

// A retry of the very plan that holds the slot (its first answer lost, or its stalled retry
// finishing) waits for it a bounded while: the caller then answers its recorded outcome rather
// than a conflict with itself.
bool Service::TookUpdateSlot(PlanSlot& slot, std::atomic<std::uint64_t>& conflicts,
                             HttpResponse& res, const std::string& id,
                             const std::function<bool(HttpResponse&)>& replayed_if_ended) {
  RC_CHECK(!slot.held());
  if (shutting_down_.load()) {
    AnswerShuttingDown(res, replayed_if_ended);
    return false;
  }
  if (TookSlotOrWaitsFor(slot, id)) WaitForSlot(slot, id);
  // The wait ends when the shutdown begins, and the slot may have been won from a shutdown that
  // waits for it: no plan starts either way.
  if (shutting_down_.load()) {
    slot.Release();
    AnswerShuttingDown(res, replayed_if_ended);
    return false;
  }
  if (slot.held()) {
    if (step_probe_) step_probe_("plan slot taken");
    return true;
  }
  // As everywhere else, nothing is replayed once fail-stopped.
  if (RefusedFailStopped(res) || (replayed_if_ended && replayed_if_ended(res))) return false;
  conflicts++;
  std::lock_guard<std::mutex> g(update_id_mu_);
  SendError(
      res, 409, "conflict",
      (running_update_id_.empty() ? std::string("another plan") : "'" + running_update_id_ + "'") +
          " is running; one update or restore at a time");
  return false;
}

// No plan starts once serve shuts down: 503, or the recorded outcome of a plan that ended (while
// its retry waited for the slot). As everywhere else, nothing is replayed once fail-stopped.
void Service::AnswerShuttingDown(HttpResponse& res,
                                 const std::function<bool(HttpResponse&)>& replayed_if_ended) {
  if (!failed() && replayed_if_ended && replayed_if_ended(res)) return;
  SendError(res, 503, "shutting_down", "the executor is shutting down");
}

bool Service::TookSlotOrWaitsFor(PlanSlot& slot, const std::string& id) {
  std::lock_guard<std::mutex> g(update_id_mu_);
  slot.lock_ = std::unique_lock<std::timed_mutex>(update_mu_, std::try_to_lock);
  if (slot.held()) {
    running_update_id_ = id;
    return false;
  }
  if (!SamePlanHoldsOrAwaitsSlot(id) || slot_waiters_total_ >= SlotWaitersMax()) return false;
  slot_waiters_[id]++;  // first: a failed insert leaves the total as it was
  slot_waiters_total_++;
  return true;
}

bool Service::SamePlanHoldsOrAwaitsSlot(const std::string& id) const {
  return !id.empty() && (running_update_id_ == id || slot_waiters_.count(id) != 0);
}

// At most a quarter of the blocking pool waits on the slot: a trainer retrying on a short
// timeout must not take the threads lease renewals and finishes need.
std::size_t Service::SlotWaitersMax() const {
  return std::max<std::size_t>(1, config_.http_threads / 4);
}

void Service::WaitForSlot(PlanSlot& slot, const std::string& id) {
  try {
    if (step_probe_) step_probe_("plan slot wait");
  } catch (...) {  // a probe only widens the window; the wait goes on whatever it does
  }
  slot.lock_ = SlotUnlessStopping(kSamePlanSlotWaitMs);
  try {
    if (slot.held() && step_probe_) step_probe_("plan slot waited for");
  } catch (...) {  // a probe only widens the window; the wait is left whatever it does
  }
  std::lock_guard<std::mutex> g(update_id_mu_);
  if (slot.held()) running_update_id_ = id;
  auto waiting = slot_waiters_.find(id);
  RC_CHECK(waiting != slot_waiters_.end() && waiting->second > 0 && slot_waiters_total_ > 0);
  if (--waiting->second == 0) slot_waiters_.erase(waiting);
  slot_waiters_total_--;
}

// The slot, waited for up to `wait_ms` in slices of kSlotWaitSliceMs: a shutdown or a fail-stop
// ends the wait within a slice, so a retry waiting here never holds a blocking thread past the
// HTTP server's stop at shutdown (kShutdownSettleMs), which would make the exit unclean.
std::unique_lock<std::timed_mutex> Service::SlotUnlessStopping(std::uint64_t wait_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  std::unique_lock<std::timed_mutex> lock(update_mu_, std::defer_lock);
  while (!shutting_down_.load() && !failed() && Clock::now() < deadline) {
    const auto slice = Clock::now() + std::chrono::milliseconds(kSlotWaitSliceMs);
    if (lock.try_lock_until(std::min(deadline, slice))) break;
  }
  return lock;
}

void Service::PlanSlot::Release() {
  if (!held()) return;
  try {
    if (service_.step_probe_) service_.step_probe_("plan slot given back");
  } catch (...) {  // a probe only widens the window; the slot is given back whatever it does
  }
  std::lock_guard<std::mutex> g(service_.update_id_mu_);
  service_.running_update_id_.clear();
  lock_.unlock();
}

// A plan's runner call threw (a thread the system refused, memory, a parse): its request may be
// durable and its effects begun, and nothing drives it now, so its outcome is unknown. The
// executor fail-stops here, before anything is answered, and the restart recovers the plan from
// the journal. The error is Internal, a journal failure's code, so each family's answer takes its
// unknown-outcome path (503 outcome_unknown, counted there): never an unjournaled refusal, and
// never the stalled-plan answer, which is not given once fail-stopped.
Status Service::PlanThrew(const std::string& what, const std::string& id) {
  const std::string why = what + " '" + Esc(id) + "' threw: " + Esc(CurrentExceptionText());
  spdlog::critical("serve: {}", why);  // FailStop logs nothing when the executor already failed
  FailStop(why);
  RC_CHECK(failed());
  return Status::Internal(why);
}

void Service::NoteTimings() {
  std::lock_guard<std::mutex> g(update_id_mu_);
  last_timings_ = runner_->last_timings();
}

// Runs a thread's whole body: nothing escapes it (FailStop logs the exception, escaped, on one
// line), so no background thread ends the process with nothing recorded.
void Service::RunGuarded(const char* role, const std::function<void()>& body) {
  try {
    body();
  } catch (...) {
    const std::string why =
        std::string("the ") + role + " thread threw: " + Esc(CurrentExceptionText());
    spdlog::critical("serve: {}", why);  // FailStop logs nothing when the executor already failed
    FailStop(why);
  }
}

std::uint64_t Service::UpdatesRequested() const {
  std::uint64_t n = 0;
  journal_->ReadState([&n](const State& s) { n = s.counters.updates_requested; });
  return n;
}

// The manifest of a source this executor reads: a colocated export, or what the NCCL sender (and
// the GPU-free transfer) read. Each transfer takes only its own kind of source.
Result<std::string> Service::ExecutorSourceManifest(const std::string& uri) const {
  const bool colocated = uri.rfind(effects::kVllmIpcScheme, 0) == 0;
  if (colocated != (config_.transfer == "ipc")) {
    return Status::InvalidArgument(colocated ? "a vllm-ipc: source needs transfer 'ipc'"
                                             : "transfer 'ipc' takes vllm-ipc: sources only");
  }
  if (!colocated) return effects::nccl::SourceManifestDigest(uri);
  Result<effects::VllmIpcFile> file = effects::ReadVllmIpcFile(uri);
  if (!file.ok()) return file.status();
  return file->manifest.digest();
}

// The source's checks that read it; a refusal first asks the journal whether the id already ended
// (its recorded outcome is the answer then). The journal is scanned only on a refusal.
bool Service::SourceUsable(const UpdateRequested& request, HttpResponse& res) {
  HttpResponse refusal;
  if (SourceChecked(request, refusal)) return true;
  std::unique_lock<std::mutex> turn;
  if (!TookLookupTurn(turn, res) || ReplayedFromJournal(request, res)) return false;
  metrics_.bad_requests++;
  res = std::move(refusal);
  return false;
}

// A source that cannot be read, or whose manifest is not the declared one: false, with the
// refusal in `refusal`.
bool Service::SourceChecked(const UpdateRequested& request, HttpResponse& refusal) const {
  Status readable = ValidateSource(request.source_uri, SourceReaderForTransfer());
  if (!readable.ok()) {
    SendStatus(refusal, readable);
    return false;
  }
  if (SourceReaderForTransfer() == SourceReader::kEngine) return true;
  Result<std::string> digest = ExecutorSourceManifest(request.source_uri);
  if (!digest.ok()) {
    SendError(refusal, 400, "invalid_source", "'source': " + digest.status().message());
    return false;
  }
  if (*digest != request.identity.manifest_digest) {
    SendError(refusal, 422, "manifest_mismatch",
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
  // The source is read only once the id is known not to have ended: a retry answers its recorded
  // outcome even once its source is gone (an IPC export closed) or rewritten (one path per step).
  Result<UpdateRequested> request = ParseUpdateBody(req.body(), SourceReader::kEngine);
  if (!request.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, request.status());
    return;
  }
  if (RefusedFailStopped(res) || ReplayedIfEnded(*request, res)) return;
  // What can be checked without the engine is checked before anything is journaled: a source
  // that cannot be read, or whose manifest is not the declared one, never drains the engine.
  if (!SourceUsable(*request, res)) return;
  PlanSlot slot(*this);
  if (!TookUpdateSlot(slot, metrics_.updates_conflict, res, request->update_id,
                      [&](HttpResponse& r) { return ReplayedIfEnded(*request, r); })) {
    return;
  }
  // It may have ended while we waited for the lock.
  if (RefusedFailStopped(res) || ReplayedIfEnded(*request, res)) return;
  RunUpdate(*request, res);
}

// After a fail-stop nothing more is decided: 503.
bool Service::RefusedFailStopped(HttpResponse& res) {
  if (!failed()) return false;
  SendError(res, 503, "failed", "the executor has fail-stopped: " + failure());
  return true;
}

// A re-POST of an update that already ended answers what was recorded (idempotent retries).
bool Service::ReplayedIfEnded(const UpdateRequested& request, HttpResponse& res) {
  std::optional<EndedUpdate> ended = FindEndedUpdate(request.update_id);
  if (!ended) return false;
  ReplayEndedUpdate(request, *ended, res);
  return true;
}

// The recorded outcome, or 409 when the update_id was used for another request.
void Service::ReplayEndedUpdate(const UpdateRequested& request, const EndedUpdate& e,
                                HttpResponse& res) {
  RC_CHECK(e.request.update_id == request.update_id && e.ended.update_id == request.update_id);
  if (!(e.request == request)) {
    metrics_.updates_conflict++;
    SendError(res, 409, "conflict",
              "update_id '" + request.update_id +
                  "' was already used for another request (different body); choose a new "
                  "update_id");
    return;
  }
  metrics_.updates_replayed++;
  spdlog::info("serve: update '{}' re-POSTed: answering its recorded outcome ({})",
               Esc(request.update_id), update_outcome_name(e.ended.outcome));
  SendUpdateOutcome(res, e.request, e.ended, /*replayed=*/true);
}

// Drives the update to its end and answers; the caller holds update_mu_.
void Service::RunUpdate(const UpdateRequested& request, HttpResponse& res) {
  spdlog::info("serve: update '{}' requested: target '{}', manifest {}, source {}",
               Esc(request.update_id), Esc(request.target_label),
               Esc(request.identity.manifest_digest), Esc(request.source_uri));
  const std::uint64_t requested_before = UpdatesRequested();
  Result<UpdateEnded> ended =
      DrivePlan("update", request.update_id, [&] { return runner_->Update(request); });
  NoteTimings();
  NotifyLifecycle(journal_->head_seq());
  if (ended.ok()) return AnswerUpdateEnded(request, *ended, res);
  const std::uint64_t requested_after = UpdatesRequested();
  RC_CHECK(requested_after >= requested_before);  // journal counters never go back
  const bool journaled = requested_after > requested_before;
  if (!journaled && AnsweredUnjournaledUpdate(request, ended.status(), res)) return;
  if (AnsweredStalledPlan("update", request.update_id, ended.status(),
                          metrics_.updates_outcome_unknown, res)) {
    return;
  }
  AnswerUpdateOutcomeUnknown(request, ended.status(), res);
}

void Service::AnswerUpdateEnded(const UpdateRequested& request, const UpdateEnded& ended,
                                HttpResponse& res) {
  RememberEndedUpdate(request, ended);
  switch (ended.outcome) {
    case UpdateOutcome::kCommitted:
      metrics_.updates_committed++;
      break;
    case UpdateOutcome::kRefused:
      metrics_.updates_refused++;
      break;
    case UpdateOutcome::kTainted:
      metrics_.updates_tainted++;
      break;
  }
  SendUpdateOutcome(res, request, ended, /*replayed=*/false);
}

// Nothing of this request was journaled: a lifecycle refusal (e.g. TAINTED), a reused update_id
// with another body (the journal's idempotency: Conflict), bad input, or a duplicate of an update
// decided before this process remembered it. False when none of these explains the error.
bool Service::AnsweredUnjournaledUpdate(const UpdateRequested& request, const Status& st,
                                        HttpResponse& res) {
  RC_CHECK(!st.ok());
  if (st.code() == Code::kRejected || st.code() == Code::kInvalidArgument) {
    RefuseUnjournaledUpdate(request, st, res);
    return true;
  }
  if (IsJournalFailure(st)) return false;
  if (ReplayedFromJournal(request, res, runner_->resubmitted_seq())) return true;
  // The id is the journal's already (another body, or an update that ended before the lookup
  // window): nothing ran, so the answer is a conflict, not an unknown outcome.
  if (st.code() != Code::kConflict) return false;
  RefuseUnjournaledUpdate(request, st, res);
  return true;
}

// The journal's recorded end of this update_id (its request at `from_seq` when not 0), answered
// as ReplayedIfEnded does; false when the journal holds no ended update of that id (within the
// lookup window).
bool Service::ReplayedFromJournal(const UpdateRequested& request, HttpResponse& res,
                                  std::uint64_t from_seq) {
  auto found = LookUpRequest<UpdateRequested>(
      *journal_, request.update_id, CatchUpDurableHead().seq, kUpdateLookupRecordsMax,
      [](const UpdateRequested& u) { return u.update_id; }, from_seq);
  if (!found.ok() || !found->request || !found->ended) return false;
  RememberEndedUpdate(*found->request, *found->ended);
  ReplayEndedUpdate(request, EndedUpdate{*found->request, *found->ended}, res);
  return true;
}

// Each lookup of a refused source's id may read millions of records: many at once would take the
// blocking pool that lease renewals and finishes need, so a second one meanwhile is told to retry.
// (The lookup after the journal refused an id runs under the plan slot, so at most one of those
// runs beside it.)
bool Service::TookLookupTurn(std::unique_lock<std::mutex>& turn, HttpResponse& res) {
  turn = std::unique_lock<std::mutex>(refusal_lookup_mu_, std::try_to_lock);
  if (turn.owns_lock()) {
    if (step_probe_) step_probe_("journal lookup");
    return true;
  }
  SetRetryAfter(res);
  SendError(res, 503, "overloaded",
            "the source cannot be used, and whether this id already ended waits for another "
            "request's journal lookup (one at a time); retry");
  return false;
}

void Service::RefuseUnjournaledUpdate(const UpdateRequested& request, const Status& st,
                                      HttpResponse& res) {
  CountUnjournaledRefusal(st.code(), {&metrics_.updates_refused, &metrics_.updates_invalid,
                                      &metrics_.updates_conflict});
  spdlog::warn("serve: update '{}' refused before anything was journaled: {}",
               Esc(request.update_id), Esc(st.ToString()));
  SendStatus(res, st);
}

// The request may be durable and its effects may have run: nobody can say how it ended. The
// executor stops (a restart recovers from what is durable); the trainer is told "unknown", never
// "failed", and re-POSTs the same update_id after the restart to read the outcome.
void Service::AnswerUpdateOutcomeUnknown(const UpdateRequested& request, const Status& st,
                                         HttpResponse& res) {
  RC_CHECK(!st.ok());
  metrics_.updates_outcome_unknown++;
  FailStop("update '" + request.update_id + "' did not reach a recorded outcome: " + st.ToString());
  SetRetryAfter(res);
  SendError(res, 503, "outcome_unknown",
            "the outcome of update '" + request.update_id + "' is unknown (" + st.ToString() +
                "); the executor fail-stopped and recovers on restart: re-POST the same "
                "update_id then to read the recorded outcome");
}

void Service::HandleAdmit(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  Result<AdmitBody> parsed =
      ParseAdmitBody(req.body(), config_.admit_wait_ms, config_.rollout_lease_ms);
  if (!parsed.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, parsed.status());
    return;
  }
  std::string id = parsed->rollout_id;
  const std::int64_t wait_ms = parsed->wait_ms;
  const std::int64_t lease_ms = parsed->lease_ms;
  if (id.empty()) id = NextRolloutId();
  AdmitResult a =
      Admit(id, static_cast<std::uint64_t>(wait_ms), static_cast<std::uint32_t>(lease_ms));
  if (!a.admitted) {
    if (a.refusal.retry_after_s > 0) {
      SetHeader(res, "Retry-After", std::to_string(a.refusal.retry_after_s));
    }
    SendError(res, a.refusal.http_status, a.refusal.type, a.refusal.message);
    return;
  }
  StartLease(id, lease_ms);
  const RolloutAdmitted& b = a.admitted->binding;
  const DurableHead& head = a.admitted->head;
  RC_CHECK(head.seq >= a.admitted->seq);  // the admission's own group
  SetHeadHeader(res, head);
  SendJson(res, 201,
           {{"rollout_id", b.rollout_id},
            {"admission_seq", a.admitted->seq},
            {"version", journal::WeightVersionToJson(b.version)},
            {"identity", journal::WeightIdentityToJson(b.identity)},
            {"cache_salt", DeriveCacheSalt(b, "")},
            {"lease_ms", lease_ms},
            {"head", head.ToString()}});
}

// The lease of a rollout just admitted runs from now, unless it already ended (a DELETE between
// its durable admission and this): a deadline left for an ended rollout would expire the next
// admission of the same id. Checked under lease_mu_, which every finish takes to erase its entry.
void Service::StartLease(const std::string& id, std::int64_t lease_ms) {
  std::lock_guard<std::mutex> g(lease_mu_);
  bool active = false;
  journal_->ReadState([&](const State& s) { active = s.active.count(id) > 0; });
  if (active) lease_deadline_ms_[id] = effects::system_clock().now_ms() + lease_ms;
}

// The lease of an active rollout (0: not active, or proxied). The admission view may be older
// than the admission, so a miss there is looked up in the journal's own state, without a copy.
std::uint32_t Service::ActiveLeaseMs(const std::string& id) {
  const std::shared_ptr<const State> view = AdmitView();
  auto it = view->active.find(id);
  if (it != view->active.end()) return it->second.lease_ms;
  std::uint32_t lease_ms = 0;
  journal_->ReadState([&](const State& s) {
    auto f = s.active.find(id);
    if (f != s.active.end()) lease_ms = f->second.lease_ms;
  });
  return lease_ms;
}

void Service::HandleLease(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  const std::string id = req.captures.at(0);
  Status st = ParseLeaseBody(req.body());
  if (!st.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, st);
    return;
  }
  if (failed()) {
    SendError(res, 503, "failed", "the executor has fail-stopped: " + failure());
    return;
  }
  const std::uint32_t lease_ms = ActiveLeaseMs(id);
  std::lock_guard<std::mutex> g(lease_mu_);
  auto it = lease_deadline_ms_.find(id);
  if (it == lease_deadline_ms_.end() || lease_ms == 0) {
    if (lease_ms == 0 && it == lease_deadline_ms_.end()) {
      SendError(res, 404, "not_found",
                "rollout '" + id +
                    "' holds no lease (not active, finished, expired, or a "
                    "proxied rollout)");
    } else {
      SendError(res, 404, "not_found", "the lease of rollout '" + id + "' has lapsed");
    }
    return;
  }
  it->second = effects::system_clock().now_ms() + lease_ms;
  metrics_.leases_renewed++;
  SendJson(res, 200, {{"rollout_id", id}, {"lease_ms", lease_ms}});
}

// Every 100 ms until Shutdown or a fail-stop.
void Service::LeaseLoop() {
  pthread_setname_np(pthread_self(), "rc-lease");
  RunGuarded("lease expiry", [this] {
    while (WaitBackgroundTick(std::chrono::milliseconds(100))) ExpireLapsedLeases();
  });
}

void Service::ExpireLapsedLeases() {
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
    Status st = FinishLeased(id, RolloutOutcome::kExpired, 0, 0);
    if (st.ok()) {
      metrics_.leases_expired++;
      spdlog::warn(
          "serve: the lease of rollout {} lapsed (its client stopped renewing): "
          "recorded expired",
          Esc(id));
    } else if (st.code() != Code::kNotFound) {
      spdlog::error("serve: recording the lapsed lease of rollout {} failed: {}", Esc(id),
                    Esc(st.ToString()));
    }
  }
}

void Service::HandleFinish(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  const std::string id = req.captures.at(0);
  Result<FinishBody> parsed = ParseFinishBody(req.body());
  if (!parsed.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, parsed.status());
    return;
  }
  // A proxied rollout (no lease) lives as long as its HTTP request: ending it here would let an
  // update start while its generation still runs. FinishLeased refuses it.
  const RolloutOutcome outcome = parsed->outcome;
  const std::int64_t pt = parsed->prompt_tokens, ct = parsed->completion_tokens;
  Status done =
      FinishLeased(id, outcome, static_cast<std::uint32_t>(pt), static_cast<std::uint32_t>(ct));
  if (!done.ok()) {
    if (done.code() == Code::kUnavailable) {
      SendError(res, 503, "failed", done.message());
    } else if (done.code() == Code::kConflict) {
      SendError(res, 409, "conflict", done.message());
    } else {
      SendStatus(res, done);
    }
    return;
  }
  const DurableHead head = CatchUpDurableHead();
  SetHeadHeader(res, head);
  SendJson(res, 200,
           {{"rollout_id", id}, {"outcome", outcome_name(outcome)}, {"head", head.ToString()}});
}

void Service::SetRetryAfter(HttpResponse& res) const {
  SetHeader(res, "Retry-After", std::to_string(std::max<std::uint32_t>(1, config_.retry_after_s)));
}

// Each long poll holds a thread of the blocking pool for up to watch_timeout_ms_max: at most a
// quarter of the pool watches at once, so that polls (which need no token) never hold off
// updates, finishes and state reads.
void Service::HandleWatch(const ApiRequest& req, HttpResponse& res) {
  const std::size_t watches_max = std::max<std::size_t>(1, config_.http_threads / 4);
  if (watches_.fetch_add(1) >= watches_max) {
    watches_--;
    metrics_.watches_refused++;
    SetRetryAfter(res);
    SendError(res, 503, "overloaded",
              std::to_string(watches_max) + " long polls already wait (a quarter of http_threads)");
    return;
  }
  struct Leave {
    std::atomic<std::size_t>& waiting;
    ~Leave() { waiting--; }
  } leave{watches_};
  WatchFor(req, res);
}

void Service::WatchFor(const ApiRequest& req, HttpResponse& res) {
  auto after = QueryU64(req, "after", 0, 0, UINT64_MAX);
  auto timeout =
      QueryU64(req, "timeout_ms", config_.watch_timeout_ms_max, 0, config_.watch_timeout_ms_max);
  if (!after.ok() || !timeout.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, after.ok() ? timeout.status() : after.status());
    return;
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(*timeout);
  // Only durable decisions are reported. A notice not yet durable is looked at again within 2 ms
  // (its commit is under way); one that is durable and decided nothing past `after` (an engine
  // observation, an admission under the head) waits for the next notice, or 20 ms: a watch looks
  // at most once per notice or per 20 ms, never in a loop on a notice already seen.
  for (;;) {
    if (step_probe_) step_probe_("watch looked");
    const DurableView looked = CatchUpDurable(false);
    if (looked.decision_seq > *after) break;
    std::unique_lock<std::mutex> lock(lifecycle_mu_);
    if (Clock::now() >= deadline || shutting_down_.load() || failed()) break;
    const std::uint64_t seen = lifecycle_seq_;
    const auto next_look_ms = std::chrono::milliseconds(seen > looked.head.seq ? 2 : 20);
    lifecycle_cv_.wait_until(lock, std::min(deadline, Clock::now() + next_look_ms), [&] {
      return lifecycle_seq_ != seen || shutting_down_.load() || failed();
    });
  }
  const DurableView v = CatchUpDurable(true);
  json j = SummaryJson(v.state, v.head);
  j["seq"] = v.decision_seq;
  j["changed"] = v.decision_seq > *after;
  SetHeadHeader(res, v.head);
  SendJson(res, 200, j);
}

// A page is at most this many bytes of records (and at least one record): each record is
// serialised as it is read, so a page never holds more than one record's JSON tree.
constexpr std::size_t kEventsPageBytesMax = 4u << 20;

// The journal holds prompts and outputs (trajectories): reading it wants the trainer's token.
void Service::HandleEvents(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res)) return;
  auto since = QueryU64(req, "since", 0, 0, UINT64_MAX - 1);
  auto limit = QueryU64(req, "limit", config_.events_page_max, 1, config_.events_page_max);
  if (!since.ok() || !limit.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, since.ok() ? limit.status() : since.status());
    return;
  }
  // Only durable records: the durable head, never what is merely enqueued.
  const DurableHead head = CatchUpDurableHead();
  std::string records = "[";
  std::uint64_t next = *since;
  if (*since < head.seq) {
    const std::uint64_t to = *limit >= head.seq - *since ? head.seq : *since + *limit;
    bool page_full = false;
    Status st = journal_->Scan(*since + 1, to, [&](const journal::Record& r) {
      page_full = next > *since && records.size() >= kEventsPageBytesMax;
      if (page_full) return Status::NotFound("the page is full");  // ends the scan here
      records += (next > *since ? "," : "") + DumpSafe(journal::RecordToJson(r));
      next = r.seq;
      return Status::OK();
    });
    // A durable record that cannot be read is a damaged journal, as for any other read.
    if (IsJournalFailure(st)) FailStop("reading the journal for /v1/events: " + st.ToString());
    if (!st.ok() && !page_full) return SendStatus(res, st);
  }
  records += "]";
  SetHeadHeader(res, head);
  const json tail = {{"next_since", next}, {"head_seq", head.seq}, {"head", head.ToString()}};
  const std::string rest = DumpSafe(tail);  // {"head":...,...}
  SetBody(res, 200, "{\"records\":" + records + "," + rest.substr(1), "application/json");
}

void Service::HandleManifest(const ApiRequest& req, HttpResponse& res) {
  // It opens files (on this host, or the engine's with the reload transfer): only for the
  // trainer, and its errors never quote them.
  if (!Authorized(req, res)) return;
  const std::string source = req.query("source").value_or("");
  Status valid = ValidateSource(source, SourceReaderForTransfer());
  if (!valid.ok()) {
    metrics_.bad_requests++;
    SendStatus(res, valid);
    return;
  }
  // A preflight sends nothing to the engine; here it only computes the source's manifest.
  effects::WeightTransfer& transfer = is_fleet() ? *StayingMember().transfer : *transfer_;
  PreflightObserved p = transfer.Preflight(effects::TransferTarget{"manifest", {}, {}, source});
  if (p.source_manifest_digest.empty()) {
    spdlog::warn("serve: /v1/manifest: no manifest for {}: {}", Esc(source), Esc(p.detail));
    SendError(res, 400, "invalid",
              "no manifest for this source: it is missing, unreadable, busy or not a valid "
              "source of its kind (details in the executor's log)");
    return;
  }
  SendJson(res, 200, {{"source", source}, {"manifest_digest", p.source_manifest_digest}});
}

void Service::HandleHealthz(const ApiRequest&, HttpResponse& res) {
  // Liveness: the process serves. After a fail-stop it must be restarted: 503.
  if (failed()) {
    SendJson(res, 503, {{"ok", false}, {"reason", "fail-stopped: " + failure()}});
    return;
  }
  if (is_fleet()) {
    SendJson(res, 200, {{"ok", true}, {"engines", fleet_members_.size()}});
    return;
  }
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  journal_->ReadState([&lifecycle](const State& st) { lifecycle = st.lifecycle; });
  SendJson(res, 200, {{"ok", true}, {"lifecycle", lifecycle_name(lifecycle)}});
}

std::string Service::NotReadyReason() const {
  if (is_fleet()) return FleetNotReadyReason();
  if (failed()) return "fail-stopped: " + failure();
  if (shutting_down_.load()) return "shutting down";
  std::string blocked;
  journal_->ReadState([&](const State& s) {
    if (s.lifecycle == Lifecycle::kTainted) {
      blocked =
          "engine is TAINTED" +
          (s.taint ? std::string(" (") + cause_name(s.taint->cause) + ": " + s.taint->detail + ")"
                   : std::string()) +
          "; rolloutcore replay -- " + text::shell_quote(config_.journal_path) + " explains it";
    } else if (!admits(s)) {
      blocked = admission_block_reason(s);
    }
  });
  if (!blocked.empty()) return blocked;
  if (!watch_.up.load() && watch_.last_probe_wall_ms.load() != 0) {
    return "the engine did not answer the last probe";
  }
  return "";
}

void Service::HandleReadyz(const ApiRequest&, HttpResponse& res) {
  // Readiness: 200 only while rollouts can be served safely.
  const std::string why = NotReadyReason();
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  bool reachable = false;
  journal_->ReadState([&](const State& s) {
    lifecycle = s.lifecycle;
    reachable = s.engine_reachable;
  });
  json j = {{"ready", why.empty()},
            {"lifecycle", lifecycle_name(lifecycle)},
            {"engine_reachable", reachable},
            {"journal_failed", failed()}};
  if (!why.empty()) j["reason"] = why;
  SendJson(res, why.empty() ? 200 : 503, j);
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
  r.Blocking(verb::post, "/v1/restores", bind(&Service::HandleRestore));
  r.Blocking(verb::post, "/v1/sleep", bind(&Service::HandleSleep));
  r.Blocking(verb::post, "/v1/wake", bind(&Service::HandleWake));
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
