// The lifecycle controller: decide, apply (the fold), next_effect and the invariants.
//
// Rules (docs/architecture.md, docs/lifecycle.md), all enforced here and nowhere else:
//  * admit only in READY, bound to the committed version and identity;
//  * an update request stops admissions (READY -> DRAINING);
//  * QUIESCED only after a drain observed while no local binding is active (an engine that went
//    idle before the local release landed is re-confirmed, never assumed);
//  * mutation (the transfer intent) only from UPDATING, entered only from QUIESCED after preflight
//    (the source's manifest equals the declared identity, device and memory checked);
//  * publish only after every cache reset reported success and VALIDATING saw the target label
//    and, once the journal holds weight digests, a digest that proves the weights changed (or
//    equals the one recorded for the same weights, or the trainer's expected one);
//  * a failure that may have mutated weights -> TAINTED; one proven to precede mutation -> the
//    update is refused and the engine resumes on the old version, untainted;
//  * TAINTED admits nothing and publishes nothing; the only way out is a restore with proof:
//    the update path to a version committed earlier in this journal, published only when the
//    engine's digest equals the one recorded for it. A restore refused before mutation returns
//    to TAINTED, never to serving.
#include <string>
#include <type_traits>
#include <utility>

#include "statemachine/hex.h"
#include "statemachine/overloaded.h"
#include "statemachine/state.h"
#include "statemachine/text.h"

namespace rc {

Status check_id(const char* what, const std::string& s) {
  if (s.empty()) return Status::InvalidArgument(std::string(what) + " is empty");
  if (s.size() > kIdBytesMax) {
    return Status::InvalidArgument(std::string(what) + " exceeds " + std::to_string(kIdBytesMax) +
                                   " bytes");
  }
  if (!text::printable_utf8(s)) {
    return Status::InvalidArgument(std::string(what) + " must be UTF-8 without control characters");
  }
  return Status::OK();
}

namespace {

// Free text the executor recorded (errors, details, engine answers): bounded here, escaped by
// every reader on output.
Status check_text(const char* what, const std::string& s) {
  if (s.size() > kTextBytesMax) {
    return Status::InvalidArgument(std::string(what) + " exceeds " + std::to_string(kTextBytesMax) +
                                   " bytes");
  }
  return Status::OK();
}

}  // namespace

Status check_client_text(const char* what, const std::string& s) {
  RC_RETURN_IF_ERROR(check_text(what, s));
  if (!text::printable_utf8(s)) {
    return Status::InvalidArgument(std::string(what) + " must be UTF-8 without control characters");
  }
  return Status::OK();
}

void add_counters(Counters& sum, const Counters& c) {
  sum.events += c.events;
  sum.rollouts_admitted += c.rollouts_admitted;
  sum.rollouts_completed += c.rollouts_completed;
  sum.rollouts_aborted += c.rollouts_aborted;
  sum.rollouts_abandoned += c.rollouts_abandoned;
  sum.rollouts_expired += c.rollouts_expired;
  sum.updates_requested += c.updates_requested;
  sum.updates_committed += c.updates_committed;
  sum.updates_refused += c.updates_refused;
  sum.recoveries += c.recoveries;
  sum.restores_requested += c.restores_requested;
  sum.restores_committed += c.restores_committed;
  sum.sleeps_requested += c.sleeps_requested;
  sum.sleeps_committed += c.sleeps_committed;
  sum.wakes_requested += c.wakes_requested;
  sum.wakes_committed += c.wakes_committed;
}

Status check_digest(const char* what, const std::string& s, bool required) {
  if (s.empty()) {
    if (required) return Status::InvalidArgument(std::string(what) + " is empty");
    return Status::OK();
  }
  if (s.size() > kDigestBytesMax || !hex::is_lower(s)) {
    return Status::InvalidArgument(std::string(what) + " must be lowercase hex of at most " +
                                   std::to_string(kDigestBytesMax) + " chars");
  }
  return Status::OK();
}

namespace {

Status check_identity(const WeightIdentity& id) {
  RC_RETURN_IF_ERROR(check_digest("identity.manifest_digest", id.manifest_digest, true));
  RC_RETURN_IF_ERROR(check_digest("identity.content_digest", id.content_digest, false));
  RC_RETURN_IF_ERROR(check_client_text("identity.checkpoint", id.checkpoint));
  if (!id.run.empty()) RC_RETURN_IF_ERROR(check_id("identity.run", id.run));
  if (id.step < -1) return Status::InvalidArgument("identity.step must be >= -1");
  return Status::OK();
}

Status check_tensor_digests(const std::vector<TensorDigest>& tensors) {
  if (tensors.size() > kTensorDigestsMax) {
    return Status::InvalidArgument("digest names more than " + std::to_string(kTensorDigestsMax) +
                                   " tensors");
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorDigest& t = tensors[i];
    if (t.name.empty() || t.name.size() > kTensorNameBytesMax || !text::printable_utf8(t.name)) {
      return Status::InvalidArgument("digest tensor " + std::to_string(i) + ": name empty, over " +
                                     std::to_string(kTensorNameBytesMax) + " bytes or unprintable");
    }
    if (i > 0 && !(tensors[i - 1].name < t.name)) {
      return Status::InvalidArgument("digest tensors not sorted by name or not unique");
    }
    RC_RETURN_IF_ERROR(check_digest("digest tensor digest", t.digest, true));
  }
  return Status::OK();
}

}  // namespace

void bound_texts(Event& event) {
  const auto bound = [](std::string& t) {
    if (t.size() > kTextBytesMax) t = text::utf8_prefix(std::move(t), kTextBytesMax);
  };
  std::visit(
      [&bound](auto& e) {
        if constexpr (requires { e.detail; }) bound(e.detail);
        if constexpr (requires { e.reason; }) bound(e.reason);
        if constexpr (requires { e.error; }) bound(e.error);
        if constexpr (requires { e.http.error; }) bound(e.http.error);
      },
      event);
}

Status check_device_memory(const DeviceMemory& m) {
  if (!m.known && (m.free_bytes_before | m.free_bytes_after | m.total_bytes) != 0) {
    return Status::InvalidArgument("device memory figures marked unknown");
  }
  if (m.total_bytes > kDeviceBytesMax) {
    return Status::InvalidArgument("device memory total above " + std::to_string(kDeviceBytesMax) +
                                   " bytes");
  }
  if (m.free_bytes_before > m.total_bytes || m.free_bytes_after > m.total_bytes) {
    return Status::InvalidArgument("device free memory above its total");
  }
  return Status::OK();
}

Status check_weight_digest(const WeightDigest& d) {
  if (d.algorithm.size() > kIdBytesMax || !text::printable_utf8(d.algorithm)) {
    return Status::InvalidArgument("digest algorithm over " + std::to_string(kIdBytesMax) +
                                   " bytes or unprintable");
  }
  RC_RETURN_IF_ERROR(check_digest("digest combined", d.combined, false));
  RC_RETURN_IF_ERROR(check_text("digest error", d.error));
  if (!d.present() && (!d.tensors.empty() || !d.algorithm.empty())) {
    return Status::InvalidArgument("digest names tensors or an algorithm but no combined digest");
  }
  return check_tensor_digests(d.tensors);
}

namespace {

Status check_http(const HttpEvidence& h) {
  if (static_cast<std::uint8_t>(h.transport) > 3) {
    return Status::InvalidArgument("http.transport out of range");
  }
  if (h.http_status < 0 || h.http_status > 999) {
    return Status::InvalidArgument("http.http_status out of range");
  }
  return check_text("http.error", h.error);
}

Status reject(const State& s, const char* what) {
  return Status::Rejected(std::string(what) + " in state " + lifecycle_name(s.lifecycle));
}

bool in_update_states(Lifecycle l) {
  return l == Lifecycle::kDraining || l == Lifecycle::kQuiesced || l == Lifecycle::kUpdating ||
         l == Lifecycle::kInvalidating || l == Lifecycle::kValidating || l == Lifecycle::kResuming;
}

bool must_be_idle(Lifecycle l) {
  return l == Lifecycle::kQuiesced || l == Lifecycle::kUpdating || l == Lifecycle::kInvalidating ||
         l == Lifecycle::kValidating || l == Lifecycle::kSleeping;
}

std::uint8_t cache_bit(CacheKind c) { return static_cast<std::uint8_t>(1u << static_cast<int>(c)); }

// READY -> TAINTED: the engine is no longer the one the committed version was verified on.
bool is_engine_cause(Cause c) {
  return c == Cause::kEngineReplaced || c == Cause::kEngineRelabelled ||
         c == Cause::kEnginePausedExternally || c == Cause::kWeightsChanged;
}

// SLEEPING -> TAINTED: the sleeping engine is not the one put to sleep, or someone woke it.
bool is_sleeper_cause(Cause c) {
  return c == Cause::kEngineReplaced || c == Cause::kEngineRelabelled ||
         c == Cause::kEngineWokenExternally;
}

// A failure proven to precede mutation: an update resumes on the old version, a restore returns
// to TAINTED (the engine's weights are still the suspect ones).
bool is_refusal_cause(Cause c) {
  return c == Cause::kDrainFailed || c == Cause::kPreflightRefused ||
         c == Cause::kTransferRefused || c == Cause::kRecoveredNoMutation;
}

// The causes that leave UPDATING because of the transfer: they need its intent durable.
bool is_transfer_cause(Cause c) {
  return c == Cause::kTransferred || c == Cause::kTransferRefused ||
         c == Cause::kTransferAmbiguous || c == Cause::kRecoveredAmbiguous;
}

// The colocated edges: into and out of SLEEPING, and the wake-up of the weights in UPDATING.
bool legal_sleep_edge(Lifecycle from, Lifecycle to, Cause cause) {
  using L = Lifecycle;
  using C = Cause;
  auto is = [&](L f, L t) { return from == f && to == t; };
  if (is(L::kReady, L::kDraining)) return cause == C::kSleepRequested;
  if (is(L::kQuiesced, L::kSleeping)) return cause == C::kSlept || cause == C::kPreflightRefused;
  if (is(L::kQuiesced, L::kResuming) || is(L::kQuiesced, L::kTainted)) {
    return cause == C::kSleepFailed;
  }
  if (is(L::kSleeping, L::kQuiesced)) return cause == C::kUpdateRequested;
  if (is(L::kSleeping, L::kUpdating)) return cause == C::kWakeRequested;
  if (is(L::kSleeping, L::kTainted)) return is_sleeper_cause(cause);
  if (is(L::kUpdating, L::kSleeping)) {
    return cause == C::kWakeFailed || cause == C::kTransferRefused ||
           cause == C::kRecoveredNoMutation;
  }
  if (is(L::kUpdating, L::kTainted)) return cause == C::kWakeFailed;
  if (is(L::kUpdating, L::kInvalidating)) return cause == C::kWoken;
  if (is(L::kDraining, L::kTainted)) return cause == C::kWakeFailed;
  return false;
}

// The edges of the update path and of the engine's taint, and the causes each may carry.
bool legal_update_edge(Lifecycle from, Lifecycle to, Cause cause) {
  using L = Lifecycle;
  using C = Cause;
  auto is = [&](L f, L t) { return from == f && to == t; };
  if (is(L::kTainted, L::kDraining)) return cause == C::kRestoreRequested;
  if (is(L::kDraining, L::kTainted)) return cause == C::kDrainFailed;
  if (is(L::kQuiesced, L::kTainted)) return cause == C::kPreflightRefused;
  if (is(L::kUninitialized, L::kReady)) return cause == C::kBootstrapped;
  if (is(L::kReady, L::kDraining)) return cause == C::kUpdateRequested;
  if (is(L::kDraining, L::kQuiesced)) return cause == C::kDrained;
  if (is(L::kDraining, L::kResuming)) return cause == C::kDrainFailed;
  if (is(L::kQuiesced, L::kUpdating)) return cause == C::kPreflightPassed;
  if (is(L::kQuiesced, L::kResuming)) return cause == C::kPreflightRefused;
  if (is(L::kUpdating, L::kInvalidating)) return cause == C::kTransferred;
  if (is(L::kUpdating, L::kResuming)) {
    return cause == C::kTransferRefused || cause == C::kRecoveredNoMutation;
  }
  if (is(L::kUpdating, L::kTainted)) {
    return cause == C::kTransferAmbiguous || cause == C::kRecoveredAmbiguous ||
           cause == C::kTransferRefused || cause == C::kRecoveredNoMutation;
  }
  if (is(L::kInvalidating, L::kValidating)) return cause == C::kCachesReset;
  if (is(L::kInvalidating, L::kTainted)) return cause == C::kCacheResetFailed;
  if (is(L::kValidating, L::kResuming)) return cause == C::kValidated;
  if (is(L::kValidating, L::kTainted)) return cause == C::kValidationFailed;
  if (is(L::kResuming, L::kReady)) return cause == C::kResumed;
  if (is(L::kResuming, L::kTainted)) {
    return cause == C::kEngineReplaced || cause == C::kEngineSleptExternally;
  }
  if (is(L::kReady, L::kTainted)) return is_engine_cause(cause);
  return false;
}

// The legal edges of the lifecycle and the causes each may carry.
bool legal_edge(Lifecycle from, Lifecycle to, Cause cause) {
  return legal_update_edge(from, to, cause) || legal_sleep_edge(from, to, cause);
}

// ---- apply: one handler per event type; each checks legality before changing anything ----

Status observation_open(const State& s, EffectKind kind, const char* what) {
  if (!s.in_flight.has_value() || s.in_flight->kind != kind) {
    return Status::Rejected(std::string(what) + " without a matching EffectStarted intent in " +
                            lifecycle_name(s.lifecycle));
  }
  return Status::OK();
}

Status apply_one(State& s, const BootstrapRequested& e) {
  if (s.lifecycle != Lifecycle::kUninitialized) return reject(s, "bootstrap");
  RC_RETURN_IF_ERROR(check_id("label", e.label));
  RC_RETURN_IF_ERROR(check_identity(e.identity));
  RC_RETURN_IF_ERROR(check_digest("expected_digest", e.expected_digest, false));
  if (e.fold_rules > kFoldRulesCurrent) {
    return Status::InvalidArgument(
        "fold_rules " + std::to_string(e.fold_rules) + " are newer than this build's " +
        std::to_string(kFoldRulesCurrent) + " (a journal from a newer RolloutCore)");
  }
  s.bootstrap = e;
  s.fold_rules = e.fold_rules;
  s.attempts = 0;
  return Status::OK();
}

// A label names one policy for the journal's life: reuse only for the identity it first named.
Status check_label_reuse(const State& s, const std::string& label, const WeightIdentity& id) {
  auto it = s.labels.find(label);
  if (it == s.labels.end()) {
    if (s.labels.size() >= kLabelsMax) return Status::Rejected("too many distinct labels");
    return Status::OK();
  }
  if (it->second == id) return Status::OK();
  return Status::InvalidArgument("label '" + label +
                                 "' was committed before for other weights (checkpoint '" +
                                 it->second.checkpoint + "'); choose a new label");
}

// After a level-2 sleep the engine's weights are garbage: only an update that names every tensor
// the engine holds (the committed manifest) can make it servable again.
Status check_update_from_sleep(const State& s, const UpdateRequested& e) {
  if (s.sleep_level < 2 || e.identity.manifest_digest == s.committed_identity.manifest_digest) {
    return Status::OK();
  }
  return Status::InvalidArgument(
      "the engine slept at level 2 (weights discarded): the update must carry every tensor of "
      "the committed manifest " +
      s.committed_identity.manifest_digest.substr(0, 16));
}

Status apply_one(State& s, const UpdateRequested& e) {
  const bool asleep = s.lifecycle == Lifecycle::kSleeping;
  if ((s.lifecycle != Lifecycle::kReady && !asleep) || s.update.has_value()) {
    return reject(s, "update request");
  }
  // A sleeping engine is re-verified by the update's own validation (instance, label, digest).
  if (s.engine_recheck && !asleep) {
    return Status::Rejected("update request before the engine was re-verified after a restart");
  }
  RC_RETURN_IF_ERROR(check_id("update_id", e.update_id));
  RC_RETURN_IF_ERROR(check_id("target_label", e.target_label));
  RC_RETURN_IF_ERROR(check_identity(e.identity));
  RC_RETURN_IF_ERROR(check_client_text("source_uri", e.source_uri));
  RC_RETURN_IF_ERROR(check_digest("expected_digest", e.expected_digest, false));
  if (e.target_label == s.committed.label) {
    return Status::InvalidArgument("target_label '" + e.target_label +
                                   "' equals the committed label");
  }
  RC_RETURN_IF_ERROR(check_label_reuse(s, e.target_label, e.identity));
  RC_RETURN_IF_ERROR(check_update_from_sleep(s, e));
  UpdatePlan plan;
  plan.update_id = e.update_id;
  plan.target = WeightVersion{s.committed.generation + 1, e.target_label};
  plan.identity = e.identity;
  plan.source_uri = e.source_uri;
  plan.expected_digest = e.expected_digest;
  plan.from_sleep = asleep;
  s.update = std::move(plan);
  s.counters.updates_requested++;
  return Status::OK();
}

Status check_restore(const State& s, const RestoreRequested& e) {
  if (s.lifecycle != Lifecycle::kTainted) return reject(s, "restore (only a TAINTED engine)");
  RC_RETURN_IF_ERROR(check_id("restore_id", e.restore_id));
  RC_RETURN_IF_ERROR(check_id("label", e.label));
  RC_RETURN_IF_ERROR(check_client_text("source_uri", e.source_uri));
  if (e.adopt != e.source_uri.empty()) {
    return Status::InvalidArgument(e.adopt ? "adopt takes no source_uri (the engine holds them)"
                                           : "source_uri is required unless adopt");
  }
  if (s.labels.count(e.label) == 0) {
    return Status::InvalidArgument("label '" + e.label + "' was never committed in this journal");
  }
  if (s.label_digests.count(e.label) == 0) {
    return Status::Rejected("no weight digest was recorded for '" + e.label +
                            "': nothing could prove the restore");
  }
  return Status::OK();
}

Status apply_one(State& s, const RestoreRequested& e) {
  RC_RETURN_IF_ERROR(check_restore(s, e));
  UpdatePlan plan;
  plan.update_id = e.restore_id;
  plan.target = WeightVersion{s.committed.generation + 1, e.label};
  plan.identity = s.labels.at(e.label);
  plan.source_uri = e.source_uri;
  plan.expected_digest = s.label_digests.at(e.label);
  plan.restore = true;
  plan.adopt = e.adopt;
  plan.wake_first = s.sleep_level > 0;  // tainted while (possibly) asleep: wake it, then drain
  s.update = std::move(plan);
  s.counters.restores_requested++;
  return Status::OK();
}

// A plan that keeps the committed version (a sleep or a wake-up): its target is that version.
UpdatePlan same_version_plan(const State& s, const std::string& id) {
  UpdatePlan plan;
  plan.update_id = id;
  plan.target = s.committed;
  plan.identity = s.committed_identity;
  plan.expected_digest = s.committed_digest.combined;
  return plan;
}

Status apply_one(State& s, const SleepRequested& e) {
  if (s.lifecycle != Lifecycle::kReady || s.update.has_value()) return reject(s, "sleep request");
  if (s.engine_recheck) {
    return Status::Rejected("sleep request before the engine was re-verified after a restart");
  }
  RC_RETURN_IF_ERROR(check_id("sleep_id", e.sleep_id));
  if (e.level < 1 || e.level > kSleepLevelMax) {
    return Status::InvalidArgument(
        "sleep level must be 1 (weights kept in host memory) or 2 "
        "(weights discarded)");
  }
  s.update = same_version_plan(s, e.sleep_id);
  s.update->sleep_level = e.level;
  s.counters.sleeps_requested++;
  return Status::OK();
}

Status apply_one(State& s, const WakeRequested& e) {
  if (s.lifecycle != Lifecycle::kSleeping || s.update.has_value()) {
    return reject(s, "wake request (only a SLEEPING engine)");
  }
  RC_RETURN_IF_ERROR(check_id("wake_id", e.wake_id));
  if (s.sleep_level != 1) {
    return Status::Rejected("the engine slept at level " + std::to_string(s.sleep_level) +
                            " and its weights were discarded: only an update carrying every "
                            "tensor (or a restore) can wake it");
  }
  s.update = same_version_plan(s, e.wake_id);
  s.update->wake_only = true;
  s.update->from_sleep = true;
  s.counters.wakes_requested++;
  return Status::OK();
}

// What the journal's open found, as the executor recorded it: a torn tail's sentence is bounded
// UTF-8 (escaped by every reader on output), and present exactly with kTornTail, as its bytes.
Status check_journal_ending(const RecoveryStarted& e) {
  if (static_cast<std::uint8_t>(e.journal_ending) > kJournalEndingMax) {
    return Status::InvalidArgument("journal_ending out of range");
  }
  RC_RETURN_IF_ERROR(check_text("journal_torn_tail", e.journal_torn_tail));
  if (!text::valid_utf8(e.journal_torn_tail)) {
    return Status::InvalidArgument("journal_torn_tail must be UTF-8");
  }
  const bool torn = e.journal_ending == JournalEnding::kTornTail;
  if (torn == e.journal_torn_tail.empty() || (!torn && e.journal_bytes_unread != 0)) {
    return Status::InvalidArgument(
        "journal_torn_tail and journal_bytes_unread are recorded with a torn_tail ending only, "
        "and a torn tail names what was torn");
  }
  return Status::OK();
}

Status apply_one(State& s, const RecoveryStarted& e) {
  RC_RETURN_IF_ERROR(check_id("executor_id", e.executor_id));
  RC_RETURN_IF_ERROR(check_journal_ending(e));
  // A wake-up of a sleeper's weights whose answer was lost may have run: the plan's end must not
  // record them asleep (refuse() reads weights_awake as "woken, or possibly").
  if (s.lifecycle == Lifecycle::kUpdating && s.in_flight &&
      s.in_flight->kind == EffectKind::kWake && s.in_flight->wake == WakeTag::kWeights &&
      s.update->from_sleep) {
    s.update->weights_awake = true;
  }
  // The in-flight attempt (if any) is spent; idempotent steps are redone from their start.
  s.in_flight.reset();
  s.attempts = 0;
  if (s.update.has_value()) s.update->drain_seen = false;
#ifdef RC_MUTANT_RECOVERY_DROPS_BINDINGS
  // Simulator mutant (off in every normal build): recovery silently forgets leased bindings.
  std::erase_if(s.active, [](const auto& kv) { return kv.second.lease_ms > 0; });
#endif
  // The engine may have changed while no executor watched it: it is re-verified before anything
  // is admitted again (in READY at once; after an interrupted update, once it is READY again,
  // unless a validation vouched for the engine on the way).
  if (s.lifecycle != Lifecycle::kUninitialized && s.lifecycle != Lifecycle::kTainted) {
    s.engine_recheck = true;
  }
  s.counters.recoveries++;
  return Status::OK();
}

std::string effect_label(const Effect& e) {
  std::string out = effect_name(e.kind);
  if (e.kind == EffectKind::kResetCache) out += std::string(" ") + cache_name(e.cache);
  if (e.kind == EffectKind::kWake) out += std::string(" ") + wake_tag_name(e.wake);
  return out;
}

Status apply_one(State& s, const EffectStarted& e) {
  if (s.in_flight.has_value()) return Status::Rejected("an effect is already in flight");
  if (e.kind == EffectKind::kNone || e.kind == EffectKind::kAwaitRollouts) {
    return Status::InvalidArgument(std::string("effect ") + effect_name(e.kind) +
                                   " has no intent record");
  }
  Effect want = next_effect(s);
  Effect got{e.kind, e.kind == EffectKind::kResetCache ? e.cache : CacheKind::kPrefix,
             e.kind == EffectKind::kWake ? e.wake : WakeTag::kWeights};
  if (!(want == got)) {
    return Status::Rejected(std::string("effect ") + effect_label(got) + " is not due in " +
                            lifecycle_name(s.lifecycle) + " (due: " + effect_label(want) + ")");
  }
  s.in_flight = got;
  s.attempts++;
  if (e.kind == EffectKind::kTransfer) s.update->transfer_started = true;
  return Status::OK();
}

Status check_engine_view(const HttpEvidence& http, const std::string& label,
                         const std::string& instance) {
  RC_RETURN_IF_ERROR(check_http(http));
  RC_RETURN_IF_ERROR(check_text("reported_label", label));
  return check_text("engine_instance", instance);
}

// Why the engine answering now is not the one the committed version was verified on, or "".
std::string engine_mismatch(const State& s, const std::string& label, bool paused_known,
                            bool paused, const std::string& instance, Cause* cause) {
  if (!s.engine_instance.empty() && !instance.empty() && instance != s.engine_instance) {
    *cause = Cause::kEngineReplaced;
    return "another engine process answers (instance '" + instance + "', verified '" +
           s.engine_instance + "'; it reports '" + label + "')";
  }
  if (label != s.committed.label) {
    *cause = Cause::kEngineRelabelled;
    return "the engine reports '" + label + "' but '" + s.committed.label + "' is committed";
  }
  const bool asleep = s.lifecycle == Lifecycle::kSleeping;
  if (paused_known && paused && !asleep) {
    *cause = Cause::kEnginePausedExternally;
    return "the engine was paused outside RolloutCore while READY";
  }
  // vLLM reports a sleeping engine as paused; one that is not was resumed by someone else, and
  // would serve from memory it released.
  if (paused_known && !paused && asleep) {
    *cause = Cause::kEngineWokenExternally;
    return "the sleeping engine was resumed outside RolloutCore";
  }
  return {};
}

// Why a digest the READY engine computed is not the committed weights' ("" when it is, or when
// either side has none: the monitor and engines without the extension compute none).
std::string digest_mismatch(const State& s, const WeightDigest& d) {
  if (!d.present() || !s.committed_digest.present()) return {};
  if (d.combined == s.committed_digest.combined) return {};
  return "the engine's weight digest " + d.combined.substr(0, 16) + " is not the committed " +
         s.committed_digest.combined.substr(0, 16) + " ('" + s.committed.label + "')" +
         digest_difference(s.committed_digest, d);
}

// A look at the watched engine (EngineProbed, EngineMonitored) that vouches for the verified
// process, and shows no other weights, clears a pending re-verification once its digest also
// verifies the weights (weights_verified: the journal's fold rules decide); an engine verified
// before instances were read adopts the instance it names.
template <class Look>
bool look_vouches(const State& s, const Look& e) {
  return e.http.ok_2xx() &&
         engine_vouched(s, e.reported_label, e.is_paused_known, e.is_paused, e.engine_instance) &&
         digest_mismatch(s, e.digest).empty();
}

template <class Look>
void note_engine_seen(State& s, const Look& e) {
  const bool vouched = look_vouches(s, e);
  s.engine_reachable = e.http.ok_2xx();
  if (!vouched) return;
  if (weights_verified(s, e.digest)) s.engine_recheck = false;
  if (s.engine_instance.empty()) s.engine_instance = e.engine_instance;
}

Status apply_one(State& s, const EngineProbed& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kProbeEngine, "EngineProbed"));
  RC_RETURN_IF_ERROR(check_engine_view(e.http, e.reported_label, e.engine_instance));
  RC_RETURN_IF_ERROR(check_text("engine_version", e.engine_version));
  RC_RETURN_IF_ERROR(check_text("label_before", e.label_before));
  RC_RETURN_IF_ERROR(check_weight_digest(e.digest));
  s.in_flight.reset();
  if (s.lifecycle == Lifecycle::kUninitialized) {
    s.engine_instance = e.engine_instance;  // the bootstrap verifies this process
    s.committed_digest = e.digest;          // ... and these weights (committed from READY on)
  } else {
    note_engine_seen(s, e);
  }
  return Status::OK();
}

Status apply_one(State& s, const EngineMonitored& e) {
  const bool watched = s.lifecycle == Lifecycle::kReady || s.lifecycle == Lifecycle::kSleeping;
  if (!watched || s.update.has_value()) return reject(s, "engine monitor observation");
  if (s.lifecycle == Lifecycle::kSleeping && e.digest.present()) {
    return Status::InvalidArgument(
        "a weight digest of a sleeping engine (its weights are not "
        "mapped)");
  }
  if (s.in_flight.has_value()) return Status::Rejected("engine monitor observation mid-effect");
  if (e.updates_seen != monitor_epoch(s)) {
    return Status::Rejected(
        "stale engine monitor observation (taken before an update or a "
        "restart)");
  }
  RC_RETURN_IF_ERROR(check_engine_view(e.http, e.reported_label, e.engine_instance));
  RC_RETURN_IF_ERROR(check_weight_digest(e.digest));
  note_engine_seen(s, e);
  return Status::OK();
}

Status apply_one(State& s, const DrainObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kDrain, "DrainObserved"));
  RC_RETURN_IF_ERROR(check_http(e.http));
  s.in_flight.reset();
  if (e.http.ok_2xx() && e.paused && !s.active.empty()) {
    // The drain succeeded; what follows (await the bindings, then re-confirm) is a new effect
    // with its own budget. Without the reset a success on the last attempt left DRAINING with
    // nothing due. Bounded: bindings only shrink in DRAINING and the re-confirmation runs with
    // none, so this reset happens at most once per update (per executor start).
    s.update->drain_seen = true;
    s.attempts = 0;
  }
  return Status::OK();
}

Status apply_one(State& s, const DrainTimedOut& e) {
  (void)e;
  if (next_effect(s).kind != EffectKind::kAwaitRollouts || s.in_flight.has_value()) {
    return reject(s, "drain timeout while not awaiting rollouts");
  }
  return Status::OK();
}

Status apply_one(State& s, const PreflightObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kPreflight, "PreflightObserved"));
  RC_RETURN_IF_ERROR(check_digest("source_manifest_digest", e.source_manifest_digest, false));
  RC_RETURN_IF_ERROR(check_text("detail", e.detail));
  s.in_flight.reset();
  return Status::OK();
}

Status apply_one(State& s, const TransferObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kTransfer, "TransferObserved"));
  if (static_cast<std::uint8_t>(e.mutation) > 2) {
    return Status::InvalidArgument("mutation class out of range");
  }
  RC_RETURN_IF_ERROR(check_text("finish_label", e.finish_label));
  RC_RETURN_IF_ERROR(check_text("error", e.error));
  s.in_flight.reset();
  return Status::OK();
}

Status apply_one(State& s, const CacheResetObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kResetCache, "CacheResetObserved"));
  if (static_cast<std::uint8_t>(e.cache) >= kCacheKinds) {
    return Status::InvalidArgument("cache kind out of range");
  }
  if (s.in_flight->cache != e.cache) {
    return Status::Rejected(std::string("reset of ") + cache_name(e.cache) +
                            " cache observed while " + cache_name(s.in_flight->cache) +
                            " was in flight");
  }
  RC_RETURN_IF_ERROR(check_http(e.http));
  s.in_flight.reset();
  if (e.http.ok_2xx() && e.reported_success) {
    s.update->caches_reset_mask |= cache_bit(e.cache);
    s.attempts = 0;
  }
  return Status::OK();
}

Status apply_one(State& s, const ValidationObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kValidate, "ValidationObserved"));
  RC_RETURN_IF_ERROR(check_http(e.http));
  RC_RETURN_IF_ERROR(check_text("reported_label", e.reported_label));
  RC_RETURN_IF_ERROR(check_text("detail", e.detail));
  RC_RETURN_IF_ERROR(check_text("engine_instance", e.engine_instance));
  RC_RETURN_IF_ERROR(check_weight_digest(e.digest));
  s.in_flight.reset();
  s.update->observed_digest = e.digest;
  // A restore proves the weights, not the process: the engine may have been restarted since the
  // taint (adopt), so the instance that answers the validation is the one verified from now on.
  if (s.update->restore && s.engine_instance.empty()) s.engine_instance = e.engine_instance;
  return Status::OK();
}

Status apply_one(State& s, const SleepObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kSleep, "SleepObserved"));
  RC_RETURN_IF_ERROR(check_http(e.http));
  RC_RETURN_IF_ERROR(check_device_memory(e.memory));
  if (e.level != s.update->sleep_level) {
    return Status::Rejected("sleep observed at level " + std::to_string(e.level) + ", requested " +
                            std::to_string(s.update->sleep_level));
  }
  s.in_flight.reset();
  s.update->sleep_memory = e.memory;
  return Status::OK();
}

Status apply_one(State& s, const WakeObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kWake, "WakeObserved"));
  if (static_cast<std::uint8_t>(e.tag) > kWakeTagMax) {
    return Status::InvalidArgument("wake tag out of range");
  }
  if (s.in_flight->wake != e.tag) {
    return Status::Rejected(std::string("wake of ") + wake_tag_name(e.tag) + " observed while " +
                            wake_tag_name(s.in_flight->wake) + " was in flight");
  }
  RC_RETURN_IF_ERROR(check_http(e.http));
  RC_RETURN_IF_ERROR(check_device_memory(e.memory));
  RC_RETURN_IF_ERROR(check_text("engine_instance", e.engine_instance));
  s.in_flight.reset();
  if (!e.http.ok_2xx()) return Status::OK();
  if (e.tag == WakeTag::kWeights) {
    s.update->weights_awake = true;
    s.attempts = 0;
  } else if (s.update->wake_first) {
    // Both pools answered awake: whatever slept is mapped again, the engine no longer sleeps.
    s.update->kv_awake = true;
    s.sleep_level = 0;
    s.attempts = 0;
  }
  return Status::OK();
}

Status apply_one(State& s, const ResumeObserved& e) {
  RC_RETURN_IF_ERROR(observation_open(s, EffectKind::kResume, "ResumeObserved"));
  RC_RETURN_IF_ERROR(check_http(e.http));
  RC_RETURN_IF_ERROR(check_text("engine_instance", e.engine_instance));
  s.in_flight.reset();
  return Status::OK();
}

// The fleet's own events belong to the fleet fold (statemachine/fleet.h), never to an engine's.
template <class T>
requires std::is_same_v<T, FleetConfigured> || std::is_same_v<T, EngineJoined> ||
    std::is_same_v<T, EngineRemovalRequested> || std::is_same_v<T, EngineRemoved> ||
    std::is_same_v<T, FleetUpdateRequested> || std::is_same_v<T, FleetUpdateEnded> ||
    std::is_same_v<T, FleetUpdateCancelled>
        Status apply_one(State&, const T&) {
  return Status::InvalidArgument("a fleet event: no engine's own fold takes it");
}

Status check_binding(const State& s, const RolloutAdmitted& e) {
#ifdef RC_MUTANT_ADMIT_IN_DRAINING
  // Simulator mutant (off in every normal build): DRAINING still admits.
  if (s.lifecycle != Lifecycle::kDraining) {
#endif
    if (s.lifecycle != Lifecycle::kReady || s.update.has_value()) return reject(s, "admission");
    if (!admits(s)) return Status::Rejected("admission refused: " + admission_block_reason(s));
#ifdef RC_MUTANT_ADMIT_IN_DRAINING
  }
#endif
  RC_RETURN_IF_ERROR(check_id("rollout_id", e.rollout_id));
  if (e.lease_ms > kLeaseMsMax) {
    return Status::InvalidArgument("lease_ms exceeds " + std::to_string(kLeaseMsMax));
  }
  if (s.active.count(e.rollout_id) != 0) {
    return Status::Conflict("rollout '" + e.rollout_id + "' is already active");
  }
  if (s.active.size() >= kActiveRolloutsMax) {
    return Status::Rejected("too many active rollouts (" + std::to_string(kActiveRolloutsMax) +
                            ")");
  }
  if (!(e.version == s.committed) || !(e.identity == s.committed_identity)) {
    return Status::Rejected("admission for version '" + e.version.label +
                            "' but the committed version is '" + s.committed.label + "'");
  }
  return Status::OK();
}

Status apply_one(State& s, const RolloutAdmitted& e) {
  RC_RETURN_IF_ERROR(check_binding(s, e));
  s.active.emplace(e.rollout_id, ActiveRollout{e.version, e.lease_ms});
  s.counters.rollouts_admitted++;
  return Status::OK();
}

Status check_binding(const State& s, const RolloutFinished& e) {
  RC_RETURN_IF_ERROR(check_id("rollout_id", e.rollout_id));
  if (static_cast<std::uint8_t>(e.outcome) > kRolloutOutcomeMax) {
    return Status::InvalidArgument("rollout outcome out of range");
  }
  auto it = s.active.find(e.rollout_id);
  if (it == s.active.end()) {
    return Status::NotFound("rollout '" + e.rollout_id + "' is not active");
  }
  if (e.outcome == RolloutOutcome::kExpired && it->second.lease_ms == 0) {
    return Status::InvalidArgument("rollout '" + e.rollout_id + "' has no lease to expire");
  }
  return Status::OK();
}

Status apply_one(State& s, const RolloutFinished& e) {
  RC_RETURN_IF_ERROR(check_binding(s, e));
  auto it = s.active.find(e.rollout_id);
  s.active.erase(it);
  switch (e.outcome) {
    case RolloutOutcome::kCompleted:
      s.counters.rollouts_completed++;
      break;
    case RolloutOutcome::kAborted:
      s.counters.rollouts_aborted++;
      break;
    case RolloutOutcome::kAbandoned:
      s.counters.rollouts_abandoned++;
      break;
    case RolloutOutcome::kExpired:
      s.counters.rollouts_expired++;
      break;
  }
  return Status::OK();
}

Status check_binding(const State& s, const TrajectoryRecorded& e) {
  RC_RETURN_IF_ERROR(check_id("rollout_id", e.rollout_id));
  if (s.active.find(e.rollout_id) == s.active.end()) {
    return Status::NotFound("trajectory for rollout '" + e.rollout_id + "', which is not active");
  }
  if (e.prompt_token_ids.size() + e.output_token_ids.size() > kTrajectoryTokensPerRecordMax) {
    return Status::InvalidArgument("trajectory record holds more than " +
                                   std::to_string(kTrajectoryTokensPerRecordMax) +
                                   " tokens; split it into parts");
  }
  if (!e.output_logprobs.empty() && e.output_logprobs.size() != e.output_token_ids.size()) {
    return Status::InvalidArgument("trajectory has " + std::to_string(e.output_logprobs.size()) +
                                   " logprobs for " + std::to_string(e.output_token_ids.size()) +
                                   " output tokens");
  }
  return Status::OK();
}

// A trajectory changes no lifecycle state; the journal keeps it for the audit.
Status apply_one(State& s, const TrajectoryRecorded& e) { return check_binding(s, e); }

// Every way out of UPDATING is grounded in what was done there: an observed transfer (or an
// ambiguous restart) needs the transfer intent durable; a no-mutation restart or a failed wake-up
// needs it absent; a wake-up alone leaves only once the weights answered awake. A forged
// UPDATING -> INVALIDATING without the intent used to be accepted and later aborted the fold.
Status check_updating_exit(const UpdatePlan& u, const StateChanged& e) {
  const Cause c = e.cause;
  // A plan from sleep refused after the weights were woken (or may have been) taints as a failed
  // wake-up, with or without a transfer intent: the engine does not sleep as recorded.
  if (c == Cause::kWakeFailed && e.to == Lifecycle::kTainted && u.from_sleep && u.weights_awake &&
      !u.restore) {
    return Status::OK();
  }
  const bool intent_needed = is_transfer_cause(c);
  const bool intent_forbidden = c == Cause::kRecoveredNoMutation || c == Cause::kWakeFailed;
  if ((intent_needed && !u.transfer_started) || (intent_forbidden && u.transfer_started)) {
    return Status::Rejected(std::string("transition out of UPDATING (") + cause_name(c) +
                            (intent_needed ? ") without" : ") after") + " a transfer intent");
  }
  if (c == Cause::kWoken && !(u.wake_only && u.weights_awake)) {
    return Status::Rejected("UPDATING -> INVALIDATING (woken) without a wake-up of the weights");
  }
  if (c == Cause::kWakeFailed && (!u.from_sleep || u.weights_awake)) {
    return Status::Rejected("a failed wake-up of weights that were not asleep or already awake");
  }
  return Status::OK();
}

// The colocated edges belong to their kind of plan: a sleep enters SLEEPING (or fails), a plan
// from a sleeping engine leaves it and returns there when refused, and only a wake-up is woken.
Status check_plan_kind(const UpdatePlan& u, const StateChanged& e) {
  using L = Lifecycle;
  const bool sleep_plan = u.sleep_level > 0;
  const bool back_to_sleep = e.to == L::kSleeping && e.cause != Cause::kSlept;
  bool ok = true;
  if (e.cause == Cause::kSleepRequested || e.cause == Cause::kSlept ||
      e.cause == Cause::kSleepFailed) {
    ok = sleep_plan;
  } else if (e.cause == Cause::kUpdateRequested) {
    ok = !sleep_plan && !u.wake_only && (e.from == L::kSleeping) == u.from_sleep;
  } else if (e.cause == Cause::kWakeRequested || e.cause == Cause::kWoken) {
    ok = u.wake_only;
  }
  if (back_to_sleep) ok = ok && u.from_sleep && !u.restore;
  if (e.from == L::kDraining && e.cause == Cause::kWakeFailed) ok = u.wake_first && !u.kv_awake;
  if (u.from_sleep && !u.restore && e.to == L::kResuming) ok = ok && e.cause == Cause::kValidated;
  if (ok) return Status::OK();
  return Status::Rejected(std::string("transition ") + lifecycle_name(e.from) + " -> " +
                          lifecycle_name(e.to) + " (" + cause_name(e.cause) +
                          ") does not belong to this plan");
}

Status check_state_changed(const State& s, const StateChanged& e) {
  if (e.from != s.lifecycle) {
    return Status::Rejected(std::string("transition from ") + lifecycle_name(e.from) +
                            " recorded in state " + lifecycle_name(s.lifecycle));
  }
  if (!legal_edge(e.from, e.to, e.cause)) {
    return Status::Rejected(std::string("illegal transition ") + lifecycle_name(e.from) + " -> " +
                            lifecycle_name(e.to) + " (" + cause_name(e.cause) + ")");
  }
  RC_RETURN_IF_ERROR(check_text("detail", e.detail));
  if (s.in_flight.has_value()) return Status::Rejected("transition while an effect is in flight");
  if (e.from == Lifecycle::kReady && e.to == Lifecycle::kDraining && s.engine_recheck) {
    return Status::Rejected("update before the engine was re-verified");
  }
  if (e.to == Lifecycle::kReady && e.from == Lifecycle::kUninitialized && !s.bootstrap) {
    return Status::Rejected("bootstrap transition without a bootstrap request");
  }
  const bool engine_taint = (e.from == Lifecycle::kReady || e.from == Lifecycle::kSleeping) &&
                            e.to == Lifecycle::kTainted;
  if (e.from != Lifecycle::kUninitialized && !engine_taint && !s.update.has_value()) {
    return Status::Rejected("transition without an update in flight");
  }
  if (engine_taint && s.update.has_value()) {
    return Status::Rejected("engine taint while an update is planned");
  }
  const bool restore_edge = e.cause == Cause::kRestoreRequested ||
                            (e.to == Lifecycle::kTainted && is_refusal_cause(e.cause));
  if (restore_edge && !s.update->restore) {
    return Status::Rejected(std::string("transition ") + lifecycle_name(e.from) + " -> " +
                            lifecycle_name(e.to) + " (" + cause_name(e.cause) +
                            ") outside a restore");
  }
  if (s.update.has_value() && s.update->restore && e.to == Lifecycle::kResuming &&
      e.cause != Cause::kValidated) {
    return Status::Rejected("a refused restore resumed the TAINTED engine");
  }
  if (e.from == Lifecycle::kUpdating) RC_RETURN_IF_ERROR(check_updating_exit(*s.update, e));
  if (!engine_taint && s.update.has_value()) RC_RETURN_IF_ERROR(check_plan_kind(*s.update, e));
  if (e.to == Lifecycle::kQuiesced && !s.active.empty()) {
    return Status::Rejected("QUIESCED with active rollouts");
  }
  if (e.to == Lifecycle::kValidating && s.update->caches_reset_mask != kAllCachesMask) {
    return Status::Rejected("VALIDATING before every cache reset succeeded");
  }
  if (e.from == Lifecycle::kResuming && e.to == Lifecycle::kReady && s.update->validated &&
      !(s.committed == s.update->target)) {
    return Status::Rejected("RESUMING -> READY before the validated target was published");
  }
  return Status::OK();
}

Status apply_one(State& s, const StateChanged& e) {
  RC_RETURN_IF_ERROR(check_state_changed(s, e));
  const Lifecycle from = s.lifecycle;
  s.lifecycle = e.to;
  s.attempts = 0;
  // A validation (label and instance checked while paused) vouches for the engine; a taint ends
  // every question. Any other edge keeps a pending re-verification.
  const bool vouched = e.to == Lifecycle::kResuming && from == Lifecycle::kValidating;
  if (vouched || e.to == Lifecycle::kTainted) s.engine_recheck = false;
  if (from == Lifecycle::kTainted) {
    // The restore owns the engine now; the incident stays in the journal. Which process serves
    // afterwards is what the restore's validation sees.
    s.taint.reset();
    s.engine_instance.clear();
  }
  if (e.to == Lifecycle::kReady && from == Lifecycle::kUninitialized) {
    s.committed = WeightVersion{0, s.bootstrap->label};
    s.committed_identity = s.bootstrap->identity;
    s.labels[s.bootstrap->label] = s.bootstrap->identity;
    if (s.committed_digest.present()) {
      s.label_digests[s.bootstrap->label] = s.committed_digest.combined;
    }
    s.bootstrap.reset();
  } else if (e.to == Lifecycle::kResuming && from == Lifecycle::kValidating) {
    s.update->validated = true;
  } else if (e.to == Lifecycle::kResuming) {
    s.update->aborting = true;
    s.update->abort_reason = e.detail;
  } else if (e.to == Lifecycle::kReady) {
    s.update.reset();
    s.sleep_level = 0;
  } else if (e.to == Lifecycle::kSleeping) {
    if (e.cause == Cause::kSlept) s.sleep_level = s.update->sleep_level;
    s.update.reset();
  } else if (e.to == Lifecycle::kTainted && s.update.has_value()) {
    s.taint = TaintRecord{from, e.cause, s.update->update_id, s.update->target, e.detail};
    // An ambiguous sleep may have released the memory: a restore wakes the engine first.
    if (e.cause == Cause::kSleepFailed) s.sleep_level = s.update->sleep_level;
    // Slept by someone else at a level nobody recorded: the weights may be discarded.
    if (e.cause == Cause::kEngineSleptExternally) s.sleep_level = kSleepLevelMax;
    s.update.reset();
  } else if (e.to == Lifecycle::kTainted) {
    s.taint = TaintRecord{from, e.cause, "", s.committed, e.detail};
  }
  return Status::OK();
}

Status apply_one(State& s, const VersionPublished& e) {
  if (s.lifecycle != Lifecycle::kResuming || !s.update.has_value() || !s.update->validated) {
    return reject(s, "publish without validation");
  }
  if (s.update->keeps_version()) return Status::Rejected("a sleep or a wake-up publishes nothing");
  if (e.update_id != s.update->update_id || !(e.version == s.update->target) ||
      !(e.identity == s.update->identity)) {
    return Status::Rejected("published version/identity differ from the validated target");
  }
  if (e.engine_digest != s.update->observed_digest.combined) {
    return Status::Rejected("published engine digest differs from the validated one");
  }
  if (e.version.generation != s.committed.generation + 1) {
    return Status::Rejected("published generation is not committed + 1");
  }
  s.committed = e.version;
  s.committed_identity = e.identity;
  s.labels[e.version.label] = e.identity;
  s.committed_digest = s.update->observed_digest;
  if (s.committed_digest.present()) s.label_digests[e.version.label] = e.engine_digest;
  if (s.update->restore) {
    s.counters.restores_committed++;
  } else {
    s.counters.updates_committed++;
  }
  return Status::OK();
}

// A restore, and a plan from a sleeping engine, end refused before the weights may change (the
// engine stays TAINTED, or SLEEPING); any other plan is refused once resumed on the old version.
Status check_refusal(const State& s) {
  const UpdatePlan& u = *s.update;
  const Lifecycle l = s.lifecycle;
  if (u.restore || u.from_sleep) {
    if (l != Lifecycle::kDraining && l != Lifecycle::kQuiesced && l != Lifecycle::kUpdating) {
      return Status::Rejected("refused after the weights may have changed");
    }
    return Status::OK();
  }
  if (l != Lifecycle::kResuming || !u.aborting) {
    return Status::Rejected("refused outside an aborting RESUMING");
  }
  return Status::OK();
}

Status apply_one(State& s, const UpdateEnded& e) {
  if (!s.update.has_value() || s.update->update_id != e.update_id) {
    return Status::Rejected("update '" + e.update_id + "' is not in flight");
  }
  RC_RETURN_IF_ERROR(check_text("reason", e.reason));
  const UpdatePlan& u = *s.update;
  switch (e.outcome) {
    case UpdateOutcome::kCommitted:
      if (!(s.committed == u.target)) return Status::Rejected("committed before publish");
      if (u.sleep_level > 0) s.counters.sleeps_committed++;
      if (u.wake_only) s.counters.wakes_committed++;
      break;
    case UpdateOutcome::kRefused:
      RC_RETURN_IF_ERROR(check_refusal(s));
      if (!u.restore && !u.keeps_version()) s.counters.updates_refused++;
      break;
    case UpdateOutcome::kTainted:
      // RESUMING: another process answered the resume (another_process).
      if (s.lifecycle != Lifecycle::kUpdating && s.lifecycle != Lifecycle::kInvalidating &&
          s.lifecycle != Lifecycle::kValidating && s.lifecycle != Lifecycle::kResuming &&
          !(s.lifecycle == Lifecycle::kQuiesced && u.sleep_level > 0)) {
        return Status::Rejected("tainted outside a mutation state");
      }
      break;
    default:
      return Status::InvalidArgument("update outcome out of range");
  }
  return Status::OK();
}

// ---- decide: derive the decisions an (already applied) input causes ----

StateChanged change(const State& s, Lifecycle to, Cause cause, std::string detail) {
  return StateChanged{s.lifecycle, to, cause, std::move(detail)};
}

void taint(const State& s, Cause cause, std::string detail, std::vector<Event>& out) {
  out.push_back(UpdateEnded{s.update->update_id, UpdateOutcome::kTainted, detail});
  out.push_back(change(s, Lifecycle::kTainted, cause, std::move(detail)));
}

// A failure proven to precede mutation: an update resumes on the old version; a restore ends
// refused and the engine stays TAINTED (its weights were never proven).
// A plan from a sleeping engine ends refused and the engine sleeps on, as it was, unless its
// weights were woken (or may have been): they hold device memory the trainer was told is free,
// and the engine sleeps no more as recorded. That is TAINTED (a restore wakes and proves it).
void refuse(const State& s, Cause cause, std::string detail, std::vector<Event>& out) {
  const UpdatePlan& u = *s.update;
  if (!u.restore && !u.from_sleep) {
    out.push_back(change(s, Lifecycle::kResuming, cause, std::move(detail)));
    return;
  }
  if (!u.restore && u.weights_awake) {
    taint(s, Cause::kWakeFailed,
          std::string("refused (") + cause_name(cause) +
              ") after the weights were woken, or may have been: not asleep as recorded: " + detail,
          out);
    return;
  }
  out.push_back(UpdateEnded{u.update_id, UpdateOutcome::kRefused, detail});
  if (u.restore) {
    out.push_back(change(s, Lifecycle::kTainted, cause, "restore refused: " + detail));
  } else {
    out.push_back(change(s, Lifecycle::kSleeping, cause, "refused, still asleep: " + detail));
  }
}

// What the engine's workers reported about device memory around a sleep or a wake-up.
std::string memory_note(const DeviceMemory& m) {
  if (!m.known) return "; device memory not reported";
  const auto before = static_cast<std::int64_t>(m.free_bytes_before);
  const auto after = static_cast<std::int64_t>(m.free_bytes_after);
  return "; device free " + std::to_string(before) + " -> " + std::to_string(after) + " bytes (" +
         std::to_string(after - before) + ")";
}

// A sleep or wake-up that provably did nothing: never sent, or refused by the route itself (a
// 4xx: vLLM without its development routes answers 404, a bad level 400).
bool provably_not_done(const HttpEvidence& h) {
  return h.never_sent() ||
         (h.transport == Transport::kOk && h.http_status >= 400 && h.http_status < 500);
}

std::string http_summary(const HttpEvidence& h) {
  std::string out = std::string("transport=") + transport_name(h.transport) +
                    " status=" + std::to_string(h.http_status);
  if (!h.body_parsed && h.transport == Transport::kOk) out += " body=unparseable";
  if (!h.error.empty()) out += " error=" + h.error.substr(0, 256);
  return out;
}

bool out_of_attempts(const State& s) { return s.attempts >= kEffectAttemptsMax; }

std::string bootstrap_detail(const EngineProbed& e) {
  std::string out = "engine " + e.engine_version + " reports '" + e.reported_label + "'";
  if (!e.label_before.empty()) out += " (found '" + e.label_before + "', relabelled)";
  if (e.resumed_before) out += " (found paused, resumed: adopted)";
  if (!e.engine_instance.empty()) out += ", instance '" + e.engine_instance + "'";
  return out;
}

void taint_engine(const State& s, Cause cause, std::string detail, std::vector<Event>& out) {
  out.push_back(change(s, Lifecycle::kTainted, cause, std::move(detail)));
}

void derive_engine_view(const State& s, bool ok, const std::string& label, bool paused_known,
                        bool paused, const std::string& instance, std::vector<Event>& out) {
  if (!ok || s.update.has_value()) return;  // an update owns the engine from its request on
  Cause cause = Cause::kEngineReplaced;
  std::string why = engine_mismatch(s, label, paused_known, paused, instance, &cause);
  if (!why.empty()) taint_engine(s, cause, std::move(why), out);
}

// A READY engine whose digest is no longer the committed one changed weights outside RolloutCore.
void derive_weights_view(const State& s, bool ok, const WeightDigest& d, std::vector<Event>& out) {
  if (!out.empty() || !ok || s.update.has_value()) return;
  std::string drift = digest_mismatch(s, d);
  if (!drift.empty()) taint_engine(s, Cause::kWeightsChanged, std::move(drift), out);
}

void derive(const State& s, const EngineProbed& e, std::vector<Event>& out) {
  if (s.lifecycle != Lifecycle::kUninitialized || !s.bootstrap.has_value()) {
    derive_engine_view(s, e.http.ok_2xx(), e.reported_label, e.is_paused_known, e.is_paused,
                       e.engine_instance, out);
    derive_weights_view(s, e.http.ok_2xx(), e.digest, out);
    return;
  }
  if (explain_bootstrap_refusal(*s.bootstrap, e).empty()) {
    out.push_back(change(s, Lifecycle::kReady, Cause::kBootstrapped, bootstrap_detail(e)));
  }
}

void derive(const State& s, const EngineMonitored& e, std::vector<Event>& out) {
  derive_engine_view(s, e.http.ok_2xx(), e.reported_label, e.is_paused_known, e.is_paused,
                     e.engine_instance, out);
  derive_weights_view(s, e.http.ok_2xx(), e.digest, out);
}

void derive(const State& s, const DrainObserved& e, std::vector<Event>& out) {
  const bool ok = e.http.ok_2xx() && e.paused;
  if (ok && s.active.empty()) {
    out.push_back(change(s, Lifecycle::kQuiesced, Cause::kDrained, "engine paused, no bindings"));
  } else if (!ok && (e.http.transport == Transport::kTimeout || out_of_attempts(s))) {
    refuse(s, Cause::kDrainFailed, "drain failed: " + http_summary(e.http), out);
  }
}

void derive(const State& s, const DrainTimedOut& e, std::vector<Event>& out) {
  refuse(s, Cause::kDrainFailed,
         std::to_string(e.active_rollouts) + " rollouts still active after " +
             std::to_string(e.waited_ms) + " ms",
         out);
}

void derive(const State& s, const PreflightObserved& e, std::vector<Event>& out) {
  std::string why;
  // Adopt transfers nothing, so there is no source to check; the digest is the proof.
  const bool no_source = s.update->adopt && e.source_manifest_digest.empty();
  if (!no_source && e.source_manifest_digest != s.update->identity.manifest_digest) {
    why += "source manifest " + e.source_manifest_digest.substr(0, 16) + " != declared " +
           s.update->identity.manifest_digest.substr(0, 16) + "; ";
  }
  if (!e.device_ok) why += "wrong CUDA device; ";
  if (!e.memory_ok) why += "not enough device memory for staging; ";
  if (why.empty()) {
    out.push_back(change(s, Lifecycle::kUpdating, Cause::kPreflightPassed, e.detail));
  } else {
    refuse(s, Cause::kPreflightRefused, why + e.detail, out);
  }
}

void derive(const State& s, const TransferObserved& e, std::vector<Event>& out) {
  if (e.acknowledged && e.mutation == MutationClass::kComplete) {
    out.push_back(change(
        s, Lifecycle::kInvalidating, Cause::kTransferred,
        std::to_string(e.bytes_sent) + " bytes, " + std::to_string(e.tensors_sent) + " tensors"));
#ifdef RC_MUTANT_RESET_BEFORE_TRANSFER
    if (s.update->caches_reset_mask == kAllCachesMask) {
      out.push_back(StateChanged{Lifecycle::kInvalidating, Lifecycle::kValidating,
                                 Cause::kCachesReset, "mutant"});
    }
#endif
  } else if (!e.acknowledged && e.mutation == MutationClass::kNone) {
    refuse(s, Cause::kTransferRefused, "no mutation: " + e.error, out);
  } else {
    taint(s, Cause::kTransferAmbiguous,
          std::string("mutation ") + mutation_name(e.mutation) + " after " +
              std::to_string(e.bytes_sent) + " bytes: " + e.error,
          out);
  }
}

void derive(const State& s, const CacheResetObserved& e, std::vector<Event>& out) {
  const bool ok = e.http.ok_2xx() && e.reported_success;
#ifdef RC_MUTANT_RESET_BEFORE_TRANSFER
  if (s.lifecycle == Lifecycle::kQuiesced) {
    if (!ok && out_of_attempts(s)) {
      out.push_back(change(s, Lifecycle::kResuming, Cause::kPreflightRefused, "mutant"));
    }
    return;
  }
#endif
  if (ok && s.update->caches_reset_mask == kAllCachesMask) {
    out.push_back(change(s, Lifecycle::kValidating, Cause::kCachesReset,
                         "prefix, encoder and mm caches reset"));
  } else if (!ok && out_of_attempts(s)) {
    std::string why = std::string(cache_name(e.cache)) + " cache reset failed " +
                      std::to_string(s.attempts) + " times: " + http_summary(e.http);
    if (e.http.ok_2xx()) why += " success=false";
    taint(s, Cause::kCacheResetFailed, why, out);
  }
}

std::string digest_note(const WeightDigest& d) {
  if (!d.present()) return {};
  return ", weight digest " + d.algorithm + ":" + d.combined.substr(0, 16);
}

// The combined digest recorded for these exact weights (an identity committed before under some
// label), or nullptr when they were never served in this journal.
const std::string* recorded_digest(const State& s, const WeightIdentity& identity,
                                   std::string* label) {
  for (const auto& [l, id] : s.labels) {
    if (!(id == identity)) continue;
    auto it = s.label_digests.find(l);
    if (it == s.label_digests.end()) continue;
    *label = l;
    return &it->second;
  }
  return nullptr;
}

// Declared byte-identical. Unchanged since journals were first written (replay re-derives with
// it); a content digest claimed under another manifest is refused when requested instead.
bool same_bytes(const WeightIdentity& a, const WeightIdentity& b) {
  return !a.content_digest.empty() && a.content_digest == b.content_digest;
}

// Whether VALIDATING judges a weight digest: the journal holds digests, or the plan names the
// one it expects (a restore always does).
bool digests_in_use(const State& s) {
  return s.committed_digest.present() || !s.update->expected_digest.empty();
}

// VALIDATING's digest rules, once the journal holds digests (or the trainer sent one): the
// engine computed a digest while paused; it equals the trainer's expected one when given; it
// equals the digest recorded when the same weights were served before; otherwise it differs
// from the pre-update digest unless the source is declared byte-identical to what was served.
std::string digest_refusal(const State& s, const WeightDigest& d) {
#ifdef RC_MUTANT_IGNORE_DIGEST
  // Simulator mutant (off in every normal build): the digest is journaled but never checked.
  (void)s;
  (void)d;
  return {};
#endif
  const UpdatePlan& u = *s.update;
  if (!digests_in_use(s)) return {};
  if (!d.present()) return "no weight digest while paused: " + d.error;
  const std::string got = d.combined.substr(0, 16);
  if (u.restore && d.combined != u.expected_digest) {
    std::string why = "weight digest " + got + " is not " + u.expected_digest.substr(0, 16) +
                      ", recorded when '" + u.target.label + "' was served";
    if (u.target.label == s.committed.label) why += digest_difference(s.committed_digest, d);
    return why;
  }
  if (!u.expected_digest.empty() && d.combined != u.expected_digest) {
    return "weight digest " + got + " is not the trainer's expected " +
           u.expected_digest.substr(0, 16) + digest_difference(s.committed_digest, d);
  }
  std::string label;
  if (const std::string* recorded = recorded_digest(s, u.identity, &label)) {
    if (d.combined == *recorded) return {};
    std::string why = "weight digest " + got + " is not " + recorded->substr(0, 16) +
                      ", recorded when these weights were served as '" + label + "'";
    if (label == s.committed.label) why += digest_difference(s.committed_digest, d);
    return why;
  }
  if (d.combined == s.committed_digest.combined && !same_bytes(s.committed_identity, u.identity)) {
    return "the weights did not change: weight digest " + got + " equals the pre-update one of '" +
           s.committed.label + "'";
  }
  return {};
}

// Evidence proves something only of a known process, read while it was paused: an answer that
// names no process or no pause state (a read that failed) is read again within the attempts. A
// restore adopts the process that answers.
bool validation_is_evidence(const State& s, const ValidationObserved& e) {
  const bool required = !s.engine_instance.empty() || s.update->restore;
  return (!e.engine_instance.empty() || !required) && e.is_paused_known;
}

void derive(const State& s, const ValidationObserved& e, std::vector<Event>& out) {
  const std::string& want = s.update->target.label;
  bool replaced = e.http.ok_2xx() && !s.engine_instance.empty() && !e.engine_instance.empty() &&
                  e.engine_instance != s.engine_instance;
#ifdef RC_MUTANT_PUBLISH_WITHOUT_VALIDATION
  // Simulator mutant (off in every normal build): any 2xx validates, whatever it reports.
  replaced = false;
  if (e.http.ok_2xx()) {
    out.push_back(change(s, Lifecycle::kResuming, Cause::kValidated, "mutant"));
    return;
  }
#endif
  if (replaced) {
    taint(s, Cause::kValidationFailed,
          "the engine process changed during the update (instance '" + e.engine_instance +
              "', verified '" + s.engine_instance + "')",
          out);
  } else if (e.http.ok_2xx() && e.is_paused_known && !e.is_paused) {
    taint(s, Cause::kValidationFailed,
          "the engine was not paused when its weights were checked (resumed outside "
          "RolloutCore during the update): the evidence proves nothing about what it served",
          out);
  } else if (e.http.ok_2xx() && !validation_is_evidence(s, e)) {
    if (out_of_attempts(s)) {
      taint(s, Cause::kValidationFailed,
            "the validation never read which engine process answered and whether it was "
            "paused: its evidence cannot be tied to the paused engine",
            out);
    }
  } else if (e.http.ok_2xx() && e.reported_label == want && e.checks_passed) {
    std::string why = digest_refusal(s, e.digest);
    if (!why.empty()) {
      taint(s, Cause::kValidationFailed, std::move(why), out);
      return;
    }
    out.push_back(change(s, Lifecycle::kResuming, Cause::kValidated,
                         "engine reports '" + e.reported_label + "'" + digest_note(e.digest)));
  } else if (e.http.ok_2xx()) {
    std::string why = "engine reports '" + e.reported_label + "', expected '" + want + "'";
    if (!e.checks_passed) why = "checks failed: " + e.detail;
    taint(s, Cause::kValidationFailed, why, out);
  } else if (out_of_attempts(s)) {
    taint(s, Cause::kValidationFailed, "validation unreachable: " + http_summary(e.http), out);
  }
}

// An engine restarted during the plan comes back unpaused with other weights: the resume must not
// put it in service on what the process before it was verified for.
bool another_process(const State& s, const std::string& instance) {
  return !s.engine_instance.empty() && !instance.empty() && instance != s.engine_instance;
}

void derive_resumed(const State& s, bool answered, bool resumed, const std::string& instance,
                    bool asleep, std::vector<Event>& out) {
  // An engine verified by its process instance must name it again: an answer without one (its
  // read failed) cannot tell the same process from a new one, so the resume is tried again.
  if (answered && !s.engine_instance.empty() && instance.empty()) return;
  if (answered && another_process(s, instance)) {
    taint(s, Cause::kEngineReplaced,
          "another engine process answers the resume (instance '" + instance + "', verified '" +
              s.engine_instance + "')",
          out);
    return;
  }
  if (resumed && asleep) {
    taint(s, Cause::kEngineSleptExternally,
          "the resumed engine reports sleeping: someone slept it while the plan held it paused, "
          "and it would serve from memory it released",
          out);
    return;
  }
  if (!resumed) return;
  const UpdatePlan& u = *s.update;
  if (u.validated && u.wake_only) {
    out.push_back(UpdateEnded{u.update_id, UpdateOutcome::kCommitted,
                              "awake, serving '" + u.target.label + "'"});
  } else if (u.validated) {
    out.push_back(VersionPublished{u.update_id, u.target, u.identity, u.observed_digest.combined});
    out.push_back(UpdateEnded{u.update_id, UpdateOutcome::kCommitted,
                              "engine serves '" + u.target.label + "'"});
  } else {
    out.push_back(UpdateEnded{u.update_id, UpdateOutcome::kRefused, u.abort_reason});
  }
  out.push_back(change(s, Lifecycle::kReady, Cause::kResumed, "engine resumed"));
}

void derive(const State& s, const ResumeObserved& e, std::vector<Event>& out) {
  derive_resumed(s, e.http.ok_2xx(), e.http.ok_2xx() && e.is_paused_known && !e.is_paused,
                 e.engine_instance, e.is_sleeping_known && e.is_sleeping, out);
}

void derive(const State& s, const SleepObserved& e, std::vector<Event>& out) {
  const UpdatePlan& u = *s.update;
  const std::string level = std::to_string(u.sleep_level);
  if (e.http.ok_2xx() && (!e.is_sleeping_known || e.is_sleeping)) {
    std::string why = "asleep at level " + level + memory_note(e.memory);
    out.push_back(UpdateEnded{u.update_id, UpdateOutcome::kCommitted, why});
    out.push_back(change(s, Lifecycle::kSleeping, Cause::kSlept, std::move(why)));
  } else if (provably_not_done(e.http)) {
    if (e.http.never_sent() && !out_of_attempts(s)) return;  // retried
    refuse(s, Cause::kSleepFailed, "sleep not done: " + http_summary(e.http), out);
  } else {
    // The sleep may have released memory (vLLM unmaps before its last check can fail): the
    // weights are unknown until proven.
    std::string why = e.http.ok_2xx() ? "the engine answered the sleep but reports not sleeping"
                                      : "sleep at level " + level +
                                            " may have released memory: " + http_summary(e.http);
    taint(s, Cause::kSleepFailed, std::move(why), out);
  }
}

void derive_weights_woken(const State& s, const WakeObserved& e, std::vector<Event>& out) {
  if (e.http.ok_2xx()) {
    if (s.update->wake_only) {
      out.push_back(change(s, Lifecycle::kInvalidating, Cause::kWoken,
                           "weights awake" + memory_note(e.memory)));
    }
  } else if (provably_not_done(e.http)) {
    if (e.http.never_sent() && !out_of_attempts(s)) return;  // retried
    refuse(s, Cause::kWakeFailed, "wake-up of the weights not done: " + http_summary(e.http), out);
  } else {
    taint(s, Cause::kWakeFailed,
          "wake-up of the weights may have mapped or overwritten them: " + http_summary(e.http),
          out);
  }
}

// A restore wakes a possibly sleeping engine before it drains: the engine is TAINTED either way,
// so a wake-up that did not answer 2xx (after its retries) ends the restore refused.
void derive_woken_first(const State& s, const WakeObserved& e, std::vector<Event>& out) {
  if (e.http.ok_2xx()) return;
  if (e.http.transport != Transport::kTimeout && !out_of_attempts(s)) return;  // retried
  refuse(s, Cause::kWakeFailed,
         std::string("wake-up of the ") + wake_tag_name(e.tag) +
             " before the restore's drain failed: " + http_summary(e.http),
         out);
}

void derive(const State& s, const WakeObserved& e, std::vector<Event>& out) {
  if (s.lifecycle == Lifecycle::kDraining) {
    derive_woken_first(s, e, out);
  } else if (e.tag == WakeTag::kKvCache) {
    derive_resumed(s, e.http.ok_2xx(), e.http.ok_2xx() && e.is_paused_known && !e.is_paused,
                   e.engine_instance, /*asleep=*/false, out);
  } else {
    derive_weights_woken(s, e, out);
  }
}

void derive(const State& s, const RecoveryStarted&, std::vector<Event>& out) {
  // A proxied rollout's client was the executor's own connection: gone with it. A leased one's
  // client is another process, which keeps renewing; its lease decides.
  for (const auto& [id, rollout] : s.active) {
    if (rollout.lease_ms == 0) out.push_back(RolloutFinished{id, RolloutOutcome::kAbandoned, 0, 0});
  }
  if (s.lifecycle != Lifecycle::kUpdating) return;
  if (s.update->transfer_started) {
    taint(s, Cause::kRecoveredAmbiguous, "executor restarted after the transfer intent", out);
  } else {
    refuse(s, Cause::kRecoveredNoMutation, "executor restarted before any transfer", out);
  }
}

template <class T>
void derive(const State& s, const T& e, std::vector<Event>& out) {
  if constexpr (std::is_same_v<T, UpdateRequested>) {
    (void)e;
    const std::string target = "target '" + s.update->target.label + "'";
    if (s.update->from_sleep) {
      out.push_back(change(s, Lifecycle::kQuiesced, Cause::kUpdateRequested,
                           target + " (asleep at level " + std::to_string(s.sleep_level) + ")"));
    } else {
      out.push_back(change(s, Lifecycle::kDraining, Cause::kUpdateRequested, target));
    }
  } else if constexpr (std::is_same_v<T, SleepRequested>) {
    out.push_back(change(s, Lifecycle::kDraining, Cause::kSleepRequested,
                         "sleep at level " + std::to_string(e.level)));
  } else if constexpr (std::is_same_v<T, WakeRequested>) {
    (void)e;
    out.push_back(change(s, Lifecycle::kUpdating, Cause::kWakeRequested,
                         "wake-up on '" + s.committed.label + "'"));
  } else if constexpr (std::is_same_v<T, RestoreRequested>) {
    out.push_back(change(s, Lifecycle::kDraining, Cause::kRestoreRequested,
                         "restore to '" + e.label + "'" +
                             (e.adopt ? " (adopt)" : " from " + e.source_uri) + ", proof: digest " +
                             s.update->expected_digest.substr(0, 16)));
  } else {
    (void)s;
    (void)e;
    (void)out;  // BootstrapRequested, EffectStarted, bindings: no decisions.
  }
}

}  // namespace

bool engine_matches(const State& s, const std::string& label, bool paused_known, bool paused,
                    const std::string& instance) {
  Cause unused = Cause::kEngineReplaced;
  return engine_mismatch(s, label, paused_known, paused, instance, &unused).empty();
}

bool engine_vouched(const State& s, const std::string& label, bool paused_known, bool paused,
                    const std::string& instance) {
  const bool named = !instance.empty() || s.engine_instance.empty();
  return named && engine_matches(s, label, paused_known, paused, instance);
}

bool look_clears_recheck(const State& s, const EngineMonitored& seen) {
  return s.engine_recheck && look_vouches(s, seen) && weights_verified(s, seen.digest);
}

bool look_changes_reachability(const State& s, const EngineMonitored& seen) {
  const bool ok = seen.http.ok_2xx();
  if (s.engine_reachable) return !ok;
  return ok && engine_vouched(s, seen.reported_label, seen.is_paused_known, seen.is_paused,
                              seen.engine_instance);
}

// The engine found at bootstrap is taken only as declared: a fresh engine (relabelled once), or
// one that already reports the declared label; anything else only when the operator adopts it.
std::string explain_bootstrap_refusal(const BootstrapRequested& b, const EngineProbed& e) {
  if (!e.http.ok_2xx()) return "engine not answering: " + http_summary(e.http);
  if (e.is_paused_known && e.is_paused) return "the engine is paused";
  // The process verified now is the one every later answer is compared with.
  if (e.engine_instance.empty()) {
    return "the engine named no process instance (a restart could not be told from it)";
  }
  const bool foreign =
      !e.label_before.empty() && e.label_before != kFreshEngineLabel && e.label_before != b.label;
  if ((foreign || e.resumed_before) && !b.adopt) return "the engine was changed without adopt";
  if (e.reported_label != b.label) {
    return "the engine reports '" + e.reported_label + "', not the declared '" + b.label + "'";
  }
  if ((b.require_digest || !b.expected_digest.empty()) && !e.digest.present()) {
    return "the engine computed no weight digest (" + e.digest.error + ")";
  }
  if (!b.expected_digest.empty() && e.digest.combined != b.expected_digest) {
    return "the engine's weight digest " + e.digest.combined + " is not the expected " +
           b.expected_digest;
  }
  return {};
}

Status apply(State& state, const Event& event) {
  // Every apply_one checks legality before it changes anything, so the fold runs in place.
  Status st = std::visit([&](const auto& e) { return apply_one(state, e); }, event);
  if (!st.ok()) return st;
  state.counters.events++;
  // The cheap (O(1)) checks run after every event.
  // A binding touches one rollout (an admission is checked against the committed version before
  // it lands); only decisions and recovery can break the per-rollout invariants.
  const bool full =
      family_of(event) == Family::kDecision || std::holds_alternative<RecoveryStarted>(event);
  const std::string broken = full ? check_invariants(state) : check_invariants_cheap(state);
  if (!broken.empty()) {
    std::fprintf(stderr, "rolloutcore: after %s: %s\n", event_name(event), broken.c_str());
    RC_CHECK(broken.empty());
  }
  return Status::OK();
}

std::vector<Event> derive_decisions(const State& after, const Event& input) {
  std::vector<Event> out;
  std::visit([&](const auto& e) { derive(after, e, out); }, input);
  // A decision quotes its evidence behind a prefix, so it may pass the bound the evidence kept.
  for (Event& decision : out) bound_texts(decision);
  return out;
}

Status check_new_request_rules(const State& s, const Event& input) {
  const bool asks_engine =
      std::holds_alternative<SleepRequested>(input) ||
      (std::holds_alternative<UpdateRequested>(input) && s.lifecycle != Lifecycle::kSleeping);
  if (asks_engine && !s.engine_reachable) {
    return Status::Rejected(std::string(event_name(input)) +
                            " while the engine is unreachable: it must answer as the committed "
                            "engine before anything is asked of it");
  }
  if (const auto* u = std::get_if<UpdateRequested>(&input)) {
    return check_identity_consistent(s.labels, u->identity);
  }
  return Status::OK();
}

Result<std::vector<Event>> decide(const State& state, const Event& input) {
  if (family_of(input) == Family::kDecision) {
    return Status::InvalidArgument(std::string(event_name(input)) +
                                   " is a decision and cannot be submitted as input");
  }
  if (const auto* f = std::get_if<RolloutFinished>(&input);
      f != nullptr && f->outcome == RolloutOutcome::kAbandoned) {
    return Status::InvalidArgument("abandoned is recorded by recovery, not submitted");
  }
  // Client bindings derive no decisions: check them without copying the state (the hot path of
  // every proxied request; the copy is O(active rollouts)).
  if (const auto* a = std::get_if<RolloutAdmitted>(&input)) {
    RC_RETURN_IF_ERROR(check_binding(state, *a));
    return std::vector<Event>{};
  }
  if (const auto* f = std::get_if<RolloutFinished>(&input)) {
    RC_RETURN_IF_ERROR(check_binding(state, *f));
    return std::vector<Event>{};
  }
  if (const auto* t = std::get_if<TrajectoryRecorded>(&input)) {
    RC_RETURN_IF_ERROR(check_binding(state, *t));
    return std::vector<Event>{};
  }
  State after = state;
  RC_RETURN_IF_ERROR(apply(after, input));
  std::vector<Event> out = derive_decisions(after, input);
  // The derived decisions must themselves be legal: a failure here is a bug in derive().
  for (const Event& d : out) {
    Status st = apply(after, d);
    if (!st.ok()) std::fprintf(stderr, "rolloutcore: derived %s\n", st.ToString().c_str());
    RC_CHECK(st.ok());
  }
  return out;
}

Result<std::vector<Event>> step(State& state, const Event& input) {
  Result<std::vector<Event>> decided = decide(state, input);
  if (!decided.ok()) return decided;
  RC_RETURN_IF_ERROR(check_new_request_rules(state, input));
  State next = state;
  RC_CHECK(apply(next, input).ok());
  for (const Event& d : decided.value()) RC_CHECK(apply(next, d).ok());
  state = std::move(next);
  return decided;
}

namespace {

// UPDATING: a sleeper's weights are woken first (retried: an awake tag is a no-op), then the
// transfer runs once (not idempotent: the observation decides); a wake-up has no transfer.
Effect updating_effect(const State& s) {
  const UpdatePlan& u = *s.update;
  if (u.from_sleep && !u.weights_awake) {
    if (s.attempts >= kEffectAttemptsMax) return {};
    return Effect{EffectKind::kWake, CacheKind::kPrefix, WakeTag::kWeights};
  }
  if (u.wake_only || u.transfer_started) return {};
  return Effect{EffectKind::kTransfer};
}

// DRAINING: a restore of a possibly sleeping engine wakes it fully first (the weights, then the
// KV cache; an awake tag is a no-op), then drains and pauses it like any other.
Effect draining_effect(const State& s) {
  const UpdatePlan& u = *s.update;
  const bool can_retry = s.attempts < kEffectAttemptsMax;
  if (u.wake_first && !u.kv_awake) {
    if (!can_retry) return {};
    const WakeTag tag = u.weights_awake ? WakeTag::kKvCache : WakeTag::kWeights;
    return Effect{EffectKind::kWake, CacheKind::kPrefix, tag};
  }
  if (u.drain_seen && !s.active.empty()) return {EffectKind::kAwaitRollouts};
  return can_retry ? Effect{EffectKind::kDrain} : Effect{};
}

}  // namespace

Effect next_effect(const State& s) {
  const bool can_retry = s.attempts < kEffectAttemptsMax;
  switch (s.lifecycle) {
    case Lifecycle::kUninitialized:
      if (s.bootstrap.has_value() && can_retry) return {EffectKind::kProbeEngine};
      return {};
    case Lifecycle::kReady:
      if (s.engine_recheck && can_retry) return {EffectKind::kProbeEngine};
      return {};
    case Lifecycle::kTainted:
    case Lifecycle::kSleeping:
      return {};
    case Lifecycle::kDraining:
      return draining_effect(s);
    case Lifecycle::kQuiesced:
#ifdef RC_MUTANT_RESET_BEFORE_TRANSFER
      // Simulator mutant (off in every normal build): caches reset before the mutation.
      for (std::uint8_t c = 0; c < kCacheKinds; ++c) {
        if ((s.update->caches_reset_mask & (1u << c)) == 0) {
          return can_retry ? Effect{EffectKind::kResetCache, static_cast<CacheKind>(c)} : Effect{};
        }
      }
#endif
      if (!can_retry) return {};
      return Effect{s.update->sleep_level > 0 ? EffectKind::kSleep : EffectKind::kPreflight};
    case Lifecycle::kUpdating:
      return updating_effect(s);
    case Lifecycle::kInvalidating:
      for (std::uint8_t c = 0; c < kCacheKinds; ++c) {
        if ((s.update->caches_reset_mask & (1u << c)) == 0) {
          return can_retry ? Effect{EffectKind::kResetCache, static_cast<CacheKind>(c)} : Effect{};
        }
      }
      return {};
    case Lifecycle::kValidating:
      return can_retry ? Effect{EffectKind::kValidate} : Effect{};
    case Lifecycle::kResuming:
      if (!can_retry) return {};
      // Waking the KV cache is what resumes a sleeper's scheduler: it is the resume.
      if (s.update->from_sleep)
        return Effect{EffectKind::kWake, CacheKind::kPrefix, WakeTag::kKvCache};
      return Effect{EffectKind::kResume};
  }
  return {};
}

bool plan_stalled(const State& s) {
  return s.update.has_value() && !s.in_flight.has_value() && s.attempts >= kEffectAttemptsMax &&
         next_effect(s).kind == EffectKind::kNone;
}

std::string check_invariants(const State& s) {
  for (const auto& [id, r] : s.active) {
    if (!(r.version == s.committed)) return "rollout '" + id + "' bound to a non-committed version";
  }
  return check_invariants_cheap(s);
}

namespace {

// A restore that wakes first: only of a possibly sleeping engine, weights before the KV cache,
// and nothing past DRAINING until both answered awake (which is when the sleep level clears).
std::string check_wake_first(const State& s) {
  const UpdatePlan& u = *s.update;
  if (u.wake_first && (!u.restore || u.from_sleep))
    return "a wake before the drain outside a restore";
  if (u.kv_awake && (!u.wake_first || !u.weights_awake)) {
    return "the KV cache woken before the weights, or outside a restore that wakes first";
  }
  if (!u.wake_first) return {};
  if (u.kv_awake == (s.sleep_level > 0)) return "a restore's wake-up and the sleep level disagree";
  const Lifecycle l = s.lifecycle;
  if (!u.kv_awake && l != Lifecycle::kTainted && l != Lifecycle::kDraining) {
    return "a restore left DRAINING before the engine was woken";
  }
  return {};
}

// What the engine released, and the plans that sleep or start asleep, agree with the lifecycle.
std::string check_sleep_invariants(const State& s) {
  const Lifecycle l = s.lifecycle;
  if (s.sleep_level > kSleepLevelMax) return "sleep level out of range";
  if (l == Lifecycle::kSleeping && s.sleep_level == 0) return "SLEEPING without a sleep level";
  if ((l == Lifecycle::kReady || l == Lifecycle::kUninitialized) && s.sleep_level != 0) {
    return "a sleep level on an awake engine";
  }
  if (!s.update.has_value()) return {};
  const UpdatePlan& u = *s.update;
  if (u.sleep_level > kSleepLevelMax) return "planned sleep level out of range";
  if (u.sleep_level > 0 && (u.from_sleep || u.restore || u.wake_only || u.transfer_started)) {
    return "a sleep plan that also updates, restores or wakes";
  }
  if (u.from_sleep && s.sleep_level == 0) return "a plan from sleep on an awake engine";
  if (u.wake_only && (!u.from_sleep || u.restore || u.transfer_started)) {
    return "a wake-up that transfers or restores";
  }
  if (u.weights_awake && !u.from_sleep && !u.wake_first) {
    return "weights woken outside a plan from sleep";
  }
  if (u.transfer_started && u.from_sleep && !u.weights_awake) {
    return "a transfer into weights still asleep";
  }
  return check_wake_first(s);
}

}  // namespace

std::string check_invariants_cheap(const State& s) {
  const Lifecycle l = s.lifecycle;
  if (static_cast<std::uint8_t>(l) > kLifecycleMax) return "lifecycle out of range";
  if (must_be_idle(l) && !s.active.empty()) return "rollouts active while weights may mutate";
  if (l == Lifecycle::kResuming && s.update && !s.update->aborting && !s.active.empty()) {
    return "rollouts active while resuming a new version";
  }
  if (in_update_states(l) && !s.update.has_value()) return "update state without an update plan";
  // A restore's plan exists in TAINTED, and a plan from sleep in SLEEPING, only between its
  // request and the transition out.
  const bool untouched = s.update.has_value() && !s.update->drain_seen &&
                         !s.update->transfer_started && s.update->caches_reset_mask == 0 &&
                         !s.update->weights_awake && !s.update->kv_awake;
  const bool requested = untouched && ((l == Lifecycle::kTainted && s.update->restore) ||
                                       (l == Lifecycle::kSleeping && s.update->from_sleep));
  const bool plan_free =
      l == Lifecycle::kUninitialized || l == Lifecycle::kTainted || l == Lifecycle::kSleeping;
  if (plan_free && s.update.has_value() && !requested) {
    return "update plan outside the update states";
  }
  std::string sleep_broken = check_sleep_invariants(s);
  if (!sleep_broken.empty()) return sleep_broken;
  if ((l == Lifecycle::kTainted) != s.taint.has_value()) return "taint record mismatch";
  if (l == Lifecycle::kUninitialized && (!s.active.empty() || s.committed.generation != 0)) {
    return "UNINITIALIZED with bindings or a committed generation";
  }
  if (s.update.has_value()) {
    const UpdatePlan& u = *s.update;
    const bool published = s.committed == u.target;
    if (u.keeps_version() && !published) return "a sleep or wake-up not on the committed version";
    if (!published && u.target.generation != s.committed.generation + 1) {
      return "target generation is not committed + 1";
    }
    if (published && !u.keeps_version() && !(l == Lifecycle::kResuming && u.validated)) {
      return "target published outside a validated RESUMING";
    }
    if (l == Lifecycle::kValidating && u.caches_reset_mask != kAllCachesMask) {
      return "VALIDATING with a cache not reset";
    }
    const bool written = u.wake_only ? u.weights_awake : u.transfer_started;
    if (u.validated && (u.caches_reset_mask != kAllCachesMask || !written)) {
      return "validated without transfer and resets";
    }
    if (u.validated && u.aborting) return "validated and aborting at once";
    if ((l == Lifecycle::kUpdating || l == Lifecycle::kInvalidating ||
         l == Lifecycle::kValidating) &&
        u.aborting) {
      return "aborting while mutating";
    }
    if (u.transfer_started && (l == Lifecycle::kDraining || l == Lifecycle::kQuiesced)) {
      return "transfer intent before UPDATING";
    }
    if (u.adopt && !u.restore) return "adopt outside a restore";
    if (u.restore && u.expected_digest.empty()) return "a restore without the digest to prove it";
    if (u.restore && u.aborting) return "a restore aborting to serve";
  }
  if (s.attempts > kEffectAttemptsMax) return "attempts over the bound";
  if (s.active.size() > kActiveRolloutsMax) return "active rollouts over the bound";
  const bool recheck_probe = l == Lifecycle::kReady && s.engine_recheck && s.in_flight &&
                             s.in_flight->kind == EffectKind::kProbeEngine;
  if (s.in_flight.has_value() && !recheck_probe &&
      (l == Lifecycle::kReady || l == Lifecycle::kTainted || l == Lifecycle::kSleeping)) {
    return "effect in flight in a state without effects";
  }
  if (s.engine_recheck && (l == Lifecycle::kUninitialized || l == Lifecycle::kTainted)) {
    return "engine re-verification pending before bootstrap or after a taint";
  }

  if (s.bootstrap.has_value() && l != Lifecycle::kUninitialized) return "bootstrap after start";
  if (l != Lifecycle::kUninitialized && s.committed_digest.present()) {
    auto it = s.label_digests.find(s.committed.label);
    if (it == s.label_digests.end() || it->second != s.committed_digest.combined) {
      return "the committed digest is not the one recorded for the committed label";
    }
  }
  if (s.label_digests.size() > s.labels.size()) return "digests for labels never committed";
  return {};
}

RolloutAdmitted make_admission(const State& state, std::string rollout_id, std::uint32_t lease_ms) {
  return RolloutAdmitted{std::move(rollout_id), state.committed, state.committed_identity,
                         lease_ms};
}

Status check_weight_identity(const WeightIdentity& identity) { return check_identity(identity); }

Status check_identity_consistent(const std::map<std::string, WeightIdentity>& labels,
                                 const WeightIdentity& identity) {
  if (identity.content_digest.empty()) return Status::OK();
  for (const auto& [label, known] : labels) {
    if (known.content_digest != identity.content_digest) continue;
    if (known.manifest_digest == identity.manifest_digest) continue;
    return Status::InvalidArgument(
        "identity.content_digest " + identity.content_digest.substr(0, 16) +
        " names the bytes committed as '" + label + "' (manifest " +
        known.manifest_digest.substr(0, 16) + "), but the identity declares manifest " +
        identity.manifest_digest.substr(0, 16) +
        ": another manifest proves other bytes, so the identity contradicts itself");
  }
  return Status::OK();
}

bool admits(const State& s) { return admission_block_reason(s).empty(); }

std::string admission_block_reason(const State& s) {
  if (s.lifecycle == Lifecycle::kTainted) return "the engine is TAINTED";
  if (s.lifecycle == Lifecycle::kSleeping) {
    return "the engine is asleep (level " + std::to_string(s.sleep_level) +
           "): a colocated trainer holds its GPU memory";
  }
  if (s.lifecycle != Lifecycle::kReady || s.update.has_value()) {
    return std::string("an update is in progress (") + lifecycle_name(s.lifecycle) + ")";
  }
  if (!s.engine_reachable) return "the engine is unreachable";
  if (s.engine_recheck && next_effect(s).kind == EffectKind::kNone && !s.in_flight) {
    return "the engine is not re-verified since the executor restarted (its " +
           std::to_string(kEffectAttemptsMax) +
           " probes are spent: a look of the engine monitor that re-verifies it, or an executor "
           "restart, lifts this)";
  }
  if (s.engine_recheck) return "the engine is not re-verified since the executor restarted";
  return {};
}

std::string digest_difference(const WeightDigest& was, const WeightDigest& now) {
  if (was.tensors.empty() || now.tensors.empty()) return {};
  std::vector<std::string> names;
  std::size_t differing = 0;
  auto note = [&](const std::string& name) {
    if (++differing <= kDigestTensorsNamedMax) names.push_back(name);
  };
  std::size_t i = 0, j = 0;
  while (i < was.tensors.size() || j < now.tensors.size()) {
    const bool take_was = j == now.tensors.size() ||
                          (i < was.tensors.size() && was.tensors[i].name < now.tensors[j].name);
    const bool take_now = i == was.tensors.size() ||
                          (j < now.tensors.size() && now.tensors[j].name < was.tensors[i].name);
    if (take_was) {
      note(was.tensors[i++].name + " (missing)");
    } else if (take_now) {
      note(now.tensors[j++].name + " (new)");
    } else {
      if (was.tensors[i].digest != now.tensors[j].digest) note(now.tensors[j].name);
      ++i, ++j;
    }
  }
  if (differing == 0) return "; no tensor differs";
  std::string out = "; " + std::to_string(differing) + " of " + std::to_string(now.tensors.size()) +
                    " tensors differ: ";
  for (std::size_t k = 0; k < names.size(); ++k) out += (k ? ", " : "") + names[k];
  if (differing > names.size()) out += ", ...";
  return out;
}

bool weights_match(const State& s, const WeightDigest& d) { return digest_mismatch(s, d).empty(); }

bool weights_verified(const State& s, const WeightDigest& d) {
  if (s.fold_rules == 0 || !s.committed_digest.present()) return weights_match(s, d);
  return d.present() && d.combined == s.committed_digest.combined;
}

std::uint64_t monitor_epoch(const State& s) {
  return s.counters.updates_requested + s.counters.restores_requested + s.counters.recoveries +
         s.counters.sleeps_requested + s.counters.wakes_requested;
}

}  // namespace rc
