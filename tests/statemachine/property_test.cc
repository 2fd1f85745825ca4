// Property tests (rapidcheck): random command/observation sequences, biased towards what
// next_effect() asks for so that updates actually progress, with faults and garbage mixed in.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "tests/statemachine/gen.h"

#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

namespace rc::test {
namespace {

// Per-step seeds: shrinking drops steps, so a counterexample comes back short.
::rc::Gen<std::vector<std::uint64_t>> step_seeds() {
  return ::rc::gen::mapcat(::rc::gen::inRange<std::size_t>(1, 600), [](std::size_t n) {
    return ::rc::gen::container<std::vector<std::uint64_t>>(n,
                                                            ::rc::gen::arbitrary<std::uint64_t>());
  });
}

struct Walk {
  State s;
  std::vector<HistoryEntry> history;
  std::vector<Event> accepted;  // every event apply() took, in order
  std::uint64_t seq = 1;
  std::map<std::string, std::uint64_t> admitted_generation;  // the test's own bookkeeping
  std::uint64_t published = 0;

  // One step with every per-step property checked; returns false if the input was rejected.
  bool step_checked(const Event& input) {
    const State before = s;
    Result<std::vector<Event>> r = step(s, input);
    if (!r.ok()) {
      RC_ASSERT(s == before);  // a rejection leaves the state byte-identical
      return false;
    }
    RC_ASSERT(check_invariants(s) == std::string());
    if (before.lifecycle == Lifecycle::kTainted) RC_ASSERT(s.lifecycle == Lifecycle::kTainted);
    const std::uint64_t in_seq = seq++;
    history.push_back({in_seq, 0, input});
    accepted.push_back(input);
    note(before, input);
    for (const Event& d : r.value()) {
      history.push_back({seq++, in_seq, d});
      accepted.push_back(d);
      note(before, d);
    }
    return true;
  }

  void note(const State& before, const Event& e) {
    if (const auto* a = std::get_if<RolloutAdmitted>(&e)) {
      RC_ASSERT(before.lifecycle == Lifecycle::kReady);
      admitted_generation[a->rollout_id] = a->version.generation;
    } else if (const auto* f = std::get_if<RolloutFinished>(&e)) {
      // No rollout spans two versions: it ends under the generation it was admitted under.
      RC_ASSERT(admitted_generation.at(f->rollout_id) == s.committed.generation);
      admitted_generation.erase(f->rollout_id);
    } else if (const auto* p = std::get_if<VersionPublished>(&e)) {
      // Nothing is published without validation (seen by the state before the input).
      RC_ASSERT(before.lifecycle == Lifecycle::kResuming);
      RC_ASSERT(before.update.has_value() && before.update->validated);
      RC_ASSERT(before.update->target == p->version);
      RC_ASSERT(admitted_generation.empty());
      ++published;
    } else if (const auto* c = std::get_if<StateChanged>(&e)) {
      RC_ASSERT(c->from != Lifecycle::kTainted);
    } else if (const auto* x = std::get_if<EffectStarted>(&e)) {
      if (x->kind == EffectKind::kTransfer) RC_ASSERT(before.active.empty());
    }
  }

  void check_whole() {
    State refold;
    for (const Event& e : accepted) RC_ASSERT(apply(refold, e).ok());
    RC_ASSERT(refold == s);
    HistoryReport rep = check_history(history);
    if (!rep.ok) RC_FAIL(rep.message);
    RC_ASSERT(rep.state == s);
    RC_ASSERT(rep.summary.updates_committed == s.counters.updates_committed);
    RC_ASSERT(rep.summary.updates_refused == s.counters.updates_refused);
    RC_ASSERT(rep.summary.updates_committed == published);
  }
};

// Every accepted step keeps the invariants, a rejected one changes nothing, no rollout spans two
// versions, nothing is published unvalidated, TAINTED is never left, the refold equals the live
// state and the history checker accepts the history; catches any rule the fold lets slip.
RC_GTEST_PROP(StatemachineProperty, RandomWalksKeepTheContract, ()) {
  const auto seeds = *step_seeds();
  Rng mix_rng(seeds.front());
  InputGen gen{FaultMix::draw(mix_rng), 2, 0};
  Walk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    w.step_checked(gen.next(w.s, r));
  }
  w.check_whole();
  RC_CLASSIFY(w.s.lifecycle == Lifecycle::kTainted, "ended tainted");
  RC_CLASSIFY(w.published > 0, "published");
}

// decide() never mutates its input state, and deciding twice gives the same events; catches a
// decide that leaks state or depends on anything but its arguments.
RC_GTEST_PROP(StatemachineProperty, DecideIsPureAndDeterministic, ()) {
  const auto seeds = *step_seeds();
  InputGen gen;
  Walk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    const Event input = gen.next(w.s, r);
    const State before = w.s;
    Result<std::vector<Event>> a = decide(w.s, input);
    RC_ASSERT(w.s == before);
    Result<std::vector<Event>> b = decide(w.s, input);
    RC_ASSERT(a.ok() == b.ok());
    if (a.ok()) RC_ASSERT(a.value() == b.value());
    if (!a.ok()) RC_ASSERT(a.status().code() == b.status().code());
    w.step_checked(input);
  }
}

// Forged events (decisions, abandoned finishes, anything) applied straight to the fold are either
// refused with the state unchanged or accepted with the invariants intact, and the fold keeps
// working from there; catches a forged history that crashes the fold or slips past it.
RC_GTEST_PROP(StatemachineProperty, ApplyWithstandsForgedEvents, ()) {
  const auto seeds = *step_seeds();
  InputGen gen;
  gen.mix.garbage = 0;
  Walk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    if (r.chance(10)) {
      const Event forged = garbage(w.s, r);
      State copy = w.s;
      Status st = apply(copy, forged);
      if (!st.ok()) {
        RC_ASSERT(copy == w.s);
      } else {
        RC_ASSERT(check_invariants(copy) == std::string());
        // Keep folding the forged state with ordinary inputs: apply asserts the invariants.
        for (int k = 0; k < 80; ++k) {
          Rng r2(seed + static_cast<std::uint64_t>(k));
          (void)step(copy, gen.next(copy, r2)).ok();
        }
      }
      continue;
    }
    w.step_checked(gen.next(w.s, r));
  }
  w.check_whole();
}

// A history with one entry removed or one derived event duplicated is never accepted with a
// different final state; catches a checker that tolerates missing or repeated records.
RC_GTEST_PROP(StatemachineProperty, CheckerRejectsTruncatedOrDuplicatedGroups, ()) {
  const auto seeds = *step_seeds();
  InputGen gen;
  gen.mix.garbage = 0;
  Walk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    w.step_checked(gen.next(w.s, r));
  }
  std::vector<std::size_t> derived;
  for (std::size_t i = 0; i < w.history.size(); ++i) {
    if (w.history[i].cause_seq != 0) derived.push_back(i);
  }
  RC_PRE(!derived.empty());
  const std::size_t pick = derived[*::rc::gen::inRange<std::size_t>(0, derived.size())];
  auto dropped = w.history;
  const std::uint64_t bad_cause = dropped[pick].cause_seq;
  dropped.erase(dropped.begin() + static_cast<long>(pick));
  HistoryReport r1 = check_history(dropped);
  RC_ASSERT(!r1.ok);
  RC_ASSERT(r1.first_bad_seq <= bad_cause);
  auto doubled = w.history;
  HistoryEntry copy = doubled[pick];
  doubled.insert(doubled.begin() + static_cast<long>(pick) + 1, copy);
  for (std::size_t k = pick + 1; k < doubled.size(); ++k) doubled[k].seq = doubled[k - 1].seq + 1;
  // Keep later groups' cause_seq consistent with their renumbered inputs.
  for (std::size_t k = pick + 2; k < doubled.size(); ++k) {
    if (doubled[k].cause_seq != 0) {
      std::size_t in = k;
      while (doubled[in].cause_seq != 0) --in;
      doubled[k].cause_seq = doubled[in].seq;
    }
  }
  RC_ASSERT(!check_history(doubled).ok);
}

}  // namespace
}  // namespace rc::test

// A few hundred cases per property (each up to 600 steps) keep every property at about a second;
// RC_PARAMS in the environment still wins (e.g. RC_PARAMS="seed=123 max_success=5000").
int main(int argc, char** argv) {
  setenv("RC_PARAMS", "max_success=300", /*overwrite=*/0);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
