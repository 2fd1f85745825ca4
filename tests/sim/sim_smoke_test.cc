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
// Recover() failed. Proves the runner looks again after its backoff.
TEST(Sim, MonitorDuringRecoveryBackoff) {
  SimOptions o;
  o.seed = 17;
  o.cycles = 200;
  o.monitor_during_recovery = true;
  ExpectPasses(o, PlanForSeed(o.seed, o.cycles));
}

}  // namespace
}  // namespace rc::sim
