// Events: the only way anything enters or leaves the controller. Plain C++ types.
//
// Three families:
//   inputs    — commands accepted (bootstrap, update, recovery) and adapter observations
//               (typed evidence of each effect, plus the write-ahead EffectStarted intent);
//   bindings  — a rollout admitted under a committed version+identity, and its end;
//   decisions — lifecycle transitions, a published version, the end of an update.
//
// A journal append is one group: an input (or client binding) followed by the events decide()
// derived from it; each derived event records the seq of its input (`cause_seq` in the journal
// envelope). Everything nondeterministic (outcomes, durations, labels the engine reported) is a
// field here; the fold never reads a clock, the network or the disk.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "statemachine/types.h"

namespace rc {

// ---- inputs: commands ----

// The versions of the fold's rules. A journal folds by the rules its BootstrapRequested recorded,
// so a journal written by an earlier RolloutCore folds as it was folded then, and a new bootstrap
// records the current rules. What each version changed:
//   0  the rules before versions were recorded (a BootstrapRequested without the field).
//   1  a pending re-verification (State::engine_recheck) is cleared by an observation
//      (EngineProbed, EngineMonitored) only with a weight digest equal to the committed one,
//      when one is committed: a look whose digest read failed no longer re-verifies the weights.
// A rule change that would fold a recorded journal differently raises this number, never changes
// what an existing number means. A record of a version above this build's is refused (the journal
// is from a newer RolloutCore), never folded by rules this build does not know.
inline constexpr std::uint32_t kFoldRulesCurrent = 1;

// Start serving: the engine must report `label` before the controller goes READY.
// With `adopt`, the operator accepts an engine found in another state: one that reports another
// label (it is relabelled) or is paused (it is resumed); the probe journals what was seen.
struct BootstrapRequested {
  std::string label;
  WeightIdentity identity;
  bool adopt = false;
  // The engine must compute a weight digest at the probe; without one the bootstrap is refused.
  // (Without this flag a digest is used whenever the engine computes one.)
  bool require_digest = false;
  // The combined weight digest the engine must hold ("" = none): the digest the fleet's engines
  // of the same layout hold for `label` (recorded, or read by an open plan's validation), so that
  // a joining engine is proven to hold the fleet's weights, not only to report its label.
  std::string expected_digest;
  // The fold rules the engine's journal folds by (kFoldRulesCurrent above): a new bootstrap
  // records this build's, a record written before they were recorded reads 0.
  std::uint32_t fold_rules = kFoldRulesCurrent;
  bool operator==(const BootstrapRequested&) const = default;
};

// A trainer asks for the engine to move to a new generation.
struct UpdateRequested {
  std::string update_id;     // client-chosen, unique per update
  std::string target_label;  // what the engine must report after the update
  WeightIdentity identity;   // what the target is declared to contain
  std::string source_uri;    // e.g. "safetensors:/ckpt/model.safetensors", "ipc:..."
  // The combined weight digest the trainer computed for the engine's layout ("" = none): when
  // given, VALIDATING requires the engine's digest to equal it.
  std::string expected_digest;
  bool operator==(const UpdateRequested&) const = default;
};

// An operator asks to take a TAINTED engine back to a version committed earlier in this journal,
// with proof: the engine reloads that version's weights from `source_uri` (or, with `adopt`, is
// taken as already holding them: an engine restarted outside RolloutCore on that checkpoint), and
// VALIDATING requires the weight digest recorded when that version was served. The restore runs
// the update path (drain, preflight, transfer, resets, validation while paused, resume); anything
// that fails before the weights may have changed leaves the engine TAINTED, as it was.
struct RestoreRequested {
  std::string restore_id;  // client-chosen, unique per update or restore
  std::string label;       // a label committed earlier in this journal, with a digest recorded
  std::string source_uri;  // where that version's weights are ("" with adopt)
  bool adopt = false;      // the engine already holds them: only label, reset and prove
  bool operator==(const RestoreRequested&) const = default;
};

// Colocated mode: the trainer asks the engine to release its GPU memory. The engine drains like
// for an update (every rollout admitted before finishes first), then sleeps at `level` (1 or 2)
// and admits nothing until an update (or, after level 1, a wake-up) brings it back.
struct SleepRequested {
  std::string sleep_id;  // client-chosen, unique per update, restore, sleep or wake
  std::uint8_t level = 1;
  bool operator==(const SleepRequested&) const = default;
};

// Colocated mode: wake a level-1 sleeper on the weights it holds. The wake-up runs the update's
// checks with no transfer: caches reset, then the label and the weight digest are validated
// while the KV cache still sleeps (nothing is served), and only then is the KV cache woken.
struct WakeRequested {
  std::string wake_id;  // client-chosen, unique per update, restore, sleep or wake
  bool operator==(const WakeRequested&) const = default;
};

// How the run before an executor's start left the journal, as the journal's open found it (the
// executor records it in RecoveryStarted: once the journal is written on, its WAL no longer shows
// a torn tail, and the record is what tells it). Values are part of the journal format: append
// only.
enum class JournalEnding : std::uint8_t {
  kNotRecorded = 0,  // a record from before this was recorded, or no open (a stalled-plan retry)
  kNewJournal = 1,   // the journal held no records: no run before this one wrote to it
  kCleanClose = 2,   // the last run closed it cleanly, and the open found it whole
  kCrash = 3,        // no clean close (a crash, a kill, a fail-stop); the WAL read whole
  kTornTail = 4,     // a crash, and the open's recovery could not read the WAL's tail
};
inline constexpr std::uint8_t kJournalEndingMax = 4;
inline const char* journal_ending_name(JournalEnding e) {
  switch (e) {
    case JournalEnding::kNotRecorded:
      return "not_recorded";
    case JournalEnding::kNewJournal:
      return "new_journal";
    case JournalEnding::kCleanClose:
      return "clean_close";
    case JournalEnding::kCrash:
      return "crash";
    case JournalEnding::kTornTail:
      return "torn_tail";
  }
  return "?";
}

// The executor (re)started and is reconciling with the journal; or, with an executor_id that
// begins with kStalledPlanRetryPrefix, a running executor tries a stalled plan again (the fold
// treats both alike; replay tells them apart).
struct RecoveryStarted {
  std::string executor_id;
  // What the journal's open before this start found (kNotRecorded for a stalled-plan retry):
  // with kTornTail, the WAL bytes its recovery could not read and the journal's own sentence
  // naming the file(s), the bytes and the seqs (bounded text, escaped by every reader on output);
  // 0 and "" otherwise.
  JournalEnding journal_ending = JournalEnding::kNotRecorded;
  std::uint64_t journal_bytes_unread = 0;
  std::string journal_torn_tail;
  bool operator==(const RecoveryStarted&) const = default;
};
inline constexpr const char* kStalledPlanRetryPrefix = "stalled-plan-retry:";
inline bool is_stalled_plan_retry(const RecoveryStarted& e) {
  return e.executor_id.rfind(kStalledPlanRetryPrefix, 0) == 0;
}

// ---- inputs: observations ----

// Write-ahead intent: durable before the effect is performed. For kTransfer, its presence is
// what makes a crash in UPDATING ambiguous.
struct EffectStarted {
  EffectKind kind = EffectKind::kNone;
  CacheKind cache = CacheKind::kPrefix;  // meaningful for kResetCache only
  std::uint64_t deadline_ms = 0;         // the deadline the runner gave the effect
  WakeTag wake = WakeTag::kWeights;      // meaningful for kWake only
  bool operator==(const EffectStarted&) const = default;
};

// /health + /version + the label + /is_paused + the engine's process identity, at bootstrap and
// when a restarted executor re-verifies a READY engine.
struct EngineProbed {
  HttpEvidence http;
  std::string engine_version;  // from /version
  std::string reported_label;  // from /weight_info (or the worker extension)
  bool is_paused_known = false;
  bool is_paused = false;
  // Which engine process answered: the worker extension's instance nonce, else the process start
  // time from /metrics; empty when the engine exposes neither (restarts then go unseen).
  std::string engine_instance;
  std::string label_before;     // the label found before the runner set it ("" = not set)
  bool resumed_before = false;  // the runner resumed a paused engine (adoption only)
  WeightDigest digest;          // what the engine holds (absent when it cannot compute one)
  bool operator==(const EngineProbed&) const = default;
};

// The executor's engine monitor, while READY: what the engine is now. Submitted only when it
// changes something (reachability, a mismatch, a pending re-verification), never as a heartbeat.
// `updates_seen` is updates_requested + recoveries of the state the monitor compared against:
// an observation taken before an update (or a restart) is stale and refused.
struct EngineMonitored {
  HttpEvidence http;
  std::string reported_label;
  bool is_paused_known = false;
  bool is_paused = false;
  std::string engine_instance;
  std::int64_t last_ok_wall_ms = 0;  // when the monitor last saw the validated engine
  std::uint64_t updates_seen = 0;
  WeightDigest digest;  // present when this observation included a digest check
  bool operator==(const EngineMonitored&) const = default;
};

// POST /pause?mode=wait&clear_cache=false returned (or failed).
struct DrainObserved {
  HttpEvidence http;
  bool paused = false;  // body said {"status":"paused"}
  bool operator==(const DrainObserved&) const = default;
};

// The runner waited for local bindings (kAwaitRollouts) past its deadline.
struct DrainTimedOut {
  std::uint64_t waited_ms = 0;
  std::uint32_t active_rollouts = 0;
  bool operator==(const DrainTimedOut&) const = default;
};

// Checks before any mutation: the source's manifest, the sender's device and memory.
struct PreflightObserved {
  std::string source_manifest_digest;  // computed from the weight source
  bool device_ok = false;              // calling thread's device == communicator's device
  bool memory_ok = false;              // staging buffers fit
  std::string detail;
  bool operator==(const PreflightObserved&) const = default;
};

// The weight transfer (start/update/finish + data plane) ended.
struct TransferObserved {
  bool acknowledged = false;  // every HTTP step answered 2xx and every byte was sent
  MutationClass mutation = MutationClass::kNone;
  std::uint64_t bytes_sent = 0;
  std::uint32_t tensors_sent = 0;
  std::uint64_t duration_us = 0;
  std::string finish_label;  // label sent in /finish_weight_update
  std::string error;
  // The start met a weight session open that this controller did not start (someone else's):
  // the engine's weights may have changed while it served the committed version, so the audit
  // opens the taint's suspect window as for a taint found while READY. The fold reads only
  // `mutation`; a record without the field reads false.
  bool foreign_session = false;
  bool operator==(const TransferObserved&) const = default;
};

// One cache reset. `reported_success` is the body's "success"; when the engine's answer carries
// none (the mm/encoder routes; every reset route of vLLM 0.25.x answers an empty 200) it is true
// on 2xx and `success_unreported` records that the engine did not report an outcome.
struct CacheResetObserved {
  CacheKind cache = CacheKind::kPrefix;
  HttpEvidence http;
  bool reported_success = false;
  bool success_unreported = false;
  bool operator==(const CacheResetObserved&) const = default;
};

// GET /weight_info (+ optional checksum / canary checks) while the engine is still paused.
struct ValidationObserved {
  HttpEvidence http;
  std::string reported_label;
  bool checks_passed = true;  // optional checks; true when none configured
  std::string detail;
  std::string engine_instance;  // which engine process answered (see EngineProbed)
  WeightDigest digest;          // what the engine holds now, computed while paused
  // GET /is_paused after the label and digest were read: evidence read from an engine someone
  // resumed meanwhile was not checked paused (unknown: the read failed; read again).
  bool is_paused_known = false;
  bool is_paused = true;
  bool operator==(const ValidationObserved&) const = default;
};

// POST /resume, GET /is_paused, then (once unpaused) GET /is_sleeping.
struct ResumeObserved {
  HttpEvidence http;
  bool is_paused_known = false;
  bool is_paused = true;
  // Which engine process answered after the resume (see EngineProbed; "" unknown): a process
  // other than the one verified never serves what that one was verified for.
  std::string engine_instance;
  // An engine that still sleeps once resumed was slept by someone else while the plan held it
  // paused: its scheduler now runs on memory it released. Unknown without the route.
  bool is_sleeping_known = false;
  bool is_sleeping = false;
  bool operator==(const ResumeObserved&) const = default;
};

// The engine's device memory around a sleep or a wake-up, as its workers reported it (the worker
// extension's rc_device_info, summed over workers); unknown without the extension.
struct DeviceMemory {
  bool known = false;
  std::uint64_t free_bytes_before = 0;
  std::uint64_t free_bytes_after = 0;
  std::uint64_t total_bytes = 0;
  bool operator==(const DeviceMemory&) const = default;
};

// POST /sleep?level=L&mode=wait, then GET /is_sleeping.
struct SleepObserved {
  HttpEvidence http;
  std::uint8_t level = 0;  // the level sent
  bool is_sleeping_known = false;
  bool is_sleeping = false;
  DeviceMemory memory;
  bool operator==(const SleepObserved&) const = default;
};

// POST /wake_up?tags=<tag>; after the KV cache (which resumes the scheduler), GET /is_paused.
struct WakeObserved {
  HttpEvidence http;
  WakeTag tag = WakeTag::kWeights;
  bool is_paused_known = false;
  bool is_paused = true;
  DeviceMemory memory;
  std::string engine_instance;  // after the KV cache's wake-up, as ResumeObserved's
  bool operator==(const WakeObserved&) const = default;
};

// ---- bindings ----

// lease_ms 0: the rollout lives as long as its proxied request (a restarted executor records it
// abandoned). lease_ms > 0: an explicit rollout whose client renews a lease; it survives an
// executor restart and ends by its finish, or expired once the lease lapses.
struct RolloutAdmitted {
  std::string rollout_id;
  WeightVersion version;    // must equal the committed version
  WeightIdentity identity;  // must equal the committed identity
  std::uint32_t lease_ms = 0;
  bool operator==(const RolloutAdmitted&) const = default;
};

struct RolloutFinished {
  std::string rollout_id;
  RolloutOutcome outcome = RolloutOutcome::kCompleted;
  std::uint32_t prompt_tokens = 0;
  std::uint32_t completion_tokens = 0;
  bool operator==(const RolloutFinished&) const = default;
};

// What the policy produced for a rollout, recorded for audit before the rollout finishes:
// prompt and output token ids and the output tokens' logprobs as the engine reported them
// (NaN where none was reported). Long trajectories span several records (part 0, 1, ...), each
// within kTrajectoryTokensPerRecordMax tokens; the audit concatenates them in seq order.
inline constexpr std::size_t kTrajectoryTokensPerRecordMax = 4096;
struct TrajectoryRecorded {
  std::string rollout_id;
  std::uint32_t part = 0;
  std::vector<std::int32_t> prompt_token_ids;
  std::vector<std::int32_t> output_token_ids;
  std::vector<float> output_logprobs;                  // empty, or one per output token
  bool operator==(const TrajectoryRecorded& o) const;  // NaN-aware
};

// ---- decisions ----

// Why a transition happened. Values are part of the journal format: append only.
enum class Cause : std::uint8_t {
  kBootstrapped = 0,
  kUpdateRequested = 1,
  kDrained = 2,
  kDrainFailed = 3,
  kPreflightPassed = 4,
  kPreflightRefused = 5,
  kTransferred = 6,
  kTransferRefused = 7,    // failed, proven before mutation
  kTransferAmbiguous = 8,  // failed after bytes may have landed
  kCachesReset = 9,
  kCacheResetFailed = 10,
  kValidated = 11,
  kValidationFailed = 12,
  kResumed = 13,
  kRecoveredAmbiguous = 14,      // executor restarted after the transfer intent was durable
  kRecoveredNoMutation = 15,     // executor restarted in UPDATING before any transfer intent
  kEngineReplaced = 16,          // READY, but another engine process answers (restarted)
  kEngineRelabelled = 17,        // READY, but the engine reports a label nobody committed
  kEnginePausedExternally = 18,  // READY, but someone else paused the engine
  kWeightsChanged = 19,          // READY, but the engine's weight digest is not the committed one
  kRestoreRequested = 20,        // TAINTED -> DRAINING: a restore with proof begins
  kSleepRequested = 21,          // READY -> DRAINING: the trainer wants the GPU memory
  kSlept = 22,                   // QUIESCED -> SLEEPING
  kSleepFailed = 23,             // the sleep was refused (-> RESUMING) or is ambiguous (TAINTED)
  kWakeRequested = 24,           // SLEEPING -> UPDATING: wake a level-1 sleeper, no transfer
  kWakeFailed = 25,              // waking the weights was refused (-> SLEEPING) or ambiguous
  kWoken = 26,                   // UPDATING -> INVALIDATING: the weights are awake (no transfer)
  kEngineWokenExternally = 27,   // SLEEPING, but someone else resumed the engine
  kEngineSleptExternally = 28,   // RESUMING, but the resumed engine sleeps: someone else slept it
};
inline constexpr std::uint8_t kCauseMax = 28;
const char* cause_name(Cause c);

struct StateChanged {
  Lifecycle from = Lifecycle::kUninitialized;
  Lifecycle to = Lifecycle::kUninitialized;
  Cause cause = Cause::kBootstrapped;
  std::string detail;
  bool operator==(const StateChanged&) const = default;
};

struct VersionPublished {
  std::string update_id;
  WeightVersion version;
  WeightIdentity identity;
  std::string engine_digest;  // the combined digest VALIDATING saw ("" when none is in use)
  bool operator==(const VersionPublished&) const = default;
};

enum class UpdateOutcome : std::uint8_t { kCommitted = 0, kRefused = 1, kTainted = 2 };
const char* update_outcome_name(UpdateOutcome o);

struct UpdateEnded {
  std::string update_id;
  UpdateOutcome outcome = UpdateOutcome::kCommitted;
  std::string reason;
  bool operator==(const UpdateEnded&) const = default;
};

// ---- the fleet's own events (statemachine/fleet.h folds them; an engine's fold refuses them) ----

inline constexpr std::size_t kFleetEnginesMax = 256;
inline constexpr std::uint32_t kFleetStalenessMax = 1000000;  // generations

// The admission and update rules of the fleet; journaled so that the fold reads them from its
// history. Defaults: no staleness, nothing kept serving by an update outside an `all` update.
struct FleetConfigured {
  std::uint32_t staleness_max = 0;
  std::uint32_t min_serving = 0;
  bool operator==(const FleetConfigured&) const = default;
};

// A new engine: UNINITIALIZED until its bootstrap, which must name the fleet's newest label.
struct EngineJoined {
  std::string engine;
  bool operator==(const EngineJoined&) const = default;
};

// The engine admits nothing from now on; it is removed (a decision) once its last rollout ends.
struct EngineRemovalRequested {
  std::string engine;
  bool operator==(const EngineRemovalRequested&) const = default;
};

struct EngineRemoved {  // decision
  std::string engine;
  bool operator==(const EngineRemoved&) const = default;
};

// Values are part of the journal format: append only.
enum class FleetUpdateMode : std::uint8_t { kAll = 0, kRolling = 1 };
inline constexpr std::uint8_t kFleetUpdateModeMax = 1;
const char* fleet_update_mode_name(FleetUpdateMode m);

// A trainer asks every engine that can serve to move to `target_label`. Each member then gets a
// per-engine UpdateRequested with this update_id, label, identity and source, in the order the
// mode allows (the executor submits them; the fold refuses any the mode does not allow).
struct FleetUpdateRequested {
  std::string update_id;
  FleetUpdateMode mode = FleetUpdateMode::kAll;
  std::uint32_t batch_max = 1;    // rolling: members updating at once, at most
  std::uint32_t min_healthy = 1;  // members needed, else the update is refused as a whole
  std::string target_label;
  WeightIdentity identity;
  std::string source_uri;
  // The trainer's digest of the target weights (lowercase hex), for engines of one layout: each
  // member then publishes only if the digest it reads while paused equals it. "": none.
  std::string expected_digest;
  // How the fold judges a member stalled. true: once the group of the member's input is folded,
  // so an observation that succeeds on its last attempt is no stall. false: after each event, as
  // the updates journaled before this field were judged (their recorded decisions follow it).
  bool stall_judged_per_group = true;
  bool operator==(const FleetUpdateRequested&) const = default;
};

// The operator gives up on the members that have not started (they are skipped); members already
// updating finish their own updates, which have deadlines. The fleet update ends once they have.
struct FleetUpdateCancelled {
  std::string update_id;
  std::string reason;
  bool operator==(const FleetUpdateCancelled&) const = default;
};

// Values are part of the journal format: append only.
enum class FleetOutcome : std::uint8_t {
  kCommitted = 0,  // every member committed
  kPartial = 1,    // some committed; the others were refused, TAINTED or skipped
  kRefused = 2,    // none committed (refused as a whole, or every member failed)
};
inline constexpr std::uint8_t kFleetOutcomeMax = 2;
const char* fleet_outcome_name(FleetOutcome o);

struct FleetUpdateEnded {  // decision
  std::string update_id;
  FleetOutcome outcome = FleetOutcome::kCommitted;
  std::uint32_t committed = 0, refused = 0, tainted = 0, skipped = 0;
  std::string reason;
  std::uint32_t stalled = 0;  // members whose own plan was still open, out of attempts
  bool operator==(const FleetUpdateEnded&) const = default;
};

// Variant order is internal; the journal maps each alternative to a fixed union tag.
using Event =
    std::variant<BootstrapRequested, UpdateRequested, RecoveryStarted, EffectStarted, EngineProbed,
                 DrainObserved, DrainTimedOut, PreflightObserved, TransferObserved,
                 CacheResetObserved, ValidationObserved, ResumeObserved, RolloutAdmitted,
                 RolloutFinished, StateChanged, VersionPublished, UpdateEnded, TrajectoryRecorded,
                 EngineMonitored, RestoreRequested, SleepRequested, WakeRequested, SleepObserved,
                 WakeObserved, FleetConfigured, EngineJoined, EngineRemovalRequested, EngineRemoved,
                 FleetUpdateRequested, FleetUpdateEnded, FleetUpdateCancelled>;

enum class Family : std::uint8_t { kInput = 0, kBinding = 1, kDecision = 2 };
Family family_of(const Event& e);
const char* event_name(const Event& e);
// One of the fleet's own events (membership, policy, fleet updates): no engine's.
bool is_fleet_event(const Event& e);

}  // namespace rc
