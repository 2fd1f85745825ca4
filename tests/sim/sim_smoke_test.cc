#include <gtest/gtest.h>

#include <cstdio>
#include <random>

#include "sim/sim.h"

namespace rc::sim {
namespace {

void ExpectPasses(const SimOptions& o, const FaultPlan& plan) {
  SimResult r = sim::Run(o, plan);
  for (const std::string& v : r.violations) ADD_FAILURE() << v;
  if (!r.violations.empty()) ADD_FAILURE() << "replay with: " << ReplayCommand(o, plan);
}

// A regression seed replays the interleaving it names only under the schedule it was found
// with: no re-verification faults (kFirstRecheckFault on) and no legacy journals.
FaultPlan AsFound(SimOptions& o, const FaultPlan& plan) {
  o.legacy_one_in = 0;
  FaultPlan found;
  for (const Fault& f : plan) {
    if (f.kind < kFirstRecheckFault) found.push_back(f);
  }
  return found;
}

// Proves that 10,000 simulated update cycles under each seed's swarm of faults keep every check
// (acknowledged events, answers, history, refold, snapshots, weights and caches at publish,
// bindings, liveness); would catch any regression in the fold, runner or journal that breaks one.
TEST(Sim, FixedSmokeTenThousandCycles) {
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    SimOptions o;
    o.seed = seed;
    o.cycles = 200;
    ExpectPasses(o, PlanForSeed(seed, o.cycles));
    if (::testing::Test::HasFailure()) return;
  }
}

// Proves that fresh seeds (printed, so any failure replays) pass too; would catch a bug the fixed
// seeds do not reach.
TEST(Sim, RandomSeeds) {
  std::random_device rd;
  for (int i = 0; i < 4; ++i) {
    SimOptions o;
    o.seed = (std::uint64_t{rd()} << 20) ^ rd();
    o.cycles = 100;
    std::printf("random sim seed: %lu\n", o.seed);
    ExpectPasses(o, PlanForSeed(o.seed, o.cycles));
  }
}

// Proves that a seed replays exactly (same journals, same figures); would catch hidden
// nondeterminism (a wall clock, a thread, an unseeded choice) that makes failures unreplayable.
TEST(Sim, SameSeedSameRun) {
  SimOptions o;
  o.seed = 4242;
  o.cycles = 60;
  const FaultPlan plan = PlanForSeed(o.seed, o.cycles);
  const SimResult a = sim::Run(o, plan);
  const SimResult b = sim::Run(o, plan);
  EXPECT_EQ(a.head, b.head);
  EXPECT_EQ(a.stats.committed, b.stats.committed);
  EXPECT_EQ(a.stats.admissions_acked, b.stats.admissions_acked);
}

// Proves that the --faults syntax round-trips; would catch a replay command that replays
// another schedule than the one that failed.
TEST(Sim, FaultPlanRoundTrips) {
  const FaultPlan plan = PlanForSeed(77, 200);
  auto parsed = ParsePlan(FormatPlan(plan));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, plan);
}

// Regression seed (found by the simulator): the runner computed the next effect, slept its retry
// backoff, then submitted that intent; an engine-monitor observation during the backoff
// re-verified READY, the stale EffectStarted(probe_engine) was rejected ("not due in READY") and
// Recover() failed. Proves the runner looks again after its backoff. Without colocated cycles:
// the seed reproduces the interleaving it was found with.
TEST(Sim, MonitorDuringRecoveryBackoff) {
  SimOptions o;
  o.seed = 17;
  o.cycles = 200;
  o.monitor_during_recovery = true;
  o.colocated_one_in = 0;
  const FaultPlan plan = AsFound(o, PlanForSeed(o.seed, o.cycles));
  ExpectPasses(o, plan);
}

// Regression schedules (false positives of the simulator's sleeper check, found by random seeds):
// someone resumed a sleeping engine, or another engine process came up, then a journal fault
// restarted the executor before the monitor's next look; the check judged the sleeper missed
// although the monitor, down with the executor, had had no look yet. Proves the sleeper's grace
// counts from the restart's end too; would catch a check that blames the monitor for what
// happened while nobody could watch.
TEST(Sim, OutsideWakeJustBeforeARestartIsTheMonitorsToSee) {
  // And the same for another engine process that came up just before a restart.
  {
    SimOptions r;
    r.seed = 3557009365166683;
    r.cycles = 100;
    r.legacy_one_in = 4;
    auto replaced = ParsePlan(
        "relabel@4:57:1424,wal_fault@13:39:2218,wal_fault@14:17:3681,"
        "restart_keeps_label@14:11:1948");
    ASSERT_TRUE(replaced.ok()) << replaced.status().ToString();
    ExpectPasses(r, *replaced);
  }
  SimOptions o;
  o.seed = 2659084603753795;
  o.cycles = 100;
  o.legacy_one_in = 4;  // as found: the random run's options, pinned against a changed default
  auto plan = ParsePlan("external_update@36:63:3359,wal_fault@49:15:2745,external_wake@49:56:2110");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectPasses(o, *plan);
}

// Regression seed (a false positive of the simulator, found by its campaign): an executor crash
// after the intent of a sleeper's KV wake-up; the recovered runner woke it, published and, READY
// but not yet re-verified, probed the engine before the publish was durable; meanwhile an outsider
// replaced the weights, which the probe tainted. The publish check compared the validation with
// the engine's weights when the publish was observed; it now judges them as they were when the
// resume that published answered. Would catch that check blaming a publish on a later change.
TEST(Sim, PublishJudgedAtItsResume) {
  SimOptions o;
  o.seed = 6000043;
  o.cycles = 200;
  const FaultPlan plan = AsFound(o, PlanForSeed(o.seed, o.cycles));
  ExpectPasses(o, plan);
}

// Proves that with no faults every cycle can be colocated (sleep at level 1 or 2, then a wake-up
// or an update from sleep) and each plan commits, with every admission tried while asleep
// refused; would catch a colocated path that cannot make progress, which would leave the
// swarm's colocated checks vacuous.
TEST(Sim, FaultFreeColocatedCyclesAllCommit) {
  SimOptions o;
  o.seed = 9;
  o.cycles = 60;
  o.colocated_one_in = 1;
  const SimResult r = sim::Run(o, {});
  for (const std::string& v : r.violations) ADD_FAILURE() << v;
  const ColocatedStats& c = r.stats.colocated;
  EXPECT_EQ(c.cycles, 60u);
  EXPECT_EQ(c.slept, c.sleeps);
  EXPECT_EQ(c.woken, c.wakes);
  EXPECT_EQ(c.committed_from_sleep, c.updates_from_sleep);
  EXPECT_GT(c.wakes, 0u);
  EXPECT_GT(c.updates_from_sleep, 0u);
  EXPECT_GT(c.refusals_probed, 0u);
  EXPECT_GT(c.admissions_refused, 0u);
  EXPECT_EQ(r.stats.tainted, 0u);
  EXPECT_EQ(c.ended_asleep, 0u);
  EXPECT_EQ(c.restores_published_unpaused + c.updates_published_unpaused, 0u);
}

// Proves that the swarm reaches the colocated paths under faults: sleeps, wake-ups and updates
// from sleep committed and refused, cycles that end asleep and continue, deaths and external
// wake-ups of a sleeper, and taints of colocated plans; would catch a world or fault schedule
// that silently stopped exercising them (the checks would then pass vacuously).
TEST(Sim, SwarmReachesColocatedPaths) {
  SimStats total;
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    SimOptions o;
    o.seed = seed;
    o.cycles = 100;
    const SimResult r = sim::Run(o, PlanForSeed(seed, o.cycles));
    for (const std::string& v : r.violations) ADD_FAILURE() << "seed " << seed << ": " << v;
    total.Add(r.stats);
  }
  const ColocatedStats& c = total.colocated;
  EXPECT_GT(c.slept, 100u);
  EXPECT_GT(c.woken, 20u);
  EXPECT_GT(c.committed_from_sleep, 50u);
  EXPECT_GT(c.refused_from_sleep, 0u);
  EXPECT_GT(c.began_asleep, 0u);
  EXPECT_GT(c.sleep_deaths, 0u);
  EXPECT_GT(c.external_wakes, 0u);
  EXPECT_GT(c.admissions_refused, 100u);
  EXPECT_FALSE(c.taints.empty());
}

// Proves that a restore of an engine tainted asleep validates a paused engine. Found by the
// simulator (shrunk to two faults): someone wakes a level-1 sleeper (/wake_up), the monitor
// taints it (engine_woken_externally) and the fold keeps the sleep level; a restore that woke the
// weights after its pause found an engine no longer asleep, which vLLM answers by resuming its
// scheduler, and its transfer, resets and validation ran unpaused before it published. Would
// catch any restore whose wake-up follows its drain.
TEST(Sim, RestoreOfASleeperValidatesPaused) {
  SimOptions o;
  o.seed = 3;
  o.cycles = 100;
  auto plan = ParsePlan("slow_rollout@82:22:3739,external_wake@84:13:2055");
  ASSERT_TRUE(plan.ok());
  ExpectPasses(o, *plan);
}

// Proves that engine restarts which come back under the label the engine had (on its initial
// weights, or on the weights it had) are caught as a replaced engine and never leave READY on
// weights the journal did not publish; would catch a monitor or fold that trusts the label and
// misses the new process.
TEST(Sim, RestartsThatKeepTheLabelAreCaught) {
  SimOptions o;
  o.seed = 12;
  o.cycles = 60;
  FaultPlan plan;
  for (std::uint32_t c = 1; c < o.cycles; c += 2) {
    plan.push_back(Fault{FaultKind::kRestartKeepsLabel, c, c, 7 * c});
  }
  const SimResult r = sim::Run(o, plan);
  for (const std::string& v : r.violations) ADD_FAILURE() << v;
  const auto replaced = r.stats.taints.find("engine_replaced");
  ASSERT_NE(replaced, r.stats.taints.end());
  EXPECT_GE(replaced->second, 10u);
  EXPECT_GT(r.stats.committed, 0u);
}

// Proves that fleets of 2, 4 and 8 engines under each seed's faults, aimed at single engines,
// keep every check of the fleet world (each rollout one weight state of its engine, each publish
// validated on the target's weights with every cache reset and paused, the fleet's history rules,
// replay) and that both modes commit; would catch a regression in the fleet fold, the fleet
// executor or the journal's in-place fold that breaks one.
TEST(SimFleet, SeedsKeepTheFleetContract) {
  SimStats total;
  for (std::uint32_t engines : {2u, 4u, 8u}) {
    for (std::uint64_t seed = 1; seed <= 20; ++seed) {
      SimOptions o;
      o.seed = seed;
      o.cycles = 40;
      o.fleet_engines = engines;
      const FaultPlan plan = PlanForSeed(seed, o.cycles);
      SimResult r = sim::RunFleet(o, plan);
      for (const std::string& v : r.violations) ADD_FAILURE() << v;
      if (!r.violations.empty()) ADD_FAILURE() << "replay with: " << ReplayCommand(o, plan);
      if (::testing::Test::HasFailure()) return;
      total.Add(r.stats);
    }
  }
  EXPECT_GT(total.committed, 1000u);
  EXPECT_GT(total.tainted, 0u) << "no fault reached a member: the swarm's checks are vacuous";
  EXPECT_GT(total.admissions_acked, 1000u);
}

// Proves that a fleet seed replays exactly; would catch nondeterminism in the fleet world (a
// thread of the fleet executor, an unseeded choice) that would make its failures unreplayable.
TEST(SimFleet, SameSeedSameRun) {
  SimOptions o;
  o.seed = 11;
  o.cycles = 40;
  o.fleet_engines = 4;
  const FaultPlan plan = PlanForSeed(o.seed, o.cycles);
  const SimResult a = sim::RunFleet(o, plan), b = sim::RunFleet(o, plan);
  EXPECT_EQ(a.head, b.head);
  EXPECT_EQ(a.stats.events, b.stats.events);
  EXPECT_EQ(a.stats.committed, b.stats.committed);
}

}  // namespace
}  // namespace rc::sim
