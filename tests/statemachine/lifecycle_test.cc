// Unit tests: every legal transition of the lifecycle, each abort path and each taint path.
#include <gtest/gtest.h>

#include "tests/statemachine/helpers.h"

namespace rc::test {
namespace {

void expect_history_ok(const Driver& d) {
  HistoryReport r = check_history(d.history);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.state, d.s) << "the checker's fold differs from the live state";
}

// Walks bootstrap and a full update; catches any missing edge or a publish that skips a step.
TEST(Lifecycle, HappyUpdatePublishesTheTargetAndReturnsToReady) {
  Driver d;
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
  d.ok(BootstrapRequested{"rc-0", identity('a')});
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine);
  d.effect(EffectKind::kProbeEngine);
  auto ev = d.ok(EngineProbed{ok_http(), "0.25.1", "rc-0", false, false, "i-0"});
  EXPECT_EQ(last_change(ev).to, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed, (WeightVersion{0, "rc-0"}));
  const std::string r = d.admit();
  d.ok(RolloutFinished{r, RolloutOutcome::kCompleted, 5, 7});

  ev = d.ok(d.update_request("rc-1"));
  EXPECT_EQ(last_change(ev).to, Lifecycle::kDraining);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kDrain);
  d.effect(EffectKind::kDrain);
  ev = d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(last_change(ev).to, Lifecycle::kQuiesced);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kPreflight);
  d.effect(EffectKind::kPreflight);
  ev = d.ok(d.good_preflight());
  EXPECT_EQ(last_change(ev).to, Lifecycle::kUpdating);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kTransfer);
  d.effect(EffectKind::kTransfer);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone) << "transfer must never be retried";
  ev = d.ok(d.good_transfer());
  EXPECT_EQ(last_change(ev).to, Lifecycle::kInvalidating);
  // The caches are reset one by one, in order, each needing its own intent.
  for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
    EXPECT_EQ(next_effect(d.s), (Effect{EffectKind::kResetCache, c}));
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kInvalidating);
    d.reset_cache(c);
  }
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kValidating);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kValidate);
  d.effect(EffectKind::kValidate);
  ev = d.ok(ValidationObserved{ok_http(), "rc-1", true, "", "i-0", {}, true, true});
  EXPECT_EQ(last_change(ev).to, Lifecycle::kResuming);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kResume);
  d.effect(EffectKind::kResume);
  ev = d.ok(d.good_resume());
  ASSERT_EQ(count_of<VersionPublished>(ev), 1);
  EXPECT_EQ(std::get<VersionPublished>(ev[0]).version, (WeightVersion{1, "rc-1"}));
  ASSERT_EQ(count_of<UpdateEnded>(ev), 1);
  EXPECT_EQ(std::get<UpdateEnded>(ev[1]).outcome, UpdateOutcome::kCommitted);
  EXPECT_EQ(last_change(ev).to, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed, (WeightVersion{1, "rc-1"}));
  EXPECT_EQ(d.s.committed_identity, identity('b'));
  EXPECT_FALSE(d.s.update.has_value());
  EXPECT_EQ(d.s.counters.updates_committed, 1u);
  // Admissions resume, bound to the new version.
  d.admit();
  EXPECT_EQ(d.s.active.begin()->second.version, (WeightVersion{1, "rc-1"}));
  EXPECT_EQ(check_invariants(d.s), "");
  expect_history_ok(d);
  HistoryReport r2 = check_history(d.history);
  EXPECT_EQ(r2.summary.updates_committed, 1u);
  EXPECT_EQ(r2.summary.rollouts_by_generation[0].admitted, 1u);
  EXPECT_EQ(r2.summary.rollouts_by_generation[1].admitted, 1u);
}

// Bootstrap only completes when the engine reports the requested label; catches READY on a
// probe of the wrong engine or a failed probe, and unbounded probe retries.
TEST(Lifecycle, BootstrapNeedsTheLabelAndRetriesAreBounded) {
  Driver d;
  d.ok(BootstrapRequested{"rc-0", identity('a')});
  for (std::uint32_t i = 0; i < kEffectAttemptsMax; ++i) {
    d.effect(EffectKind::kProbeEngine);
    auto ev = d.ok(EngineProbed{i == 0 ? ok_http() : http(Transport::kConnectFailed), "v",
                                i == 0 ? "other" : ""});
    EXPECT_TRUE(ev.empty());
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kUninitialized);
  }
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
  d.rejected(intent(EffectKind::kProbeEngine));
  // A restart gives the probe a fresh budget.
  d.ok(RecoveryStarted{"exec-2"});
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine);
  expect_history_ok(d);
}

// Drain failing with a timeout aborts at once; catches a drain timeout that waits forever or
// taints an update that never mutated anything.
TEST(Lifecycle, DrainTimeoutAbortsToOldVersionUntainted) {
  Driver d;
  d.to_ready();
  d.to_draining();
  d.effect(EffectKind::kDrain);
  auto ev = d.ok(DrainObserved{http(Transport::kTimeout), false});
  EXPECT_EQ(last_change(ev).cause, Cause::kDrainFailed);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  EXPECT_TRUE(d.s.update->aborting);
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed, (WeightVersion{0, "rc-0"}));
  EXPECT_EQ(d.s.counters.updates_refused, 1u);
  EXPECT_FALSE(d.s.taint.has_value());
  expect_history_ok(d);
}

// A drain that fails without a timeout is retried up to the bound, then aborts; catches
// unbounded drain retries and an abort on the first transient failure.
TEST(Lifecycle, DrainFailureRetriesThenAborts) {
  Driver d;
  d.to_ready();
  d.to_draining();
  for (std::uint32_t i = 1; i <= kEffectAttemptsMax; ++i) {
    EXPECT_EQ(next_effect(d.s).kind, EffectKind::kDrain);
    d.effect(EffectKind::kDrain);
    auto ev = d.ok(DrainObserved{http(Transport::kOk, 503, false), false});
    if (i < kEffectAttemptsMax) {
      EXPECT_TRUE(ev.empty()) << "attempt " << i;
    }
  }
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  EXPECT_TRUE(d.s.update->aborting);
  d.resume();
  EXPECT_EQ(d.s.committed.generation, 0u);
  expect_history_ok(d);
}

// The drain race: an engine drained while a local binding is active never yields QUIESCED; the
// drain is re-confirmed after the binding ends. Catches assuming "engine idle" == "no bindings".
TEST(Lifecycle, DrainRaceAwaitsBindingsThenReconfirms) {
  Driver d;
  d.to_ready();
  const std::string r1 = d.admit();
  const std::string r2 = d.admit();
  d.to_draining();
  d.effect(EffectKind::kDrain);
  auto ev = d.ok(DrainObserved{ok_http(), true});
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kAwaitRollouts);
  d.rejected(intent(EffectKind::kDrain));
  d.rejected(intent(EffectKind::kAwaitRollouts));
  d.ok(RolloutFinished{r1, RolloutOutcome::kCompleted, 1, 1});
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kAwaitRollouts);
  d.ok(RolloutFinished{r2, RolloutOutcome::kAborted, 1, 0});
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining) << "the drain must be confirmed, not assumed";
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kDrain);
  d.effect(EffectKind::kDrain);
  ev = d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(last_change(ev).to, Lifecycle::kQuiesced);
  expect_history_ok(d);
}

// Waiting for bindings past the runner's deadline aborts the update; catches a drain that waits
// forever on a stuck client.
TEST(Lifecycle, DrainAwaitTimeoutAborts) {
  Driver d;
  d.to_ready();
  d.admit();
  d.to_draining();
  d.rejected(DrainTimedOut{10, 1});  // not awaiting yet
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  auto ev = d.ok(DrainTimedOut{30000, 1});
  EXPECT_EQ(last_change(ev).cause, Cause::kDrainFailed);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  // The binding survives the abort (it runs on the old version) and may finish.
  EXPECT_EQ(d.s.active.size(), 1u);
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.active.size(), 1u);
  expect_history_ok(d);
}

// A drain that succeeds on its last attempt while bindings are active still gets its
// re-confirmation once they finish; catches DRAINING stuck with nothing due (kNone).
TEST(Lifecycle, DrainSucceedingOnLastAttemptStillReconfirms) {
  Driver d;
  d.to_ready();
  const std::string r = d.admit();
  d.to_draining();
  for (std::uint32_t i = 1; i < kEffectAttemptsMax; ++i) {
    d.effect(EffectKind::kDrain);
    d.ok(DrainObserved{http(Transport::kConnectFailed), false});
  }
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kAwaitRollouts);
  d.ok(RolloutFinished{r, RolloutOutcome::kCompleted, 1, 1});
  ASSERT_EQ(next_effect(d.s).kind, EffectKind::kDrain) << describe(d.s);
  d.effect(EffectKind::kDrain);
  auto ev = d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(last_change(ev).to, Lifecycle::kQuiesced);
  expect_history_ok(d);
}

struct PreflightCase {
  const char* name;
  bool manifest_matches;
  bool device_ok;
  bool memory_ok;
};

// Each preflight refusal aborts before any mutation, untainted, back to READY at the old
// version; catches a transfer started from a mismatched manifest, the wrong device or low memory.
TEST(Lifecycle, PreflightRefusalsAbortUntainted) {
  for (PreflightCase pc : {PreflightCase{"manifest mismatch", false, true, true},
                           PreflightCase{"wrong device", true, false, true},
                           PreflightCase{"low memory", true, true, false},
                           PreflightCase{"everything", false, false, false}}) {
    SCOPED_TRACE(pc.name);
    Driver d;
    d.to_ready();
    d.to_quiesced();
    d.effect(EffectKind::kPreflight);
    PreflightObserved p = d.good_preflight();
    if (!pc.manifest_matches) p.source_manifest_digest = hex('f');
    p.device_ok = pc.device_ok;
    p.memory_ok = pc.memory_ok;
    auto ev = d.ok(p);
    EXPECT_EQ(last_change(ev).cause, Cause::kPreflightRefused);
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
    EXPECT_TRUE(d.s.update->aborting);
    EXPECT_FALSE(d.s.update->transfer_started);
    EXPECT_EQ(next_effect(d.s).kind, EffectKind::kResume);
    d.resume();
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
    EXPECT_EQ(d.s.committed, (WeightVersion{0, "rc-0"}));
    EXPECT_FALSE(d.s.taint.has_value());
    EXPECT_EQ(d.s.counters.updates_refused, 1u);
    expect_history_ok(d);
  }
}

// A preflight that matches the manifest but not a different identity digest still passes only
// on the manifest; catches comparing the wrong digest (content instead of manifest).
TEST(Lifecycle, PreflightComparesTheManifestDigest) {
  Driver d;
  d.to_ready();
  d.to_quiesced();
  d.effect(EffectKind::kPreflight);
  auto ev = d.ok(PreflightObserved{d.s.update->identity.content_digest, true, true, ""});
  EXPECT_EQ(last_change(ev).cause, Cause::kPreflightRefused);
}

// A transfer failure proven to precede mutation is refused without taint; catches tainting (or
// worse, publishing) after a connection refused before any byte was sent.
TEST(Lifecycle, TransferRefusedWithoutMutationAborts) {
  Driver d;
  d.to_ready();
  d.to_updating();
  d.effect(EffectKind::kTransfer);
  auto ev = d.ok(TransferObserved{false, MutationClass::kNone, 0, 0, 10, "", "refused"});
  EXPECT_EQ(last_change(ev).cause, Cause::kTransferRefused);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed.generation, 0u);
  EXPECT_FALSE(d.s.taint.has_value());
  expect_history_ok(d);
}

void expect_tainted(const Driver& d, const std::vector<Event>& ev, Lifecycle from, Cause cause) {
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  ASSERT_TRUE(d.s.taint.has_value());
  EXPECT_EQ(d.s.taint->from, from);
  EXPECT_EQ(d.s.taint->cause, cause);
  EXPECT_EQ(count_of<VersionPublished>(ev), 0);
  ASSERT_EQ(count_of<UpdateEnded>(ev), 1);
  EXPECT_EQ(std::get<UpdateEnded>(ev[0]).outcome, UpdateOutcome::kTainted);
  EXPECT_EQ(d.s.committed.generation, 0u) << "nothing is published on taint";
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
  expect_history_ok(d);
}

// Ambiguous transfer outcomes taint; catches treating "possibly mutated" or "complete but not
// acknowledged" as a clean refusal or a success.
TEST(Lifecycle, AmbiguousTransferTaints) {
  for (TransferObserved t : {TransferObserved{false, MutationClass::kPossible, 10, 1, 1, "", "x"},
                             TransferObserved{false, MutationClass::kComplete, 10, 1, 1, "", "x"},
                             TransferObserved{true, MutationClass::kPossible, 10, 1, 1, "", ""}}) {
    SCOPED_TRACE(mutation_name(t.mutation));
    Driver d;
    d.to_ready();
    d.to_updating();
    d.effect(EffectKind::kTransfer);
    auto ev = d.ok(t);
    expect_tainted(d, ev, Lifecycle::kUpdating, Cause::kTransferAmbiguous);
  }
}

// A cache reset that answers 200 with success:false (blocks held) is retried to the bound, then
// taints; catches trusting the HTTP status alone (the article's /reset_prefix_cache pitfall).
TEST(Lifecycle, CacheResetReportedFailureTaintsAfterBound) {
  for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
    SCOPED_TRACE(cache_name(c));
    Driver d;
    d.to_ready();
    d.to_invalidating();
    for (CacheKind before : {CacheKind::kPrefix, CacheKind::kEncoder}) {
      if (before < c) d.reset_cache(before);
    }
    std::vector<Event> ev;
    for (std::uint32_t i = 1; i <= kEffectAttemptsMax; ++i) {
      ASSERT_EQ(next_effect(d.s), (Effect{EffectKind::kResetCache, c}));
      d.effect(EffectKind::kResetCache, c);
      ev = d.ok(CacheResetObserved{c, ok_http(), false});
      if (i < kEffectAttemptsMax) {
        EXPECT_TRUE(ev.empty());
      }
    }
    expect_tainted(d, ev, Lifecycle::kInvalidating, Cause::kCacheResetFailed);
  }
}

// A 200 whose body does not parse is not a success; catches counting an unparseable body as a
// reset (the fold must never assume what it could not read).
TEST(Lifecycle, CacheResetUnparseableBodyTaintsAfterBound) {
  Driver d;
  d.to_ready();
  d.to_invalidating();
  std::vector<Event> ev;
  for (std::uint32_t i = 1; i <= kEffectAttemptsMax; ++i) {
    d.effect(EffectKind::kResetCache, CacheKind::kPrefix);
    ev = d.ok(CacheResetObserved{CacheKind::kPrefix, http(Transport::kOk, 200, false), true});
    EXPECT_EQ(d.s.update.has_value() ? d.s.update->caches_reset_mask : 0, 0);
  }
  expect_tainted(d, ev, Lifecycle::kInvalidating, Cause::kCacheResetFailed);
}

// A transient reset failure followed by success keeps going; catches a retry budget shared
// across caches (each cache gets its own kEffectAttemptsMax).
TEST(Lifecycle, CacheResetRetryBudgetIsPerCache) {
  Driver d;
  d.to_ready();
  d.to_invalidating();
  for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
    for (std::uint32_t i = 1; i < kEffectAttemptsMax; ++i) {
      d.effect(EffectKind::kResetCache, c);
      d.ok(CacheResetObserved{c, http(Transport::kBroken), false});
    }
    d.reset_cache(c);
  }
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kValidating);
  expect_history_ok(d);
}

// Validation that sees another label over HTTP 200 taints at once; catches publishing a target
// the engine does not report, or retrying a definitive wrong answer.
TEST(Lifecycle, ValidationWrongLabelTaints) {
  Driver d;
  d.to_ready();
  d.to_validating();
  d.effect(EffectKind::kValidate);
  auto ev = d.ok(ValidationObserved{ok_http(), "rc-0", true, "", "i-0", {}, true, true});
  expect_tainted(d, ev, Lifecycle::kValidating, Cause::kValidationFailed);
}

// Failed optional checks (checksum/canary) taint even with the right label; catches ignoring
// checks_passed.
TEST(Lifecycle, ValidationFailedChecksTaint) {
  Driver d;
  d.to_ready();
  d.to_validating();
  d.effect(EffectKind::kValidate);
  auto ev =
      d.ok(ValidationObserved{ok_http(), "rc-1", false, "logprob drift", "i-0", {}, true, true});
  expect_tainted(d, ev, Lifecycle::kValidating, Cause::kValidationFailed);
}

// Evidence read from an engine that reports itself not paused (someone resumed it during the
// update) taints even with the right label and checks, and paused or unknown (an engine without
// /is_paused) validates; catches publishing on evidence that was not checked paused.
TEST(Lifecycle, ValidationOnAnUnpausedEngineTaints) {
  Driver d;
  d.to_ready();
  d.to_validating();
  Driver paused = d;
  d.effect(EffectKind::kValidate);
  auto ev = d.ok(ValidationObserved{ok_http(), "rc-1", true, "", "i-0", {}, true, false});
  expect_tainted(d, ev, Lifecycle::kValidating, Cause::kValidationFailed);
  EXPECT_NE(d.s.taint->detail.find("not paused"), std::string::npos) << d.s.taint->detail;
  paused.effect(EffectKind::kValidate);
  paused.ok(ValidationObserved{ok_http(), "rc-1", true, "", "i-0", {}, true, true});
  EXPECT_EQ(paused.s.lifecycle, Lifecycle::kResuming);
}

// An unreachable engine during validation is retried to the bound, then taints; catches
// unbounded retries and publishing without evidence.
TEST(Lifecycle, ValidationUnreachableTaintsAfterBound) {
  Driver d;
  d.to_ready();
  d.to_validating();
  std::vector<Event> ev;
  for (std::uint32_t i = 1; i <= kEffectAttemptsMax; ++i) {
    EXPECT_EQ(next_effect(d.s).kind, EffectKind::kValidate);
    d.effect(EffectKind::kValidate);
    ev = d.ok(ValidationObserved{http(Transport::kConnectFailed), "", true, ""});
    if (i < kEffectAttemptsMax) {
      EXPECT_TRUE(ev.empty());
    }
  }
  expect_tainted(d, ev, Lifecycle::kValidating, Cause::kValidationFailed);
}

// Resume failures are bounded: after kEffectAttemptsMax failed resumes next_effect is kNone and
// nothing was published; catches an unbounded retry loop and a publish before resume succeeded.
TEST(Lifecycle, ResumeRetriesAreBounded) {
  Driver d;
  d.to_ready();
  d.to_resuming_validated();
  for (std::uint32_t i = 1; i <= kEffectAttemptsMax; ++i) {
    EXPECT_EQ(next_effect(d.s).kind, EffectKind::kResume);
    d.effect(EffectKind::kResume);
    // Still paused, or the pause state unknown, or a failed exchange: none of them resumes.
    ResumeObserved r = i == 1   ? ResumeObserved{ok_http(), true, true}
                       : i == 2 ? ResumeObserved{ok_http(), false, false}
                                : ResumeObserved{http(Transport::kTimeout), false, true};
    EXPECT_TRUE(d.ok(r).empty());
  }
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  EXPECT_EQ(d.s.committed.generation, 0u);
  d.rejected(intent(EffectKind::kResume));
  // A restart (an operator's action) gives the idempotent resume a new budget.
  d.ok(RecoveryStarted{"exec-2"});
  d.resume();
  EXPECT_EQ(d.s.committed, (WeightVersion{1, "rc-1"}));
  expect_history_ok(d);
}

// A resumed engine that reports sleeping (slept from outside while the plan held it paused) is
// TAINTED, never READY, whether its plan was refused or validated; its sleep level is taken as 2
// (a restore then wakes it first). Catches a resume that put a sleeper's scheduler back in service
// on released memory (READY, admitting) because the drain hid the sleep from the monitor.
TEST(Lifecycle, AResumedEngineThatSleepsIsTainted) {
  for (const bool validated : {false, true}) {
    SCOPED_TRACE(validated ? "validated" : "refused by its preflight");
    Driver d;
    d.to_ready();
    if (validated) {
      d.to_resuming_validated();
    } else {
      d.to_quiesced();
      d.effect(EffectKind::kPreflight);
      PreflightObserved p = d.good_preflight();
      p.device_ok = false;
      d.ok(p);
    }
    ASSERT_EQ(next_effect(d.s).kind, EffectKind::kResume);
    d.effect(EffectKind::kResume);
    ResumeObserved r = d.good_resume();
    r.is_sleeping_known = true;
    r.is_sleeping = true;
    const std::vector<Event> out = d.ok(r);
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(d.s.taint->cause, Cause::kEngineSleptExternally);
    EXPECT_EQ(last_change(out).from, Lifecycle::kResuming);
    EXPECT_EQ(d.s.committed, (WeightVersion{0, "rc-0"})) << "published on a sleeping engine";
    EXPECT_EQ(d.s.sleep_level, kSleepLevelMax);
    EXPECT_FALSE(admits(d.s));
    expect_history_ok(d);
  }
  Driver awake;  // the same answer, not sleeping (or the read failed): the resume stands
  awake.to_ready();
  awake.to_resuming_validated();
  awake.effect(EffectKind::kResume);
  ResumeObserved r = awake.good_resume();
  r.is_sleeping_known = true;
  awake.ok(r);
  EXPECT_EQ(awake.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(awake.s.committed, (WeightVersion{1, "rc-1"}));
}

// TAINTED is terminal: no admission, no update, no effect, and recovery does not leave it;
// catches any path out of TAINTED.
TEST(Lifecycle, TaintedIsTerminal) {
  Driver d;
  d.to_ready();
  d.to_validating();
  d.effect(EffectKind::kValidate);
  d.ok(ValidationObserved{ok_http(), "nope", true, "", "i-0", {}, true, true});
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  d.rejected(make_admission(d.s, "late"));
  d.rejected(d.update_request("rc-2"));
  for (std::uint8_t k = 0; k <= kEffectKindMax; ++k) d.rejected(intent(static_cast<EffectKind>(k)));
  d.rejected(BootstrapRequested{"rc-0", identity('a')});
  auto ev = d.ok(RecoveryStarted{"exec-2"});
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
  expect_history_ok(d);
}

// Recovery in every state abandons every active binding (recorded, never dropped) and, outside
// UPDATING, keeps the lifecycle and redoes the idempotent step; catches silently dropped rollouts
// and a recovery that skips or repeats a non-idempotent step.
TEST(Lifecycle, RecoveryInEveryStateAbandonsBindings) {
  struct Case {
    const char* name;
    void (*walk)(Driver&);
    Lifecycle expect;
    EffectKind due;
  };
  const Case cases[] = {
      {"uninitialized-empty", [](Driver&) {}, Lifecycle::kUninitialized, EffectKind::kNone},
      {"uninitialized-bootstrapping",
       [](Driver& d) {
         d.ok(BootstrapRequested{"rc-0", identity('a')});
         d.effect(EffectKind::kProbeEngine);
       },
       Lifecycle::kUninitialized, EffectKind::kProbeEngine},
      // READY is re-verified after a restart: the engine may have changed while unwatched.
      {"ready",
       [](Driver& d) {
         d.to_ready();
         d.admit();
         d.admit();
       },
       Lifecycle::kReady, EffectKind::kProbeEngine},
      {"draining",
       [](Driver& d) {
         d.to_ready();
         d.admit();
         d.to_draining();
         d.effect(EffectKind::kDrain);
         d.ok(DrainObserved{ok_http(), true});
       },
       Lifecycle::kDraining, EffectKind::kDrain},
      {"quiesced",
       [](Driver& d) {
         d.to_ready();
         d.to_quiesced();
         d.effect(EffectKind::kPreflight);
       },
       Lifecycle::kQuiesced, EffectKind::kPreflight},
      {"invalidating",
       [](Driver& d) {
         d.to_ready();
         d.to_invalidating();
         d.reset_cache(CacheKind::kPrefix);
         d.effect(EffectKind::kResetCache, CacheKind::kEncoder);
       },
       Lifecycle::kInvalidating, EffectKind::kResetCache},
      {"validating",
       [](Driver& d) {
         d.to_ready();
         d.to_validating();
         d.effect(EffectKind::kValidate);
       },
       Lifecycle::kValidating, EffectKind::kValidate},
      {"resuming-validated",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
         d.effect(EffectKind::kResume);
       },
       Lifecycle::kResuming, EffectKind::kResume},
      {"resuming-aborting",
       [](Driver& d) {
         d.to_ready();
         d.admit();
         d.to_draining();
         d.effect(EffectKind::kDrain);
         d.ok(DrainObserved{http(Transport::kTimeout), false});
       },
       Lifecycle::kResuming, EffectKind::kResume},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Driver d;
    c.walk(d);
    const std::size_t active = d.s.active.size();
    const State before = d.s;
    auto ev = d.ok(RecoveryStarted{"exec-2"});
    EXPECT_EQ(count_of<RolloutFinished>(ev), static_cast<int>(active));
    for (const Event& e : ev) {
      if (const auto* f = std::get_if<RolloutFinished>(&e)) {
        EXPECT_EQ(f->outcome, RolloutOutcome::kAbandoned);
        EXPECT_EQ(before.active.count(f->rollout_id), 1u);
      }
    }
    EXPECT_TRUE(d.s.active.empty());
    EXPECT_EQ(d.s.counters.rollouts_abandoned, active);
    EXPECT_EQ(d.s.lifecycle, c.expect);
    EXPECT_FALSE(d.s.in_flight.has_value());
    EXPECT_EQ(d.s.attempts, 0u);
    EXPECT_EQ(next_effect(d.s).kind, c.due);
    if (c.expect == Lifecycle::kInvalidating) {
      EXPECT_EQ(next_effect(d.s).cache, CacheKind::kEncoder) << "a reset cache is not redone";
    }
    expect_history_ok(d);
  }
}

// Recovery in UPDATING before the transfer intent is a clean refusal; catches tainting when
// nothing could have reached the engine.
TEST(Lifecycle, RecoveryInUpdatingBeforeTransferIntentRefuses) {
  Driver d;
  d.to_ready();
  d.to_updating();
  auto ev = d.ok(RecoveryStarted{"exec-2"});
  EXPECT_EQ(last_change(ev).cause, Cause::kRecoveredNoMutation);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  EXPECT_TRUE(d.s.update->aborting);
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_FALSE(d.s.taint.has_value());
  EXPECT_EQ(d.s.counters.updates_refused, 1u);
  expect_history_ok(d);
}

// Recovery in UPDATING after the durable transfer intent taints; catches retrying a transfer
// that may have partly landed, or resuming on weights of unknown content.
TEST(Lifecycle, RecoveryInUpdatingAfterTransferIntentTaints) {
  Driver d;
  d.to_ready();
  d.to_updating();
  d.effect(EffectKind::kTransfer);
  auto ev = d.ok(RecoveryStarted{"exec-2"});
  expect_tainted(d, ev, Lifecycle::kUpdating, Cause::kRecoveredAmbiguous);
}

// Two updates in a row commit generations 1 and 2; catches a plan or attempt counter that
// leaks from one update into the next.
TEST(Lifecycle, ConsecutiveUpdatesCommitIncreasingGenerations) {
  Driver d;
  d.to_ready();
  d.to_resuming_validated("rc-1");
  d.resume();
  d.admit();
  d.ok(RolloutFinished{"r1", RolloutOutcome::kCompleted, 1, 1});
  d.to_resuming_validated("rc-2");
  d.resume();
  EXPECT_EQ(d.s.committed, (WeightVersion{2, "rc-2"}));
  // An old label may return as a new generation.
  d.to_resuming_validated("rc-1");
  d.resume();
  EXPECT_EQ(d.s.committed, (WeightVersion{3, "rc-1"}));
  expect_history_ok(d);
}

}  // namespace
}  // namespace rc::test
