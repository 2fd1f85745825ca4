// Seeded generators of legal controller histories, for tests, benchmarks and fuzz seeds.
// A history is built by driving rc::step with random inputs (admissions, finishes, updates, the
// EffectStarted intent for next_effect(), observations with random outcomes, recoveries);
// inputs the fold rejects are skipped, so every group in the result is legal in order.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "statemachine/events.h"
#include "statemachine/hex.h"
#include "statemachine/state.h"

namespace rc::journal::testing {

inline WeightIdentity RandomIdentity(std::mt19937_64& rng) {
  WeightIdentity id;
  for (int i = 0; i < 16; ++i) id.manifest_digest.push_back(hex::kLowerDigits[rng() % 16]);
  if (rng() % 2) id.content_digest = id.manifest_digest + "ff";
  id.checkpoint = "/ckpt/step-" + std::to_string(rng() % 1000);
  id.run = "run-" + std::to_string(rng() % 10);
  id.step = static_cast<std::int64_t>(rng() % 1000) - 1;
  return id;
}

inline HttpEvidence RandomHttp(std::mt19937_64& rng, bool ok) {
  HttpEvidence h;
  if (ok) {
    h = HttpEvidence{Transport::kOk, 200, true, rng() % 5000, ""};
  } else {
    h.transport = static_cast<Transport>(rng() % 4);
    h.http_status = h.transport == Transport::kOk ? 500 : 0;
    h.error = "injected failure " + std::to_string(rng() % 100);
  }
  return h;
}

// A random input aimed at `s` (the fold may still reject it). `counter` makes ids unique.
// With allow_taint false, no observation can taint (long histories stay live).
inline Event RandomInput(const State& s, std::mt19937_64& rng, std::uint64_t& counter,
                         bool allow_taint = true) {
  auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
  const std::uint64_t n = ++counter;
  std::vector<Event> options;
  if (s.lifecycle == Lifecycle::kUninitialized && !s.bootstrap) {
    return BootstrapRequested{"rc-0", RandomIdentity(rng)};
  }
  const Effect due = next_effect(s);
  if (!s.in_flight && due.kind != EffectKind::kNone && due.kind != EffectKind::kAwaitRollouts) {
    options.push_back(EffectStarted{due.kind, due.cache, 1000 + rng() % 1000});
  }
  if (s.in_flight) {
    const bool ok = chance(95);
    const bool ok_mutating = !allow_taint || chance(99);
    switch (s.in_flight->kind) {
      case EffectKind::kProbeEngine:
        options.push_back(EngineProbed{RandomHttp(rng, ok), "0.25.1",
                                       ok && s.bootstrap ? s.bootstrap->label : "other"});
        break;
      case EffectKind::kDrain:
        options.push_back(DrainObserved{RandomHttp(rng, ok), ok});
        break;
      case EffectKind::kPreflight:
        options.push_back(PreflightObserved{ok ? s.update->identity.manifest_digest : "00ff",
                                            ok || chance(50), ok || chance(50), "preflight"});
        break;
      case EffectKind::kTransfer: {
        const bool clean = ok_mutating;
        const auto mutation =
            clean ? MutationClass::kComplete : static_cast<MutationClass>(rng() % 2);
        options.push_back(TransferObserved{clean, mutation, rng() % (1u << 30),
                                           static_cast<std::uint32_t>(rng() % 300), rng() % 100000,
                                           s.update->target.label, clean ? "" : "broken pipe"});
        break;
      }
      case EffectKind::kResetCache:
        options.push_back(CacheResetObserved{s.in_flight->cache,
                                             RandomHttp(rng, ok || !allow_taint),
                                             ok || !allow_taint || chance(30)});
        break;
      case EffectKind::kValidate:
        options.push_back(ValidationObserved{RandomHttp(rng, ok_mutating || chance(50)),
                                             ok_mutating ? s.update->target.label : "stale",
                                             ok_mutating || chance(50),
                                             ok_mutating ? "" : "canary logprob drift"});
        break;
      case EffectKind::kResume:
        options.push_back(ResumeObserved{RandomHttp(rng, ok), ok, !ok});
        break;
      default:
        break;
    }
  }
  if (due.kind == EffectKind::kAwaitRollouts && !s.in_flight && chance(20)) {
    options.push_back(DrainTimedOut{rng() % 60000, static_cast<std::uint32_t>(s.active.size())});
  }
  if (s.lifecycle == Lifecycle::kReady && !s.update) {
    for (int i = 0; i < 3; ++i)
      options.push_back(make_admission(s, "r" + std::to_string(n) + "-" + std::to_string(i)));
    if (chance(30)) {
      options.push_back(UpdateRequested{"u" + std::to_string(n), "rc-" + std::to_string(n),
                                        RandomIdentity(rng),
                                        "safetensors:/ckpt/" + std::to_string(n)});
    }
  }
  if (!s.active.empty()) {
    auto it = s.active.begin();
    std::advance(it, static_cast<long>(rng() % s.active.size()));
    const auto outcome = chance(80) ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted;
    for (int i = 0; i < 2; ++i) {
      options.push_back(RolloutFinished{it->first, outcome,
                                        static_cast<std::uint32_t>(rng() % 4096),
                                        static_cast<std::uint32_t>(rng() % 4096)});
    }
  }
  if (options.empty() || (allow_taint && chance(1)))
    return RecoveryStarted{"executor-" + std::to_string(rng() % 4)};
  return options[rng() % options.size()];
}

// Appends legal groups (input followed by its decisions) to `groups` until `events_min` events.
inline std::vector<std::vector<Event>> RandomHistory(std::uint64_t seed, std::size_t events_min,
                                                     State* final_state = nullptr,
                                                     bool allow_taint = true) {
  std::mt19937_64 rng(seed);
  State s;
  std::uint64_t counter = 0;
  std::vector<std::vector<Event>> groups;
  std::size_t events = 0;
  std::size_t attempts = 0;
  while (events < events_min && attempts < events_min * 50 + 100) {
    ++attempts;
    Event input = RandomInput(s, rng, counter, allow_taint);
    Result<std::vector<Event>> d = step(s, input);
    if (!d.ok()) continue;
    std::vector<Event> group{std::move(input)};
    for (Event& e : d.value()) group.push_back(std::move(e));
    events += group.size();
    groups.push_back(std::move(group));
  }
  if (final_state != nullptr) *final_state = s;
  return groups;
}

}  // namespace rc::journal::testing
