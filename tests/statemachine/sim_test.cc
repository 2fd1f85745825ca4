// Seeded simulator (TigerBeetle-style swarm testing): the production fold drives many update
// cycles with many concurrent simulated rollouts, effect outcomes drawn from a per-seed fault mix,
// and random executor restarts; now and then a colocated sleep, then a wake-up or an update from
// sleep. After every step it checks the invariants and the contract; at the end the refold and
// the history checker. Every failure message carries the seed to replay.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <set>
#include <string>

#include "tests/statemachine/gen.h"

namespace rc::test {
namespace {

struct SimResult {
  std::uint64_t steps = 0;
  std::uint64_t committed = 0;  // updates and restores (sleeps and wake-ups apart)
  std::uint64_t refused = 0;
  std::uint64_t updates_tainted = 0;
  bool tainted = false;
  std::uint64_t slept = 0, woken = 0;  // sleeps and wake-ups committed
  std::uint64_t recoveries = 0;
  std::uint64_t drain_races = 0;  // drain observed while bindings were active
};

// A client-side model: each simulated rollout remembers the generation it was admitted under.
class Sim {
 public:
  Sim(std::uint64_t seed, std::uint64_t cycles) : seed_(seed), cycles_(cycles), rng_(seed) {
    gen_.mix = FaultMix::draw(rng_);
    gen_.mix.garbage = rng_.below(4);       // the runner is production code: little garbage
    gen_.recovery_percent = rng_.below(3);  // 0..2% restarts per step
    rollouts_target_ = 1 + rng_.below(200);
  }

  SimResult run() {
    const std::uint64_t steps_max = cycles_ * 400 + 200;
    while (res_.steps < steps_max && res_.committed + res_.refused < cycles_ && !res_.tainted) {
      tick();
      if (::testing::Test::HasFatalFailure()) return res_;
    }
    // Drain what is left so the history ends with every rollout accounted for.
    while (!state_.active.empty() && state_.lifecycle != Lifecycle::kTainted) {
      feed(RolloutFinished{state_.active.begin()->first, RolloutOutcome::kCompleted, 1, 1});
      if (::testing::Test::HasFatalFailure()) return res_;
    }
    final_checks();
    return res_;
  }

 private:
  void tick() {
    res_.steps++;
    if (std::optional<Event> colocated = colocated_input()) {
      feed(*colocated);
      return;
    }
    // Client traffic in READY: keep many rollouts in flight.
    if (state_.lifecycle == Lifecycle::kReady && !state_.update &&
        state_.active.size() < rollouts_target_ && rng_.chance(60)) {
      const int burst = 1 + static_cast<int>(rng_.below(8));
      for (int i = 0; i < burst; ++i) feed(make_admission(state_, "c" + std::to_string(++ids_)));
      return;
    }
    // Rollouts finish at random, including while the controller drains (the race).
    if (!state_.active.empty() && rng_.chance(35)) {
      auto it = state_.active.begin();
      std::advance(
          it,
          rng_.below(static_cast<std::uint32_t>(std::min<std::size_t>(state_.active.size(), 32))));
      feed(RolloutFinished{it->first,
                           rng_.chance(90) ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted,
                           10, 20});
      return;
    }
    feed(gen_.next(state_, rng_));
  }

  // Colocated traffic, which the generator does not know: a READY engine is put to sleep now and
  // then and a SLEEPING one is woken or updated; the sleep and wake-up effects get their intents
  // (with the tag) and observations, good or bad as the seed's mix says.
  std::optional<Event> colocated_input() {
    if (state_.in_flight.has_value()) {
      if (state_.in_flight->kind == EffectKind::kSleep) return sleep_observation();
      if (state_.in_flight->kind == EffectKind::kWake)
        return wake_observation(state_.in_flight->wake);
      return std::nullopt;
    }
    const Effect due = next_effect(state_);
    if (due.kind == EffectKind::kSleep || due.kind == EffectKind::kWake) {
      return EffectStarted{due.kind, due.cache, 1000, due.wake};
    }
    if (state_.lifecycle == Lifecycle::kReady && !state_.update && rng_.chance(3)) {
      const auto level = static_cast<std::uint8_t>(1 + rng_.below(2));
      return SleepRequested{"s" + std::to_string(++ids_), level};
    }
    if (state_.lifecycle == Lifecycle::kSleeping && rng_.chance(80)) return plan_from_sleep();
    return std::nullopt;
  }

  Event sleep_observation() {
    const std::uint8_t level = state_.update->sleep_level;
    if (rng_.chance(gen_.mix.resume_fail)) {
      return rng_.chance(50) ? SleepObserved{random_bad_http(rng_), level, false, false, {}}
                             : SleepObserved{ok_http(), level, true, false, {}};
    }
    return SleepObserved{ok_http(), level, true, true, {}};
  }

  Event wake_observation(WakeTag tag) {
    const bool kv = tag == WakeTag::kKvCache;
    if (rng_.chance(gen_.mix.resume_fail)) {
      return rng_.chance(50) ? WakeObserved{random_bad_http(rng_), tag, false, true, {}}
                             : WakeObserved{ok_http(), tag, kv, kv, {}};
    }
    return WakeObserved{ok_http(), tag, kv, false, {}, kv ? process_of(state_) : ""};
  }

  // A wake-up (level 1 only) or an update carrying the committed manifest (required after level
  // 2); now and then one with another manifest, which level 2 must refuse.
  Event plan_from_sleep() {
    const std::string n = std::to_string(++ids_);
    if (state_.sleep_level == 1 && rng_.chance(50)) return WakeRequested{"w" + n};
    WeightIdentity id = state_.committed_identity;
    id.checkpoint = "/ckpt/s" + n;
    if (rng_.chance(10)) id.manifest_digest = hex('9');
    return UpdateRequested{"u" + n, "rc-" + std::to_string(state_.committed.generation + 1), id,
                           "ipc:x"};
  }

  void feed(const Event& input) {
    const State before = state_;
    Result<std::vector<Event>> r = step(state_, input);
    if (!r.ok()) {
      ASSERT_EQ(state_, before) << where() << "rejected input changed the state";
      return;
    }
    ASSERT_EQ(check_invariants(state_), "") << where();
    if (before.lifecycle == Lifecycle::kTainted) {
      ASSERT_EQ(state_.lifecycle, Lifecycle::kTainted) << where() << "left TAINTED";
    }
    if (const auto* d = std::get_if<DrainObserved>(&input)) {
      if (d->http.ok_2xx() && d->paused && !before.active.empty()) {
        res_.drain_races++;
        ASSERT_NE(state_.lifecycle, Lifecycle::kQuiesced) << where() << "QUIESCED with bindings";
      }
    }
    const std::uint64_t in_seq = seq_++;
    history_.push_back({in_seq, 0, input});
    accepted_.push_back(input);
    account(before, input);
    for (const Event& e : r.value()) {
      history_.push_back({seq_++, in_seq, e});
      accepted_.push_back(e);
      account(before, e);
    }
  }

  void account(const State& before, const Event& e) {
    note_pools(e);
    if (const auto* a = std::get_if<RolloutAdmitted>(&e)) {
      ASSERT_EQ(before.lifecycle, Lifecycle::kReady) << where();
      ASSERT_FALSE(weights_asleep_ || kv_asleep_) << where() << "admission while the engine sleeps";
      bound_[a->rollout_id] = a->version.generation;
    } else if (const auto* f = std::get_if<RolloutFinished>(&e)) {
      ASSERT_EQ(bound_.count(f->rollout_id), 1u) << where();
      ASSERT_EQ(bound_[f->rollout_id], state_.committed.generation)
          << where() << "rollout '" << f->rollout_id << "' spans two versions";
      bound_.erase(f->rollout_id);
    } else if (const auto* p = std::get_if<VersionPublished>(&e)) {
      ASSERT_TRUE(before.update && before.update->validated) << where() << "unvalidated publish";
      ASSERT_EQ(p->version.generation, before.committed.generation + 1) << where();
      ASSERT_TRUE(bound_.empty()) << where() << "publish with live rollouts";
    } else if (const auto* u = std::get_if<UpdateEnded>(&e)) {
      account_end(*u);
    } else if (const auto* c = std::get_if<StateChanged>(&e)) {
      if (c->to == Lifecycle::kReady) {
        ASSERT_FALSE(weights_asleep_ || kv_asleep_) << where() << "READY while the engine sleeps";
      }
    } else if (const auto* x = std::get_if<EffectStarted>(&e)) {
      if (x->kind == EffectKind::kTransfer) {
        ASSERT_TRUE(before.active.empty()) << where() << "mutation with live rollouts";
        ASSERT_FALSE(weights_asleep_) << where() << "transfer into sleeping weights";
      }
    } else if (std::holds_alternative<RecoveryStarted>(e)) {
      res_.recoveries++;
    }
  }

  void account_end(const UpdateEnded& u) {
    if (u.outcome == UpdateOutcome::kTainted) res_.tainted = true;
    if (u.update_id[0] == 's' || u.update_id[0] == 'w') {  // a sleep or a wake-up
      if (u.outcome == UpdateOutcome::kCommitted)
        (u.update_id[0] == 's' ? res_.slept : res_.woken)++;
      return;
    }
    if (u.outcome == UpdateOutcome::kCommitted) res_.committed++;
    if (u.outcome == UpdateOutcome::kRefused) res_.refused++;
    if (u.outcome == UpdateOutcome::kTainted) res_.updates_tainted++;
  }

  // The pools the engine certainly released, from the observations alone (an ambiguous answer
  // proves nothing either way): the oracle for "no transfer into sleeping weights, nothing
  // admitted or READY while asleep", independent of the fold's own fields.
  void note_pools(const Event& e) {
    if (const auto* sl = std::get_if<SleepObserved>(&e)) {
      if (sl->http.ok_2xx() && sl->is_sleeping_known && sl->is_sleeping) {
        weights_asleep_ = kv_asleep_ = true;
      }
    } else if (const auto* w = std::get_if<WakeObserved>(&e)) {
      if (w->http.ok_2xx()) (w->tag == WakeTag::kWeights ? weights_asleep_ : kv_asleep_) = false;
    }
  }

  void final_checks() {
    State refold;
    for (const Event& e : accepted_) ASSERT_TRUE(apply(refold, e).ok()) << where();
    ASSERT_EQ(refold, state_) << where() << "refold differs from the live state";
    HistoryReport rep = check_history(history_);
    ASSERT_TRUE(rep.ok) << where() << rep.message;
    ASSERT_EQ(rep.summary.updates_committed, res_.committed) << where();
    ASSERT_EQ(rep.summary.updates_refused, res_.refused) << where();
    ASSERT_EQ(rep.summary.updates_tainted, res_.updates_tainted) << where();
    ASSERT_EQ(rep.summary.sleeps_committed, res_.slept) << where();
    ASSERT_EQ(rep.summary.wakes_committed, res_.woken) << where();
    std::uint64_t admitted = 0;
    for (const auto& [gen, v] : rep.summary.rollouts_by_generation) {
      admitted += v.admitted;
      if (state_.lifecycle != Lifecycle::kTainted || gen != state_.committed.generation) {
        EXPECT_EQ(v.admitted, v.finished) << where() << "generation " << gen;
      }
    }
    ASSERT_EQ(admitted, state_.counters.rollouts_admitted) << where();
  }

  std::string where() const {
    return "[seed " + std::to_string(seed_) + ", step " + std::to_string(res_.steps) + ", " +
           describe(state_) + "] ";
  }

  std::uint64_t seed_;
  std::uint64_t cycles_;
  Rng rng_;
  InputGen gen_;
  std::uint32_t rollouts_target_ = 0;
  std::uint64_t ids_ = 0;
  State state_;
  std::uint64_t seq_ = 1;
  std::vector<HistoryEntry> history_;
  std::vector<Event> accepted_;
  std::map<std::string, std::uint64_t> bound_;
  bool weights_asleep_ = false, kv_asleep_ = false;
  SimResult res_;
};

std::uint64_t base_seed() {
  const char* env = std::getenv("RC_SIM_SEED");  // replay one seed: RC_SIM_SEED=<n>
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 0x5eed;
}

// Many seeds, each with its own fault mix, each running update cycles against the fold; catches
// any interleaving of rollouts, faults and restarts that breaks the contract (prints the seed).
TEST(StatemachineSim, SwarmOfSeeds) {
  const std::uint64_t base = base_seed();
  const int seeds = std::getenv("RC_SIM_SEED") != nullptr ? 1 : 64;
  SimResult total;
  for (int i = 0; i < seeds; ++i) {
    const std::uint64_t seed = base + static_cast<std::uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed) + " (replay: RC_SIM_SEED=" + std::to_string(seed) +
                 ")");
    Sim sim(seed, 20);
    SimResult r = sim.run();
    if (HasFailure()) return;
    total.steps += r.steps;
    total.committed += r.committed;
    total.refused += r.refused;
    total.tainted = total.tainted || r.tainted;
    total.recoveries += r.recoveries;
    total.drain_races += r.drain_races;
    total.slept += r.slept;
    total.woken += r.woken;
  }
  std::printf(
      "sim: %d seeds, %llu steps, %llu committed, %llu refused, %llu recoveries, "
      "%llu drain races, %llu sleeps and %llu wake-ups committed\n",
      seeds, static_cast<unsigned long long>(total.steps),
      static_cast<unsigned long long>(total.committed),
      static_cast<unsigned long long>(total.refused),
      static_cast<unsigned long long>(total.recoveries),
      static_cast<unsigned long long>(total.drain_races),
      static_cast<unsigned long long>(total.slept), static_cast<unsigned long long>(total.woken));
  // The simulator must actually exercise the lifecycle, or it proves nothing.
  if (std::getenv("RC_SIM_SEED") == nullptr) {
    EXPECT_GT(total.committed, 100u);
    EXPECT_GT(total.refused, 10u);
    EXPECT_GT(total.drain_races, 10u);
    EXPECT_GT(total.recoveries, 10u);
    EXPECT_TRUE(total.tainted);
    EXPECT_GT(total.slept, 10u);
    EXPECT_GT(total.woken, 0u);
  }
}

// With no faults, no restarts and no garbage, every update commits; catches a lifecycle that
// cannot make progress on the happy path under rollout traffic (which would make the swarm
// vacuous).
TEST(StatemachineSim, FaultFreeRunCommitsEveryCycle) {
  Driver d;
  d.to_ready();
  InputGen gen;
  gen.mix = FaultMix{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  gen.recovery_percent = 0;
  Rng rng(42);
  for (int i = 0; i < 20000 && d.s.counters.updates_committed < 30; ++i) {
    (void)step(d.s, gen.next(d.s, rng)).ok();
    ASSERT_EQ(check_invariants(d.s), "");
    ASSERT_NE(d.s.lifecycle, Lifecycle::kTainted);
  }
  EXPECT_EQ(d.s.counters.updates_committed, 30u);
  EXPECT_EQ(d.s.counters.updates_refused, 0u);
  EXPECT_EQ(d.s.committed.generation, 30u);
}

}  // namespace
}  // namespace rc::test
