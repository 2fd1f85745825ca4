// The fleet fold (see fleet.h): per-engine events go through the single-engine fold of their
// engine after the fleet's own rules; fleet events change membership, policy and fleet updates.
#include "statemachine/fleet.h"

#include <algorithm>

#include "statemachine/overloaded.h"
#include "statemachine/text.h"

namespace rc {

bool same_weight_layout(const WeightDigest& a, const WeightDigest& b) {
  return a.present() && b.present() && a.algorithm == b.algorithm && a.bytes == b.bytes &&
         a.tensors.size() == b.tensors.size() &&
         std::equal(a.tensors.begin(), a.tensors.end(), b.tensors.begin(),
                    [](const TensorDigest& x, const TensorDigest& y) { return x.name == y.name; });
}

namespace {

const State kUnbornEngine{};  // what the implicit engine "" is before its first event

std::string quoted(const std::string& engine) { return "engine '" + engine + "'"; }

// The engine a per-engine event names: a member, or the implicit "" of a journal of one engine,
// born by the journal's very first event (never after a fleet event).
Result<const State*> engine_of(const FleetState& f, const std::string& engine) {
  if (auto it = f.engines.find(engine); it != f.engines.end()) return &it->second;
  if (engine.empty() && f.engines.empty() && !f.named && f.events == 0) return &kUnbornEngine;
  return Status::NotFound("no " + quoted(engine) + " in the fleet");
}

bool is_member_in_flight(const FleetState& f, const std::string& engine) {
  if (!f.update) return false;
  auto it = f.update->members.find(engine);
  return it != f.update->members.end() && !member_ended(it->second);
}

std::size_t serving_except(const FleetState& f, const std::string& except) {
  std::size_t n = 0;
  for (const auto& [id, s] : f.engines) n += id != except && fleet_admits(f, id) ? 1 : 0;
  return n;
}

// Whether a leaving engine may go now: no rollout holds it, and no plan, or one that nothing
// moves any more (an engine that died paused leaves with its plan open; the journal keeps it).
bool can_leave(const State& s) { return s.active.empty() && (!s.update || plan_stalled(s)); }

// A member whose own plan is the fleet update's: updating, or stalled in it.
bool plan_is_members(MemberStatus m) {
  return m == MemberStatus::kUpdating || m == MemberStatus::kStalled;
}

// The members whose plan moves: a stalled one takes no place in a rolling batch.
std::size_t updating_members(const FleetUpdate& u) {
  return static_cast<std::size_t>(std::count_if(u.members.begin(), u.members.end(), [](auto& m) {
    return m.second == MemberStatus::kUpdating;
  }));
}

// The identity `label` names in the fleet: served already, or the target of a plan or bootstrap
// in flight on some engine (two engines must never publish one label for different weights).
const WeightIdentity* label_identity(const FleetState& f, const std::string& label) {
  if (auto it = f.labels.find(label); it != f.labels.end()) return &it->second;
  for (const auto& [id, s] : f.engines) {
    if (s.update && s.update->target.label == label) return &s.update->identity;
    if (s.bootstrap && s.bootstrap->label == label) return &s.bootstrap->identity;
  }
  if (f.update && f.update->request.target_label == label) return &f.update->request.identity;
  return nullptr;
}

// A label names one identity for the fleet's life, whichever engine served it.
Status check_fleet_label(const FleetState& f, const std::string& label, const WeightIdentity& id) {
  const WeightIdentity* known = label_identity(f, label);
  if (known == nullptr || *known == id) return Status::OK();
  return Status::InvalidArgument("label '" + label +
                                 "' names other weights in this fleet (checkpoint '" +
                                 known->checkpoint + "')");
}

// The label of the newest generation an untainted engine holds ("" when none holds one).
std::string newest_held_label(const FleetState& f) {
  const std::optional<std::uint64_t> newest = newest_held_generation(f);
  if (!newest) return {};
  for (const auto& [label, g] : f.label_generation) {
    if (g == *newest) return label;
  }
  return {};
}

// The combined digest `s` holds for `label`: the one recorded when it served `label`; else, in a
// plan to `label` still open that may publish it, the one its validation read while paused or the
// one it is held to. nullptr when none: such a plan may still publish `label` on any digest.
const std::string* label_digest_of(const State& s, const std::string& label) {
  if (const auto it = s.label_digests.find(label); it != s.label_digests.end()) return &it->second;
  if (!s.update || s.update->target.label != label || s.update->aborting ||
      s.update->keeps_version()) {
    return nullptr;
  }
  const UpdatePlan& u = *s.update;
  if (u.validated && u.observed_digest.present()) return &u.observed_digest.combined;
  return u.expected_digest.empty() ? nullptr : &u.expected_digest;
}

// Whether an engine of the fleet holds `digest` for `label` (label_digest_of).
bool label_digest_held(const FleetState& f, const std::string& label, const std::string& digest) {
  return std::any_of(f.engines.begin(), f.engines.end(), [&](const auto& e) {
    const std::string* held = label_digest_of(e.second, label);
    return held != nullptr && *held == digest;
  });
}

// An engine other than `except` whose committed digest is of `layout` and whose plan to `label`
// may still publish it on a digest no engine holds (label_digest_of gives none): the first of its
// layout, whose validation reads the digest the rest of the layout is then held to. nullptr when
// none, or `layout` is absent (an engine that computes no digest has no known layout).
const std::string* layout_pioneer(const FleetState& f, const WeightDigest& layout,
                                  const std::string& label, const std::string& except) {
  for (const auto& [id, s] : f.engines) {
    if (id == except || !s.update || s.update->target.label != label) continue;
    if (s.update->aborting || s.update->keeps_version() || label_digest_of(s, label) != nullptr) {
      continue;
    }
    if (same_weight_layout(layout, s.committed_digest)) return &id;
  }
  return nullptr;
}

// A joining engine starts where the fleet is: on the newest label an untainted engine holds, and
// when it is held to a digest, one an engine of the fleet holds for that label (label_digest_of:
// recorded, or read validating a plan to it still open, as join_digest finds it). Accepting a
// digest of an open plan only widens what the fold accepted before (it took recorded ones only):
// a request it refused was never journaled, so every journal folds as it did.
Status check_bootstrap(const FleetState& f, const BootstrapRequested& b) {
  RC_RETURN_IF_ERROR(check_fleet_label(f, b.label, b.identity));
  RC_RETURN_IF_ERROR(check_digest("expected_digest", b.expected_digest, false));
  if (!b.expected_digest.empty() && !label_digest_held(f, b.label, b.expected_digest)) {
    return Status::Rejected("no engine of the fleet holds digest " + b.expected_digest + " for '" +
                            b.label + "'");
  }
  const std::string newest = newest_held_label(f);
  if (newest.empty() || newest == b.label) return Status::OK();
  return Status::Rejected("a joining engine bootstraps at the fleet's newest label '" + newest +
                          "', not '" + b.label + "'");
}

// Keeping `min_serving` engines serving: an engine that serves may stop only if enough others do.
Status check_min_serving(const FleetState& f, const std::string& engine, const char* what) {
  if (!fleet_admits(f, engine)) return Status::OK();
  const std::size_t others = serving_except(f, engine);
  if (others >= f.policy.min_serving) return Status::OK();
  return Status::Rejected(std::string(what) + " of " + quoted(engine) + " would leave " +
                          std::to_string(others) + " engines serving; min_serving is " +
                          std::to_string(f.policy.min_serving));
}

// The digest a member's update may be held to: the fleet update's, or, when it names none, one an
// engine of the fleet holds for the target (layout_digest picks its layout's). This only widens
// what the fold accepts: a request it refused before was never journaled, so every journal folds
// as it did and the fold rules keep their version. Which digest a new request must carry is
// check_new_requests' rule (check_member_digest).
bool member_digest_allowed(const FleetState& f, const FleetUpdateRequested& r,
                           const std::string& digest) {
  if (digest == r.expected_digest) return true;
  return r.expected_digest.empty() && label_digest_held(f, r.target_label, digest);
}

// A member's own update: exactly the fleet update's target, when the mode allows it.
Status check_member_update(const FleetState& f, const std::string& engine,
                           const UpdateRequested& u) {
  const FleetUpdate& fu = *f.update;
  auto it = fu.members.find(engine);
  if (it == fu.members.end() || it->second != MemberStatus::kPending) {
    return Status::Rejected(quoted(engine) + " is not a pending member of fleet update '" +
                            fu.request.update_id + "'");
  }
  const FleetUpdateRequested& r = fu.request;
  if (u.target_label != r.target_label || !(u.identity == r.identity) ||
      u.source_uri != r.source_uri) {
    return Status::InvalidArgument("a member's update must carry fleet update '" + r.update_id +
                                   "''s label, identity and source");
  }
  if (!member_digest_allowed(f, r, u.expected_digest)) {
    return Status::InvalidArgument(
        "a member's update must carry fleet update '" + r.update_id +
        "''s expected digest or, when it names none, one an engine of the fleet holds for '" +
        r.target_label + "'");
  }
  if (r.mode == FleetUpdateMode::kAll) return Status::OK();
  if (updating_members(fu) >= r.batch_max) {
    return Status::Rejected("rolling update '" + r.update_id + "' already updates " +
                            std::to_string(r.batch_max) + " engines at once");
  }
  return check_min_serving(f, engine, "rolling update");
}

// An update or sleep of the engine's own, outside any fleet update it belongs to.
Status check_own_plan(const FleetState& f, const std::string& engine, const char* what) {
  if (is_member_in_flight(f, engine)) {
    return Status::Rejected(quoted(engine) + " belongs to fleet update '" +
                            f.update->request.update_id + "'");
  }
  return check_min_serving(f, engine, what);
}

Status check_update(const FleetState& f, const std::string& engine, const UpdateRequested& u) {
  if (f.leaving.count(engine) != 0) return Status::Rejected(quoted(engine) + " is being removed");
  RC_RETURN_IF_ERROR(check_fleet_label(f, u.target_label, u.identity));
  if (f.update && u.update_id == f.update->request.update_id) {
    return check_member_update(f, engine, u);
  }
  return check_own_plan(f, engine, "update");
}

Status check_admission(const FleetState& f, const std::string& engine, const RolloutAdmitted& a) {
  if (std::string why = fleet_admission_block_reason(f, engine); !why.empty()) {
    return Status::Rejected(why);
  }
  for (const auto& [id, s] : f.engines) {
    if (id != engine && s.active.count(a.rollout_id) != 0) {
      return Status::Conflict("rollout '" + a.rollout_id + "' is active on " + quoted(id));
    }
  }
  return Status::OK();
}

// A leaving engine starts nothing: no plan may keep it from being removed once idle.
bool starts_a_plan(const Event& e) {
  return std::holds_alternative<UpdateRequested>(e) ||
         std::holds_alternative<RestoreRequested>(e) || std::holds_alternative<SleepRequested>(e) ||
         std::holds_alternative<WakeRequested>(e) || std::holds_alternative<BootstrapRequested>(e);
}

// The fleet's rules for one per-engine event, before its own fold sees it.
Status check_engine_rules(const FleetState& f, const std::string& engine, const Event& e) {
  if (f.leaving.count(engine) != 0 && starts_a_plan(e)) {
    return Status::Rejected(quoted(engine) + " is being removed");
  }
  return std::visit(Overloaded{
                        [&](const RolloutAdmitted& a) { return check_admission(f, engine, a); },
                        [&](const BootstrapRequested& b) { return check_bootstrap(f, b); },
                        [&](const UpdateRequested& u) { return check_update(f, engine, u); },
                        [&](const SleepRequested&) { return check_own_plan(f, engine, "sleep"); },
                        [&](const auto&) { return Status::OK(); },
                    },
                    e);
}

void note_label(FleetState& f, const std::string& label, const WeightIdentity& identity) {
  if (f.label_generation.count(label) != 0) return;
  f.label_generation[label] = f.next_generation++;
  f.labels[label] = identity;
}

// Whether the engine's plan is stalled once `e`'s group is folded, `s` being the state after `e`.
// An input's decisions follow it in its group and may move the plan on: an observation that
// succeeds on the last attempt leaves no attempt until its StateChanged gives the next effect its
// own. A decision is judged with its input. Copies the engine only for a non-binding input that
// derives decisions: a handful per update.
bool stalled_at_rest(const State& s, const Event& e) {
  const Family family = family_of(e);
  if (family == Family::kDecision) return false;
  if (family == Family::kBinding) return plan_stalled(s);  // bindings derive no decisions
  const std::vector<Event> decisions = derive_decisions(s, e);
  if (decisions.empty()) return plan_stalled(s);
  State rest = s;
  for (const Event& d : decisions) {
    if (!apply(rest, d).ok()) return false;  // the group is refused whole; nothing stalls
  }
  return plan_stalled(rest);
}

bool member_stalled(const FleetUpdateRequested& r, const State& s, const Event& e) {
  return r.stall_judged_per_group ? stalled_at_rest(s, e) : plan_stalled(s);
}

void note_member(FleetState& f, const std::string& engine, const State& s, const Event& e) {
  if (!f.update) return;
  auto it = f.update->members.find(engine);
  if (it == f.update->members.end()) return;
  MemberStatus& m = it->second;
  const std::string& id = f.update->request.update_id;
  if (const auto* u = std::get_if<UpdateRequested>(&e); u && u->update_id == id) {
    m = MemberStatus::kUpdating;
  } else if (const auto* end = std::get_if<UpdateEnded>(&e);
             end && end->update_id == id && plan_is_members(m)) {
    m = end->outcome == UpdateOutcome::kCommitted ? MemberStatus::kCommitted
        : end->outcome == UpdateOutcome::kRefused ? MemberStatus::kRefused
                                                  : MemberStatus::kTainted;
  }
  if (m == MemberStatus::kPending && s.lifecycle == Lifecycle::kTainted) m = MemberStatus::kSkipped;
  // Stalled stays stalled for this fleet update, even once a restart gives the plan its attempts
  // back: the batch slot it gave up may be taken, and its engine serves nothing either way.
  if (m == MemberStatus::kUpdating && member_stalled(f.update->request, s, e)) {
    m = MemberStatus::kStalled;
  }
}

// What a per-engine event changes in the fleet's own records (after the engine's fold took it).
void note_engine_event(FleetState& f, const std::string& engine, const Event& e) {
  const State& s = f.engines.at(engine);
  if (const auto* c = std::get_if<StateChanged>(&e);
      c && c->from == Lifecycle::kUninitialized && c->to == Lifecycle::kReady) {
    note_label(f, s.committed.label, s.committed_identity);
  } else if (const auto* p = std::get_if<VersionPublished>(&e)) {
    note_label(f, p->version.label, p->identity);
  }
  note_member(f, engine, s, e);
}

bool member_updating(const FleetState& f, const std::string& engine) {
  if (!f.update) return false;
  auto it = f.update->members.find(engine);
  return it != f.update->members.end() && plan_is_members(it->second);
}

// An updating member's plan ends only after its UpdateEnded told the fleet how: a history in
// which the plan vanishes first is forged (the fold derives the end before the last edge). A plan
// ends only by a transition to READY, SLEEPING or TAINTED (lifecycle.cc), so that is refused
// before the engine's fold takes the event, without copying the engine (O(labels) per event).
Status apply_to_updating_member(State& s, const std::string& update_id, const Event& e) {
  const auto* c = std::get_if<StateChanged>(&e);
  const bool ends = c != nullptr && (c->to == Lifecycle::kReady || c->to == Lifecycle::kSleeping ||
                                     c->to == Lifecycle::kTainted);
  if (ends || !s.update || s.update->update_id != update_id) {
    return Status::Rejected("the fleet update's plan on this engine ends without its UpdateEnded");
  }
  RC_RETURN_IF_ERROR(apply(s, e));
  RC_CHECK(s.update && s.update->update_id == update_id);
  return Status::OK();
}

// The engine's fold and the fleet's records of it, once the fleet's rules accepted the event.
Status fold_engine_event(FleetState& f, const std::string& engine, const Event& e) {
  if (f.engines.count(engine) == 0) {  // the implicit engine's first event
    State born;
    RC_RETURN_IF_ERROR(apply(born, e));
    f.engines.emplace(engine, std::move(born));
  } else if (member_updating(f, engine) && family_of(e) != Family::kBinding &&
             !std::holds_alternative<UpdateEnded>(e)) {
    RC_RETURN_IF_ERROR(
        apply_to_updating_member(f.engines.at(engine), f.update->request.update_id, e));
  } else {
    RC_RETURN_IF_ERROR(apply(f.engines.at(engine), e));
  }
  note_engine_event(f, engine, e);
  return Status::OK();
}

Status apply_engine_event(FleetState& f, const std::string& engine, const Event& e) {
  Result<const State*> found = engine_of(f, engine);
  if (!found.ok()) return found.status();
  RC_RETURN_IF_ERROR(check_engine_rules(f, engine, e));
  return fold_engine_event(f, engine, e);
}

// What an engine's input can change in the fleet that settle() reads: that engine, and the
// fleet's removal and update records (O(one engine), not O(fleet)). settle() on this view is
// exact: no leaving engine other than this one is idle (check_fleet_invariants), and the label
// registry is written here but never read by settle().
FleetState engine_view(const FleetState& f, const std::string& engine, const State& s) {
  FleetState view;
  view.engines.emplace(engine, s);
  if (f.leaving.count(engine) != 0) view.leaving.insert(engine);
  view.policy = f.policy;
  view.named = f.named;
  view.next_generation = f.next_generation;
  view.update = f.update;
  return view;
}

// ---- fleet events ----

Status apply_one(FleetState& f, const FleetConfigured& c) {
  if (c.staleness_max > kFleetStalenessMax) {
    return Status::InvalidArgument("staleness_max exceeds " + std::to_string(kFleetStalenessMax));
  }
  if (c.min_serving > kFleetEnginesMax) {
    return Status::InvalidArgument("min_serving exceeds " + std::to_string(kFleetEnginesMax));
  }
  f.policy = c;
  return Status::OK();
}

Status apply_one(FleetState& f, const EngineJoined& j) {
  RC_RETURN_IF_ERROR(check_id("engine id", j.engine));
  if (f.engines.count("") != 0) {
    return Status::Rejected("this journal drives one unnamed engine; no engine can join it");
  }
  if (f.engines.count(j.engine) != 0) {
    return Status::Conflict(quoted(j.engine) + " is already in the fleet");
  }
  if (f.engines.size() >= kFleetEnginesMax) {
    return Status::Rejected("the fleet has " + std::to_string(kFleetEnginesMax) + " engines");
  }
  f.engines.emplace(j.engine, State{});
  f.named = true;
  return Status::OK();
}

Status apply_one(FleetState& f, const EngineRemovalRequested& r) {
  if (r.engine.empty()) return Status::Rejected("the one engine of this journal cannot leave it");
  auto it = f.engines.find(r.engine);
  if (it == f.engines.end()) return Status::NotFound("no " + quoted(r.engine) + " in the fleet");
  if (f.leaving.count(r.engine) != 0) return Status::Conflict(quoted(r.engine) + " is leaving");
  MemberStatus* member = nullptr;
  if (f.update && f.update->members.count(r.engine) != 0) member = &f.update->members[r.engine];
  if (member != nullptr && plan_is_members(*member)) {
    return Status::Rejected(quoted(r.engine) + " is updating in fleet update '" +
                            f.update->request.update_id + "'");
  }
  if (it->second.update.has_value() && !plan_stalled(it->second)) {
    return Status::Rejected(quoted(r.engine) + " is in an update; remove it once that ends");
  }
  // A member not started yet is skipped: the fleet update goes on without it.
  if (member != nullptr && *member == MemberStatus::kPending) *member = MemberStatus::kSkipped;
  f.leaving.insert(r.engine);
  return Status::OK();
}

Status apply_one(FleetState& f, const EngineRemoved& r) {
  auto it = f.engines.find(r.engine);
  if (it == f.engines.end() || f.leaving.count(r.engine) == 0) {
    return Status::Rejected(quoted(r.engine) + " was not asked to leave");
  }
  if (!can_leave(it->second)) {
    return Status::Rejected(quoted(r.engine) + " still has rollouts or an update that can move");
  }
  add_counters(f.removed, it->second.counters);
  f.engines.erase(it);
  f.leaving.erase(r.engine);
  return Status::OK();
}

// Generations number labels by first serve. A label served before, older than the newest by more
// than staleness_max, would leave every engine it reaches admitting nothing while another holds
// the newest: a rolling update back to it could never finish (min_serving), and any member that
// fails leaves the others out of service. A rollback is an update under a new label.
Status check_not_behind(const FleetState& f, const std::string& label) {
  const auto g = f.label_generation.find(label);
  const std::optional<std::uint64_t> newest = newest_held_generation(f);
  if (g == f.label_generation.end() || !newest || g->second + f.policy.staleness_max >= *newest) {
    return Status::OK();
  }
  return Status::Rejected("label '" + label + "' is generation " + std::to_string(g->second) +
                          ", older than the fleet's newest " + std::to_string(*newest) +
                          " by more than staleness_max " + std::to_string(f.policy.staleness_max) +
                          ": the engines it reached would admit nothing; roll back under a new "
                          "label (the same identity is allowed)");
}

Status check_fleet_update(const FleetState& f, const FleetUpdateRequested& r) {
  RC_RETURN_IF_ERROR(check_id("update_id", r.update_id));
  RC_RETURN_IF_ERROR(check_id("target_label", r.target_label));
  if (static_cast<std::uint8_t>(r.mode) > kFleetUpdateModeMax) {
    return Status::InvalidArgument("fleet update mode out of range");
  }
  if (r.batch_max == 0 || r.batch_max > kFleetEnginesMax) {
    return Status::InvalidArgument("batch_max must be 1.." + std::to_string(kFleetEnginesMax));
  }
  if (r.min_healthy > kFleetEnginesMax) {
    return Status::InvalidArgument("min_healthy exceeds " + std::to_string(kFleetEnginesMax));
  }
  RC_RETURN_IF_ERROR(check_client_text("source_uri", r.source_uri));
  RC_RETURN_IF_ERROR(check_weight_identity(r.identity));
  RC_RETURN_IF_ERROR(check_digest("expected_digest", r.expected_digest, false));
  if (f.update) {
    return Status::Rejected("fleet update '" + f.update->request.update_id + "' is in flight");
  }
  return check_fleet_label(f, r.target_label, r.identity);
}

Status apply_one(FleetState& f, const FleetUpdateRequested& r) {
  RC_RETURN_IF_ERROR(check_fleet_update(f, r));
  FleetUpdate u;
  u.request = r;
  for (const std::string& id : updatable_engines(f)) {
    const bool holds = f.engines.at(id).committed.label == r.target_label;
    u.members[id] = holds ? MemberStatus::kCommitted : MemberStatus::kPending;
  }
  f.update = std::move(u);
  return Status::OK();
}

FleetUpdateEnded tally(const FleetUpdate& u) {
  FleetUpdateEnded end;
  end.update_id = u.request.update_id;
  for (const auto& [id, m] : u.members) {
    end.committed += m == MemberStatus::kCommitted ? 1 : 0;
    end.refused += m == MemberStatus::kRefused ? 1 : 0;
    end.tainted += m == MemberStatus::kTainted ? 1 : 0;
    end.skipped += m == MemberStatus::kSkipped ? 1 : 0;
    end.stalled += m == MemberStatus::kStalled ? 1 : 0;
  }
  end.outcome = end.committed == 0                  ? FleetOutcome::kRefused
                : end.committed == u.members.size() ? FleetOutcome::kCommitted
                                                    : FleetOutcome::kPartial;
  return end;
}

// Too few members to begin (members that already hold the target count: they can serve it).
// The members are fixed by the request, so this holds from its own group on or never: nothing
// was asked of any engine.
bool refused_whole(const FleetUpdate& u) {
  return u.members.size() < u.request.min_healthy || u.members.empty();
}

// The rule of builds before members holding the target counted: only an update none of whose
// members held it was refused whole. Their recorded ends still apply (a journal opens as it was
// written); replay re-derives with the rule above and reports where the two differ.
bool refused_whole_before_holders_counted(const FleetUpdate& u) {
  const bool none_held = std::all_of(u.members.begin(), u.members.end(),
                                     [](auto& m) { return m.second == MemberStatus::kPending; });
  return none_held && refused_whole(u);
}

bool every_member_ended(const FleetUpdate& u) {
  return std::all_of(u.members.begin(), u.members.end(),
                     [](auto& m) { return member_ended(m.second); });
}

Status apply_one(FleetState& f, const FleetUpdateEnded& e) {
  if (!f.update || f.update->request.update_id != e.update_id) {
    return Status::Rejected("fleet update '" + e.update_id + "' is not in flight");
  }
  if (e.reason.size() > kTextBytesMax) return Status::InvalidArgument("reason is too long");
  const bool whole = refused_whole(*f.update);
  const bool whole_before = refused_whole_before_holders_counted(*f.update);
  const bool ended = every_member_ended(*f.update);
  if (!whole && !ended) {
    return Status::Rejected("fleet update '" + e.update_id + "' has members still to end");
  }
  FleetUpdateEnded expect = tally(*f.update);
  expect.reason = e.reason;
  FleetUpdateEnded refused = expect;
  refused.outcome = FleetOutcome::kRefused;
  const bool matches = (whole && refused == e) || (ended && !whole_before && expect == e);
  if (!matches) return Status::Rejected("fleet update end does not match its members");
  f.update.reset();
  f.fleet_updates_ended++;
  return Status::OK();
}

Status apply_one(FleetState& f, const FleetUpdateCancelled& c) {
  if (!f.update || f.update->request.update_id != c.update_id) {
    return Status::NotFound("fleet update '" + c.update_id + "' is not in flight");
  }
  if (c.reason.size() > kFleetCancelReasonBytesMax || !text::printable_utf8(c.reason)) {
    return Status::InvalidArgument("reason must be printable UTF-8 of at most " +
                                   std::to_string(kFleetCancelReasonBytesMax) + " bytes");
  }
  if (f.update->cancelled)
    return Status::Conflict("fleet update '" + c.update_id + "' is cancelled");
  for (auto& [id, m] : f.update->members) {
    if (m == MemberStatus::kPending) m = MemberStatus::kSkipped;
  }
  f.update->cancelled = c.reason;
  return Status::OK();
}

Status apply_fleet_event(FleetState& f, const FleetEvent& e) {
  RC_CHECK(is_fleet_event(e.event));
  if (!e.engine.empty()) return Status::InvalidArgument("a fleet event names no engine");
  if (f.engines.count("") != 0) {
    return Status::Rejected(
        "this journal drives one unnamed engine; no engine can join it and it takes no fleet "
        "event");
  }
  return std::visit(Overloaded{
                        [&](const FleetConfigured& x) { return apply_one(f, x); },
                        [&](const EngineJoined& x) { return apply_one(f, x); },
                        [&](const EngineRemovalRequested& x) { return apply_one(f, x); },
                        [&](const EngineRemoved& x) { return apply_one(f, x); },
                        [&](const FleetUpdateRequested& x) { return apply_one(f, x); },
                        [&](const FleetUpdateEnded& x) { return apply_one(f, x); },
                        [&](const FleetUpdateCancelled& x) { return apply_one(f, x); },
                        [&](const auto&) { return Status::Internal("not a fleet event"); },
                    },
                    e.event);
}

// ---- decide ----

std::string refusal_reason(const FleetUpdate& u) {
  return "only " + std::to_string(u.members.size()) + " engines can serve; min_healthy is " +
         std::to_string(u.request.min_healthy);
}

// Leaving engines with nothing left (a last finish, a recovery's abandonments) are removed.
void settle_removals(const FleetState& after, std::vector<FleetEvent>& out) {
  for (const std::string& id : after.leaving) {
    const State& s = after.engines.at(id);
    if (can_leave(s)) out.push_back(FleetEvent{"", EngineRemoved{id}});
  }
}

void settle_update(const FleetState& after, std::vector<FleetEvent>& out);

// The fleet decisions that follow once `after` holds an input and its per-engine consequences.
void settle(const FleetState& after, std::vector<FleetEvent>& out) {
  settle_removals(after, out);
  settle_update(after, out);
}

// settle() after an input of `engine` alone: only that engine can have become idle while leaving.
void settle_engine(const FleetState& after, const std::string& engine,
                   std::vector<FleetEvent>& out) {
  const auto it = after.engines.find(engine);
  if (after.leaving.count(engine) != 0 && it != after.engines.end() && can_leave(it->second)) {
    out.push_back(FleetEvent{"", EngineRemoved{engine}});
  }
  settle_update(after, out);
}

// A fleet update that every member ended, or too few can take, ends.
void settle_update(const FleetState& after, std::vector<FleetEvent>& out) {
  if (!after.update) return;
  const FleetUpdate& u = *after.update;
  if (refused_whole(u)) {
    FleetUpdateEnded end = tally(u);
    end.outcome = FleetOutcome::kRefused;
    end.reason = refusal_reason(u);
    out.push_back(FleetEvent{"", end});
  } else if (every_member_ended(u)) {
    FleetUpdateEnded end = tally(u);
    if (u.cancelled) end.reason = "cancelled: " + *u.cancelled;
    out.push_back(FleetEvent{"", end});
  }
}

// The engine's own fold speaks first (so one unnamed engine refuses exactly as before fleets),
// then the fleet's rules. A binding derives nothing of its engine; its only fleet consequence is a
// leaving engine's removal once its last rollout ends (decided without copying the fleet: the hot
// path).
Result<std::vector<FleetEvent>> decide_binding(const FleetState& f, const FleetEvent& in,
                                               const State& s) {
  const Event& e = in.event;
  Result<std::vector<Event>> own = decide(s, e);
  if (!own.ok()) return own.status();
  RC_CHECK(own->empty());
  RC_RETURN_IF_ERROR(check_engine_rules(f, in.engine, e));
  std::vector<FleetEvent> out;
  const auto* fin = std::get_if<RolloutFinished>(&e);
  if (fin != nullptr && f.leaving.count(in.engine) != 0 && s.active.size() == 1 &&
      (!s.update || plan_stalled(s))) {
    out.push_back(FleetEvent{"", EngineRemoved{in.engine}});
  }
  return out;
}

}  // namespace

bool member_ended(MemberStatus s) {
  return s != MemberStatus::kPending && s != MemberStatus::kUpdating;
}

const char* member_status_name(MemberStatus s) {
  switch (s) {
    case MemberStatus::kPending:
      return "pending";
    case MemberStatus::kUpdating:
      return "updating";
    case MemberStatus::kCommitted:
      return "committed";
    case MemberStatus::kRefused:
      return "refused";
    case MemberStatus::kTainted:
      return "tainted";
    case MemberStatus::kSkipped:
      return "skipped";
    case MemberStatus::kStalled:
      return "stalled";
  }
  return "unknown";
}

Status fleet_apply(FleetState& fleet, const FleetEvent& event) {
  Status applied = is_fleet_event(event.event)
                       ? apply_fleet_event(fleet, event)
                       : apply_engine_event(fleet, event.engine, event.event);
  if (applied.ok()) fleet.events++;
  return applied;
}

Result<std::vector<FleetEvent>> fleet_decide(const FleetState& fleet, const FleetEvent& input) {
  if (family_of(input.event) == Family::kDecision) {
    return Status::InvalidArgument("a decision cannot be submitted as input");
  }
  const Event* e = is_fleet_event(input.event) ? nullptr : &input.event;
  if (e != nullptr && family_of(*e) == Family::kBinding) {
    Result<const State*> s = engine_of(fleet, input.engine);
    if (!s.ok()) return s.status();
    return decide_binding(fleet, input, **s);
  }
  std::vector<FleetEvent> out;
  if (e != nullptr) {
    Result<const State*> s = engine_of(fleet, input.engine);
    if (!s.ok()) return s.status();
    Result<std::vector<Event>> own = decide(**s, *e);
    if (!own.ok()) return own.status();
    RC_RETURN_IF_ERROR(check_engine_rules(fleet, input.engine, *e));
    for (Event& d : *own) out.push_back(FleetEvent{input.engine, std::move(d)});
    FleetState view = engine_view(fleet, input.engine, **s);
    RC_RETURN_IF_ERROR(fold_engine_event(view, input.engine, *e));
    for (const FleetEvent& d : out) RC_CHECK(fold_engine_event(view, d.engine, d.event).ok());
    settle(view, out);
    return out;
  }
  FleetState after = fleet;
  RC_RETURN_IF_ERROR(fleet_apply(after, input));
  for (const FleetEvent& d : out) RC_CHECK(fleet_apply(after, d).ok());
  settle(after, out);
  return out;
}

namespace {

// Whether fleet_step folds the input without a copy: an engine's input that is neither a binding
// (decided without a copy already) nor a decision (refused).
bool folds_in_place(const FleetEvent& input) {
  if (is_fleet_event(input.event)) return false;
  const Family family = family_of(input.event);
  return family != Family::kBinding && family != Family::kDecision;
}

// An engine's input folded into `f` itself. The fleet's rules read the state before the input, so
// they are checked first; when they refuse, the engine's own fold is asked first on a copy (a
// refusal, off the hot path), so the reason is fleet_decide's. The engine's fold refuses before
// it changes anything, and what the input caused must apply.
Result<std::vector<FleetEvent>> fold_engine_input(FleetState& f, const FleetEvent& input) {
  const Result<const State*> s = engine_of(f, input.engine);
  if (!s.ok()) return s.status();
  const Event& e = input.event;
  if (Status rules = check_engine_rules(f, input.engine, e); !rules.ok()) {
    Result<std::vector<Event>> own = decide(**s, e);
    return own.ok() ? rules : own.status();
  }
  RC_RETURN_IF_ERROR(fold_engine_event(f, input.engine, e));
  f.events++;
  std::vector<FleetEvent> out;
  for (Event& d : derive_decisions(engine_state(f, input.engine), e)) {
    RC_CHECK(fold_engine_event(f, input.engine, d).ok());
    f.events++;
    out.push_back(FleetEvent{input.engine, std::move(d)});
  }
  const std::size_t own_count = out.size();
  settle_engine(f, input.engine, out);
  for (std::size_t i = own_count; i < out.size(); ++i) RC_CHECK(fleet_apply(f, out[i]).ok());
  return out;
}

std::string digest_prefix(const std::string& digest) {
  return digest.empty() ? std::string("none") : digest.substr(0, 16);
}

// One label, one content per weight layout. A member of the open fleet update is held to the
// digest its layout holds for the target (layout_digest) when the fleet update names none; while
// its layout holds none, one member of the layout at a time starts without a digest, and the
// others wait for the digest its validation reads (otherwise members validated side by side could
// each publish the label on other weights). With an expected digest, a member whose layout holds
// another one for the target is refused: it could only publish the label on other weights than
// its layout's, or fail its validation once its weights changed.
Status check_member_digest(const FleetState& f, const std::string& engine,
                           const UpdateRequested& u) {
  if (!f.update || u.update_id != f.update->request.update_id) return Status::OK();
  const FleetUpdateRequested& r = f.update->request;
  const std::string held = layout_digest(f, engine, r.target_label);
  if (!r.expected_digest.empty() && !held.empty() && held != r.expected_digest) {
    return Status::Rejected("the weight layout of " + quoted(engine) + " holds digest " +
                            digest_prefix(held) + " for '" + r.target_label +
                            "', not fleet update '" + r.update_id + "''s expected " +
                            digest_prefix(r.expected_digest));
  }
  const std::string& want = r.expected_digest.empty() ? held : r.expected_digest;
  if (u.expected_digest != want) {
    return Status::InvalidArgument(quoted(engine) + "'s update to '" + r.target_label +
                                   "' must be held to digest " + digest_prefix(want) + ", not " +
                                   digest_prefix(u.expected_digest));
  }
  if (!want.empty()) return Status::OK();
  const WeightDigest& layout = engine_state(f, engine).committed_digest;
  if (const std::string* first = layout_pioneer(f, layout, r.target_label, engine)) {
    return Status::Rejected(quoted(engine) + " waits for the digest that " + quoted(*first) +
                            ", of its weight layout, reads for '" + r.target_label +
                            "' (fleet update '" + r.update_id + "' names none)");
  }
  return Status::OK();
}

}  // namespace

// Besides the rules fleet.h names: a fleet update may not target a label behind the served one,
// and a member's update carries its layout's digest (check_member_digest).
Status check_new_requests(const FleetState& fleet, const FleetEvent& input) {
  if (const auto* u = std::get_if<FleetUpdateRequested>(&input.event)) {
    RC_RETURN_IF_ERROR(check_not_behind(fleet, u->target_label));
    return check_identity_consistent(fleet.labels, u->identity);
  }
  if (is_fleet_event(input.event)) return Status::OK();
  RC_RETURN_IF_ERROR(check_new_request_rules(engine_state(fleet, input.engine), input.event));
  if (const auto* u = std::get_if<UpdateRequested>(&input.event)) {
    RC_RETURN_IF_ERROR(check_identity_consistent(fleet.labels, u->identity));
    return check_member_digest(fleet, input.engine, *u);
  }
  return Status::OK();
}

// In place: decide accepted the group, and every fleet_apply that fails changes nothing. A new
// request's rules refuse after the fold's own (the fold speaks first; off the hot path).
Result<std::vector<FleetEvent>> fleet_step(FleetState& fleet, const FleetEvent& input) {
  if (Status rules = check_new_requests(fleet, input); !rules.ok()) {
    Result<std::vector<FleetEvent>> d = fleet_decide(fleet, input);
    return d.ok() ? rules : d.status();
  }
  if (folds_in_place(input)) return fold_engine_input(fleet, input);
  Result<std::vector<FleetEvent>> derived = fleet_decide(fleet, input);
  if (!derived.ok()) return derived.status();
  RC_CHECK(fleet_apply(fleet, input).ok());
  for (const FleetEvent& d : *derived) RC_CHECK(fleet_apply(fleet, d).ok());
  return derived;
}

const State& engine_state(const FleetState& fleet, const std::string& engine) {
  auto it = fleet.engines.find(engine);
  return it != fleet.engines.end() ? it->second : kUnbornEngine;
}

std::optional<std::uint64_t> fleet_generation(const FleetState& fleet, const std::string& engine) {
  auto it = fleet.engines.find(engine);
  if (it == fleet.engines.end() || it->second.lifecycle == Lifecycle::kUninitialized) {
    return std::nullopt;
  }
  auto g = fleet.label_generation.find(it->second.committed.label);
  if (g == fleet.label_generation.end()) return std::nullopt;
  return g->second;
}

std::optional<std::uint64_t> newest_held_generation(const FleetState& fleet) {
  std::optional<std::uint64_t> newest;
  for (const auto& [id, s] : fleet.engines) {
    if (s.lifecycle == Lifecycle::kTainted) continue;
    const std::optional<std::uint64_t> g = fleet_generation(fleet, id);
    if (g && (!newest || *g > *newest)) newest = g;
  }
  return newest;
}

namespace {

// fleet_admission_block_reason with the fleet's newest held generation computed once.
std::string block_reason(const FleetState& fleet, const std::string& engine,
                         const std::optional<std::uint64_t>& newest) {
  auto it = fleet.engines.find(engine);
  if (it == fleet.engines.end()) return "no " + quoted(engine) + " in the fleet";
  if (fleet.leaving.count(engine) != 0) return quoted(engine) + " is being removed";
  if (std::string why = admission_block_reason(it->second); !why.empty()) {
    return engine.empty() ? why : quoted(engine) + ": " + why;
  }
  const std::optional<std::uint64_t> g = fleet_generation(fleet, engine);
  RC_CHECK(g.has_value() && newest.has_value() && *g <= *newest);
  if (*g + fleet.policy.staleness_max >= *newest) return {};
  return quoted(engine) + " holds generation " + std::to_string(*g) + "; the fleet's newest is " +
         std::to_string(*newest) + " and staleness_max is " +
         std::to_string(fleet.policy.staleness_max);
}

}  // namespace

std::string fleet_admission_block_reason(const FleetState& fleet, const std::string& engine) {
  return block_reason(fleet, engine, newest_held_generation(fleet));
}

bool fleet_admits(const FleetState& fleet, const std::string& engine) {
  return fleet_admission_block_reason(fleet, engine).empty();
}

std::vector<std::string> admitting_engines(const FleetState& fleet) {
  const std::optional<std::uint64_t> newest = newest_held_generation(fleet);
  std::vector<std::string> out;
  for (const auto& [id, s] : fleet.engines) {
    if (block_reason(fleet, id, newest).empty()) out.push_back(id);
  }
  return out;
}

std::vector<std::string> updatable_engines(const FleetState& fleet) {
  std::vector<std::string> out;
  for (const auto& [id, s] : fleet.engines) {
    if (fleet.leaving.count(id) == 0 && admission_block_reason(s).empty()) out.push_back(id);
  }
  return out;
}

// Engines in id order: a journal written before the rule may hold two digests of one layout for a
// label (it folds as written), and every caller then picks the same one.
std::string layout_label_digest(const FleetState& fleet, const WeightDigest& layout,
                                const std::string& label) {
  for (const auto& [id, s] : fleet.engines) {
    if (!same_weight_layout(layout, s.committed_digest)) continue;
    if (const std::string* held = label_digest_of(s, label)) return *held;
  }
  return {};
}

// The engine's own digest for the label first: its own fold holds it to that one anyway.
std::string layout_digest(const FleetState& fleet, const std::string& engine,
                          const std::string& label) {
  const State& self = engine_state(fleet, engine);
  if (const std::string* own = label_digest_of(self, label)) return *own;
  return layout_label_digest(fleet, self.committed_digest, label);
}

// The same layout's digest first: a plan of the layout that has read none yet is held to it too.
// A joiner has no plan of its own, so no engine is left out of the search for the first.
Result<std::string> join_digest(const FleetState& fleet, const std::string& label,
                                const WeightDigest& probed) {
  if (!probed.present()) {
    for (const auto& [id, s] : fleet.engines) {
      if (label_digest_of(s, label) == nullptr) continue;
      return Status::Rejected(quoted(id) + " holds a weight digest for '" + label +
                              "' and the joining engine computes none: its weights cannot be "
                              "verified");
    }
    return std::string();
  }
  std::string held = layout_label_digest(fleet, probed, label);
  if (!held.empty()) return held;
  if (const std::string* first = layout_pioneer(fleet, probed, label, "")) {
    return Status::Rejected(quoted(*first) + ", of the joining engine's weight layout, updates " +
                            "to '" + label + "' and its validation has read no digest yet: the " +
                            "join waits for that digest or the plan's end (retry then), so that '" +
                            label + "' is not published on two contents");
  }
  return std::string();
}

namespace {

// The fleet update's target as a member's request, held to the fleet update's expected digest
// only: what the first member of a layout carries. Any other member carrying it is refused while
// its layout holds a digest (check_member_digest), so it is only the base of
// member_update_request(fleet, engine).
UpdateRequested fleet_target_request(const FleetState& fleet) {
  RC_CHECK(fleet.update.has_value());
  const FleetUpdateRequested& r = fleet.update->request;
  return UpdateRequested{r.update_id, r.target_label, r.identity, r.source_uri, r.expected_digest};
}

}  // namespace

UpdateRequested member_update_request(const FleetState& fleet, const std::string& engine) {
  UpdateRequested u = fleet_target_request(fleet);
  if (u.expected_digest.empty()) u.expected_digest = layout_digest(fleet, engine, u.target_label);
  return u;
}

namespace {

// Tries each pending member in id order on a copy of the fleet, as the executor would submit
// them (each with member_update_request(fleet, id)); `why` gets the first refusal.
std::vector<std::string> fleet_next_members_why(const FleetState& fleet, std::string* why) {
  std::vector<std::string> out;
  if (!fleet.update) return out;
  FleetState trial = fleet;
  for (const auto& [id, m] : fleet.update->members) {
    if (m != MemberStatus::kPending) continue;
    Result<std::vector<FleetEvent>> r =
        fleet_step(trial, FleetEvent{id, member_update_request(fleet, id)});
    if (r.ok()) {
      out.push_back(id);
    } else if (why != nullptr && why->empty()) {
      *why = "'" + id + "': " + r.status().message();
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> fleet_next_members(const FleetState& fleet) {
  return fleet_next_members_why(fleet, nullptr);
}

std::string fleet_update_blocked_reason(const FleetState& fleet) {
  if (!fleet.update || updating_members(*fleet.update) > 0) return {};
  std::string why;
  if (!fleet_next_members_why(fleet, &why).empty()) return {};
  return "fleet update '" + fleet.update->request.update_id + "' cannot start a member" +
         (why.empty() ? "" : " (" + why + ")");
}

FleetEvent make_fleet_admission(const FleetState& fleet, const std::string& engine,
                                std::string rollout_id) {
  Result<const State*> s = engine_of(fleet, engine);
  return FleetEvent{engine, make_admission(s.ok() ? **s : kUnbornEngine, std::move(rollout_id))};
}

namespace {

std::string check_rollouts_disjoint(const FleetState& f) {
  std::map<std::string, const std::string*> owner;
  for (const auto& [id, s] : f.engines) {
    for (const auto& [rollout, r] : s.active) {
      if (!owner.emplace(rollout, &id).second) {
        return "rollout '" + rollout + "' is active on two engines";
      }
    }
  }
  return {};
}

std::string check_generations(const FleetState& f) {
  std::set<std::uint64_t> seen;
  for (const auto& [label, g] : f.label_generation) {
    if (g >= f.next_generation || !seen.insert(g).second) return "fleet generations are not unique";
    if (f.labels.count(label) == 0) return "a served label has no identity";
  }
  for (const auto& [id, s] : f.engines) {
    const bool holds = s.lifecycle != Lifecycle::kUninitialized && !s.committed.label.empty();
    if (holds && f.label_generation.count(s.committed.label) == 0) {
      return quoted(id) + " holds a label the fleet never served";
    }
    if (holds && !(f.labels.at(s.committed.label) == s.committed_identity)) {
      return quoted(id) + " serves '" + s.committed.label + "' for other weights than the fleet";
    }
  }
  return f.labels.size() == f.label_generation.size() ? "" : "labels and generations differ";
}

std::string check_update_members(const FleetState& f) {
  if (!f.update) return {};
  const FleetUpdate& u = *f.update;
  for (const auto& [id, m] : u.members) {
    if (member_ended(m) && m != MemberStatus::kStalled) continue;
    auto it = f.engines.find(id);
    if (it == f.engines.end()) return "a member in flight left the fleet";
    const bool own = it->second.update && it->second.update->update_id == u.request.update_id;
    if (plan_is_members(m) != own) return quoted(id) + "'s member status is wrong";
  }
  if (u.request.mode == FleetUpdateMode::kRolling && updating_members(u) > u.request.batch_max) {
    return "a rolling update exceeds batch_max";
  }
  return {};
}

}  // namespace

std::string check_fleet_invariants(const FleetState& fleet) {
  if (fleet.engines.size() > kFleetEnginesMax) return "too many engines";
  if (fleet.engines.count("") != 0 && fleet.engines.size() != 1) {
    return "the unnamed engine shares a journal with named ones";
  }
  for (const auto& [id, s] : fleet.engines) {
    if (std::string bad = check_invariants(s); !bad.empty()) return quoted(id) + ": " + bad;
  }
  for (const std::string& id : fleet.leaving) {
    auto it = fleet.engines.find(id);
    if (it == fleet.engines.end()) return "a leaving engine is not in the fleet";
    // An engine that leaves is removed in the group that idles it (settle_removals).
    if (can_leave(it->second)) return quoted(id) + " left but stays";
  }
  if (std::string bad = check_rollouts_disjoint(fleet); !bad.empty()) return bad;
  if (std::string bad = check_generations(fleet); !bad.empty()) return bad;
  return check_update_members(fleet);
}

}  // namespace rc
