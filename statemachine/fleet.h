// The fleet: N engines, each with its own lifecycle (State, the single-engine fold, unchanged),
// and the rules that span them, as a pure fold of its own.
//
// A fleet event names its engine: every per-engine input, binding and decision of the single-
// engine fold is carried with the id of the engine it belongs to. A journal written before fleets
// existed names none: its events all belong to the implicit engine "" and fold exactly as before.
//
// What the fleet adds (each rule enforced by decide and by apply, so a forged history is refused):
//   - membership: engines join by name and leave by a removal that first drains them;
//   - generations: the fleet orders the labels it serves (the first served is generation 0, each
//     label first served anywhere gets the next); an engine's fleet generation is that of the
//     label it has committed;
//   - staleness: a rollout is admitted to an engine only if its fleet generation is at least the
//     newest one an untainted engine holds minus `staleness_max` (0: no rollout starts on an old
//     generation once a newer one is committed anywhere). Quarantined engines do not count, so a
//     fleet whose newest engines are TAINTED keeps serving what it still holds, and a single
//     engine restored to an earlier label serves it;
//   - fleet updates, `all` (every healthy engine at once) or `rolling` (at most `batch_max` at a
//     time while at least `min_serving` engines keep serving); refused as a whole when fewer than
//     `min_healthy` engines can take it; each member ends committed, refused or TAINTED on its own
//     evidence, or stalls (its own plan out of attempts), and the fleet update ends once every
//     member has: one dead engine never holds the fleet;
//   - one label names one identity across the fleet, and one content per weight layout: a member
//     of a fleet update that names no expected digest, or a joining engine, may be held only to a
//     digest an engine holds for the label; as a rule for new requests (check_new_requests), a
//     member must be held to its own layout's (layout_digest), and while its layout has none, one
//     member of the layout at a time starts without one; a joining engine, whose layout only its
//     own digest tells, is held the same way by join_digest, which its executor asks first;
//   - a rollout id is active on one engine at most.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "statemachine/state.h"

namespace rc {

// `engine` names the engine of a per-engine event ("" = the implicit engine of a one-engine
// journal); a fleet event (is_fleet_event) names none.
// A cancel's reason, at most: the fleet update's end carries it after "cancelled: ".
inline constexpr std::size_t kFleetCancelReasonBytesMax = kTextBytesMax - 64;

struct FleetEvent {
  std::string engine;
  Event event;
  bool operator==(const FleetEvent&) const = default;
};

enum class MemberStatus : std::uint8_t {
  kPending = 0,   // its UpdateRequested has not been taken yet
  kUpdating = 1,  // its own update is in flight
  kCommitted = 2,
  kRefused = 3,
  kTainted = 4,
  kSkipped = 5,  // TAINTED (quarantined) before its own update started, or cancelled
  // Its own update stalled (plan_stalled: an engine that never answered its resume). The fleet
  // update does not wait for it, and it holds no rolling batch slot; its plan goes on alone once
  // an executor restart retries it, and ends with its own UpdateEnded (which, while the fleet
  // update is still open, gives the member that end's status).
  kStalled = 6,
};
bool member_ended(MemberStatus s);
const char* member_status_name(MemberStatus s);

struct FleetUpdate {
  FleetUpdateRequested request;
  std::map<std::string, MemberStatus> members;  // updatable_engines when it began
  std::optional<std::string> cancelled;         // the cancel's reason
  bool operator==(const FleetUpdate&) const = default;
};

struct FleetState {
  std::map<std::string, State> engines;
  std::set<std::string> leaving;  // removal requested: no admissions, removed once idle
  FleetConfigured policy;
  std::map<std::string, std::uint64_t> label_generation;  // every label the fleet served
  std::map<std::string, WeightIdentity> labels;           // one identity per label, fleet-wide
  std::uint64_t next_generation = 0;                      // the generation the next new label gets
  bool named = false;  // an engine ever joined: the implicit unnamed engine never exists
  std::optional<FleetUpdate> update;
  std::uint64_t fleet_updates_ended = 0;
  // Removed engines' counters, added up: fleet-wide totals (engines plus this) never fall.
  Counters removed;
  std::uint64_t events = 0;  // events applied: the journal seq this state is the fold of
  bool operator==(const FleetState&) const = default;
};

// decide: the events an input causes (per-engine decisions named with their engine, then the
// fleet's), or a rejection; never mutates. apply: the fold; an illegal event changes nothing.
[[nodiscard]] Result<std::vector<FleetEvent>> fleet_decide(const FleetState& fleet,
                                                           const FleetEvent& input);
[[nodiscard]] Status fleet_apply(FleetState& fleet, const FleetEvent& event);
// Rules for requests submitted now, never for recorded ones: apply, and the replay and audit that
// re-decide a recorded input, do not check them, so a journal that recorded such a request before
// the rule existed opens, replays and audits as written. fleet_step checks them; a caller that
// decides a new input with fleet_decide checks them too. An update of an awake engine or a sleep
// only while it answers; no identity claiming, under another manifest, a content digest any
// engine of the fleet committed; a member's update held to its layout's digest, and started
// without one only as its layout's first (see member_update_request). A bootstrap's digest is
// held by its executor (join_digest): the request does not say the joiner's layout.
[[nodiscard]] Status check_new_requests(const FleetState& fleet, const FleetEvent& input);
// decide, then apply the input and what it caused; returns the caused events. The result is
// fleet_decide's and fleet_apply's, but an engine's input that is not a binding (an update's
// request, observation, intent) is folded into `fleet` itself, without the copy of its engine
// fleet_decide makes: O(the event), not O(the labels and rollouts the engine holds). A refused
// input leaves `fleet` unchanged either way.
[[nodiscard]] Result<std::vector<FleetEvent>> fleet_step(FleetState& fleet,
                                                         const FleetEvent& input);

// "" when the fleet's invariants (and every engine's) hold.
std::string check_fleet_invariants(const FleetState& fleet);

// The state of `engine`, or an empty State (UNINITIALIZED, nothing held) when the fleet holds no
// such engine: not joined, removed, or the unnamed engine before its first event.
const State& engine_state(const FleetState& fleet, const std::string& engine);

// The fleet generation of the label `engine` has committed; nullopt before its bootstrap.
std::optional<std::uint64_t> fleet_generation(const FleetState& fleet, const std::string& engine);
// The newest fleet generation an engine that is neither UNINITIALIZED nor TAINTED holds.
std::optional<std::uint64_t> newest_held_generation(const FleetState& fleet);

// Whether a rollout may be admitted to `engine` now, and if not, why ("" when it may).
std::string fleet_admission_block_reason(const FleetState& fleet, const std::string& engine);
bool fleet_admits(const FleetState& fleet, const std::string& engine);

// The engines a rollout may be admitted to now, in id order (the balancer's candidates).
std::vector<std::string> admitting_engines(const FleetState& fleet);
// The engines a fleet update takes as members, in id order: those that would admit but for the
// staleness bound (READY, reachable and re-verified, no plan of their own, not leaving), so an
// engine an earlier update left behind catches up instead of being stranded.
std::vector<std::string> updatable_engines(const FleetState& fleet);

// Whether two weight digests are of one layout: one algorithm, the same tensor names in the same
// order and the same bytes digested (both present). Digests of one model differ by layout (a TP=2
// worker digests its shard), so only digests of one layout say whether two engines hold the same
// weights.
bool same_weight_layout(const WeightDigest& a, const WeightDigest& b);
// The combined digest the engines of `layout`'s weight layout (by their committed digests) hold
// for `label`: one such an engine recorded for `label` (a TAINTED one's too: what a layout
// published under a label stays its content for it), read validating a plan to `label` still
// open, or is held to in such a plan; "" when none does, or `layout` is absent (an engine that
// computes no digest has no known layout). The one notion of a layout's digest that holds fleet
// update members (layout_digest) and joining engines (join_digest) alike.
std::string layout_label_digest(const FleetState& fleet, const WeightDigest& layout,
                                const std::string& label);
// The combined digest `engine` must read to publish `label` when nothing else names one: the one
// it holds for `label` itself, else layout_label_digest of its committed digest's layout.
std::string layout_digest(const FleetState& fleet, const std::string& engine,
                          const std::string& label);
// The digest a joining engine whose own digest reads `probed` must be held to at `label`: its
// layout's (layout_label_digest; "" when none, and the engine is checked by its label only).
// Refused (kRejected) when `probed` is absent while an engine holds a digest for `label` (the
// joiner's weights cannot be verified), and, retryable, while an engine of its layout has a plan
// to `label` open that has read no digest yet (that plan may publish the label on other weights
// than the joiner's; once it validated or ended, the join is held to what it read, or is first).
// A BootstrapRequested does not carry the joiner's layout, so the fold cannot hold it to this:
// the executor asks first, and the fold checks that the digest it carries is one the fleet holds.
[[nodiscard]] Result<std::string> join_digest(const FleetState& fleet, const std::string& label,
                                              const WeightDigest& probed);

// The members of the open fleet update that may start now, in id order: submitting their
// UpdateRequested (member_update_request(fleet, id)) in that order is accepted by fleet_step (a
// rolling update proposes at most what its batch and min_serving allow; a member whose layout
// waits for a digest is not proposed). Empty when none may.
std::vector<std::string> fleet_next_members(const FleetState& fleet);
// The per-engine UpdateRequested that starts `engine` as a member of the open fleet update: the
// fleet update's target, held to its expected digest or, when it names none, to
// layout_digest(engine, target).
UpdateRequested member_update_request(const FleetState& fleet, const std::string& engine);
// Why the open fleet update cannot progress ("" when a member may start or one is updating): no
// member updates and none may start. An executor cancels it after its own deadline, so nothing
// waits forever.
std::string fleet_update_blocked_reason(const FleetState& fleet);

// A binding for a new rollout on `engine` (the caller checks fleet_admits first).
FleetEvent make_fleet_admission(const FleetState& fleet, const std::string& engine,
                                std::string rollout_id);

}  // namespace rc
