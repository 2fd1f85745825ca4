// Colocated mode in the fold: a sleep drains and releases the engine's memory; a sleeping engine
// admits nothing; an update from sleep wakes the weights before the transfer and the KV cache
// only after validation; a level-1 wake-up is validated like an update; whatever fails before the
// weights may change leaves the engine asleep, anything ambiguous taints it.
#include <gtest/gtest.h>

#include "tests/statemachine/helpers.h"

namespace rc {
namespace {

using namespace rc::test;

struct SleepDriver : Driver {
  // READY on rc-0 (digest 111), engine instance i-1.
  void start() {
    ok(BootstrapRequested{"rc-0", identity('a')});
    effect(EffectKind::kProbeEngine);
    EngineProbed p{ok_http(), "0.25.1", "rc-0"};
    p.engine_instance = "i-1";
    p.digest = digest_of("111");
    ok(p);
    ASSERT_EQ(s.lifecycle, Lifecycle::kReady);
  }
  void wake_effect(WakeTag t) {
    EffectStarted e = intent(EffectKind::kWake);
    e.wake = t;
    ok(e);
  }
  std::vector<Event> woken(WakeTag t, HttpEvidence h = ok_http()) {
    wake_effect(t);
    WakeObserved w{h, t};
    if (t == WakeTag::kKvCache && h.ok_2xx()) {
      w.is_paused_known = true;
      w.is_paused = false;
      w.engine_instance = s.engine_instance;  // the same process
    }
    return ok(w);
  }
  std::vector<Event> sleep(std::uint8_t level, HttpEvidence h = ok_http()) {
    ok(SleepRequested{"s-1", level});
    EXPECT_EQ(s.lifecycle, Lifecycle::kDraining);
    effect(EffectKind::kDrain);
    ok(DrainObserved{ok_http(), true});
    EXPECT_EQ(s.lifecycle, Lifecycle::kQuiesced);
    EXPECT_EQ(next_effect(s).kind, EffectKind::kSleep);
    effect(EffectKind::kSleep);
    SleepObserved o{h, level, h.ok_2xx(), h.ok_2xx()};
    o.memory = DeviceMemory{true, 10, 90, 100};
    return ok(o);
  }
  UpdateRequested colocated_update(const std::string& label, char ident = 'a') const {
    // The trainer's next step: the committed architecture (manifest), new values.
    return UpdateRequested{"u-" + label, label, identity(ident, 2), "vllm-ipc:/tmp/x.json"};
  }
  // SLEEPING -> QUIESCED -> preflight -> UPDATING, weights still asleep.
  void update_to_updating(const std::string& label) {
    ok(colocated_update(label));
    ASSERT_EQ(s.lifecycle, Lifecycle::kQuiesced);
    effect(EffectKind::kPreflight);
    ok(good_preflight());
    ASSERT_EQ(s.lifecycle, Lifecycle::kUpdating);
  }
  void resets() {
    for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
      reset_cache(c);
    }
  }
  std::vector<Event> validate(const std::string& label, const WeightDigest& d,
                              const std::string& instance = "i-1") {
    effect(EffectKind::kValidate);
    ValidationObserved v{ok_http(), label, true, ""};
    v.is_paused_known = true;  // read while paused
    v.digest = d;
    v.engine_instance = instance;
    return ok(v);
  }
};

Effect wake(WakeTag t) { return Effect{EffectKind::kWake, CacheKind::kPrefix, t}; }

void expect_history_ok(const Driver& d) {
  HistoryReport r = check_history(d.history);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.state, d.s) << "the checker's fold differs from the live state";
}

// The colocated step end to end: sleep (committed, SLEEPING, nothing admitted), an update from
// sleep that wakes the weights before the transfer and the KV cache only after validation, then
// READY on the new generation; catches a transfer into sleeping weights, a KV wake-up (which
// resumes vLLM's scheduler) before validation, and admissions while asleep.
TEST(Colocated, SleepThenUpdateFromSleepPublishesAfterValidation) {
  SleepDriver d;
  d.start();
  std::vector<Event> slept = d.sleep(1);
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kSleeping);
  EXPECT_EQ(d.s.sleep_level, 1);
  ASSERT_EQ(count_of<UpdateEnded>(slept), 1);
  EXPECT_EQ(std::get<UpdateEnded>(slept[0]).outcome, UpdateOutcome::kCommitted);
  EXPECT_FALSE(admits(d.s));
  EXPECT_NE(admission_block_reason(d.s).find("asleep"), std::string::npos);
  EXPECT_EQ(d.rejected(make_admission(d.s, "r-asleep")), Code::kRejected);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);

  d.update_to_updating("rc-1");
  EXPECT_EQ(next_effect(d.s), wake(WakeTag::kWeights));
  EXPECT_EQ(d.rejected(intent(EffectKind::kTransfer)), Code::kRejected);
  d.woken(WakeTag::kWeights);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kTransfer);
  d.effect(EffectKind::kTransfer);
  d.ok(d.good_transfer());
  d.resets();
  d.validate("rc-1", digest_of("222"));
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  EXPECT_EQ(next_effect(d.s), wake(WakeTag::kKvCache));
  EXPECT_EQ(d.rejected(intent(EffectKind::kResume)), Code::kRejected);
  std::vector<Event> ended = d.woken(WakeTag::kKvCache);
  EXPECT_EQ(count_of<VersionPublished>(ended), 1);
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed, (WeightVersion{1, "rc-1"}));
  EXPECT_EQ(d.s.sleep_level, 0);
  EXPECT_EQ(d.s.counters.sleeps_committed, 1u);
  EXPECT_EQ(d.s.counters.updates_committed, 1u);
  EXPECT_TRUE(admits(d.s));
  expect_history_ok(d);
  HistoryReport r = check_history(d.history);
  EXPECT_EQ(r.summary.sleeps_committed, 1u);
  EXPECT_EQ(r.summary.updates_committed, 1u);
}

// A level-1 wake-up: the weights come back from host memory and are validated (label and the
// committed digest) while the KV cache still sleeps; the version does not change; catches a
// wake-up that serves unvalidated weights or bumps the generation.
TEST(Colocated, LevelOneWakeUpValidatesTheCommittedWeights) {
  SleepDriver d;
  d.start();
  d.sleep(1);
  d.ok(WakeRequested{"w-1"});
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kUpdating);
  EXPECT_EQ(next_effect(d.s), wake(WakeTag::kWeights));
  d.woken(WakeTag::kWeights);
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kInvalidating);
  d.resets();
  d.validate("rc-0", digest_of("111"));
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  std::vector<Event> ended = d.woken(WakeTag::kKvCache);
  EXPECT_EQ(count_of<VersionPublished>(ended), 0);
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed, (WeightVersion{0, "rc-0"}));
  EXPECT_EQ(d.s.counters.wakes_committed, 1u);
  expect_history_ok(d);
}

// A host copy that did not come back intact (another digest) taints the wake-up; catches a
// wake-up trusted on its label alone.
TEST(Colocated, WakeUpWithOtherWeightsTaints) {
  SleepDriver d;
  d.start();
  d.sleep(1);
  d.ok(WakeRequested{"w-1"});
  d.woken(WakeTag::kWeights);
  d.resets();
  d.validate("rc-0", digest_of("191"));
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_NE(d.s.taint->detail.find("1 of 3 tensors differ: b"), std::string::npos)
      << d.s.taint->detail;
  expect_history_ok(d);
}

// Level 2 discarded the weights: a wake-up is refused and an update must name every tensor of
// the committed manifest; catches serving garbage after a level-2 sleep.
TEST(Colocated, LevelTwoNeedsAFullUpdate) {
  SleepDriver d;
  d.start();
  d.sleep(2);
  EXPECT_EQ(d.s.sleep_level, 2);
  EXPECT_EQ(d.rejected(WakeRequested{"w-1"}), Code::kRejected);
  EXPECT_EQ(d.rejected(d.colocated_update("rc-1", 'b')), Code::kInvalidArgument);
  d.update_to_updating("rc-1");
  d.woken(WakeTag::kWeights);
  d.effect(EffectKind::kTransfer);
  d.ok(d.good_transfer());
  d.resets();
  d.validate("rc-1", digest_of("222"));
  d.woken(WakeTag::kKvCache);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  expect_history_ok(d);
}

// A sleep provably not done (vLLM without its dev routes answers 404; a connection refused
// three times) resumes the engine on its version; catches a refusal that leaves it paused.
TEST(Colocated, SleepNotDoneResumesServing) {
  for (const HttpEvidence& h : {http(Transport::kOk, 404, true), http(Transport::kConnectFailed)}) {
    SleepDriver d;
    d.start();
    d.sleep(1, h);
    for (int i = 1; i < 3 && d.s.lifecycle == Lifecycle::kQuiesced; ++i) {
      d.effect(EffectKind::kSleep);
      d.ok(SleepObserved{h, 1});
    }
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kResuming) << describe(d.s);
    d.resume();
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
    EXPECT_EQ(d.s.sleep_level, 0);
    EXPECT_EQ(d.s.counters.sleeps_committed, 0u);
    expect_history_ok(d);
  }
}

// A sleep that may have released memory (500, timeout) taints, remembering the level, and a
// restore then wakes the engine fully (weights, then KV cache) before it drains, so the reload,
// resets and validation all run paused; catches a restore that writes into unmapped weights, or
// that wakes the engine after its pause (vLLM's wake-up resumes an awake engine's scheduler, so
// the evidence would be checked while it serves).
TEST(Colocated, AmbiguousSleepTaintsAndTheRestoreWakesTheEngineBeforeItsDrain) {
  SleepDriver d;
  d.start();
  d.sleep(1, http(Transport::kOk, 500, true));
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(d.s.taint->cause, Cause::kSleepFailed);
  EXPECT_EQ(d.s.sleep_level, 1);
  d.ok(RestoreRequested{"x-1", "rc-0", "vllm-ipc:/tmp/rc0.json", false});
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kDraining);
  EXPECT_TRUE(d.s.update->wake_first);
  EXPECT_FALSE(d.s.update->from_sleep);
  EXPECT_EQ(next_effect(d.s), wake(WakeTag::kWeights));
  EXPECT_EQ(d.rejected(intent(EffectKind::kDrain)), Code::kRejected);
  d.woken(WakeTag::kWeights);
  EXPECT_EQ(next_effect(d.s), wake(WakeTag::kKvCache));
  EXPECT_EQ(d.s.sleep_level, 1) << "half awake is still asleep";
  EXPECT_TRUE(d.woken(WakeTag::kKvCache).empty()) << "waking in DRAINING decides nothing";
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining);
  EXPECT_EQ(d.s.sleep_level, 0);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kDrain);
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  d.effect(EffectKind::kPreflight);
  d.ok(d.good_preflight());
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kTransfer) << "the weights were woken already";
  d.effect(EffectKind::kTransfer);
  d.ok(d.good_transfer());
  d.resets();
  d.validate("rc-0", digest_of("111"));
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kResume) << "the engine is awake: a plain resume";
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.counters.restores_committed, 1u);
  expect_history_ok(d);
}

// A restore's wake-up before its drain that fails (refused after its retries, or timed out) ends
// the restore refused: the engine stays TAINTED and still possibly asleep, so the next restore
// wakes it again; catches a failed wake that drains anyway or forgets the sleep level.
TEST(Colocated, ARestoresFailedWakeUpLeavesItTaintedAndAsleep) {
  for (WakeTag failing : {WakeTag::kWeights, WakeTag::kKvCache}) {
    SleepDriver d;
    d.start();
    d.sleep(2, http(Transport::kTimeout));
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    d.ok(RestoreRequested{"x-1", "rc-0", "vllm-ipc:/tmp/rc0.json", false});
    if (failing == WakeTag::kKvCache) d.woken(WakeTag::kWeights);
    std::vector<Event> out;
    for (int i = 0; i < 3 && d.s.lifecycle == Lifecycle::kDraining; ++i) {
      out = d.woken(failing, http(Transport::kOk, 500, true));
    }
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted) << describe(d.s);
    EXPECT_EQ(d.s.taint->cause, Cause::kWakeFailed);
    ASSERT_EQ(count_of<UpdateEnded>(out), 1);
    EXPECT_EQ(std::get<UpdateEnded>(out[0]).outcome, UpdateOutcome::kRefused);
    EXPECT_EQ(d.s.sleep_level, 2);
    d.ok(RestoreRequested{"x-2", "rc-0", "vllm-ipc:/tmp/rc0.json", false});
    EXPECT_EQ(next_effect(d.s), wake(WakeTag::kWeights)) << "the next restore wakes it again";
    expect_history_ok(d);
  }
  SleepDriver d;
  d.start();
  d.sleep(1, http(Transport::kOk, 500, true));
  d.ok(RestoreRequested{"x-1", "rc-0", "vllm-ipc:/tmp/rc0.json", false});
  d.woken(WakeTag::kWeights, http(Transport::kTimeout));
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted) << "a timed-out wake-up is not retried blindly";
  expect_history_ok(d);
}

// Refusals before the weights may change leave the engine asleep (preflight refused, the wake of
// the weights refused) while nothing woke them; once the weights were woken, or may have been (a
// transfer proven unsent after the wake, an executor restart after the wake's intent or answer),
// the engine is not asleep as recorded and taints as a failed wake-up; ambiguous ones taint.
// Catches a refused colocated update that resumes a sleeping engine, and one recorded asleep
// while its weights hold the device memory the trainer was told is free.
TEST(Colocated, RefusalsLeaveTheEngineAsleepAmbiguityTaints) {
  {
    SleepDriver d;
    d.start();
    d.sleep(1);
    d.ok(d.colocated_update("rc-1"));
    d.effect(EffectKind::kPreflight);
    PreflightObserved bad = d.good_preflight();
    bad.device_ok = false;
    std::vector<Event> out = d.ok(bad);
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kSleeping);
    EXPECT_EQ(count_of<UpdateEnded>(out), 1);
    EXPECT_EQ(d.s.counters.updates_refused, 1u);
    expect_history_ok(d);
  }
  {
    SleepDriver d;
    d.start();
    d.sleep(1);
    d.update_to_updating("rc-1");
    d.woken(WakeTag::kWeights, http(Transport::kOk, 404, true));
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kSleeping);
    expect_history_ok(d);
  }
  {
    SleepDriver d;
    d.start();
    d.sleep(1);
    d.update_to_updating("rc-1");
    d.woken(WakeTag::kWeights);
    d.effect(EffectKind::kTransfer);
    d.ok(TransferObserved{false, MutationClass::kNone, 0, 0, 10, "", "refused"});
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(d.s.taint->cause, Cause::kWakeFailed);
    EXPECT_EQ(d.s.sleep_level, 1);
    expect_history_ok(d);
  }
  {
    SleepDriver d;
    d.start();
    d.sleep(1);
    d.update_to_updating("rc-1");
    d.woken(WakeTag::kWeights);
    d.ok(RecoveryStarted{"exec-2"});
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(d.s.taint->cause, Cause::kWakeFailed);
    expect_history_ok(d);
  }
  {
    SleepDriver d;  // the executor died with the wake's intent durable, its answer lost
    d.start();
    d.sleep(1);
    d.update_to_updating("rc-1");
    d.wake_effect(WakeTag::kWeights);
    d.ok(RecoveryStarted{"exec-2"});
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(d.s.taint->cause, Cause::kWakeFailed);
    expect_history_ok(d);
  }
  {
    SleepDriver d;  // a restart before the wake's intent: nothing woke them
    d.start();
    d.sleep(1);
    d.update_to_updating("rc-1");
    d.ok(RecoveryStarted{"exec-2"});
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kSleeping);
    expect_history_ok(d);
  }
  {
    SleepDriver d;
    d.start();
    d.sleep(1);
    d.update_to_updating("rc-1");
    d.woken(WakeTag::kWeights, http(Transport::kTimeout));
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(d.s.taint->cause, Cause::kWakeFailed);
    expect_history_ok(d);
  }
}

// The monitor watches a sleeper: paused is how vLLM reports it; resumed behind our back, or
// another process, taints; a digest of unmapped weights and an observation from before the sleep
// are refused; catches a restart while asleep going unnoticed.
TEST(Colocated, MonitorWatchesTheSleeper) {
  SleepDriver d;
  d.start();
  EngineMonitored before_sleep{ok_http(), "rc-0", true, false, "i-1"};
  before_sleep.updates_seen = monitor_epoch(d.s);
  d.sleep(1);
  EXPECT_EQ(d.rejected(before_sleep), Code::kRejected);
  EngineMonitored asleep{ok_http(), "rc-0", true, true, "i-1"};
  asleep.updates_seen = monitor_epoch(d.s);
  EXPECT_TRUE(d.ok(asleep).empty());
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kSleeping);
  EngineMonitored with_digest = asleep;
  with_digest.digest = digest_of("111");
  EXPECT_EQ(d.rejected(with_digest), Code::kInvalidArgument);
  {
    SleepDriver w = d;
    EngineMonitored resumed = asleep;
    resumed.is_paused = false;
    w.ok(resumed);
    EXPECT_EQ(w.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(w.s.taint->cause, Cause::kEngineWokenExternally);
    expect_history_ok(w);
  }
  EngineMonitored restarted = asleep;
  restarted.engine_instance = "i-2";
  restarted.reported_label = "default";
  restarted.is_paused = false;
  d.ok(restarted);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(d.s.taint->cause, Cause::kEngineReplaced);
  expect_history_ok(d);
}

// Rollouts admitted before the sleep finish before the engine sleeps; bad requests change
// nothing; catches a sleep that cuts rollouts off or accepts an unknown level.
TEST(Colocated, SleepDrainsRolloutsAndRefusesBadRequests) {
  SleepDriver d;
  d.start();
  EXPECT_EQ(d.rejected(SleepRequested{"s-0", 0}), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(SleepRequested{"s-0", 3}), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(SleepRequested{"", 1}), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(WakeRequested{"w-0"}), Code::kRejected);
  const std::string r = d.admit();
  d.ok(SleepRequested{"s-1", 1});
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kAwaitRollouts);
  d.ok(RolloutFinished{r, RolloutOutcome::kCompleted, 1, 1});
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kQuiesced);
  d.effect(EffectKind::kSleep);
  d.ok(SleepObserved{ok_http(), 1, true, true});
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kSleeping);
  EXPECT_EQ(d.rejected(SleepRequested{"s-2", 1}), Code::kRejected);
  expect_history_ok(d);
}

// Forged colocated edges are refused by the fold, and a journal that writes into sleeping
// weights is refused by the history checker's own bookkeeping; catches an edited journal passing
// off a transfer while asleep or a sleep plan publishing.
TEST(Colocated, ForgedEdgesAreRefused) {
  SleepDriver d;
  d.start();
  EXPECT_FALSE(
      apply(d.s, StateChanged{Lifecycle::kReady, Lifecycle::kSleeping, Cause::kSlept, ""}).ok());
  SleepDriver u = d;
  u.to_quiesced("rc-1");
  EXPECT_FALSE(
      apply(u.s, StateChanged{Lifecycle::kQuiesced, Lifecycle::kSleeping, Cause::kSlept, ""}).ok());
  d.sleep(1);
  d.update_to_updating("rc-1");
  EXPECT_FALSE(
      apply(d.s, StateChanged{Lifecycle::kUpdating, Lifecycle::kInvalidating, Cause::kWoken, ""})
          .ok());
  // A history whose transfer intent precedes the wake-up of the weights.
  std::vector<HistoryEntry> forged = d.history;
  EffectStarted transfer = intent(EffectKind::kTransfer);
  forged.push_back({forged.back().seq + 1, 0, transfer});
  HistoryReport r = check_history(forged);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("asleep"), std::string::npos) << r.message;
}

// A wake-up failure out of DRAINING belongs only to a restore still waking its engine; catches a
// forged journal tainting an ordinary update (or a restore already awake) with a wake it never
// attempted.
TEST(Colocated, ForgedWakeFailureInDrainingIsRefused) {
  const StateChanged forged{Lifecycle::kDraining, Lifecycle::kTainted, Cause::kWakeFailed, ""};
  SleepDriver u;
  u.start();
  u.ok(u.colocated_update("rc-1"));
  ASSERT_EQ(u.s.lifecycle, Lifecycle::kDraining);
  EXPECT_FALSE(apply(u.s, forged).ok());
  SleepDriver r;
  r.start();
  r.sleep(1, http(Transport::kOk, 500, true));
  r.ok(RestoreRequested{"x-1", "rc-0", "vllm-ipc:/tmp/rc0.json", false});
  r.woken(WakeTag::kWeights);
  r.woken(WakeTag::kKvCache);
  EXPECT_FALSE(apply(r.s, forged).ok());
  EXPECT_FALSE(
      apply(r.s, EffectStarted{EffectKind::kWake, CacheKind::kPrefix, 1000, WakeTag::kKvCache})
          .ok())
      << "no wake-up is due once both pools answered";
}

}  // namespace
}  // namespace rc
