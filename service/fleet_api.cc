// The trainer API of a fleet (docs/api.md, "A fleet"):
//   GET    /v1/state                      the fleet, engine by engine (durable view); ?full
//   POST   /v1/fleet/updates              a fleet update, all or rolling; answers its end
//   POST   /v1/fleet/updates/<id>/cancel  members not started are skipped; once the update
//                                         ended, its recorded end
//   DELETE /v1/fleet/engines/<name>       the engine admits nothing more and leaves once idle
//   /healthz, /readyz (ready while some engine admits), /metrics, and the proxy.
//   GET    /v1/manifest                   a source's manifest digest (the first member's transfer)
// The one-engine routes (updates, restores, sleep, explicit rollouts, watch, events)
// answer 409 naming the fleet's: they would act on one engine without the fleet's rules.
#include <mutex>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "journal/json.h"
#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"

namespace rc::service {
namespace {

using namespace internal;  // NOLINT: the service's own helpers
using nlohmann::json;

// The HTTP status of a fleet update's end: every member committed (200), some did (207: read
// each engine's outcome), none did (422).
int FleetOutcomeHttpStatus(FleetOutcome o) {
  switch (o) {
    case FleetOutcome::kCommitted:
      return 200;
    case FleetOutcome::kPartial:
      return 207;
    case FleetOutcome::kRefused:
      return 422;
  }
  return 500;
}

json MemberJson(const FleetState& f, const std::string& name, const State& s,
                std::uint32_t outstanding) {
  json j = {{"lifecycle", lifecycle_name(s.lifecycle)},
            {"committed", journal::WeightVersionToJson(s.committed)},
            {"identity", journal::WeightIdentityToJson(s.committed_identity)},
            {"admitting", fleet_admits(f, name)},
            {"leaving", f.leaving.count(name) != 0},
            {"active_rollouts", s.active.size()},
            {"outstanding", outstanding}};
  const std::optional<std::uint64_t> g = fleet_generation(f, name);
  j["generation"] = g ? json(*g) : json(nullptr);
  if (s.update) {
    j["update_id"] = s.update->update_id;
    j["stalled"] = plan_stalled(s);
  }
  if (s.lifecycle == Lifecycle::kTainted && s.taint) {
    j["taint"] = {{"cause", cause_name(s.taint->cause)},
                  {"update_id", s.taint->update_id},
                  {"detail", s.taint->detail}};
  }
  return j;
}

json FleetUpdateJson(const FleetUpdate& u) {
  json members = json::object();
  for (const auto& [name, status] : u.members) members[name] = member_status_name(status);
  json j = {{"update_id", u.request.update_id},
            {"mode", fleet_update_mode_name(u.request.mode)},
            {"target_label", u.request.target_label},
            {"members", std::move(members)}};
  if (u.cancelled) j["cancelled"] = *u.cancelled;
  return j;
}

// What SourceChecked checks of a fleet update: its source and declared identity.
UpdateRequested member_update_request_of(const FleetUpdateRequested& r) {
  return UpdateRequested{r.update_id, r.target_label, r.identity, r.source_uri, r.expected_digest};
}

json FleetEndJson(const FleetUpdateEnded& e) {
  return {{"update_id", e.update_id}, {"outcome", fleet_outcome_name(e.outcome)},
          {"committed", e.committed}, {"refused", e.refused},
          {"tainted", e.tainted},     {"skipped", e.skipped},
          {"stalled", e.stalled},     {"reason", e.reason}};
}

// Whether a fleet update's end was closed by the shutdown's own cancel
// (CancelFleetUpdateAtShutdown): the fold's end names a cancel's reason after "cancelled: ".
bool EndedByShutdownCancel(const FleetUpdateEnded& e) {
  return e.reason == std::string("cancelled: ") + kShutdownCancelReason;
}

// Whether a fleet update that ended refused once the MutationGate closed was refused by the
// shutdown, as one engine's plan is (Service::RefusedAtShutdown): a member's runner gave its plan
// up to the stop (a drain cut short, a mutation the gate kept from the engine), or no member ran
// a plan that ended it and the shutdown's own cancel skipped them all. One refused on its own
// grounds (too few engines for min_healthy, its members refused by their engines, e.g. a source
// whose manifest is not the declared one) answers as any refusal does.
bool RefusedByShutdown(const FleetUpdateEnded& e, bool member_plan_stopped) {
  if (e.outcome != FleetOutcome::kRefused) return false;
  const bool only_skipped = e.refused == 0 && e.tainted == 0 && e.stalled == 0;
  return member_plan_stopped || (only_skipped && EndedByShutdownCancel(e));
}

json AlreadyCancelledJson(const std::string& update_id, const std::string& reason) {
  return {{"update_id", update_id}, {"cancelled", true}, {"reason", reason}, {"already", true}};
}

using EndedFleetUpdate = EndedPlans<FleetUpdateRequested, FleetUpdateEnded>::Ended;

// The newest fleet update of this id that the journal holds, with its end, among the last
// `records_max` records up to `durable_seq`; nullopt when it holds none, or none that ended.
Result<std::optional<EndedFleetUpdate>> LookUpFleetEnd(journal::Journal& j,
                                                       const std::string& update_id,
                                                       std::uint64_t durable_seq,
                                                       std::uint64_t records_max) {
  if (durable_seq == 0) return std::optional<EndedFleetUpdate>();  // Scan's 0 is the head
  std::optional<FleetUpdateRequested> request;
  std::optional<FleetUpdateEnded> ended;
  const std::uint64_t from = durable_seq > records_max ? durable_seq - records_max + 1 : 1;
  RC_RETURN_IF_ERROR(j.Scan(from, durable_seq, [&](const journal::Record& r) {
    if (const auto* q = std::get_if<FleetUpdateRequested>(&r.event);
        q != nullptr && q->update_id == update_id) {
      request = *q;
      ended.reset();
    } else if (const auto* e = std::get_if<FleetUpdateEnded>(&r.event);
               e != nullptr && e->update_id == update_id && request && !ended) {
      ended = *e;
    }
    return Status::OK();
  }));
  if (!request || !ended) return std::optional<EndedFleetUpdate>();
  return std::optional<EndedFleetUpdate>(EndedFleetUpdate{*request, *ended});
}

// The end of a fleet update as this process remembers it, else as the journal holds it within the
// lookup window (then remembered). That lookup may read millions of records, so it runs one at a
// time under `lookup_mu`, the turn a refused source's id is looked up in: Busy while another runs.
Result<std::optional<EndedFleetUpdate>> RecordedFleetEnd(
    EndedPlans<FleetUpdateRequested, FleetUpdateEnded>& remembered, std::mutex& lookup_mu,
    journal::Journal& j, const std::string& update_id, std::uint64_t durable_seq) {
  if (std::optional<EndedFleetUpdate> e = remembered.Find(update_id)) return e;
  const std::unique_lock<std::mutex> turn(lookup_mu, std::try_to_lock);
  if (!turn.owns_lock()) {
    return Status::Busy(
        "whether this fleet update ended waits for another request's journal lookup (one at a "
        "time); retry");
  }
  Result<std::optional<EndedFleetUpdate>> found =
      LookUpFleetEnd(j, update_id, durable_seq, kUpdateLookupRecordsMax);
  if (found.ok() && found->has_value()) {
    remembered.Remember(update_id, (*found)->request, (*found)->ended);
  }
  return found;
}

}  // namespace

void Service::HandleFleetState(const ApiRequest& req, HttpResponse& res) {
  const DurableView v = CatchUpDurable(true);
  SetHeadHeader(res, v.head);
  json j;
  if (req.query("full").has_value()) {
    j = journal::FleetStateToJson(v.fleet);
  } else {
    const FleetState& f = v.fleet;
    json engines = json::object();
    for (const auto& [name, s] : f.engines) {
      const auto m = fleet_members_.find(name);
      const std::uint32_t outstanding =
          m == fleet_members_.end() ? 0 : m->second->outstanding.load();
      engines[name] = MemberJson(f, name, s, outstanding);
      engines[name]["configured"] = m != fleet_members_.end();
      engines[name]["retiring"] = m != fleet_members_.end() && m->second->retire;
    }
    const std::optional<std::uint64_t> newest = newest_held_generation(f);
    j = {{"engines", std::move(engines)},
         {"policy",
          {{"staleness_max", f.policy.staleness_max}, {"min_serving", f.policy.min_serving}}},
         {"newest_generation", newest ? json(*newest) : json(nullptr)},
         {"update", f.update ? FleetUpdateJson(*f.update) : json(nullptr)},
         {"fleet_updates_ended", f.fleet_updates_ended}};
  }
  j["head_seq"] = v.head.seq;
  j["head"] = v.head.ToString();
  SendJson(res, 200, j);
}

void Service::HandleFleetUpdate(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res) || RefusedFailStopped(res)) return;
  Result<FleetUpdateRequested> request =
      ParseFleetUpdateBody(req.body(), SourceReader::kEngine);  // the source: FleetSourceChecked
  if (!request.ok()) {
    metrics_.bad_requests++;
    return SendError(res, 400, "invalid", request.status().message());
  }
  // A re-POST of an update that ended answers its recorded end before the source is read or the
  // slot asked for: its source may be gone, and another plan may hold the slot now.
  if (ReplayedIfFleetEnded(*request, res)) return;
  if (!FleetSourceChecked(*request, res)) return;
  PlanSlot slot(*this);
  if (!TookUpdateSlot(slot, metrics_.updates_conflict, res, request->update_id,
                      [&](HttpResponse& r) { return ReplayedIfFleetEnded(*request, r); })) {
    return;
  }
  // It may have fail-stopped while we read the source, or ended while we waited for the slot.
  if (RefusedFailStopped(res) || ReplayedIfFleetEnded(*request, res)) return;
  spdlog::info("serve: fleet update '{}' ({}) to '{}' requested", Esc(request->update_id),
               fleet_update_mode_name(request->mode), Esc(request->target_label));
  const Result<FleetUpdateEnded> ended = DrivePlan("fleet update", request->update_id,
                                                   [&] { return fleet_runner_->Update(*request); });
  AnswerFleetUpdate(*request, ended, res);
}

bool Service::ReplayedIfFleetEnded(const FleetUpdateRequested& request, HttpResponse& res) {
  const std::optional<EndedPlans<FleetUpdateRequested, FleetUpdateEnded>::Ended> e =
      ended_fleet_updates_.Find(request.update_id);
  if (!e) return false;
  RC_CHECK(e->request.update_id == request.update_id && e->ended.update_id == request.update_id);
  if (!(e->request == request)) {
    metrics_.updates_conflict++;
    SendError(res, 409, "conflict",
              "update_id '" + request.update_id +
                  "' was already used for another fleet update (different body); choose a new "
                  "update_id");
    return true;
  }
  metrics_.updates_replayed++;
  spdlog::info("serve: fleet update '{}' re-POSTed: answering its recorded end ({})",
               Esc(request.update_id), fleet_outcome_name(e->ended.outcome));
  SendFleetOutcome(e->ended, /*replayed=*/true, res);
  return true;
}

// As for one engine: a source that cannot be read, or whose manifest is not the declared one,
// never drains an engine. A request the journal already holds passes (a re-POST reads its
// recorded end, even once its source is gone).
bool Service::FleetSourceChecked(const FleetUpdateRequested& request, HttpResponse& res) {
  HttpResponse refusal;
  if (SourceChecked(member_update_request_of(request), refusal)) return true;
  std::unique_lock<std::mutex> turn;
  if (!TookLookupTurn(turn, res)) return false;
  if (FleetUpdateJournaled(request.update_id)) return true;
  metrics_.bad_requests++;
  res = std::move(refusal);
  return false;
}

// Whether the journal holds a fleet update of this id: open now, or requested within the last
// kUpdateLookupRecordsMax records.
bool Service::FleetUpdateJournaled(const std::string& update_id) {
  bool open = false;
  journal_->ReadFleetState(
      [&](const FleetState& f) { open = f.update && f.update->request.update_id == update_id; });
  if (open) return true;
  auto found = LookUpRequest<FleetUpdateRequested>(
      *journal_, update_id, CatchUpDurableHead().seq, kUpdateLookupRecordsMax,
      [](const FleetUpdateRequested& q) { return q.update_id; });
  return found.ok() && found->request.has_value();
}

// "" once no plan runs.
std::string Service::SwapRunningUpdate(const std::string& update_id) {
  std::lock_guard<std::mutex> g(update_id_mu_);
  std::string before = std::move(running_update_id_);
  running_update_id_ = update_id;
  return before;
}

// The end as the fold decided it, with the fleet after it; or why there is none: a refusal
// before anything was journaled (4xx), or a journal failure or an update that could not end
// (fail-stop, 503 outcome_unknown: a member's plan is stuck open, so nothing more may be decided
// until a restart recovers it; the same request then reads the recorded end). Once serve has
// fail-stopped, even an end the executor saw is not answered: the fleet around it may be ahead
// of what is durable.
void Service::AnswerFleetUpdate(const FleetUpdateRequested& request,
                                const Result<FleetUpdateEnded>& ended, HttpResponse& res) {
  if (!ended.ok()) {
    const Status& st = ended.status();
    // Decided from the journal, not the code: stuck only while this update is still open there.
    bool open = false;
    journal_->ReadFleetState([&](const FleetState& f) {
      open = f.update && f.update->request.update_id == request.update_id;
    });
    // A conflict refused this request before it journaled anything (the same id with another
    // body), even while the update of that id is open (a restart going on with it).
    const bool refused_here = st.code() == Code::kConflict;
    if ((!open || refused_here) && !IsJournalFailure(st) && !failed()) {
      if (IsUnjournaledRefusal(st.code())) {
        CountUnjournaledRefusal(st.code(), {&metrics_.updates_refused, &metrics_.updates_invalid,
                                            &metrics_.updates_conflict});
      }
      return SendStatus(res, st);
    }
    FailStop("fleet update '" + request.update_id + "' did not end: " + st.ToString());
    return SendFleetOutcomeUnknown(request.update_id, res);
  }
  if (failed()) return SendFleetOutcomeUnknown(request.update_id, res);
  const FleetUpdateEnded& e = *ended;
  RC_CHECK(e.update_id == request.update_id);
  ended_fleet_updates_.Remember(request.update_id, request, e);
  (e.outcome == FleetOutcome::kCommitted ? metrics_.updates_committed
   : e.tainted > 0                       ? metrics_.updates_tainted
                                         : metrics_.updates_refused)++;
  if (e.outcome != FleetOutcome::kCommitted) {
    spdlog::warn(
        "serve: fleet update '{}' {} (committed {}, refused {}, tainted {}, skipped {}, stalled "
        "{}){}{}; {}",
        Esc(e.update_id), fleet_outcome_name(e.outcome), e.committed, e.refused, e.tainted,
        e.skipped, e.stalled, e.reason.empty() ? "" : ": ", Esc(e.reason),
        ReplayHint(config_.journal_path));
  }
  SendFleetOutcome(e, /*replayed=*/false, res);
}

// The end with every engine as the durable fleet has it now. One the shutdown refused (its members
// given up to the stop, or skipped by the shutdown's own cancel) is answered 503 shutting_down,
// with the same body; any other keeps its outcome's status.
void Service::SendFleetOutcome(const FleetUpdateEnded& e, bool replayed, HttpResponse& res) {
  const DurableView v = CatchUpDurable(true);
  SetHeadHeader(res, v.head);
  json j = FleetEndJson(e);
  json engines = json::object();
  for (const auto& [name, s] : v.fleet.engines) {
    engines[name] = MemberJson(v.fleet, name, s, 0);
    engines[name].erase("outstanding");
  }
  j["engines"] = std::move(engines);
  j["head_seq"] = v.head.seq;
  j["replayed"] = replayed;
  if (!replayed && mutation_gate_.closed() &&
      RefusedByShutdown(e, fleet_runner_->MemberPlanStopped(e.update_id))) {
    j["error"] = {{"type", "shutting_down"},
                  {"message",
                   "serve is shutting down: this fleet update ended refused, as recorded "
                   "(`reason` says why, `engines` where each is now); request it again, under a "
                   "new id, once serve is back"}};
    SetRetryAfter(res);
    SendJson(res, 503, j);
    return;
  }
  SendJson(res, FleetOutcomeHttpStatus(e.outcome), j);
}

void Service::SendFleetOutcomeUnknown(const std::string& update_id, HttpResponse& res) {
  RC_CHECK(failed());
  metrics_.updates_outcome_unknown++;
  const json body = {
      {"error",
       {{"type", "outcome_unknown"},
        {"message", "the executor fail-stopped while this fleet update ran (" + failure() +
                        "); after a restart, POST the same request again to read its end"}}},
      {"update_id", update_id}};
  SendJson(res, 503, body);
}

void Service::HandleFleetCancel(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res) || RefusedFailStopped(res)) return;
  RC_CHECK(req.captures.size() == 1);
  const std::string& id = req.captures[0];
  Result<std::string> reason = ParseFleetCancelBody(req.body());
  if (!reason.ok()) {
    metrics_.bad_requests++;
    return SendError(res, 400, "invalid", reason.status().message());
  }
  const Status st = fleet_runner_->Cancel(id, *reason);
  if (IsJournalFailure(st)) FailStop("cancel of fleet update '" + id + "': " + st.ToString());
  const bool retry = st.code() == Code::kConflict || st.code() == Code::kNotFound;
  if (retry && AnsweredAlreadyCancelled(id, res)) return;
  if (!st.ok()) return SendStatus(res, st);
  spdlog::warn("serve: fleet update '{}' cancelled: {}", Esc(id), Esc(*reason));
  SendJson(res, 202, {{"update_id", id}, {"cancelled", true}, {"reason", *reason}});
}

// A cancel is retried (its answer lost) and may come after its update ended. The fold refuses a
// second cancel (Conflict): answered 202 again, with the reason recorded. It refuses the cancel of
// an update no longer in flight (NotFound): one the journal holds ended is answered its recorded
// end, as a re-POST of it is (200, 207 or 422 by its outcome, "replayed": true); an id it holds
// no fleet update of stays the fold's 404. The fold may be ahead of what is durable (the cancel or
// the end it refused on still committing): that is made durable first, so the answer agrees with
// the fold's refusal and acknowledges nothing a crash could take back.
bool Service::AnsweredAlreadyCancelled(const std::string& update_id, HttpResponse& res) {
  if (const Status durable = journal_->WaitForHead(); !durable.ok()) {
    FailStop("cancel of fleet update '" + update_id + "': " + durable.ToString());
    return RefusedFailStopped(res);
  }
  const DurableView v = CatchUpDurable(true);
  const std::optional<FleetUpdate>& u = v.fleet.update;
  if (u && u->request.update_id == update_id) {
    if (u->cancelled) SendJson(res, 202, AlreadyCancelledJson(update_id, *u->cancelled));
    return u->cancelled.has_value();
  }
  const Result<std::optional<EndedFleetUpdate>> ended =
      RecordedFleetEnd(ended_fleet_updates_, refusal_lookup_mu_, *journal_, update_id, v.head.seq);
  if (ended.status().code() == Code::kBusy) {
    SetRetryAfter(res);
    SendError(res, 503, "overloaded", ended.status().message());
    return true;
  }
  if (!ended.ok()) {
    FailStop("reading fleet update '" + update_id + "' back: " + ended.status().ToString());
    return RefusedFailStopped(res);
  }
  if (!ended->has_value()) return false;
  SendFleetOutcome((*ended)->ended, /*replayed=*/true, res);
  return true;
}

void Service::HandleFleetRemove(const ApiRequest& req, HttpResponse& res) {
  if (!Authorized(req, res) || RefusedFailStopped(res)) return;
  RC_CHECK(req.captures.size() == 1);
  const std::string& engine = req.captures[0];
  const Status st = fleet_runner_->Remove(engine);
  if (IsJournalFailure(st)) FailStop("removal of engine '" + engine + "': " + st.ToString());
  if (st.code() == Code::kConflict && AnsweredAlreadyLeaving(engine, res)) return;
  if (!st.ok()) return SendStatus(res, st);
  spdlog::warn("serve: engine {} is leaving the fleet: nothing more is admitted to it",
               Esc(engine));
  SendJson(res, 202, {{"engine", engine}, {"leaving", true}});
}

// The fold refuses the removal of an engine that already leaves (Conflict): a retry whose first
// 202 was lost is answered 202 again. Read from the durable fleet, as a cancel's retry is.
bool Service::AnsweredAlreadyLeaving(const std::string& engine, HttpResponse& res) {
  if (CatchUpDurable(true).fleet.leaving.count(engine) == 0) return false;
  SendJson(res, 202, {{"engine", engine}, {"leaving", true}, {"already", true}});
  return true;
}

void Service::HandleFleetReadyz(const ApiRequest&, HttpResponse& res) {
  const std::string why = FleetNotReadyReason();
  std::size_t admitting = 0;
  journal_->ReadFleetState([&](const FleetState& f) {
    for (const auto& [name, m] : fleet_members_) {
      admitting += !m->retire && fleet_admits(f, name) ? 1 : 0;
    }
  });
  json j = {{"ready", why.empty()},
            {"engines_admitting", admitting},
            {"engines", fleet_members_.size()},
            {"journal_failed", failed()}};
  if (!why.empty()) j["reason"] = why;
  SendJson(res, why.empty() ? 200 : 503, j);
}

void Service::HandleNotForFleet(const ApiRequest&, HttpResponse& res) {
  SendError(res, 409, "fleet",
            "this executor drives a fleet: use GET /v1/state, POST /v1/fleet/updates, POST "
            "/v1/fleet/updates/<id>/cancel and DELETE /v1/fleet/engines/<name> (docs/fleet.md)");
}

HttpRouter Service::FleetRoutes() {
  using bhttp::verb;
  HttpRouter r;
  auto bind = [this](void (Service::*fn)(const ApiRequest&, HttpResponse&)) {
    return [this, fn](const ApiRequest& req, HttpResponse& res) { (this->*fn)(req, res); };
  };
  r.Blocking(verb::get, "/healthz", bind(&Service::HandleHealthz));
  r.Blocking(verb::get, "/readyz", bind(&Service::HandleFleetReadyz));
  r.Blocking(verb::get, "/v1/state", bind(&Service::HandleFleetState));
  r.Blocking(verb::post, "/v1/fleet/updates", bind(&Service::HandleFleetUpdate));
  r.Blocking(verb::post, "/v1/fleet/updates/*/cancel", bind(&Service::HandleFleetCancel));
  r.Blocking(verb::delete_, "/v1/fleet/engines/*", bind(&Service::HandleFleetRemove));
  r.Blocking(verb::get, "/metrics", bind(&Service::HandleMetrics));
  r.Blocking(verb::get, "/v1/manifest", bind(&Service::HandleManifest));
  const std::pair<verb, const char*> one_engine[] = {
      {verb::get, "/v1/version"},        {verb::post, "/v1/updates"},
      {verb::post, "/v1/restores"},      {verb::post, "/v1/sleep"},
      {verb::post, "/v1/wake"},          {verb::post, "/v1/rollouts"},
      {verb::delete_, "/v1/rollouts/*"}, {verb::post, "/v1/rollouts/*/lease"},
      {verb::get, "/v1/watch"},          {verb::get, "/v1/events"}};
  for (const auto& [method, path] : one_engine) {
    r.Blocking(method, path, bind(&Service::HandleNotForFleet));
  }
  AddProxyRoutes(r);
  return r;
}

}  // namespace rc::service
