// The controller's state and its three pure functions: decide, apply (the fold), next_effect.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "statemachine/events.h"
#include "statemachine/status.h"
#include "statemachine/types.h"

namespace rc {

struct Effect {
  EffectKind kind = EffectKind::kNone;
  CacheKind cache = CacheKind::kPrefix;  // kResetCache only
  WakeTag wake = WakeTag::kWeights;      // kWake only
  bool operator==(const Effect&) const = default;
};

struct ActiveRollout {
  WeightVersion version;
  std::uint32_t lease_ms = 0;  // > 0: explicit, survives an executor restart
  bool operator==(const ActiveRollout&) const = default;
};

// An update in flight, from READY→DRAINING until it ends in READY or TAINTED.
struct UpdatePlan {
  std::string update_id;
  WeightVersion target;
  WeightIdentity identity;
  std::string source_uri;
  bool drain_seen = false;        // a drain succeeded while local bindings were still active
  bool transfer_started = false;  // the kTransfer intent is durable: mutation may have begun
  std::uint8_t caches_reset_mask = 0;
  std::string expected_digest;   // the trainer's combined digest for the target ("" = none)
  WeightDigest observed_digest;  // the last digest VALIDATING observed
  bool validated = false;        // VALIDATING saw the target label: RESUMING publishes
  bool aborting = false;         // refused before mutation: RESUMING returns to the old version
  std::string abort_reason;
  // A restore of a TAINTED engine to an earlier committed version (expected_digest is the one
  // recorded for it): refused before mutation it returns to TAINTED, never to serving.
  bool restore = false;
  bool adopt = false;  // restore only: nothing is transferred, the engine is labelled and proven
  // Colocated mode. A sleep (sleep_level 1 or 2) and a wake-up (wake_only) keep the committed
  // version: their target is it. A plan from a SLEEPING engine (from_sleep: an update or a
  // wake-up) wakes the weights before the transfer and the KV cache last, as its resume; refused
  // before mutation, it leaves the engine SLEEPING.
  // A restore of an engine tainted while (possibly) asleep (wake_first) cannot know whether it
  // still sleeps, and vLLM resumes the scheduler of any engine a wake-up finds awake: it wakes
  // the weights, then the KV cache, and only then drains and pauses, so everything it checks is
  // checked paused.
  std::uint8_t sleep_level = 0;
  bool wake_only = false;
  bool from_sleep = false;
  bool weights_awake = false;  // the weights were woken (POST /wake_up?tags=weights answered 2xx)
  bool wake_first = false;
  bool kv_awake = false;      // wake_first only: POST /wake_up?tags=kv_cache answered 2xx
  DeviceMemory sleep_memory;  // a sleep's device memory around /sleep (for its answer)
  bool keeps_version() const { return sleep_level > 0 || wake_only; }
  bool operator==(const UpdatePlan&) const = default;
};

struct TaintRecord {
  Lifecycle from = Lifecycle::kUninitialized;
  Cause cause = Cause::kTransferAmbiguous;
  std::string update_id;
  WeightVersion target;
  std::string detail;
  bool operator==(const TaintRecord&) const = default;
};

struct Counters {
  std::uint64_t events = 0;
  std::uint64_t rollouts_admitted = 0;
  std::uint64_t rollouts_completed = 0;
  std::uint64_t rollouts_aborted = 0;
  std::uint64_t rollouts_abandoned = 0;
  std::uint64_t rollouts_expired = 0;
  std::uint64_t updates_requested = 0;
  std::uint64_t updates_committed = 0;
  std::uint64_t updates_refused = 0;
  std::uint64_t recoveries = 0;
  std::uint64_t restores_requested = 0;
  std::uint64_t restores_committed = 0;
  std::uint64_t sleeps_requested = 0;
  std::uint64_t sleeps_committed = 0;
  std::uint64_t wakes_requested = 0;
  std::uint64_t wakes_committed = 0;
  bool operator==(const Counters&) const = default;
};

// Adds every counter of `c` to `sum`.
void add_counters(Counters& sum, const Counters& c);

struct State {
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  // Committed version and identity: what the engine serves (valid from READY on).
  WeightVersion committed;
  WeightIdentity committed_identity;
  // The committed version's weight digest as the engine computed it (absent when the journal
  // uses none: it was bootstrapped on an engine that computes no digest).
  WeightDigest committed_digest;
  // The combined digest recorded for every committed label that had one: an identity served
  // again must come back with the same digest.
  std::map<std::string, std::string> label_digests;
  // Bootstrap request awaiting the probe (UNINITIALIZED only).
  std::optional<BootstrapRequested> bootstrap;
  // The fold rules the last bootstrap request recorded (BootstrapRequested::fold_rules), kept for
  // the journal's life; 0 before any.
  std::uint32_t fold_rules = 0;
  // Attempts of the current effect (counted from EffectStarted; reset when the effect changes).
  std::uint32_t attempts = 0;
  // The effect whose EffectStarted intent is durable and whose observation has not arrived.
  std::optional<Effect> in_flight;
  std::map<std::string, ActiveRollout> active;  // ordered: decisions over it are deterministic
  std::optional<UpdatePlan> update;
  std::optional<TaintRecord> taint;
  // The engine process the committed version was verified on ("" = it exposes no identity).
  std::string engine_instance;
  bool engine_reachable = true;  // the monitor's last word; false refuses admissions
  // An executor restarted and nothing has re-verified the engine since: no admissions (and, in
  // READY, a probe is due, kEffectAttemptsMax times) until a probe or the monitor shows the same
  // engine with the committed weights (weights_verified), or a validation does.
  bool engine_recheck = false;
  // Every label ever committed and the identity it named: a label names one policy for the
  // journal's life (re-committing it is allowed only for the same identity).
  std::map<std::string, WeightIdentity> labels;
  // What the engine released to a colocated trainer: 0 awake, else the sleep level. Set on
  // entering SLEEPING (or TAINTED by an ambiguous sleep), kept through a plan from sleep and a
  // taint, cleared when the engine is READY again.
  std::uint8_t sleep_level = 0;
  Counters counters;
  bool operator==(const State&) const = default;
};

// decide: for an input (or a client binding), the events it causes, or a rejection
// (kRejected for lifecycle refusals, kInvalidArgument for malformed fields). Never mutates.
[[nodiscard]] Result<std::vector<Event>> decide(const State& state, const Event& input);
// What decide derives once `after` holds `input` (applied by the caller, on its own state): the
// decisions, not yet applied. decide() is a copy, apply(input), derive_decisions, apply(each).
std::vector<Event> derive_decisions(const State& after, const Event& input);

// apply: the fold. Returns an error and leaves the state unchanged if the event is not legal
// in this state (a corrupt or forged history); asserts the invariants after every change.
[[nodiscard]] Status apply(State& state, const Event& event);

// next_effect: what the runner must perform now (kNone: nothing, wait for input).
Effect next_effect(const State& state);
// A plan that nothing moves any more: its effect failed kEffectAttemptsMax times and none is in
// flight (a RESUMING whose engine never answered the resume). Only an executor restart
// (RecoveryStarted) tries it again.
bool plan_stalled(const State& state);

// Invariants that must hold between any two events. Empty string when they hold.
std::string check_invariants(const State& state);
// The same without the per-rollout checks (O(1)); apply runs it after inputs.
std::string check_invariants_cheap(const State& state);

// Convenience: decide then apply the input and its consequences; returns the derived events.
[[nodiscard]] Result<std::vector<Event>> step(State& state, const Event& input);

// A binding for a new rollout under the committed version (the caller journals it as input).
RolloutAdmitted make_admission(const State& state, std::string rollout_id,
                               std::uint32_t lease_ms = 0);

// The fold's rules for outside text: an id (label, update id, engine name) is 1..kIdBytesMax
// bytes of printable UTF-8; text a client declared (checkpoint, source) is printable UTF-8 of at
// most kTextBytesMax bytes. `what` names the field in the error.
[[nodiscard]] Status check_id(const char* what, const std::string& s);
[[nodiscard]] Status check_client_text(const char* what, const std::string& s);

// The fold's rule for a declared identity (digests, checkpoint text, run id, step): the fleet
// checks a fleet update's target with it before any member is asked.
[[nodiscard]] Status check_weight_identity(const WeightIdentity& identity);
// A declared identity against the identities committed under `labels`: a content digest names
// one set of bytes, so one already committed with another manifest cannot be declared again with
// this one (the update and the fleet update are refused before anything is journaled).
[[nodiscard]] Status check_identity_consistent(const std::map<std::string, WeightIdentity>& labels,
                                               const WeightIdentity& identity);
// Rules for new requests only (step checks them, decide and apply do not: replay and audit
// re-decide recorded inputs), so a journal that recorded such a request before the rule existed
// opens, replays and audits as written.
// An update (of an awake engine) or a sleep only while the engine answers (`engine_reachable`);
// an identity that does not claim, under another manifest, a content digest already committed.
[[nodiscard]] Status check_new_request_rules(const State& s, const Event& input);
// A digest: lowercase hex of at most kDigestBytesMax chars; empty only when not `required`.
[[nodiscard]] Status check_digest(const char* what, const std::string& s, bool required);
// The fold's rule for a weight digest an engine computed (algorithm, combined, tensors sorted,
// unique, bounded): the executor checks an engine's answer with it before recording it.
[[nodiscard]] Status check_weight_digest(const WeightDigest& digest);
// Device memory an engine reported around a sleep or wake-up: each figure at most
// kDeviceBytesMax (so differences of them never overflow), free never above total, nothing
// when unknown. The executor checks its sums with it before recording them.
inline constexpr std::uint64_t kDeviceBytesMax = std::uint64_t{1} << 50;  // 1 PiB
[[nodiscard]] Status check_device_memory(const DeviceMemory& memory);
// Cuts an event's free texts (detail, reason, error, http.error) to kTextBytesMax, whole UTF-8
// characters: what the fold accepts. The executor applies it to what an effect reports, the fold
// to its own decisions, so neither is ever refused for its length.
void bound_texts(Event& event);

// Whether the state admits rollouts, and if not, why (for 503 messages and /readyz).
bool admits(const State& state);
std::string admission_block_reason(const State& state);

// Why a bootstrap probe does not take the engine ("" when it does): the fold's rule, exported so
// the executor can tell the operator exactly what was refused.
std::string explain_bootstrap_refusal(const BootstrapRequested& bootstrap, const EngineProbed& e);

// Whether an engine answering with this label, pause state and instance is the one the committed
// version was verified on (the fold's rule for EngineProbed and EngineMonitored in READY).
bool engine_matches(const State& state, const std::string& label, bool paused_known, bool paused,
                    const std::string& instance);
// Whether such an answer vouches for the engine: it matches and names its process (unless none
// was ever verified, as in journals from before instances). An answer that names none cannot
// tell the verified process from a restarted one, so it never clears a pending re-verification.
bool engine_vouched(const State& state, const std::string& label, bool paused_known, bool paused,
                    const std::string& instance);
// Whether the executor records a look at the engine as a change of its reachability: a failed
// answer while it was reachable, or, while it was unreachable, only an answer that vouches for it.
// An outage is what a restart looks like, so an answer naming no process must not resume
// admissions. (The fold sets reachability from what is recorded; journals written before this
// rule may hold an unvouched return, which it still reads as it did.)
bool look_changes_reachability(const State& state, const EngineMonitored& seen);

// "; N of M tensors differ: a, b, ..." naming at most kDigestTensorsNamedMax tensors of `now`
// whose digests are not those of `was` (or are in one only): the text a failed digest check
// carries. "" when either side names no tensors.
std::string digest_difference(const WeightDigest& was, const WeightDigest& now);

// Whether a digest the READY engine computed is the committed weights' (true when either side
// has none): the fold's rule for EngineProbed and EngineMonitored in READY.
bool weights_match(const State& state, const WeightDigest& digest);

// Whether a look's digest re-verifies the committed weights, by the journal's fold rules
// (state.fold_rules): from rules 1, only a digest equal to the committed one (any look, when none
// is committed); under rules 0, any that does not show other weights, one whose read failed
// included. Together with engine_vouched, the fold's rule for clearing engine_recheck on
// EngineProbed and EngineMonitored: a look that vouches for the process but fails this leaves the
// re-verification pending (journaling it clears nothing).
bool weights_verified(const State& state, const WeightDigest& digest);

// Whether a look clears a pending re-verification: the fold's rule for EngineMonitored (a look
// that answered, vouches for the verified process, shows no other weights, and re-verifies them
// by weights_verified). The executors journal a look for this only when it does, so a look that
// clears nothing is not recorded at every tick.
bool look_clears_recheck(const State& state, const EngineMonitored& seen);

// updates_requested + restores_requested + recoveries: what an EngineMonitored must name to be
// current.
std::uint64_t monitor_epoch(const State& state);

}  // namespace rc
