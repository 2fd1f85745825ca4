// The simulator's paths around a pending re-verification (State::engine_recheck): weight-digest
// reads that fail, journals that fold by rules 0, and sleepers whose executor restarted. The
// oracle tests fold real events; the world tests run real runners and journals.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sim/engine.h"
#include "sim/oracle.h"
#include "sim/sim.h"
#include "statemachine/history.h"
#include "statemachine/state.h"

namespace rc::sim {
namespace {

HttpEvidence Ok() { return HttpEvidence{Transport::kOk, 200, true, 1000, ""}; }

WeightIdentity Initial() {
  return WeightIdentity{std::string(64, 'a'), "", kInitialWeights, "sim-run", 0};
}

BootstrapRequested Bootstrap(std::uint32_t fold_rules) {
  BootstrapRequested b{"rc-0", Initial()};
  b.fold_rules = fold_rules;
  return b;
}

// Folds `input` and its decisions with the real fold, recorded as the journal records them.
void Fold(State& s, std::vector<HistoryEntry>& history, const Event& input) {
  Result<std::vector<Event>> decided = step(s, input);
  ASSERT_TRUE(decided.ok()) << decided.status().ToString();
  const std::uint64_t seq = history.size() + 1;
  history.push_back(HistoryEntry{seq, 0, input});
  for (const Event& d : *decided) history.push_back(HistoryEntry{history.size() + 1, seq, d});
}

// The bootstrap's probe of process sim-1 on the initial weights: READY on rc-0.
void FoldToReady(State& s, std::vector<HistoryEntry>& history) {
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, EffectStarted{EffectKind::kProbeEngine}));
  EngineProbed p;
  p.http = Ok();
  p.engine_version = "0.30.0";
  p.reported_label = "rc-0";
  p.is_paused_known = true;
  p.engine_instance = "sim-1";
  p.digest = SimDigest(kInitialWeights);
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, p));
  ASSERT_EQ(s.lifecycle, Lifecycle::kReady);
}

// READY under `fold_rules`, then an executor restart: the re-verification is pending.
void FoldToRecheck(std::uint32_t fold_rules, State& s, std::vector<HistoryEntry>& history) {
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, Bootstrap(fold_rules)));
  ASSERT_NO_FATAL_FAILURE(FoldToReady(s, history));
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, RecoveryStarted{"sim"}));
  ASSERT_TRUE(s.engine_recheck);
  ASSERT_EQ(s.fold_rules, fold_rules);
}

// The monitor's look at the verified engine (its process and label, unpaused), with the
// committed digest or with a digest read that failed.
EngineMonitored Look(const State& s, bool digest_read) {
  EngineMonitored m;
  m.http = Ok();
  m.reported_label = "rc-0";
  m.is_paused_known = true;
  m.engine_instance = "sim-1";
  m.updates_seen = monitor_epoch(s);
  if (digest_read) {
    m.digest = SimDigest(kInitialWeights);
  } else {
    m.digest.error = "the weight digest read failed: /collective_rpc rc_weight_digest: timed out";
  }
  return m;
}

// Proves that under rules 1 a look whose digest read failed keeps the re-verification pending
// and the executors' look_clears_recheck says so, and that the committed digest then clears it;
// would catch a fold (weights_verified) or a look_clears_recheck that lets the unread look clear
// it, or one that never clears it.
TEST(SimOracle, Rules1LookWithoutDigestKeepsTheRecheck) {
  State s;
  std::vector<HistoryEntry> history;
  ASSERT_NO_FATAL_FAILURE(FoldToRecheck(kFoldRulesCurrent, s, history));
  const EngineMonitored unread = Look(s, false);
  const LookJudgement j = JudgeMonitorLook(s, unread);
  EXPECT_EQ(j.broken, "");
  EXPECT_TRUE(j.judged && j.unread && j.vouched);
  EXPECT_FALSE(j.cleared);
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, unread));
  EXPECT_TRUE(s.engine_recheck);

  const LookJudgement read = JudgeMonitorLook(s, Look(s, true));
  EXPECT_EQ(read.broken, "");
  EXPECT_TRUE(read.cleared);
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, Look(s, true)));
  RecheckHistoryCounts counts;
  EXPECT_EQ(CheckRecheckHistory(history, &counts), "");
  EXPECT_EQ(counts.unread_kept, 1u);
  EXPECT_EQ(counts.clears, 1u);
  EXPECT_EQ(counts.rules0_unread_clears, 0u);
}

// Proves that a journal that recorded rules 0 still folds by them: a look that vouches for the
// process and label clears the re-verification without a digest, and the executors' predicate
// agrees; would catch rules 1 applied to a journal written before rules were recorded.
TEST(SimOracle, Rules0LookWithoutDigestClearsTheRecheck) {
  State s;
  std::vector<HistoryEntry> history;
  ASSERT_NO_FATAL_FAILURE(FoldToRecheck(0, s, history));
  const EngineMonitored unread = Look(s, false);
  const LookJudgement j = JudgeMonitorLook(s, unread);
  EXPECT_EQ(j.broken, "");
  EXPECT_TRUE(j.judged && j.unread && j.vouched && j.cleared);
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, unread));
  EXPECT_FALSE(s.engine_recheck);
  RecheckHistoryCounts counts;
  EXPECT_EQ(CheckRecheckHistory(history, &counts), "");
  EXPECT_EQ(counts.rules0_unread_clears, 1u);
  EXPECT_EQ(counts.unread_kept, 0u);
}

// Proves that the one way a journal's rules change is a new bootstrap request before READY (a
// journal whose first bootstrap never reached READY, bootstrapped again by this build), and that
// the history oracle accepts it; would catch an oracle that flags that journal, or a fold that
// keeps the first request's rules.
TEST(SimOracle, RulesChangeOnlyByABootstrapBeforeReady) {
  State s;
  std::vector<HistoryEntry> history;
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, Bootstrap(0)));
  ASSERT_NO_FATAL_FAILURE(Fold(s, history, Bootstrap(kFoldRulesCurrent)));
  ASSERT_NO_FATAL_FAILURE(FoldToReady(s, history));
  EXPECT_EQ(s.fold_rules, kFoldRulesCurrent);
  EXPECT_EQ(CheckRecheckHistory(history, nullptr), "");
  EXPECT_FALSE(decide(s, Bootstrap(0)).ok()) << "a READY journal took a bootstrap of rules 0";
}

// Proves that the history oracle reports what a broken fold would let into a journal: a
// bootstrap after READY, and an admission while a re-verification is pending (the real fold
// refuses both, so the entries are forged); would catch an oracle that misses either.
TEST(SimOracle, ForgedHistoriesAreReported) {
  State s;
  std::vector<HistoryEntry> history;
  ASSERT_NO_FATAL_FAILURE(FoldToRecheck(kFoldRulesCurrent, s, history));
  std::vector<HistoryEntry> rebootstrapped = history;
  rebootstrapped.push_back(HistoryEntry{history.size() + 1, 0, Bootstrap(0)});
  EXPECT_NE(CheckRecheckHistory(rebootstrapped, nullptr).find("after READY"), std::string::npos);
  std::vector<HistoryEntry> admitted = history;
  admitted.push_back(HistoryEntry{history.size() + 1, 0, make_admission(s, "r-1")});
  EXPECT_NE(CheckRecheckHistory(admitted, nullptr).find("admission"), std::string::npos);
}

// Proves that a sleeper is judged against the engine's truth while its re-verification is
// pending (after an executor restart under rules 1 it stays pending until a plan from sleep
// validates: no look of a sleeper carries a digest); would catch the check skipping such
// sleepers, which leaves every sleeper after a restart unchecked.
TEST(SimOracle, SleeperJudgedWhileItsRecheckIsPending) {
  Scheduler sched;
  std::vector<std::string> violations;
  SimEngine engine(sched, Line::kNewer, violations);
  engine.SetLabel("rc-0");
  engine.Sleep(1);
  State s;  // the fields a SLEEPING fold records of its sleeper
  s.lifecycle = Lifecycle::kSleeping;
  s.committed.label = "rc-0";
  s.engine_instance = engine.instance_name();
  s.sleep_level = 1;
  s.engine_recheck = true;
  const std::int64_t grace_us = 20'000;
  const SleeperJudgement asleep = JudgeSleeper(s, engine, sched.now_us(), 0, grace_us);
  EXPECT_TRUE(asleep.judged);
  EXPECT_EQ(asleep.mismatch, "");
  engine.WakeAll();  // awake and serving: not the sleeper the fold records
  const SleeperJudgement awake = JudgeSleeper(s, engine, sched.now_us(), 0, grace_us);
  EXPECT_TRUE(awake.judged);
  EXPECT_NE(awake.mismatch, "");
  const SleeperJudgement just_woken =
      JudgeSleeper(s, engine, sched.now_us(), sched.now_us(), grace_us);
  EXPECT_FALSE(just_woken.judged) << "an outside wake-up this instant is the monitor's to see";
  EXPECT_TRUE(violations.empty());
}

void ExpectPasses(const SimResult& r, const SimOptions& o, const FaultPlan& plan) {
  for (const std::string& v : r.violations) ADD_FAILURE() << v;
  if (!r.violations.empty()) ADD_FAILURE() << "replay with: " << ReplayCommand(o, plan);
}

// Cycles of four kinds: every digest read fails (the look before the update fails, the executor
// restarts, its re-verification probes and the monitor's looks read no digest); half of them
// fail, and the executor dies mid-update; every validation's read fails; none fail.
FaultPlan DigestFaultCycles(std::uint32_t cycles) {
  FaultPlan plan;
  for (std::uint32_t c = 0; c < cycles; ++c) {
    const std::uint32_t failure = c % 3;  // timeout, HTTP 5xx, malformed body
    if (c % 4 == 0) plan.push_back(Fault{FaultKind::kDigestUnread, c, failure, 3});
    if (c % 4 == 1) {
      plan.push_back(Fault{FaultKind::kDigestUnread, c, failure, 1});
      plan.push_back(Fault{FaultKind::kExecutorCrash, c, c, 0});
    }
    if (c % 4 == 2) plan.push_back(Fault{FaultKind::kDigestUnread, c, 3 + failure, 3});
  }
  return plan;
}

// Proves that with weight-digest reads failing at probes, looks, validations and the monitor
// (rules 1) no look without a digest clears a re-verification (the fold and look_clears_recheck
// agree at every monitor look, and over the journal), nothing is admitted while one is pending
// or published without a digest, and each pending one clears once reads succeed; would catch a
// mutated rules-1 predicate (look_clears_recheck or weights_verified letting an unread look clear
// it, or never clearing it) and an engine model whose digest reads never fail (the counts stay 0).
TEST(Sim, DigestReadFaultsNeverClearARecheck) {
  SimOptions o;
  o.seed = 31;
  o.cycles = 96;
  o.colocated_one_in = 0;
  o.legacy_one_in = 0;
  const FaultPlan plan = DigestFaultCycles(o.cycles);
  const SimResult r = sim::Run(o, plan);
  ExpectPasses(r, o, plan);
  const RecheckStats& c = r.stats.recheck;
  EXPECT_GT(c.digest_reads_failed, 0u);
  EXPECT_GT(c.monitor_looks_kept_pending, 0u) << "no monitor look met a pending re-verification";
  EXPECT_GT(c.journaled_unread_kept, 0u) << "no probe without a digest met one";
  EXPECT_GT(c.journaled_clears, 0u) << "no pending re-verification ever cleared";
  EXPECT_GT(c.validations_unread, 0u);
  EXPECT_GT(c.admissions_refused_pending, 0u);
  EXPECT_EQ(c.rules0_worlds, 0u);
  EXPECT_GT(r.stats.committed + r.stats.restored, 0u);
}

// Proves that journals an earlier RolloutCore began (no fold rules: 0) fold by the old rule for
// their life under digest faults (a look that vouches for the process clears a re-verification
// without a digest; refold, snapshot, replay and reopen agree; a bootstrap naming other rules is
// refused once READY, and one before READY, the only change, gives the current rules); would
// catch rules 1 applied to such journals, a codec or snapshot that loses the rules, and worlds
// that never begin from such a journal.
TEST(Sim, LegacyJournalsFoldByTheRulesTheyRecorded) {
  SimOptions o;
  o.seed = 32;
  o.cycles = 96;
  o.cycles_per_world = 15;
  o.legacy_one_in = 1;
  FaultPlan plan = DigestFaultCycles(o.cycles);
  for (std::uint32_t c = 0; c < o.cycles; ++c) {
    plan.push_back(Fault{FaultKind::kExecutorRestartAsleep, c, 5 + c, c});
  }
  const SimResult r = sim::Run(o, plan);
  ExpectPasses(r, o, plan);
  const RecheckStats& c = r.stats.recheck;
  EXPECT_GT(c.rules0_worlds, 0u);
  EXPECT_GT(c.rebootstrapped_worlds, 0u);
  EXPECT_EQ(c.rules0_worlds + c.rebootstrapped_worlds, r.stats.worlds);
  EXPECT_EQ(c.rules_changes_refused, r.stats.worlds);
  EXPECT_GT(c.rules0_unread_clears, 0u) << "no rules-0 look cleared a re-verification unread";
  EXPECT_GT(r.stats.committed + r.stats.restored, 0u);
}

// Proves that sleepers whose executor restarted while they slept (their re-verification pending
// until a plan from sleep validates them) are judged against the engine's truth, and that the
// plans from sleep still commit; would catch the sleeper check skipping them (no sleeper after a
// restart asleep would be checked) and a world that never restarts an executor asleep.
TEST(Sim, ExecutorRestartsWhileAsleepKeepTheSleeperChecked) {
  SimOptions o;
  o.seed = 33;
  o.cycles = 60;
  o.colocated_one_in = 1;
  o.legacy_one_in = 0;
  FaultPlan plan;
  for (std::uint32_t c = 0; c < o.cycles; ++c) {
    plan.push_back(Fault{FaultKind::kExecutorRestartAsleep, c, 3 * c, c});
  }
  const SimResult r = sim::Run(o, plan);
  ExpectPasses(r, o, plan);
  const ColocatedStats& c = r.stats.colocated;
  EXPECT_GT(c.executor_restarts_asleep, 10u);
  EXPECT_GT(c.sleepers_checked_pending, 10u);
  EXPECT_GT(c.woken + c.committed_from_sleep, 10u);
}

// Proves that the new fault kinds round-trip through the --faults syntax and the replay command
// names the legacy-journal option; would catch a replay that runs another schedule or other
// worlds than the failing run.
TEST(Sim, RecheckFaultsReplay) {
  const FaultPlan plan = {Fault{FaultKind::kDigestUnread, 3, 1, 2},
                          Fault{FaultKind::kExecutorRestartAsleep, 4, 40, 7}};
  auto parsed = ParsePlan(FormatPlan(plan));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, plan);
  SimOptions o;
  o.legacy_one_in = 1;
  EXPECT_NE(ReplayCommand(o, plan).find("--legacy 1"), std::string::npos);
}

}  // namespace
}  // namespace rc::sim
