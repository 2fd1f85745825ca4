// The engine under a READY executor can change (restart, relabel, someone's pause), a fresh
// journal can meet an engine someone else left behind, explicit rollouts outlive executor
// restarts, and a label names one policy: the fold's rules for each.
#include <gtest/gtest.h>

#include "tests/statemachine/helpers.h"

namespace rc::test {
namespace {

EngineProbed probe(const std::string& label, bool paused = false,
                   const std::string& instance = "i-1") {
  EngineProbed p{ok_http(), "0.25.1", label};
  p.is_paused_known = true;
  p.is_paused = paused;
  p.engine_instance = instance;
  return p;
}

EngineMonitored seen(const State& s, const std::string& label, bool paused = false,
                     const std::string& instance = "i-1") {
  EngineMonitored m{ok_http(), label, true, paused, instance, 1000, monitor_epoch(s)};
  return m;
}

// A driver whose engine reported instance "i-1" at bootstrap.
Driver ready_on_instance() {
  Driver d;
  d.ok(BootstrapRequested{"rc-0", identity('a')});
  d.effect(EffectKind::kProbeEngine);
  d.ok(probe("rc-0"));
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.engine_instance, "i-1");
  return d;
}

// Each way the READY engine stops being the verified one taints with its own cause and keeps
// the active rollouts visible; catches a monitor whose observation leaves a silent READY.
TEST(EngineMonitor, EachChangeTaintsWithItsCause) {
  struct Case {
    const char* name;
    EngineMonitored (*make)(const State&);
    Cause cause;
  };
  const Case cases[] = {
      {"restarted", [](const State& s) { return seen(s, "default", false, "i-2"); },
       Cause::kEngineReplaced},
      {"relabelled", [](const State& s) { return seen(s, "rc-9"); }, Cause::kEngineRelabelled},
      {"paused", [](const State& s) { return seen(s, "rc-0", true); },
       Cause::kEnginePausedExternally},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Driver d = ready_on_instance();
    const std::string r = d.admit();
    auto ev = d.ok(c.make(d.s));
    EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
    EXPECT_EQ(last_change(ev).cause, c.cause);
    EXPECT_EQ(d.s.taint->update_id, "");
    EXPECT_EQ(d.s.active.count(r), 1u) << "a suspect rollout is kept, never dropped";
    EXPECT_EQ(d.rejected(make_admission(d.s, "late")), Code::kRejected);
    d.ok(RolloutFinished{r, RolloutOutcome::kCompleted, 1, 1});  // it may still end
    HistoryReport h = check_history(d.history);
    EXPECT_TRUE(h.ok) << h.message;
  }
}

// An unreachable engine stops admissions without a taint and a matching answer restores them;
// catches admissions forwarded to a dead engine, and a blip that taints forever.
TEST(EngineMonitor, UnreachableBlocksAdmissionUntilTheSameEngineAnswers) {
  Driver d = ready_on_instance();
  EngineMonitored down{
      http(Transport::kConnectFailed), "", false, false, "", 0, monitor_epoch(d.s)};
  EXPECT_TRUE(d.ok(down).empty());
  EXPECT_FALSE(d.s.engine_reachable);
  EXPECT_FALSE(admits(d.s));
  EXPECT_EQ(d.rejected(make_admission(d.s, "x")), Code::kRejected);
  EXPECT_TRUE(d.ok(seen(d.s, "rc-0")).empty());
  EXPECT_TRUE(admits(d.s));
  d.admit();
}

// Proves the executors record an unreachable engine as reachable again only on an answer that
// vouches for the verified process, while an old journal's unvouched return still folds as it
// did; catches admissions resumed onto an engine that may have restarted during the outage (the
// label alone matches a restarted process too), and a rule that would refuse older journals.
TEST(EngineMonitor, AnUnnamedAnswerDoesNotLiftUnreachable) {
  Driver d = ready_on_instance();
  EngineMonitored down{
      http(Transport::kConnectFailed), "", false, false, "", 0, monitor_epoch(d.s)};
  EXPECT_FALSE(look_changes_reachability(d.s, seen(d.s, "rc-0", false, /*instance=*/"")));
  EXPECT_TRUE(look_changes_reachability(d.s, down));
  EXPECT_TRUE(d.ok(down).empty());
  EXPECT_FALSE(look_changes_reachability(d.s, seen(d.s, "rc-0", false, /*instance=*/"")));
  EXPECT_FALSE(look_changes_reachability(d.s, down));
  EXPECT_TRUE(look_changes_reachability(d.s, seen(d.s, "rc-0")));
  // A journal written before the rule may hold the unnamed return: it still applies.
  State old = d.s;
  EXPECT_TRUE(apply(old, seen(old, "rc-0", false, /*instance=*/"")).ok());
  EXPECT_TRUE(old.engine_reachable);
  EXPECT_TRUE(d.ok(seen(d.s, "rc-0")).empty());
  EXPECT_TRUE(admits(d.s));
}

// What the executor journals when it looks at the engine before a plan: the monitor's record,
// with no last sight of the verified engine (the audit's window then opens at READY).
EngineMonitored look(const State& s, const std::string& label, bool paused,
                     const std::string& instance = "i-1") {
  return EngineMonitored{ok_http(), label, true, paused, instance, 0, monitor_epoch(s)};
}

// Proves the look at the engine before an update taints an engine someone else changed (paused,
// relabelled, restarted, other weights) from READY with the monitor's cause, and that the update
// is then refused with no drain or transfer intent possible; catches an update that overwrites
// an outside change to the engine with nothing recorded and no rollout suspected.
TEST(EngineMonitor, ALookBeforeAnUpdateTaintsAChangedEngineAndRefusesTheUpdate) {
  struct Case {
    const char* name;
    EngineMonitored (*make)(const State&);
    Cause cause;
  };
  const Case cases[] = {
      {"paused", [](const State& s) { return look(s, "rc-0", true); },
       Cause::kEnginePausedExternally},
      {"paused and relabelled", [](const State& s) { return look(s, "outsider", true); },
       Cause::kEngineRelabelled},
      {"restarted", [](const State& s) { return look(s, "default", false, "i-2"); },
       Cause::kEngineReplaced},
      {"other weights",
       [](const State& s) {
         EngineMonitored m = look(s, "rc-0", false);
         m.digest = digest_of("191");
         return m;
       },
       Cause::kWeightsChanged},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Driver d;
    d.ok(BootstrapRequested{"rc-0", identity('a')});
    d.effect(EffectKind::kProbeEngine);
    EngineProbed p{ok_http(), "0.25.1", "rc-0", true, false, "i-1"};
    p.digest = digest_of("111");
    d.ok(p);
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
    const std::string r = d.admit();
    auto ev = d.ok(c.make(d.s));
    EXPECT_EQ(last_change(ev).from, Lifecycle::kReady) << "an engine taint, not a plan's";
    EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
    EXPECT_EQ(last_change(ev).cause, c.cause);
    EXPECT_EQ(d.s.active.count(r), 1u) << "a rollout served in the window stays visible";
    EXPECT_EQ(d.rejected(d.update_request("rc-1")), Code::kRejected);
    EXPECT_EQ(d.rejected(intent(EffectKind::kDrain)), Code::kRejected);
    EXPECT_EQ(d.rejected(intent(EffectKind::kTransfer)), Code::kRejected);
    EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
    EXPECT_EQ(d.s.counters.updates_requested, 0u);
    HistoryReport h = check_history(d.history);
    EXPECT_TRUE(h.ok) << h.message;
  }
}

// Proves an update or a sleep is refused while the last look at the engine found it unreachable,
// and taken once the same engine answers again; catches a plan that pauses an engine nobody
// could verify as the committed one.
TEST(EngineMonitor, AnUnreachableEngineTakesNoPlanUntilItAnswers) {
  Driver d = ready_on_instance();
  d.ok(EngineMonitored{http(Transport::kConnectFailed), "", false, false, "", 0,
                       monitor_epoch(d.s)});
  ASSERT_FALSE(d.s.engine_reachable);
  EXPECT_EQ(d.rejected(d.update_request("rc-1")), Code::kRejected);
  EXPECT_EQ(d.rejected(SleepRequested{"s-1", 1}), Code::kRejected);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_TRUE(d.ok(look(d.s, "rc-0", false)).empty());
  d.to_draining("rc-1");
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining);
}

// Proves the rule is for new requests only: a history recorded before it existed (an update
// requested while the engine was marked unreachable, accepted then) is re-decided by the history
// check (audit's and replay's) as it was recorded, while step refuses the same request now;
// catches the upgrade after which replay and audit called such a healthy journal damaged.
TEST(EngineMonitor, AnUpdateRecordedWhileUnreachableBeforeTheRuleStillChecks) {
  Driver d = ready_on_instance();
  d.ok(EngineMonitored{http(Transport::kConnectFailed), "", false, false, "", 0,
                       monitor_epoch(d.s)});
  ASSERT_FALSE(d.s.engine_reachable);
  const UpdateRequested old = d.update_request("rc-1");
  EXPECT_EQ(d.rejected(old), Code::kRejected);
  Result<std::vector<Event>> decided = decide(d.s, old);  // what the older fold did
  ASSERT_TRUE(decided.ok()) << decided.status().ToString();
  ASSERT_TRUE(apply(d.s, old).ok());
  for (const Event& e : *decided) ASSERT_TRUE(apply(d.s, e).ok());
  d.record(old, *decided);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining);
  const HistoryReport checked = check_history(d.history);
  EXPECT_TRUE(checked.ok) << checked.first_bad_seq << ": " << checked.message;
}

// An observation taken before an update (or restart) began is refused as stale; catches the
// race where a probe of the old generation lands after the new one committed and taints it.
TEST(EngineMonitor, StaleObservationIsRefused) {
  Driver d = ready_on_instance();
  EngineMonitored before = seen(d.s, "rc-0");
  d.to_resuming_validated("rc-1");
  d.resume();
  ASSERT_EQ(d.s.committed.label, "rc-1");
  EXPECT_EQ(d.rejected(before), Code::kRejected);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  // Monitors are refused outside READY too.
  d.to_draining("rc-2");
  EXPECT_EQ(d.rejected(seen(d.s, "rc-1")), Code::kRejected);
}

// A restarted executor re-verifies READY before admitting, and a replaced engine found then
// taints; catches the executor restart that trusted an engine it had not watched.
TEST(EngineMonitor, RecoveryInReadyReverifiesBeforeAdmitting) {
  Driver d = ready_on_instance();
  d.ok(RecoveryStarted{"exec-2"});
  EXPECT_TRUE(d.s.engine_recheck);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine);
  EXPECT_EQ(d.rejected(make_admission(d.s, "x")), Code::kRejected);
  EXPECT_EQ(d.rejected(d.update_request("rc-1")), Code::kRejected);
  d.effect(EffectKind::kProbeEngine);
  d.ok(probe("rc-0"));
  EXPECT_FALSE(d.s.engine_recheck);
  d.admit();

  Driver e = ready_on_instance();
  e.ok(RecoveryStarted{"exec-2"});
  e.effect(EffectKind::kProbeEngine);
  auto ev = e.ok(probe("default", false, "i-7"));
  EXPECT_EQ(last_change(ev).cause, Cause::kEngineReplaced);
  EXPECT_EQ(e.s.lifecycle, Lifecycle::kTainted);
}

// An executor restarted mid-update re-verifies the engine once READY again, unless a validation
// vouched for it; catches a restart that resumed an aborted update and admitted rollouts onto an
// engine replaced while the executor was down.
TEST(EngineMonitor, RecoveryMidUpdateReverifiesAfterAnAbortedUpdate) {
  Driver d = ready_on_instance();
  d.admit();
  d.to_draining("rc-1");
  d.ok(RecoveryStarted{"exec-2"});  // abandons the proxied rollout
  EXPECT_TRUE(d.s.engine_recheck);
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{http(Transport::kTimeout), false});  // drain failed: refused
  d.resume();
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_TRUE(d.s.engine_recheck);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine);
  EXPECT_EQ(d.rejected(make_admission(d.s, "x")), Code::kRejected);
  d.effect(EffectKind::kProbeEngine);
  auto ev = d.ok(probe("default", false, "i-9"));
  EXPECT_EQ(last_change(ev).cause, Cause::kEngineReplaced);

  Driver v = ready_on_instance();
  v.to_invalidating("rc-1");
  v.ok(RecoveryStarted{"exec-2"});
  v.reset_cache(CacheKind::kPrefix);
  v.reset_cache(CacheKind::kEncoder);
  v.reset_cache(CacheKind::kMultimodal);
  v.effect(EffectKind::kValidate);
  ValidationObserved ok{ok_http(), "rc-1", true, ""};
  ok.engine_instance = "i-1";
  ok.is_paused_known = true;
  v.ok(ok);
  v.resume();
  EXPECT_FALSE(v.s.engine_recheck) << "the validation vouched for the engine";
  v.admit();
}

// Bootstrap takes a fresh or declared engine; a foreign label or a paused engine only with adopt;
// catches the bootstrap that relabelled an engine left at rc-7 (maybe tainted) as rc-0.
TEST(Bootstrap, RefusesAForeignOrPausedEngineUnlessAdopted) {
  auto boot = [](bool adopt, EngineProbed p) {
    Driver d;
    d.ok(BootstrapRequested{"rc-0", identity('a'), adopt});
    d.effect(EffectKind::kProbeEngine);
    d.ok(p);
    return d.s.lifecycle;
  };
  EngineProbed fresh = probe("rc-0");
  fresh.label_before = kFreshEngineLabel;
  EXPECT_EQ(boot(false, fresh), Lifecycle::kReady);
  EXPECT_EQ(boot(false, probe("rc-0")), Lifecycle::kReady);
  EngineProbed foreign = probe("rc-0");
  foreign.label_before = "rc-7";
  EXPECT_EQ(boot(false, foreign), Lifecycle::kUninitialized);
  EXPECT_EQ(boot(true, foreign), Lifecycle::kReady);
  EXPECT_EQ(boot(false, probe("rc-7")), Lifecycle::kUninitialized);
  EXPECT_EQ(boot(false, probe("rc-0", /*paused=*/true)), Lifecycle::kUninitialized);
  EngineProbed resumed = probe("rc-0");
  resumed.resumed_before = true;
  EXPECT_EQ(boot(false, resumed), Lifecycle::kUninitialized);
  EXPECT_EQ(boot(true, resumed), Lifecycle::kReady);
  EXPECT_NE(
      explain_bootstrap_refusal(BootstrapRequested{"rc-0", identity('a')}, probe("rc-0", true)),
      "");
}

// Validation fails when another engine process answers than the one verified; catches an
// engine restarted mid-update (back on its initial weights) being published as the target.
TEST(EngineMonitor, ValidationRefusesAnotherEngineProcess) {
  Driver d = ready_on_instance();
  d.to_validating("rc-1");
  d.effect(EffectKind::kValidate);
  ValidationObserved v{ok_http(), "rc-1", true, ""};
  v.engine_instance = "i-2";
  auto ev = d.ok(v);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(last_change(ev).cause, Cause::kValidationFailed);
}

// A resume answered by another engine process taints the engine and publishes nothing, after a
// validated update and after a refused one alike, while an unknown instance keeps the old rule;
// catches an engine restarted between validation (or a refusal) and the resume coming back
// unpaused on its initial weights and being put in service as the target or the old version.
TEST(EngineMonitor, AResumeAnsweredByAnotherProcessTaints) {
  for (const bool validated : {true, false}) {
    SCOPED_TRACE(validated ? "validated" : "refused at preflight");
    Driver d = ready_on_instance();
    if (validated) {
      d.to_resuming_validated("rc-1");
    } else {
      d.to_quiesced("rc-1");
      d.effect(EffectKind::kPreflight);
      d.ok(PreflightObserved{hex('f'), true, true, "manifest differs"});
    }
    ASSERT_EQ(d.s.lifecycle, Lifecycle::kResuming);
    d.effect(EffectKind::kResume);
    ResumeObserved r = d.good_resume();
    r.engine_instance = "i-2";
    auto ev = d.ok(r);
    EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(last_change(ev).cause, Cause::kEngineReplaced);
    EXPECT_EQ(count_of<VersionPublished>(ev), 0);
    EXPECT_EQ(d.s.committed.label, "rc-0");
    EXPECT_EQ(d.rejected(make_admission(d.s, "late")), Code::kRejected);
    HistoryReport h = check_history(d.history);
    EXPECT_TRUE(h.ok) << h.message;
  }
  Driver same = ready_on_instance();
  same.to_resuming_validated("rc-1");
  same.effect(EffectKind::kResume);
  ResumeObserved r = same.good_resume();
  r.engine_instance = "i-1";
  same.ok(r);
  EXPECT_EQ(same.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(same.s.committed.label, "rc-1");
}

// A resume whose answer names no process instance, after validation recorded one, publishes
// nothing and is tried again until an answer names the process; catches an engine restarted
// while paused whose instance read failed once being put in service on its predecessor's evidence.
TEST(EngineMonitor, AResumeThatNamesNoInstanceIsTriedAgain) {
  Driver d = ready_on_instance();
  d.to_resuming_validated("rc-1");
  d.effect(EffectKind::kResume);
  ResumeObserved unnamed = d.good_resume();
  unnamed.engine_instance.clear();
  auto ev = d.ok(unnamed);
  EXPECT_EQ(count_of<VersionPublished>(ev), 0);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kResume);
  EXPECT_EQ(d.rejected(make_admission(d.s, "early")), Code::kRejected);
  d.effect(EffectKind::kResume);
  ResumeObserved named = d.good_resume();
  named.engine_instance = "i-2";
  ev = d.ok(named);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(count_of<VersionPublished>(ev), 0);
}

// A bootstrap probe that names no process is not taken: the instance verified then is what every
// later answer is compared with; catches an engine whose one failed /metrics read at bootstrap
// turned every restart check off for the journal's life.
TEST(EngineMonitor, ABootstrapThatNamesNoProcessIsProbedAgain) {
  Driver d;
  d.ok(BootstrapRequested{"rc-0", identity('a')});
  d.effect(EffectKind::kProbeEngine);
  auto ev = d.ok(probe("rc-0", false, ""));
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kUninitialized);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine);
  EXPECT_NE(explain_bootstrap_refusal(*d.s.bootstrap, probe("rc-0", false, ""))
                .find("named no process instance"),
            std::string::npos);
  d.effect(EffectKind::kProbeEngine);
  d.ok(probe("rc-0"));
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.engine_instance, "i-1");
}

// A validation whose answer names no process, once one is verified, is read again, and taints
// when no read within the attempts names one; catches evidence of an engine restarted mid-update
// (whose instance read failed) published as the paused engine's.
TEST(EngineMonitor, AValidationThatNamesNoProcessIsReadAgain) {
  for (const bool named_later : {true, false}) {
    SCOPED_TRACE(named_later ? "named on a later read" : "never named");
    Driver d = ready_on_instance();
    d.to_validating("rc-1");
    const ValidationObserved unnamed{ok_http(), "rc-1", true, "", "", {}, true, true};
    for (std::uint32_t i = 0; i + 1 < kEffectAttemptsMax; ++i) {
      d.effect(EffectKind::kValidate);
      EXPECT_TRUE(d.ok(unnamed).empty());
      EXPECT_EQ(d.s.lifecycle, Lifecycle::kValidating);
    }
    d.effect(EffectKind::kValidate);
    ValidationObserved last = unnamed;
    if (named_later) last.engine_instance = "i-1";
    auto ev = d.ok(last);
    EXPECT_EQ(last_change(ev).to, named_later ? Lifecycle::kResuming : Lifecycle::kTainted);
    if (!named_later) {
      EXPECT_EQ(last_change(ev).cause, Cause::kValidationFailed);
    }
  }
}

// A validation that could not read the pause state is read again, and taints when no read within
// the attempts does; catches evidence published although an outside /resume may have unpaused
// the engine while it was read (the /is_paused read failed and was taken as "no such route").
TEST(EngineMonitor, AValidationWithoutThePauseStateIsReadAgain) {
  Driver d = ready_on_instance();
  d.to_validating("rc-1");
  const ValidationObserved unknown{ok_http(), "rc-1", true, "", "i-1"};  // pause state unknown
  for (std::uint32_t i = 0; i + 1 < kEffectAttemptsMax; ++i) {
    d.effect(EffectKind::kValidate);
    EXPECT_TRUE(d.ok(unknown).empty());
  }
  d.effect(EffectKind::kValidate);
  auto ev = d.ok(unknown);
  EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
  EXPECT_EQ(count_of<VersionPublished>(ev), 0);
}

// An answer that names no process never clears a pending re-verification, from the recovery's
// probe or the monitor; catches a restarted engine (same label given by its launcher) taken for
// the verified one because its instance read failed.
TEST(EngineMonitor, AnAnswerThatNamesNoProcessVouchesForNothing) {
  Driver d = ready_on_instance();
  d.ok(RecoveryStarted{"exec-2"});
  d.effect(EffectKind::kProbeEngine);
  d.ok(probe("rc-0", false, ""));
  EXPECT_TRUE(d.s.engine_recheck);
  EXPECT_EQ(d.rejected(make_admission(d.s, "x")), Code::kRejected);
  EXPECT_FALSE(engine_vouched(d.s, "rc-0", true, false, ""));
  EXPECT_TRUE(engine_matches(d.s, "rc-0", true, false, "")) << "unknown is no mismatch either";
  d.effect(EffectKind::kProbeEngine);
  d.ok(probe("rc-0"));
  EXPECT_FALSE(d.s.engine_recheck);
  d.admit();
}

// Leased (explicit) rollouts survive recovery; proxied ones are abandoned; a lapsed lease ends
// as expired, only for a leased rollout; catches explicit rollouts lost on an executor restart.
TEST(Lease, ExplicitRolloutsSurviveRecoveryAndExpire) {
  Driver d = ready_on_instance();
  const std::string proxied = d.admit();
  d.ok(make_admission(d.s, "explicit", 30000));
  auto ev = d.ok(RecoveryStarted{"exec-2"});
  EXPECT_EQ(count_of<RolloutFinished>(ev), 1);
  EXPECT_EQ(d.s.active.count(proxied), 0u);
  EXPECT_EQ(d.s.active.count("explicit"), 1u);
  d.reverify();
  EXPECT_EQ(d.rejected(RolloutFinished{proxied, RolloutOutcome::kExpired}), Code::kNotFound);
  const std::string other = d.admit();
  EXPECT_EQ(d.rejected(RolloutFinished{other, RolloutOutcome::kExpired}), Code::kInvalidArgument);
  d.ok(RolloutFinished{"explicit", RolloutOutcome::kExpired});
  EXPECT_EQ(d.s.counters.rollouts_expired, 1u);
  EXPECT_EQ(d.rejected(make_admission(d.s, "long", kLeaseMsMax + 1)), Code::kInvalidArgument);
  HistoryReport h = check_history(d.history);
  EXPECT_TRUE(h.ok) << h.message;
}

// A label names one identity for the journal's life; catches `step-5` committed twice with
// different weights, after which X-RolloutCore-Version no longer names one policy.
TEST(Labels, ReuseOnlyForTheSameIdentity) {
  Driver d = ready_on_instance();
  d.to_resuming_validated("step-5");
  d.resume();
  d.to_resuming_validated("step-6");
  d.resume();
  UpdateRequested other{"u-x", "step-5", identity('c'), "safetensors:/ckpt/c"};
  EXPECT_EQ(d.rejected(other), Code::kInvalidArgument);
  UpdateRequested same{"u-y", "step-5", identity('b'), "safetensors:/ckpt/x"};
  d.ok(same);
  EXPECT_EQ(d.rejected(UpdateRequested{"u-z", "rc-0", identity('z'), "s"}), Code::kRejected)
      << "an update is in flight";
}

// Ids and labels must be printable UTF-8: non-ASCII letters pass, control bytes do not;
// catches the signed-char comparison that refused "rc-é" and the checkpoint that forged lines.
TEST(Labels, Utf8AcceptedControlBytesRefused) {
  Driver d = ready_on_instance();
  d.to_draining("rc-\xc3\xa9");
  Driver e = ready_on_instance();
  WeightIdentity forged = identity('b');
  forged.checkpoint = "ck\nverification: OK";
  EXPECT_EQ(e.rejected(UpdateRequested{"u", "rc-1", forged, "s"}), Code::kInvalidArgument);
  forged.checkpoint = std::string("a\0b", 3);
  EXPECT_EQ(e.rejected(UpdateRequested{"u", "rc-1", forged, "s"}), Code::kInvalidArgument);
  EXPECT_EQ(e.rejected(UpdateRequested{"u", "rc-\xff", identity('b'), "s"}),
            Code::kInvalidArgument);
}

// The history checker refuses a rollout id admitted twice; catches a journal where audit
// --rollout can report only one of two bindings under one id.
TEST(History, RefusesARolloutIdAdmittedTwice) {
  Driver d = ready_on_instance();
  d.ok(make_admission(d.s, "dup"));
  d.ok(RolloutFinished{"dup", RolloutOutcome::kCompleted});
  d.ok(make_admission(d.s, "dup"));  // the fold alone cannot see it; the journal refuses it
  HistoryReport h = check_history(d.history);
  EXPECT_FALSE(h.ok);
  EXPECT_NE(h.message.find("admitted again"), std::string::npos) << h.message;
}

}  // namespace
}  // namespace rc::test
