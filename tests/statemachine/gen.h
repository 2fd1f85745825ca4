// Random inputs for the property and simulation tests: mostly what next_effect() asks for (so the
// lifecycle progresses), with outcomes drawn from a fault mix, and sometimes garbage.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "statemachine/state.h"
#include "tests/statemachine/helpers.h"

namespace rc::test {

// splitmix64: tiny, seedable, identical on every platform.
struct Rng {
  std::uint64_t x;
  explicit Rng(std::uint64_t seed) : x(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint32_t below(std::uint32_t n) {
    return n == 0 ? 0 : static_cast<std::uint32_t>(next() % n);
  }
  bool chance(std::uint32_t percent) { return below(100) < percent; }
};

// Fault probabilities in percent, drawn per seed (swarm testing: some seeds are calm, some
// hostile, some hammer one fault).
struct FaultMix {
  std::uint32_t probe_fail = 10;
  std::uint32_t drain_fail = 10;
  std::uint32_t drain_timeout = 5;
  std::uint32_t preflight_bad = 10;
  std::uint32_t transfer_refused = 5;
  std::uint32_t transfer_ambiguous = 3;
  std::uint32_t reset_fail = 10;
  std::uint32_t validate_fail = 5;
  std::uint32_t validate_wrong = 2;
  std::uint32_t resume_fail = 10;
  std::uint32_t garbage = 5;
  // A 2xx probe, validation or resume whose process (or, for a validation, pause state) read
  // failed: the answer names none.
  std::uint32_t answer_partial = 5;
  static FaultMix draw(Rng& r) {
    FaultMix m;
    auto p = [&](std::uint32_t max) { return r.chance(30) ? 0u : r.below(max + 1); };
    m.probe_fail = p(40);
    m.drain_fail = p(40);
    m.drain_timeout = p(15);
    m.preflight_bad = p(30);
    m.transfer_refused = p(20);
    m.transfer_ambiguous = p(8);
    m.reset_fail = p(50);
    m.validate_fail = p(40);
    m.validate_wrong = p(6);
    m.resume_fail = p(50);
    m.garbage = p(20);
    m.answer_partial = p(30);
    return m;
  }
};

inline HttpEvidence random_bad_http(Rng& r) {
  switch (r.below(5)) {
    case 0:
      return http(Transport::kConnectFailed);
    case 1:
      return http(Transport::kTimeout);
    case 2:
      return http(Transport::kBroken);
    case 3:
      return http(Transport::kOk, 500, true);
    default:
      return http(Transport::kOk, 200, false);  // unparseable body
  }
}

// The engine process that answers a calm observation: the verified one (a fresh engine's at
// bootstrap, and after a restore cleared it).
inline std::string process_of(const State& s) {
  return s.engine_instance.empty() ? "i-0" : s.engine_instance;
}

// Whether this 2xx answer lost its process read (draws nothing when the mix has none).
inline bool partial(Rng& r, const FaultMix& m) {
  return m.answer_partial > 0 && r.chance(m.answer_partial);
}

// The observation for the effect in flight, good or bad according to the mix.
inline Event observation(const State& s, Rng& r, const FaultMix& m) {
  const Effect e = *s.in_flight;
  switch (e.kind) {
    case EffectKind::kProbeEngine:
      if (r.chance(m.probe_fail)) return EngineProbed{random_bad_http(r), "v", ""};
      return EngineProbed{ok_http(), "0.25.1", s.bootstrap ? s.bootstrap->label : "?",
                          false,     false,    partial(r, m) ? "" : process_of(s)};
    case EffectKind::kDrain:
      if (r.chance(m.drain_timeout)) return DrainObserved{http(Transport::kTimeout), false};
      if (r.chance(m.drain_fail)) return DrainObserved{random_bad_http(r), r.chance(50)};
      return DrainObserved{ok_http(), true};
    case EffectKind::kPreflight: {
      PreflightObserved p{s.update->identity.manifest_digest, true, true, ""};
      if (r.chance(m.preflight_bad)) {
        switch (r.below(3)) {
          case 0:
            p.source_manifest_digest = hex('9');
            break;
          case 1:
            p.device_ok = false;
            break;
          default:
            p.memory_ok = false;
            break;
        }
      }
      return p;
    }
    case EffectKind::kTransfer:
      if (r.chance(m.transfer_refused)) {
        return TransferObserved{false, MutationClass::kNone, 0, 0, 1, "", "refused"};
      }
      if (r.chance(m.transfer_ambiguous)) {
        return TransferObserved{r.chance(30),
                                r.chance(50) ? MutationClass::kPossible : MutationClass::kComplete,
                                7,
                                1,
                                1,
                                "",
                                "broken"};
      }
      return TransferObserved{true, MutationClass::kComplete, 100, 2,
                              1,    s.update->target.label,   ""};
    case EffectKind::kResetCache:
      if (r.chance(m.reset_fail)) {
        return r.chance(50) ? CacheResetObserved{e.cache, ok_http(), false}
                            : CacheResetObserved{e.cache, random_bad_http(r), r.chance(50)};
      }
      return CacheResetObserved{e.cache, ok_http(), true};
    case EffectKind::kValidate:
      if (r.chance(m.validate_wrong)) {
        return ValidationObserved{ok_http(),     r.chance(50) ? s.committed.label : "bogus",
                                  r.chance(80),  "",
                                  process_of(s), {},
                                  true,          true};
      }
      if (r.chance(m.validate_fail)) return ValidationObserved{random_bad_http(r), "", true, ""};
      if (partial(r, m)) {  // the instance or the pause state unread
        const bool named = r.chance(50);
        return ValidationObserved{
            ok_http(), s.update->target.label, true, "", named ? process_of(s) : "", {}, !named,
            true};
      }
      return ValidationObserved{
          ok_http(), s.update->target.label, true, "", process_of(s), {}, true, true};
    case EffectKind::kResume:
      if (r.chance(m.resume_fail)) {
        return r.chance(50) ? ResumeObserved{random_bad_http(r), false, true}
                            : ResumeObserved{ok_http(), r.chance(50), true};
      }
      // The same process, unless its read failed.
      // Now and then slept by someone else while the plan held it paused.
      return r.chance(2)
                 ? ResumeObserved{ok_http(), true, false, s.engine_instance, true, true}
                 : ResumeObserved{ok_http(), true, false, partial(r, m) ? "" : s.engine_instance};
    default:
      return RecoveryStarted{"exec-x"};
  }
}

// Any input at all, often nonsense: wrong effects, stale observations, bad ids, decisions.
inline Event garbage(const State& s, Rng& r) {
  const std::string ids[] = {"r1", "r2", "", std::string("x\x01"), "u-1", "rc-0"};
  const std::string& id = ids[r.below(6)];
  switch (r.below(16)) {
    case 0:
      return BootstrapRequested{r.chance(50) ? "rc-0" : id, identity('a')};
    case 1:
      return UpdateRequested{id, r.chance(50) ? "rc-g" : id, identity('b'), ""};
    case 2:
      return EffectStarted{static_cast<EffectKind>(r.below(kEffectKindMax + 2)),
                           static_cast<CacheKind>(r.below(4)), 0};
    case 3:
      return EngineProbed{ok_http(), "v", "rc-0"};
    case 4:
      return DrainObserved{ok_http(), true};
    case 5:
      return DrainTimedOut{1, 0};
    case 6:
      return PreflightObserved{hex('b'), true, true, ""};
    case 7:
      return TransferObserved{true, MutationClass::kComplete, 1, 1, 1, "", ""};
    case 8:
      return CacheResetObserved{static_cast<CacheKind>(r.below(3)), ok_http(), true};
    case 9:
      return ValidationObserved{ok_http(), "rc-1", true, ""};
    case 10:
      return ResumeObserved{ok_http(), true, false};
    // Unique per walk (ids are unique per journal; the journal, not the fold, enforces it).
    case 11:
      return RolloutAdmitted{"g" + std::to_string(s.counters.events), s.committed,
                             s.committed_identity};
    case 12:
      return RolloutFinished{id, static_cast<RolloutOutcome>(r.below(3)), 0, 0};
    case 13: {
      // Half the time a structurally legal edge out of the current state (the forgeries that
      // only grounding in the state can refuse), else anything.
      struct Edge {
        Lifecycle from, to;
        Cause cause;
      };
      using L = Lifecycle;
      using C = Cause;
      static const Edge kEdges[] = {{L::kUninitialized, L::kReady, C::kBootstrapped},
                                    {L::kReady, L::kDraining, C::kUpdateRequested},
                                    {L::kDraining, L::kQuiesced, C::kDrained},
                                    {L::kDraining, L::kResuming, C::kDrainFailed},
                                    {L::kQuiesced, L::kUpdating, C::kPreflightPassed},
                                    {L::kQuiesced, L::kResuming, C::kPreflightRefused},
                                    {L::kUpdating, L::kInvalidating, C::kTransferred},
                                    {L::kUpdating, L::kResuming, C::kTransferRefused},
                                    {L::kUpdating, L::kResuming, C::kRecoveredNoMutation},
                                    {L::kUpdating, L::kTainted, C::kTransferAmbiguous},
                                    {L::kUpdating, L::kTainted, C::kRecoveredAmbiguous},
                                    {L::kInvalidating, L::kValidating, C::kCachesReset},
                                    {L::kInvalidating, L::kTainted, C::kCacheResetFailed},
                                    {L::kValidating, L::kResuming, C::kValidated},
                                    {L::kValidating, L::kTainted, C::kValidationFailed},
                                    {L::kResuming, L::kReady, C::kResumed},
                                    {L::kTainted, L::kDraining, C::kRestoreRequested},
                                    {L::kDraining, L::kTainted, C::kDrainFailed},
                                    {L::kQuiesced, L::kTainted, C::kPreflightRefused},
                                    {L::kUpdating, L::kTainted, C::kTransferRefused}};
      std::vector<Edge> out;
      for (const Edge& e : kEdges) {
        if (e.from == s.lifecycle) out.push_back(e);
      }
      if (!out.empty() && r.chance(50)) {
        const Edge& e = out[r.below(static_cast<std::uint32_t>(out.size()))];
        return StateChanged{e.from, e.to, e.cause, "forged"};
      }
      return StateChanged{s.lifecycle, static_cast<Lifecycle>(r.below(9)),
                          static_cast<Cause>(r.below(kCauseMax + 1)), ""};
    }
    case 14:
      return VersionPublished{id, WeightVersion{s.committed.generation + 1, "rc-g"}, identity('b')};
    default:
      return UpdateEnded{id, static_cast<UpdateOutcome>(r.below(3)), ""};
  }
}

// One input for the current state: the due intent or the pending observation most of the time,
// else client traffic (admissions, finishes, updates), restarts, or garbage.
struct InputGen {
  FaultMix mix;
  std::uint32_t recovery_percent = 2;
  std::uint64_t counter = 0;

  Event next(const State& s, Rng& r) {
    if (r.chance(mix.garbage)) return garbage(s, r);
    if (r.chance(recovery_percent)) return RecoveryStarted{"exec-" + std::to_string(++counter)};
    const std::uint32_t pick = r.below(100);
    if (pick < 20 && !s.active.empty()) {  // a rollout finishes (possibly mid-drain: the race)
      auto it = s.active.begin();
      std::advance(it,
                   r.below(static_cast<std::uint32_t>(std::min<std::size_t>(s.active.size(), 64))));
      return RolloutFinished{
          it->first, r.chance(80) ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted, 5, 9};
    }
    if (pick < 45 && s.lifecycle == Lifecycle::kReady) {
      return make_admission(s, "r" + std::to_string(++counter));
    }
    if (pick < 52) {
      switch (s.lifecycle) {
        case Lifecycle::kUninitialized:
          if (!s.bootstrap) return BootstrapRequested{"rc-0", identity('a')};
          break;
        case Lifecycle::kReady:
          return UpdateRequested{"u" + std::to_string(++counter),
                                 "rc-" + std::to_string(s.committed.generation + 1),
                                 identity(static_cast<char>('a' + r.below(6))), "safetensors:x"};
        case Lifecycle::kTainted:  // refused unless a digest was recorded for the label
          return RestoreRequested{"x" + std::to_string(++counter), s.committed.label,
                                  r.chance(50) ? "safetensors:x" : "", r.chance(50)};
        default:
          break;
      }
    }
    if (s.in_flight.has_value()) return observation(s, r, mix);
    const Effect due = next_effect(s);
    if (due.kind == EffectKind::kAwaitRollouts) {
      if (r.chance(mix.drain_timeout))
        return DrainTimedOut{1000, static_cast<std::uint32_t>(s.active.size())};
      if (!s.active.empty()) {
        return RolloutFinished{s.active.begin()->first, RolloutOutcome::kCompleted, 1, 1};
      }
    }
    if (due.kind != EffectKind::kNone) return EffectStarted{due.kind, due.cache, 1000};
    if (s.lifecycle == Lifecycle::kUninitialized && !s.bootstrap) {
      return BootstrapRequested{"rc-0", identity('a')};
    }
    if (s.lifecycle == Lifecycle::kReady) {
      return UpdateRequested{"u" + std::to_string(++counter),
                             "rc-" + std::to_string(s.committed.generation + 1), identity('b'), ""};
    }
    // Stuck (bounded retries spent): only a restart helps.
    return RecoveryStarted{"exec-" + std::to_string(++counter)};
  }
};

}  // namespace rc::test
