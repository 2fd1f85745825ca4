// Human-readable names for the enums; used in messages, the journal's JSON dump and replay output.
#include <type_traits>

#include "statemachine/events.h"
#include "statemachine/types.h"

namespace rc {

const char* lifecycle_name(Lifecycle s) {
  switch (s) {
    case Lifecycle::kUninitialized:
      return "UNINITIALIZED";
    case Lifecycle::kReady:
      return "READY";
    case Lifecycle::kDraining:
      return "DRAINING";
    case Lifecycle::kQuiesced:
      return "QUIESCED";
    case Lifecycle::kUpdating:
      return "UPDATING";
    case Lifecycle::kInvalidating:
      return "INVALIDATING";
    case Lifecycle::kValidating:
      return "VALIDATING";
    case Lifecycle::kResuming:
      return "RESUMING";
    case Lifecycle::kTainted:
      return "TAINTED";
    case Lifecycle::kSleeping:
      return "SLEEPING";
  }
  return "?";
}

const char* wake_tag_name(WakeTag t) {
  switch (t) {
    case WakeTag::kWeights:
      return "weights";
    case WakeTag::kKvCache:
      return "kv_cache";
  }
  return "?";
}

const char* cache_name(CacheKind c) {
  switch (c) {
    case CacheKind::kPrefix:
      return "prefix";
    case CacheKind::kEncoder:
      return "encoder";
    case CacheKind::kMultimodal:
      return "mm";
  }
  return "?";
}

const char* mutation_name(MutationClass m) {
  switch (m) {
    case MutationClass::kNone:
      return "none";
    case MutationClass::kPossible:
      return "possible";
    case MutationClass::kComplete:
      return "complete";
  }
  return "?";
}

const char* transport_name(Transport t) {
  switch (t) {
    case Transport::kOk:
      return "ok";
    case Transport::kConnectFailed:
      return "connect_failed";
    case Transport::kTimeout:
      return "timeout";
    case Transport::kBroken:
      return "broken";
  }
  return "?";
}

const char* outcome_name(RolloutOutcome o) {
  switch (o) {
    case RolloutOutcome::kCompleted:
      return "completed";
    case RolloutOutcome::kAborted:
      return "aborted";
    case RolloutOutcome::kAbandoned:
      return "abandoned";
    case RolloutOutcome::kExpired:
      return "expired";
  }
  return "?";
}

const char* effect_name(EffectKind e) {
  switch (e) {
    case EffectKind::kNone:
      return "none";
    case EffectKind::kProbeEngine:
      return "probe_engine";
    case EffectKind::kDrain:
      return "drain";
    case EffectKind::kAwaitRollouts:
      return "await_rollouts";
    case EffectKind::kPreflight:
      return "preflight";
    case EffectKind::kTransfer:
      return "transfer";
    case EffectKind::kResetCache:
      return "reset_cache";
    case EffectKind::kValidate:
      return "validate";
    case EffectKind::kResume:
      return "resume";
    case EffectKind::kSleep:
      return "sleep";
    case EffectKind::kWake:
      return "wake";
  }
  return "?";
}

const char* cause_name(Cause c) {
  switch (c) {
    case Cause::kBootstrapped:
      return "bootstrapped";
    case Cause::kUpdateRequested:
      return "update_requested";
    case Cause::kDrained:
      return "drained";
    case Cause::kDrainFailed:
      return "drain_failed";
    case Cause::kPreflightPassed:
      return "preflight_passed";
    case Cause::kPreflightRefused:
      return "preflight_refused";
    case Cause::kTransferred:
      return "transferred";
    case Cause::kTransferRefused:
      return "transfer_refused";
    case Cause::kTransferAmbiguous:
      return "transfer_ambiguous";
    case Cause::kCachesReset:
      return "caches_reset";
    case Cause::kCacheResetFailed:
      return "cache_reset_failed";
    case Cause::kValidated:
      return "validated";
    case Cause::kValidationFailed:
      return "validation_failed";
    case Cause::kResumed:
      return "resumed";
    case Cause::kRecoveredAmbiguous:
      return "recovered_ambiguous";
    case Cause::kRecoveredNoMutation:
      return "recovered_no_mutation";
    case Cause::kEngineReplaced:
      return "engine_replaced";
    case Cause::kEngineRelabelled:
      return "engine_relabelled";
    case Cause::kEnginePausedExternally:
      return "engine_paused_externally";
    case Cause::kWeightsChanged:
      return "weights_changed";
    case Cause::kRestoreRequested:
      return "restore_requested";
    case Cause::kSleepRequested:
      return "sleep_requested";
    case Cause::kSlept:
      return "slept";
    case Cause::kSleepFailed:
      return "sleep_failed";
    case Cause::kWakeRequested:
      return "wake_requested";
    case Cause::kWakeFailed:
      return "wake_failed";
    case Cause::kWoken:
      return "woken";
    case Cause::kEngineWokenExternally:
      return "engine_woken_externally";
    case Cause::kEngineSleptExternally:
      return "engine_slept_externally";
  }
  return "?";
}

const char* update_outcome_name(UpdateOutcome o) {
  switch (o) {
    case UpdateOutcome::kCommitted:
      return "committed";
    case UpdateOutcome::kRefused:
      return "refused";
    case UpdateOutcome::kTainted:
      return "tainted";
  }
  return "?";
}

bool TrajectoryRecorded::operator==(const TrajectoryRecorded& o) const {
  if (rollout_id != o.rollout_id || part != o.part || prompt_token_ids != o.prompt_token_ids ||
      output_token_ids != o.output_token_ids ||
      output_logprobs.size() != o.output_logprobs.size()) {
    return false;
  }
  for (std::size_t i = 0; i < output_logprobs.size(); ++i) {
    const float a = output_logprobs[i];
    const float b = o.output_logprobs[i];
    if (!(a == b) && !(a != a && b != b)) return false;  // NaN == NaN here: "not reported"
  }
  return true;
}

namespace {
template <class T>
constexpr const char* name_of() {
  if constexpr (std::is_same_v<T, BootstrapRequested>) return "BootstrapRequested";
  if constexpr (std::is_same_v<T, UpdateRequested>) return "UpdateRequested";
  if constexpr (std::is_same_v<T, RecoveryStarted>) return "RecoveryStarted";
  if constexpr (std::is_same_v<T, EffectStarted>) return "EffectStarted";
  if constexpr (std::is_same_v<T, EngineProbed>) return "EngineProbed";
  if constexpr (std::is_same_v<T, DrainObserved>) return "DrainObserved";
  if constexpr (std::is_same_v<T, DrainTimedOut>) return "DrainTimedOut";
  if constexpr (std::is_same_v<T, PreflightObserved>) return "PreflightObserved";
  if constexpr (std::is_same_v<T, TransferObserved>) return "TransferObserved";
  if constexpr (std::is_same_v<T, CacheResetObserved>) return "CacheResetObserved";
  if constexpr (std::is_same_v<T, ValidationObserved>) return "ValidationObserved";
  if constexpr (std::is_same_v<T, ResumeObserved>) return "ResumeObserved";
  if constexpr (std::is_same_v<T, RolloutAdmitted>) return "RolloutAdmitted";
  if constexpr (std::is_same_v<T, RolloutFinished>) return "RolloutFinished";
  if constexpr (std::is_same_v<T, StateChanged>) return "StateChanged";
  if constexpr (std::is_same_v<T, VersionPublished>) return "VersionPublished";
  if constexpr (std::is_same_v<T, UpdateEnded>) return "UpdateEnded";
  if constexpr (std::is_same_v<T, TrajectoryRecorded>) return "TrajectoryRecorded";
  if constexpr (std::is_same_v<T, EngineMonitored>) return "EngineMonitored";
  if constexpr (std::is_same_v<T, RestoreRequested>) return "RestoreRequested";
  if constexpr (std::is_same_v<T, SleepRequested>) return "SleepRequested";
  if constexpr (std::is_same_v<T, WakeRequested>) return "WakeRequested";
  if constexpr (std::is_same_v<T, SleepObserved>) return "SleepObserved";
  if constexpr (std::is_same_v<T, WakeObserved>) return "WakeObserved";
  if constexpr (std::is_same_v<T, FleetConfigured>) return "FleetConfigured";
  if constexpr (std::is_same_v<T, EngineJoined>) return "EngineJoined";
  if constexpr (std::is_same_v<T, EngineRemovalRequested>) return "EngineRemovalRequested";
  if constexpr (std::is_same_v<T, EngineRemoved>) return "EngineRemoved";
  if constexpr (std::is_same_v<T, FleetUpdateRequested>) return "FleetUpdateRequested";
  if constexpr (std::is_same_v<T, FleetUpdateEnded>) return "FleetUpdateEnded";
  if constexpr (std::is_same_v<T, FleetUpdateCancelled>) return "FleetUpdateCancelled";
  return "?";
}
}  // namespace

const char* event_name(const Event& e) {
  return std::visit([](const auto& v) { return name_of<std::decay_t<decltype(v)>>(); }, e);
}

Family family_of(const Event& e) {
  if (std::holds_alternative<RolloutAdmitted>(e) || std::holds_alternative<RolloutFinished>(e) ||
      std::holds_alternative<TrajectoryRecorded>(e)) {
    return Family::kBinding;
  }
  if (std::holds_alternative<StateChanged>(e) || std::holds_alternative<VersionPublished>(e) ||
      std::holds_alternative<UpdateEnded>(e) || std::holds_alternative<EngineRemoved>(e) ||
      std::holds_alternative<FleetUpdateEnded>(e)) {
    return Family::kDecision;
  }
  return Family::kInput;
}

bool is_fleet_event(const Event& e) {
  return std::holds_alternative<FleetConfigured>(e) || std::holds_alternative<EngineJoined>(e) ||
         std::holds_alternative<EngineRemovalRequested>(e) ||
         std::holds_alternative<EngineRemoved>(e) ||
         std::holds_alternative<FleetUpdateRequested>(e) ||
         std::holds_alternative<FleetUpdateEnded>(e) ||
         std::holds_alternative<FleetUpdateCancelled>(e);
}

const char* fleet_update_mode_name(FleetUpdateMode m) {
  switch (m) {
    case FleetUpdateMode::kAll:
      return "all";
    case FleetUpdateMode::kRolling:
      return "rolling";
  }
  return "?";
}

const char* fleet_outcome_name(FleetOutcome o) {
  switch (o) {
    case FleetOutcome::kCommitted:
      return "committed";
    case FleetOutcome::kPartial:
      return "partial";
    case FleetOutcome::kRefused:
      return "refused";
  }
  return "?";
}

}  // namespace rc
