// Property tests of the fleet fold (rapidcheck): random fleets of up to 16 engines under fleet
// updates of both modes, per-engine faults, joins, removals and policy changes, checked step by
// step; and a journal of one unnamed engine folding exactly as the single-engine fold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>

#include "tests/statemachine/fleet_helpers.h"

#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

namespace rc::test {
namespace {

::rc::Gen<std::vector<std::uint64_t>> step_seeds() {
  return ::rc::gen::mapcat(::rc::gen::inRange<std::size_t>(1, 800), [](std::size_t n) {
    return ::rc::gen::container<std::vector<std::uint64_t>>(n,
                                                            ::rc::gen::arbitrary<std::uint64_t>());
  });
}

std::size_t serving_except(const FleetState& f, const std::string& except) {
  std::size_t n = 0;
  for (const auto& [id, s] : f.engines) n += id != except && fleet_admits(f, id) ? 1 : 0;
  return n;
}

std::string newest_label(const FleetState& f) {
  const std::optional<std::uint64_t> g = newest_held_generation(f);
  for (const auto& [label, gen] : f.label_generation) {
    if (g && gen == *g) return label;
  }
  return "rc-0";
}

template <class T>
const T& pick(const std::vector<T>& v, Rng& r) {
  return v[r.below(static_cast<std::uint32_t>(v.size()))];
}

// Inputs for a random fleet: mostly one engine's own next step, else fleet traffic.
struct FleetGen {
  InputGen engine_gen;
  std::uint64_t counter = 0;

  FleetEvent next(const FleetState& f, Rng& r) {
    std::vector<std::string> ids;
    for (const auto& [id, s] : f.engines) ids.push_back(id);
    const std::uint32_t p = r.below(100);
    if (ids.empty() || (p < 3 && ids.size() < 16)) {
      return FleetEvent{"", EngineJoined{"e" + std::to_string(++counter)}};
    }
    if (p < 5) return FleetEvent{"", EngineRemovalRequested{pick(ids, r)}};
    if (p < 7) return FleetEvent{"", FleetConfigured{r.below(3), r.below(3)}};
    if (p < 11 && !f.update) return fleet_update(r);
    if (p < 26 && f.update) {
      if (r.chance(5))
        return FleetEvent{"", FleetUpdateCancelled{f.update->request.update_id, "x"}};
      return member_update(f, r);
    }
    const std::string& id = pick(ids, r);
    const State& s = f.engines.at(id);
    // Ids unique for the walk, as the journal keeps them ("r" ids come from the engine inputs).
    if (p < 46) return FleetEvent{id, make_admission(s, "q" + std::to_string(++counter))};
    if (p < 56 && !s.active.empty()) {
      return FleetEvent{id,
                        RolloutFinished{s.active.begin()->first, RolloutOutcome::kCompleted, 1, 1}};
    }
    if (s.lifecycle == Lifecycle::kUninitialized && !s.bootstrap && r.chance(70)) {
      const std::string label = newest_label(f);
      const auto known = f.labels.find(label);
      return FleetEvent{
          id, BootstrapRequested{label, known == f.labels.end() ? identity('a') : known->second}};
    }
    Event e = engine_gen.next(s, r);
    // Garbage admissions take ids from per-engine counters: keep them unique fleet-wide too.
    if (auto* a = std::get_if<RolloutAdmitted>(&e)) a->rollout_id = "x" + std::to_string(++counter);
    return FleetEvent{id, std::move(e)};
  }

  FleetEvent fleet_update(Rng& r) {
    const std::string n = std::to_string(++counter);
    FleetUpdateRequested u{
        "fu" + n,       r.chance(50) ? FleetUpdateMode::kAll : FleetUpdateMode::kRolling,
        1 + r.below(3), r.below(4),
        "L" + n,        identity(static_cast<char>('b' + r.below(4))),
        "safetensors:x"};
    return FleetEvent{"", u};
  }

  FleetEvent member_update(const FleetState& f, Rng& r) {
    std::vector<std::string> pending;
    for (const auto& [id, m] : f.update->members) {
      if (m == MemberStatus::kPending) pending.push_back(id);
    }
    const FleetUpdateRequested& u = f.update->request;
    const std::string id = pending.empty() ? "nobody" : pick(pending, r);
    return FleetEvent{id, UpdateRequested{u.update_id, u.target_label, u.identity, u.source_uri}};
  }
};

struct FleetWalk {
  FleetState f;
  std::vector<FleetEvent> accepted;
  std::vector<FleetHistoryEntry> history;
  std::map<std::string, std::pair<std::string, WeightVersion>> bound;  // rollout: engine, version
  std::uint64_t published = 0, fleet_updates_ended = 0;
  std::uint64_t stale_refusals = 0, min_serving_refusals = 0;

  // The planner's proposals are accepted in order, and a blocked update proposes none.
  void check_plan() const {
    if (!f.update) return;
    FleetState trial = f;
    const std::vector<std::string> next = fleet_next_members(f);
    for (const std::string& id : next) {
      RC_ASSERT(fleet_step(trial, FleetEvent{id, member_update_request(f, id)}).ok());
    }
    if (!fleet_update_blocked_reason(f).empty()) RC_ASSERT(next.empty());
  }

  void step_checked(const FleetEvent& input) {
    check_plan();
    const FleetState before = f;
    Result<std::vector<FleetEvent>> r = fleet_step(f, input);
    if (!r.ok()) {
      RC_ASSERT(f == before);  // a rejection changes nothing
      const std::string& why = r.status().message();
      stale_refusals += why.find("staleness_max") != std::string::npos ? 1 : 0;
      min_serving_refusals += why.find("min_serving") != std::string::npos ? 1 : 0;
      return;
    }
    RC_ASSERT(check_fleet_invariants(f) == std::string());
    FleetDriver::record(history, input, *r);
    accepted.push_back(input);
    note(before, input);
    for (const FleetEvent& d : *r) {
      accepted.push_back(d);
      note(before, d);
    }
  }

  void note(const FleetState& before, const FleetEvent& e) {
    if (const auto* end = std::get_if<FleetUpdateEnded>(&e.event)) {
      const std::size_t members = before.update->members.size();
      RC_ASSERT(end->committed + end->refused + end->tainted + end->skipped <= members);
      ++fleet_updates_ended;
    }
    if (is_fleet_event(e.event)) return;
    const Event* ev = &e.event;
    const std::string& engine = e.engine;
    if (const auto* a = std::get_if<RolloutAdmitted>(ev)) {
      // Admitted only where the fleet admits: untainted, staying, and within the staleness bound.
      RC_ASSERT(fleet_admits(before, engine));
      RC_ASSERT(*fleet_generation(before, engine) + before.policy.staleness_max >=
                *newest_held_generation(before));
      bound[a->rollout_id] = {engine, a->version};
    } else if (const auto* fin = std::get_if<RolloutFinished>(ev)) {
      // No rollout spans two weight states: it ends on its engine, under its version.
      const auto& [owner, version] = bound.at(fin->rollout_id);
      RC_ASSERT(owner == engine);
      RC_ASSERT(before.engines.at(engine).committed == version);
      bound.erase(fin->rollout_id);
    } else if (std::get_if<VersionPublished>(ev) != nullptr) {
      for (const auto& [id, b] : bound) RC_ASSERT(b.first != engine);
      ++published;
    } else if (const auto* u = std::get_if<UpdateRequested>(ev)) {
      note_update(before, engine, *u);
    }
  }

  // A rolling member starts within its batch and leaves min_serving engines serving.
  static void note_update(const FleetState& before, const std::string& engine,
                          const UpdateRequested& u) {
    if (!before.update || before.update->request.update_id != u.update_id) return;
    const FleetUpdate& fu = *before.update;
    RC_ASSERT(fu.members.at(engine) == MemberStatus::kPending);
    if (fu.request.mode != FleetUpdateMode::kRolling) return;
    const auto updating = std::count_if(fu.members.begin(), fu.members.end(), [](auto& m) {
      return m.second == MemberStatus::kUpdating;
    });
    RC_ASSERT(static_cast<std::uint32_t>(updating) < fu.request.batch_max);
    if (fleet_admits(before, engine)) {
      RC_ASSERT(serving_except(before, engine) >= before.policy.min_serving);
    }
  }

  void check_whole() const {
    FleetState refold;
    for (const FleetEvent& e : accepted) RC_ASSERT(fleet_apply(refold, e).ok());
    RC_ASSERT(refold == f);
    const FleetHistoryReport rep = check_fleet_history(history);
    if (!rep.ok) RC_FAIL(rep.message);
    RC_ASSERT(rep.state == f);
    std::uint64_t ended = 0;
    for (const auto& [outcome, n] : rep.fleet_updates) ended += n;
    RC_ASSERT(ended == fleet_updates_ended);
  }
};

// Random fleets keep every fleet rule at every step: invariants, rejections that change nothing,
// admissions only within the staleness bound to untainted staying engines, rollouts ending under
// their own engine and version, no publish over a live rollout, rolling batches and min_serving,
// and a refold equal to the live fleet; catches any fleet rule the fold lets slip.
RC_GTEST_PROP(FleetProperty, RandomFleetsKeepTheContract, ()) {
  const auto seeds = *step_seeds();
  Rng mix_rng(seeds.front());
  FleetGen gen{InputGen{FaultMix::draw(mix_rng), 1, 0}, 0};
  gen.engine_gen.mix.garbage = std::min<std::uint32_t>(gen.engine_gen.mix.garbage, 5);
  FleetWalk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    w.step_checked(gen.next(w.f, r));
  }
  w.check_whole();
  RC_CLASSIFY(w.fleet_updates_ended > 0, "a fleet update ended");
  RC_CLASSIFY(w.published > 0, "published");
  RC_CLASSIFY(w.stale_refusals > 0, "staleness refused");
  RC_CLASSIFY(w.min_serving_refusals > 0, "min_serving refused");
}

// Forged fleet events, any engine's: fleet decisions with any counts, removals, and the
// single-engine forgeries (decisions, stale observations) under any engine's name.
FleetEvent forged(const FleetState& f, Rng& r) {
  std::vector<std::string> ids{"", "ghost"};
  for (const auto& [id, s] : f.engines) ids.push_back(id);
  const std::string& id = pick(ids, r);
  const std::string update_id = f.update && r.chance(70) ? f.update->request.update_id : "fu0";
  switch (r.below(4)) {
    case 0:
      return FleetEvent{"", EngineRemoved{id}};
    case 1:
      return FleetEvent{
          "", FleetUpdateEnded{update_id, static_cast<FleetOutcome>(r.below(kFleetOutcomeMax + 1)),
                               r.below(3), r.below(3), r.below(3), r.below(3), ""}};
    case 2:
      return FleetEvent{r.chance(50) ? "" : id, FleetUpdateCancelled{update_id, "forged"}};
    default: {
      const auto it = f.engines.find(id);
      return FleetEvent{id, garbage(it == f.engines.end() ? State{} : it->second, r)};
    }
  }
}

// Forged events applied straight to the fold are refused with the fleet unchanged, or accepted
// with every invariant intact, and the fold keeps working from there; catches a replayed history
// that fakes a fleet outcome, removes a busy engine, or corrupts one engine through another.
RC_GTEST_PROP(FleetProperty, ApplyWithstandsForgedEvents, ()) {
  const auto seeds = *step_seeds();
  FleetGen gen{InputGen{FaultMix::draw(*std::make_unique<Rng>(seeds.front())), 1, 0}, 0};
  gen.engine_gen.mix.garbage = 0;
  FleetWalk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    if (!r.chance(10)) {
      w.step_checked(gen.next(w.f, r));
      continue;
    }
    FleetState copy = w.f;
    const FleetEvent e = forged(copy, r);
    if (!fleet_apply(copy, e).ok()) {
      RC_ASSERT(copy == w.f);
      continue;
    }
    if (std::string bad = check_fleet_invariants(copy); !bad.empty()) {
      RC_FAIL("forged " + fleet_event_name(e) + " accepted: " + bad);
    }
    for (int k = 0; k < 60; ++k) {
      Rng r2(seed + static_cast<std::uint64_t>(k));
      const FleetEvent next = gen.next(copy, r2);
      (void)fleet_step(copy, next).ok();
      if (std::string bad = check_fleet_invariants(copy); !bad.empty()) {
        RC_FAIL("after forged " + fleet_event_name(e) + ", " + fleet_event_name(next) + ": " + bad);
      }
    }
  }
  w.check_whole();
}

// A fleet history with one derived event dropped, or one recorded fleet decision altered, is
// refused at or before that group; catches a checker that trusts recorded decisions.
RC_GTEST_PROP(FleetProperty, CheckerRejectsDroppedOrAlteredDecisions, ()) {
  const auto seeds = *step_seeds();
  Rng mix_rng(seeds.front());
  FleetGen gen{InputGen{FaultMix::draw(mix_rng), 1, 0}, 0};
  gen.engine_gen.mix.garbage = 0;
  FleetWalk w;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    w.step_checked(gen.next(w.f, r));
  }
  std::vector<std::size_t> derived;
  for (std::size_t i = 0; i < w.history.size(); ++i) {
    if (w.history[i].cause_seq != 0) derived.push_back(i);
  }
  RC_PRE(!derived.empty());
  const std::size_t pick = derived[*::rc::gen::inRange<std::size_t>(0, derived.size())];
  const std::uint64_t cause = w.history[pick].cause_seq;
  auto dropped = w.history;
  dropped.erase(dropped.begin() + static_cast<long>(pick));
  const FleetHistoryReport r1 = check_fleet_history(dropped);
  RC_ASSERT(!r1.ok);
  RC_ASSERT(r1.first_bad_seq <= cause);
  auto altered = w.history;
  if (auto* end = std::get_if<FleetUpdateEnded>(&altered[pick].event)) {
    end->committed += 1;
    RC_ASSERT(!check_fleet_history(altered).ok);
  }
}

// A journal of one unnamed engine folds exactly as the single-engine fold: the same inputs are
// accepted, with the same decisions and the same state; catches a fleet rule that changes the
// meaning of journals written before fleets (e.g. staleness after a restore).
RC_GTEST_PROP(FleetProperty, OneUnnamedEngineIsTheSingleEngineFold, ()) {
  const auto seeds = *step_seeds();
  Rng mix_rng(seeds.front());
  InputGen gen{FaultMix::draw(mix_rng), 2, 0};
  State single;
  FleetState fleet;
  for (std::uint64_t seed : seeds) {
    Rng r(seed);
    const Event input = gen.next(single, r);
    Result<std::vector<Event>> a = step(single, input);
    Result<std::vector<FleetEvent>> b = fleet_step(fleet, FleetEvent{"", input});
    RC_ASSERT(a.ok() == b.ok());
    if (!a.ok()) {
      if (a.status().code() != b.status().code())
        RC_FAIL(describe(input) + ": " + a.status().ToString() + " vs " + b.status().ToString());
      continue;
    }
    RC_ASSERT(a->size() == b->size());
    for (std::size_t i = 0; i < a->size(); ++i) {
      RC_ASSERT((*b)[i].engine.empty());
      RC_ASSERT((*b)[i].event == (*a)[i]);
    }
    RC_ASSERT(fleet.engines.at("") == single);
  }
}

}  // namespace
}  // namespace rc::test

// 150 cases per property (each up to 800 steps over up to 16 engines); RC_PARAMS still wins.
int main(int argc, char** argv) {
  setenv("RC_PARAMS", "max_success=150", /*overwrite=*/0);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
