// The fleet fold's rules, one scenario each: staleness, rolling batches and min_serving, an
// `all` update with one ambiguous failure, min_healthy, joining and leaving, rollout ids, and
// forged fleet decisions.
#include <gtest/gtest.h>

#include "tests/statemachine/fleet_helpers.h"

namespace rc {
namespace {

using namespace rc::test;

// Engines `ids`, each READY on rc-0.
FleetDriver ready_fleet(const std::vector<std::string>& ids) {
  FleetDriver d;
  for (const std::string& id : ids) d.join(id);
  for (const std::string& id : ids) d.bootstrap(id);
  return d;
}

// Engines a and b in an `all` update to rc-1, both started; a's transfer was ambiguous (a is
// TAINTED), b's update has not run yet.
FleetDriver all_update_with_a_tainted() {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  d.ok("b", d.member_update(u));
  d.run_update("a", /*ambiguous=*/true);
  return d;
}

// The same, after b committed: the fleet update ended partial.
FleetDriver partial_all_update() {
  FleetDriver d = all_update_with_a_tainted();
  d.run_update("b");
  return d;
}

bool has_end(const std::vector<FleetEvent>& events, FleetUpdateEnded* out) {
  for (const FleetEvent& e : events) {
    if (const auto* end = std::get_if<FleetUpdateEnded>(&e.event)) {
      *out = *end;
      return true;
    }
  }
  return false;
}

// Proves a fleet update whose identity claims the content digest of weights the fleet served
// under another manifest is refused before any member is asked; catches a fleet whose members
// publish unchanged weights on the "same bytes" exemption.
TEST(Fleet, AnIdentityContradictingServedWeightsIsRefused) {
  FleetDriver d = ready_fleet({"a", "b"});
  FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  u.identity.content_digest = d.engine("a").committed_identity.content_digest;
  ASSERT_NE(u.identity.manifest_digest, d.engine("a").committed_identity.manifest_digest);
  EXPECT_EQ(d.rejected(FleetEvent{"", u}).code(), Code::kInvalidArgument);
  EXPECT_FALSE(d.f.update.has_value());
}

// With staleness_max 0, once one engine commits a newer label, an engine still on the older one
// admits nothing, and with staleness_max 1 it does; catches a balancer-visible rule missing from
// the fold (a rollout started on a policy older than the bound).
TEST(Fleet, StalenessBoundsWhichEnginesAdmit) {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  d.run_update("a");
  ASSERT_EQ(d.engine("a").committed.label, "rc-1");
  EXPECT_EQ(fleet_generation(d.f, "a"), 1u);
  EXPECT_EQ(fleet_generation(d.f, "b"), 0u);
  const Status st = d.rejected(make_fleet_admission(d.f, "b", "late"));
  EXPECT_EQ(st.code(), Code::kRejected);
  EXPECT_NE(st.message().find("staleness_max is 0"), std::string::npos) << st.message();
  EXPECT_EQ(admitting_engines(d.f), std::vector<std::string>{"a"});
  d.ok(FleetEvent{"", FleetConfigured{1, 0}});
  d.admit("b");
  EXPECT_EQ(d.refold(), d.f);
}

// An engine an earlier update left behind (cancelled before its turn, now outside staleness 0)
// admits nothing but is a member of the next fleet update, so it catches up; catches members taken
// from the admitting engines only, which strands such an engine for good.
TEST(Fleet, AStaleEngineIsAMemberOfTheNextUpdate) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.update_only("a", "u1", "rc-1");
  ASSERT_FALSE(d.f.update.has_value());
  ASSERT_EQ(admitting_engines(d.f), std::vector<std::string>{"a"});
  EXPECT_EQ(updatable_engines(d.f), (std::vector<std::string>{"a", "b"}));
  const FleetUpdateRequested u2 = d.fleet_update("u2", FleetUpdateMode::kAll, "rc-2");
  d.ok(FleetEvent{"", u2});
  ASSERT_TRUE(d.f.update.has_value());
  EXPECT_EQ(d.f.update->members.at("b"), MemberStatus::kPending);
  d.ok("b", d.member_update(u2));
  d.run_update("b");
  EXPECT_EQ(d.engine("b").committed.label, "rc-2");
  EXPECT_EQ(d.refold(), d.f);
}

// A rolling update takes at most batch_max members at once and never leaves fewer than
// min_serving engines serving; catches a rolling update that drains the whole fleet.
TEST(Fleet, RollingHonoursBatchAndMinServing) {
  FleetDriver d = ready_fleet({"a", "b", "c"});
  d.ok(FleetEvent{"", FleetConfigured{1, 2}});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1", 2);
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  // b would leave only c serving (a drains): min_serving 2 refuses it although batch_max is 2.
  const Status st = d.rejected("b", d.member_update(u));
  EXPECT_NE(st.message().find("min_serving is 2"), std::string::npos) << st.message();
  d.run_update("a");
  d.ok("b", d.member_update(u));
  d.run_update("b");
  d.ok("c", d.member_update(u));
  std::vector<FleetEvent> last;
  {
    Rng rng(3);
    for (int i = 0; i < 64 && d.engine("c").update; ++i) {
      const State& s = d.engine("c");
      if (s.in_flight) {
        last = d.ok("c", observation(s, rng, calm_mix()));
        continue;
      }
      const Effect due = next_effect(s);
      last = d.ok("c", EffectStarted{due.kind, due.cache, 1000});
    }
  }
  FleetUpdateEnded end;
  ASSERT_TRUE(has_end(last, &end));
  EXPECT_EQ(end.outcome, FleetOutcome::kCommitted);
  EXPECT_EQ(end.committed, 3u);
  EXPECT_FALSE(d.f.update.has_value());
  EXPECT_EQ(d.refold(), d.f);
}

// An `all` update drains every member together; one member's ambiguous transfer makes it TAINTED
// and quarantined while the other commits, and the fleet update ends partial with both counted;
// catches a partial failure hidden in the fleet's outcome or a tainted engine still admitting.
TEST(Fleet, AllModeIsolatesAnAmbiguousMember) {
  FleetDriver d = all_update_with_a_tainted();
  EXPECT_EQ(d.engine("a").lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kTainted);
  d.run_update("b");
  ASSERT_FALSE(d.f.update.has_value());
  EXPECT_EQ(d.f.fleet_updates_ended, 1u);
  const FleetEvent& end_event = d.accepted.back();
  const auto* end = std::get_if<FleetUpdateEnded>(&end_event.event);
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial);
  EXPECT_EQ(end->committed, 1u);
  EXPECT_EQ(end->tainted, 1u);
  EXPECT_FALSE(fleet_admits(d.f, "a"));
  EXPECT_NE(fleet_admission_block_reason(d.f, "a").find("TAINTED"), std::string::npos);
  d.admit("b");
  EXPECT_EQ(d.refold(), d.f);
}

// Fewer engines able to serve than min_healthy: the fleet update is refused in the same group
// and no member may start; catches an update that begins on a fleet already too degraded.
TEST(Fleet, TooFewHealthyRefusesTheWholeUpdate) {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1", 1, 3);
  const std::vector<FleetEvent> caused = d.ok(FleetEvent{"", u});
  FleetUpdateEnded end;
  ASSERT_TRUE(has_end(caused, &end));
  EXPECT_EQ(end.outcome, FleetOutcome::kRefused);
  EXPECT_NE(end.reason.find("min_healthy is 3"), std::string::npos) << end.reason;
  EXPECT_FALSE(d.f.update.has_value());
  EXPECT_EQ(d.engine("a").lifecycle, Lifecycle::kReady);
}

// Members that already hold the target count towards min_healthy but do not lift the rule: too
// few members is a refusal even when one of them holds the label; catches the 200/207 answered
// for an update the fleet could not take (the rule was skipped once any member held the target).
TEST(Fleet, MinHealthyHoldsWhenAMemberAlreadyHoldsTheTarget) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.update_only("a", "u1", "rc-1");
  ASSERT_FALSE(d.f.update.has_value());
  ASSERT_EQ(d.engine("a").committed.label, "rc-1");
  ASSERT_EQ(d.engine("b").committed.label, "rc-0");
  const FleetUpdateRequested again = d.fleet_update("u2", FleetUpdateMode::kAll, "rc-1", 1, 3);
  FleetUpdateEnded end;
  ASSERT_TRUE(has_end(d.ok(FleetEvent{"", again}), &end));
  EXPECT_EQ(end.outcome, FleetOutcome::kRefused);
  EXPECT_NE(end.reason.find("min_healthy is 3"), std::string::npos) << end.reason;
  EXPECT_EQ(d.engine("b").committed.label, "rc-0");
  // With min_healthy 2, the holder counts: the update goes on, and only b has anything to do.
  const FleetUpdateRequested enough = d.fleet_update("u3", FleetUpdateMode::kAll, "rc-1", 1, 2);
  EXPECT_FALSE(has_end(d.ok(FleetEvent{"", enough}), &end));
  ASSERT_TRUE(d.f.update.has_value());
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kCommitted);
  EXPECT_EQ(d.f.update->members.at("b"), MemberStatus::kPending);
  EXPECT_EQ(d.refold(), d.f);
}

// A pending member that becomes TAINTED before its own update is skipped, so the fleet update
// still ends; catches a fleet update that waits forever on a quarantined engine.
TEST(Fleet, APendingMemberTaintedMeanwhileIsSkipped) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(FleetEvent{"", FleetConfigured{1, 0}});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  // b is seen answering as another process (restarted): the monitor taints it.
  EngineMonitored m{ok_http(), "rc-0", true, false, "other-instance", 0, 1};
  m.updates_seen = monitor_epoch(d.engine("b"));
  d.ok("b", m);
  ASSERT_EQ(d.engine("b").lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(d.f.update->members.at("b"), MemberStatus::kSkipped);
  d.run_update("a");
  ASSERT_FALSE(d.f.update.has_value());
  const auto* end = std::get_if<FleetUpdateEnded>(&d.accepted.back().event);
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial);
  EXPECT_EQ(end->skipped, 1u);
}

// Cancelling skips the members that have not started, lets the updating one finish, and ends
// the fleet update once it has; catches a fleet update that waits forever on members nobody will
// start (an executor gave up, an engine stays unable to update).
TEST(Fleet, CancelSkipsPendingMembersAndWaitsForTheUpdatingOne) {
  FleetDriver d = ready_fleet({"a", "b", "c"});
  d.ok(FleetEvent{"", FleetConfigured{1, 0}});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  EXPECT_TRUE(d.ok(FleetEvent{"", FleetUpdateCancelled{"u1", "operator"}}).empty());
  EXPECT_EQ(d.f.update->members.at("b"), MemberStatus::kSkipped);
  EXPECT_EQ(d.rejected("b", d.member_update(u)).code(), Code::kRejected);
  EXPECT_EQ(d.rejected(FleetEvent{"", FleetUpdateCancelled{"u1", "again"}}).code(),
            Code::kConflict);
  d.run_update("a");
  ASSERT_FALSE(d.f.update.has_value());
  const auto* end = std::get_if<FleetUpdateEnded>(&d.accepted.back().event);
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial);
  EXPECT_EQ(end->committed, 1u);
  EXPECT_EQ(end->skipped, 2u);
  EXPECT_EQ(end->reason, "cancelled: operator");
  EXPECT_EQ(d.rejected(FleetEvent{"", FleetUpdateCancelled{"u1", "late"}}).code(), Code::kNotFound);
  EXPECT_EQ(d.refold(), d.f);
}

// A member whose engine dies paused (its resume never answered) stalls, and the fleet update ends
// without it: partial, counted as stalled, the others committed; the dead engine admits nothing
// and may leave with its plan open. Catches one dead engine holding the whole fleet's update open
// forever (serve then fail-stops at every start while the engine stays dead).
TEST(Fleet, AMemberThatNeverResumesStallsAndTheUpdateEnds) {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  d.ok("b", d.member_update(u));
  d.run_update("b");
  ASSERT_TRUE(d.f.update.has_value()) << "a is still updating";
  d.run_update_dead_at_resume("a");
  EXPECT_EQ(d.engine("a").lifecycle, Lifecycle::kResuming);
  EXPECT_TRUE(plan_stalled(d.engine("a")));
  ASSERT_FALSE(d.f.update.has_value());
  const auto* end = std::get_if<FleetUpdateEnded>(&d.accepted.back().event);
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial);
  EXPECT_EQ(end->committed, 1u);
  EXPECT_EQ(end->stalled, 1u);
  EXPECT_FALSE(fleet_admits(d.f, "a"));
  EXPECT_TRUE(fleet_admits(d.f, "b"));
  const std::vector<FleetEvent> left = d.ok(FleetEvent{"", EngineRemovalRequested{"a"}});
  ASSERT_EQ(left.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<EngineRemoved>(left[0].event));
  EXPECT_EQ(d.f.engines.count("a"), 0u);
  EXPECT_EQ(d.refold(), d.f);
  const FleetHistoryReport h = check_fleet_history(d.history);
  EXPECT_TRUE(h.ok) << h.message;
}

// Drains member `u`'s first engine "a" so that its last attempt succeeds, the others failing.
void drain_on_last_attempt(FleetDriver& d) {
  const HttpEvidence failed{Transport::kOk, 500, false, 0, "internal error"};
  for (std::uint32_t attempt = 1; attempt < kEffectAttemptsMax; ++attempt) {
    d.ok("a", EffectStarted{EffectKind::kDrain, CacheKind::kPrefix, 1000});
    d.ok("a", DrainObserved{failed, false});
  }
  d.ok("a", EffectStarted{EffectKind::kDrain, CacheKind::kPrefix, 1000});
  d.ok("a", DrainObserved{HttpEvidence{Transport::kOk, 200, true, 0, ""}, true});
}

// A member whose drain succeeds on its last attempt is not stalled: the observation leaves it
// with no attempt until the StateChanged in the same group moves the plan on. Catches a healthy
// member counted stalled mid-group (sticky), which ended the fleet update "partial" while the
// member went on to commit, and freed its rolling batch slot while it was still paused.
TEST(Fleet, AMemberWhoseLastAttemptSucceedsIsNotStalled) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(FleetEvent{"", FleetConfigured{0, 0}});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  ASSERT_TRUE(u.stall_judged_per_group) << "a new request is judged by the current rule";
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  drain_on_last_attempt(d);
  EXPECT_FALSE(plan_stalled(d.engine("a")));
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kUpdating);
  EXPECT_TRUE(fleet_next_members(d.f).empty()) << "a's batch slot was given away";
  d.run_update("a");
  EXPECT_EQ(d.engine("a").committed.label, "rc-1");
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kCommitted);
  EXPECT_EQ(d.refold(), d.f);
}

// An update journaled before the rule existed (no stall_judged_per_group) folds as it was
// decided then: the member counted stalled after the observation, its slot given to the next.
// Catches the new rule applied to recorded histories, whose recorded next members and ends the
// fold would then refuse (such a journal would no longer open).
TEST(Fleet, AnUpdateJournaledBeforeTheStallRuleFoldsAsRecorded) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(FleetEvent{"", FleetConfigured{0, 0}});
  FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  u.stall_judged_per_group = false;
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  drain_on_last_attempt(d);
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kStalled);
  EXPECT_EQ(fleet_next_members(d.f), std::vector<std::string>{"b"});
  d.ok("b", d.member_update(u));
  EXPECT_EQ(d.refold(), d.f);
}

// A fleet update back to a label older than the newest by more than staleness_max is refused
// (a journal that recorded one still folds), and the same weights under a new label are taken.
// Catches a rollback that, under staleness 0, left every engine it reached admitting nothing: a
// rolling one could never finish (min_serving refused the last member) and the fleet ended serving
// only the version rolled back from.
TEST(Fleet, ARollbackIsAnUpdateUnderANewLabel) {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateRequested u1 = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u1});
  for (const char* e : {"a", "b"}) {
    d.ok(e, d.member_update(u1));
    d.run_update(e);
  }
  ASSERT_FALSE(d.f.update.has_value());
  FleetUpdateRequested back = d.fleet_update("u2", FleetUpdateMode::kRolling, "rc-0");
  back.identity = identity('a');  // rc-0's weights
  const Status st = d.rejected(FleetEvent{"", back});
  EXPECT_EQ(st.code(), Code::kRejected);
  EXPECT_NE(st.message().find("new label"), std::string::npos) << st.message();
  FleetState recorded = d.f;  // a journal an older build wrote with such an update still opens
  EXPECT_TRUE(fleet_apply(recorded, FleetEvent{"", back}).ok());
  back.target_label = "rc-0-again";
  d.ok(FleetEvent{"", back});
  EXPECT_EQ(d.refold(), d.f);
}

// After the fleet update ended without it, a stalled member's plan goes on alone once a restart
// retries it, and ends on its own evidence (here: committed, publishing the target); a stalled
// member takes no place in a rolling batch, even when a restart retries it while another member
// holds the slot. Catches a stall that strands the engine for good, a rolling update that waits
// on a dead engine's batch slot, and a restart that puts two members in one slot.
TEST(Fleet, AStalledMemberGoesOnAloneAfterARestart) {
  FleetDriver d = ready_fleet({"a", "b", "c"});
  d.ok(FleetEvent{"", FleetConfigured{1, 0}});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  d.ok(FleetEvent{"", u});
  EXPECT_EQ(fleet_next_members(d.f), std::vector<std::string>{"a"});
  d.ok("a", d.member_update(u));
  d.run_update_dead_at_resume("a");
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kStalled);
  EXPECT_EQ(fleet_next_members(d.f), std::vector<std::string>{"b"});
  EXPECT_EQ(d.rejected(FleetEvent{"", EngineRemovalRequested{"a"}}).code(), Code::kRejected);
  // b takes the batch slot a gave up; then the executor restarts (b mid-drain). a's plan gets its
  // attempts back but stays stalled for this fleet update: batch_max still holds (d.ok checks
  // the invariants after each step), and a stalls again on its dead engine.
  d.ok("b", d.member_update(u));
  d.ok("a", RecoveryStarted{"exec-2"});
  d.ok("b", RecoveryStarted{"exec-2"});
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kStalled);
  EXPECT_FALSE(plan_stalled(d.engine("a")));
  d.run_update_dead_at_resume("a");
  EXPECT_TRUE(plan_stalled(d.engine("a")));
  d.run_update("b");
  d.ok("c", d.member_update(u));
  d.run_update("c");
  ASSERT_FALSE(d.f.update.has_value());
  const auto* end = std::get_if<FleetUpdateEnded>(&d.accepted.back().event);
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(end->committed, 2u);
  EXPECT_EQ(end->stalled, 1u);
  d.ok("a", RecoveryStarted{"exec-3"});
  d.run_update("a");
  EXPECT_EQ(d.engine("a").lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.engine("a").committed.label, "rc-1");
  EXPECT_EQ(d.refold(), d.f);
  const FleetHistoryReport h = check_fleet_history(d.history);
  EXPECT_TRUE(h.ok) << h.message;
}

// An engine joining a fleet that moved on must bootstrap on the newest label, with the identity
// the fleet recorded for it; catches a new replica serving an old policy.
TEST(Fleet, AJoiningEngineBootstrapsAtTheNewestLabel) {
  FleetDriver d = ready_fleet({"a"});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  d.run_update("a");
  d.join("b");
  EXPECT_EQ(d.rejected("b", BootstrapRequested{"rc-0", identity('a')}).code(), Code::kRejected);
  EXPECT_EQ(d.rejected("b", BootstrapRequested{"rc-1", identity('z')}).code(),
            Code::kInvalidArgument);
  d.bootstrap("b", "rc-1", 'b');
  EXPECT_EQ(fleet_generation(d.f, "b"), 1u);
  d.admit("b");
}

// A joining engine held to a digest may be held only to one a member recorded for its label, and
// joins only holding exactly those weights; catches an executor that invents the proof, or a
// join over other weights under the fleet's label.
TEST(Fleet, AJoiningEngineIsHeldToAMembersDigest) {
  FleetDriver d;
  d.join("a");
  d.ok("a", BootstrapRequested{"rc-0", identity('a')});
  d.ok("a", EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000});
  EngineProbed probe{ok_http(), "0.25.1", "rc-0", false, false, "i-0"};
  probe.digest = digest_of("111");
  d.ok("a", probe);
  ASSERT_EQ(engine_state(d.f, "a").lifecycle, Lifecycle::kReady);
  d.join("b");
  BootstrapRequested b{"rc-0", identity('a')};
  b.expected_digest = digest_of("999").combined;
  EXPECT_EQ(d.rejected("b", b).code(), Code::kRejected);
  b.expected_digest = digest_of("111").combined;
  d.ok("b", b);
  d.ok("b", EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000});
  probe.digest = digest_of("112");
  d.ok("b", probe);
  EXPECT_EQ(engine_state(d.f, "b").lifecycle, Lifecycle::kUninitialized);
  d.ok("b", EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000});
  probe.digest = digest_of("111");
  d.ok("b", probe);
  EXPECT_EQ(engine_state(d.f, "b").lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.refold(), d.f);
}

// A removal stops admissions at once and removes the engine in the group of its last rollout's
// finish; catches a removal that cuts off a live rollout or never completes.
TEST(Fleet, RemovalDrainsTheEngineFirst) {
  FleetDriver d = ready_fleet({"a", "b"});
  const std::string r = d.admit("a");
  EXPECT_TRUE(d.ok(FleetEvent{"", EngineRemovalRequested{"a"}}).empty());
  EXPECT_NE(fleet_admission_block_reason(d.f, "a").find("being removed"), std::string::npos);
  EXPECT_EQ(d.rejected(make_fleet_admission(d.f, "a", "r-late")).code(), Code::kRejected);
  const std::vector<FleetEvent> caused =
      d.ok("a", RolloutFinished{r, RolloutOutcome::kCompleted, 1, 1});
  ASSERT_EQ(caused.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<EngineRemoved>(caused[0].event));
  EXPECT_EQ(d.f.engines.count("a"), 0u);
  // An idle engine goes in the removal's own group.
  EXPECT_EQ(d.ok(FleetEvent{"", EngineRemovalRequested{"b"}}).size(), 1u);
  EXPECT_TRUE(d.f.engines.empty());
  EXPECT_EQ(d.refold(), d.f);
}

// Proves fleet-wide totals (every engine's counters plus the removed ones') never fall when an
// engine leaves; catches a removal that drops its engine's admissions and outcomes from the
// totals, which /metrics exports as counters (a fall reads as a restart and breaks rates).
TEST(Fleet, RemovedEnginesKeepCountingInTheTotals) {
  FleetDriver d = ready_fleet({"a", "b"});
  const std::string ra = d.admit("a");
  d.ok("a", RolloutFinished{ra, RolloutOutcome::kCompleted, 1, 1});
  d.admit("b");
  auto totals = [&d] {
    Counters sum = d.f.removed;
    for (const auto& [name, s] : d.f.engines) add_counters(sum, s.counters);
    return sum;
  };
  const Counters before = totals();
  ASSERT_EQ(before.rollouts_admitted, 2u);
  ASSERT_EQ(before.rollouts_completed, 1u);
  EXPECT_EQ(d.ok(FleetEvent{"", EngineRemovalRequested{"a"}}).size(), 1u);
  ASSERT_EQ(d.f.engines.count("a"), 0u);
  EXPECT_EQ(d.f.removed.rollouts_admitted, 1u);
  EXPECT_EQ(d.f.removed.rollouts_completed, 1u);
  EXPECT_EQ(totals(), before);
  EXPECT_EQ(d.refold(), d.f);
}

// Removing a member a rolling update has not started skips it (the update ends without it, and
// it leaves), while a member updating cannot be removed; catches a removal that waits forever on a
// dead pending member, or one that cuts an update short.
TEST(Fleet, RemovingAPendingMemberSkipsIt) {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1", 1);
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  EXPECT_EQ(d.rejected(FleetEvent{"", EngineRemovalRequested{"a"}}).code(), Code::kRejected);
  d.ok(FleetEvent{"", EngineRemovalRequested{"b"}});
  EXPECT_EQ(d.f.update->members.at("b"), MemberStatus::kSkipped);
  EXPECT_EQ(d.f.engines.count("b"), 0u) << "idle: it left in the removal's group";
  d.run_update("a");
  EXPECT_FALSE(d.f.update.has_value()) << "the update ended without its skipped member";
  EXPECT_EQ(d.refold(), d.f);
}

// A rollout id is active on one engine at a time; catches two engines bound under one id (the
// audit could not tell whose trajectory it holds).
TEST(Fleet, ARolloutIdIsActiveOnOneEngine) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(make_fleet_admission(d.f, "a", "same"));
  EXPECT_EQ(d.rejected(make_fleet_admission(d.f, "b", "same")).code(), Code::kConflict);
}

// Fleet decisions cannot be submitted, and forged ones are refused by apply with the state
// unchanged; events for unknown engines are refused; catches a history that fakes a fleet outcome.
TEST(Fleet, ForgedFleetEventsAreRefused) {
  FleetDriver d = ready_fleet({"a", "b"});
  const FleetUpdateEnded forged_end{"u1", FleetOutcome::kCommitted, 2, 0, 0, 0, ""};
  EXPECT_EQ(d.rejected(FleetEvent{"", EngineRemoved{"a"}}).code(), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(FleetEvent{"", forged_end}).code(), Code::kInvalidArgument);
  const EffectStarted probe{EffectKind::kProbeEngine, CacheKind::kPrefix, 1};
  EXPECT_EQ(d.rejected(FleetEvent{"zz", probe}).code(), Code::kNotFound);
  // A fleet event names no engine.
  EXPECT_EQ(d.rejected(FleetEvent{"a", FleetConfigured{}}).code(), Code::kInvalidArgument);
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  FleetState copy = d.f;
  EXPECT_FALSE(fleet_apply(copy, FleetEvent{"", FleetUpdateEnded{"u1", FleetOutcome::kRefused, 0, 0,
                                                                 0, 0, ""}})
                   .ok());
  EXPECT_EQ(copy, d.f);
  // A member's update must be the fleet update's target.
  UpdateRequested wrong = d.member_update(u);
  wrong.target_label = "rc-9";
  EXPECT_EQ(d.rejected("a", wrong).code(), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(FleetEvent{"", EngineJoined{""}}).code(), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(FleetEvent{"", EngineJoined{"a"}}).code(), Code::kConflict);
}

// A journal of one unnamed engine cannot gain named ones, and named engines leave no room for
// the unnamed one; catches a journal whose old records would change meaning.
TEST(Fleet, TheUnnamedEngineStaysAlone) {
  FleetDriver one;
  one.bootstrap("");
  EXPECT_EQ(one.rejected(FleetEvent{"", EngineJoined{"b"}}).code(), Code::kRejected);
  FleetDriver named = ready_fleet({"a"});
  EXPECT_EQ(named.rejected("", BootstrapRequested{"rc-0", identity('a')}).code(), Code::kNotFound);
}

// The checker accepts a real fleet history, refolds it to the live fleet, counts the fleet update
// by outcome and each engine's own updates (each life of a name apart); catches a checker that
// loses an engine's history or merges two lives of one name.
TEST(FleetHistory, ChecksAFleetAndEachEngine) {
  FleetDriver d = partial_all_update();
  d.ok(FleetEvent{"", EngineRemovalRequested{"b"}});
  d.join("b");
  d.bootstrap("b", "rc-1", 'b');
  const FleetHistoryReport rep = check_fleet_history(d.history);
  ASSERT_TRUE(rep.ok) << rep.message;
  EXPECT_EQ(rep.state, d.f);
  EXPECT_EQ(rep.fleet_updates.at(FleetOutcome::kPartial), 1u);
  EXPECT_EQ(rep.engines.at({"a", 1}).updates_tainted, 1u);
  EXPECT_EQ(rep.engines.at({"b", 1}).updates_committed, 1u);
  EXPECT_EQ(rep.engines.at({"b", 2}).updates_requested, 0u);
  EXPECT_EQ(rep.engines.size(), 3u);
}

// A recorded fleet outcome that is not what the fold decides is refused by seq; catches a journal
// whose FleetUpdateEnded was rewritten to hide a tainted member.
TEST(FleetHistory, RefusesARewrittenFleetOutcome) {
  const FleetDriver d = partial_all_update();
  std::vector<FleetHistoryEntry> forged = d.history;
  auto& end = std::get<FleetUpdateEnded>(forged.back().event);
  end.outcome = FleetOutcome::kCommitted;
  end.committed = 2;
  end.tainted = 0;
  const FleetHistoryReport rep = check_fleet_history(forged);
  ASSERT_FALSE(rep.ok);
  EXPECT_EQ(rep.first_bad_seq, forged.back().cause_seq);
  EXPECT_NE(rep.message.find("differ from fleet_decide()"), std::string::npos) << rep.message;
}

// The planner proposes exactly the members a rolling update may start (batch and min_serving),
// each accepted when submitted in order, none while the batch is full, the rest once it ends;
// catches an executor plan the fold would refuse, or one that stalls a startable update.
TEST(FleetPlan, ProposesWhatTheRollingRulesAllow) {
  FleetDriver d = ready_fleet({"a", "b", "c"});
  d.ok(FleetEvent{"", FleetConfigured{1, 1}});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1", 2);
  d.ok(FleetEvent{"", u});
  EXPECT_EQ(fleet_next_members(d.f), (std::vector<std::string>{"a", "b"}));
  for (const std::string& id : fleet_next_members(d.f)) d.ok(id, member_update_request(d.f, id));
  EXPECT_TRUE(fleet_next_members(d.f).empty());
  EXPECT_EQ(fleet_update_blocked_reason(d.f), "");  // two members are updating
  d.run_update("a");
  d.run_update("b");
  EXPECT_EQ(fleet_next_members(d.f), std::vector<std::string>{"c"});
}

// A rolling update that no member can start (min_serving above what the fleet can spare) is
// reported blocked with the fold's reason, and a cancel ends it; catches an update that would
// wait forever without anyone knowing why.
TEST(FleetPlan, ReportsAnUpdateNoMemberCanStart) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(FleetEvent{"", FleetConfigured{1, 2}});
  d.ok(FleetEvent{"", d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1")});
  EXPECT_TRUE(fleet_next_members(d.f).empty());
  const std::string why = fleet_update_blocked_reason(d.f);
  EXPECT_NE(why.find("min_serving is 2"), std::string::npos) << why;
  const std::vector<FleetEvent> caused = d.ok(FleetEvent{"", FleetUpdateCancelled{"u1", why}});
  ASSERT_EQ(caused.size(), 1u);
  EXPECT_EQ(std::get<FleetUpdateEnded>(caused[0].event).outcome, FleetOutcome::kRefused);
  EXPECT_EQ(fleet_update_blocked_reason(d.f), "");
}

// A cancel's reason at its bound still ends the fleet update (its end carries the reason after
// "cancelled: "), and one past the bound is refused; catches a cancel whose end the fold refuses.
TEST(FleetEdges, ACancelReasonAtItsBoundEndsTheUpdate) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(FleetEvent{"", FleetConfigured{1, 2}});
  d.ok(FleetEvent{"", d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1")});
  const std::string too_long(kFleetCancelReasonBytesMax + 1, 'x');
  EXPECT_EQ(d.rejected(FleetEvent{"", FleetUpdateCancelled{"u1", too_long}}).code(),
            Code::kInvalidArgument);
  const std::vector<FleetEvent> caused = d.ok(
      FleetEvent{"", FleetUpdateCancelled{"u1", std::string(kFleetCancelReasonBytesMax, 'x')}});
  ASSERT_EQ(caused.size(), 1u);
  EXPECT_FALSE(d.f.update.has_value());
}

// A leaving engine starts no plan (update, sleep, restore), and when a recovery abandons its last
// rollouts it is removed in that group; catches a removal that never completes or a fold that
// crashes deriving a removal for an engine still in an update.
TEST(FleetEdges, ALeavingEngineStartsNothingAndLeavesWhenIdle) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.admit("a");
  d.ok(FleetEvent{"", EngineRemovalRequested{"a"}});
  EXPECT_NE(d.rejected("a", SleepRequested{"s1", 1}).message().find("being removed"),
            std::string::npos);
  EXPECT_EQ(d.rejected("a", UpdateRequested{"u9", "rc-9", identity('b'), "x"}).code(),
            Code::kRejected);
  const std::vector<FleetEvent> caused = d.ok("a", RecoveryStarted{"exec-2"});
  ASSERT_FALSE(caused.empty());
  EXPECT_TRUE(std::holds_alternative<EngineRemoved>(caused.back().event));
  EXPECT_EQ(d.f.engines.count("a"), 0u);
}

// Two engines updating on their own to one new label with different weights: the second is
// refused while the first is in flight; catches one label published for two identities.
TEST(FleetEdges, ALabelInFlightNamesItsIdentityFleetWide) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok("a", UpdateRequested{"ua", "rc-1", identity('b'), "x"});
  EXPECT_EQ(d.rejected("b", UpdateRequested{"ub", "rc-1", identity('c'), "x"}).code(),
            Code::kInvalidArgument);
  d.ok("b", UpdateRequested{"ub", "rc-1", identity('b'), "x"});
}

// A fleet update whose target a member already holds counts that member committed at once, and
// a target with a malformed identity is refused before any member is asked; catches updates that
// can never finish.
TEST(FleetEdges, MembersHoldingTheTargetAreCommittedAndBadTargetsRefused) {
  FleetDriver d = ready_fleet({"a", "b"});
  d.ok(FleetEvent{"", FleetConfigured{1, 0}});
  d.ok("a", UpdateRequested{"ua", "rc-1", identity('b'), "x"});
  d.run_update("a");
  FleetUpdateRequested bad = d.fleet_update("u0", FleetUpdateMode::kAll, "rc-2");
  bad.identity.manifest_digest = "not hex";
  EXPECT_EQ(d.rejected(FleetEvent{"", bad}).code(), Code::kInvalidArgument);
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  EXPECT_EQ(d.f.update->members.at("a"), MemberStatus::kCommitted);
  d.ok("b", d.member_update(u));
  d.run_update("b");
  const auto* end = std::get_if<FleetUpdateEnded>(&d.accepted.back().event);
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(end->outcome, FleetOutcome::kCommitted);
  EXPECT_EQ(end->committed, 2u);
}

// The one unnamed engine cannot leave its journal, an emptied fleet of named engines never grows
// the unnamed one, and an admission for an unknown engine is refused, not thrown; catches a
// journal whose records change meaning, and a crash on a bad engine name.
TEST(FleetEdges, TheUnnamedEngineNeitherLeavesNorReturns) {
  FleetDriver one;
  one.bootstrap("");
  EXPECT_EQ(one.rejected(FleetEvent{"", EngineRemovalRequested{""}}).code(), Code::kRejected);
  FleetDriver named = ready_fleet({"a"});
  named.ok(FleetEvent{"", EngineRemovalRequested{"a"}});
  ASSERT_TRUE(named.f.engines.empty());
  EXPECT_EQ(named.rejected("", BootstrapRequested{"rc-0", identity('a')}).code(), Code::kNotFound);
  EXPECT_EQ(named.rejected(make_fleet_admission(named.f, "zz", "r1")).code(), Code::kNotFound);
}

// A digest of the layout two workers give (each tensor's shard named by its worker's rank), its
// values named by `v` as digest_of's are.
WeightDigest two_worker_digest(const std::string& v) {
  WeightDigest d;
  d.algorithm = "rcd1";
  d.bytes = 6 * 1024;
  for (const char* rank : {"r0/", "r1/"}) {
    for (int i = 0; i < 3; ++i) {
      d.tensors.push_back({std::string(rank) + "abc"[i], std::string(32, v[i])});
    }
  }
  d.combined = std::string(61, 'f') + v;
  return d;
}

// Engines a and b (one worker each) and c (two workers), READY on rc-0 with the digests of their
// layouts, and an `all` fleet update to rc-1 that names no expected digest.
FleetDriver digest_fleet() {
  FleetDriver d;
  for (const char* id : {"a", "b", "c"}) d.join(id);
  d.bootstrap("a", "rc-0", 'a', digest_of("111"));
  d.bootstrap("b", "rc-0", 'a', digest_of("111"));
  d.bootstrap("c", "rc-0", 'a', two_worker_digest("111"));
  d.ok(FleetEvent{"", d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1")});
  return d;
}

// Proves that in a fleet update naming no expected digest one member of each weight layout starts
// without a digest, the others of its layout wait until its digest is known and then carry it,
// and the fold itself still takes a digest-less member request (a journal written before the rule
// folds as it was written); catches members of one layout validated side by side, each free to
// publish the label on weights of its own.
TEST(FleetDigest, OneMemberPerLayoutStartsWithoutADigest) {
  FleetDriver d = digest_fleet();
  EXPECT_EQ(fleet_next_members(d.f), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(member_update_request(d.f, "a").expected_digest, "");
  d.ok("a", member_update_request(d.f, "a"));
  d.ok("c", member_update_request(d.f, "c"));
  const UpdateRequested early = member_update_request(d.f, "b");
  EXPECT_EQ(early.expected_digest, "") << "no engine holds a digest for rc-1 yet";
  FleetState recorded = d.f;
  EXPECT_TRUE(fleet_apply(recorded, FleetEvent{"b", early}).ok()) << "the fold's own rule changed";
  const Status waits = d.rejected("b", early);
  EXPECT_EQ(waits.code(), Code::kRejected);
  EXPECT_NE(waits.message().find("waits for the digest that engine 'a'"), std::string::npos)
      << waits.message();
  EXPECT_TRUE(fleet_next_members(d.f).empty());
  EXPECT_EQ(fleet_update_blocked_reason(d.f), "");  // a and c are updating
  d.run_update_reading("a", digest_of("222"));
  ASSERT_EQ(d.engine("a").committed.label, "rc-1");
  EXPECT_EQ(fleet_next_members(d.f), std::vector<std::string>{"b"});
  EXPECT_EQ(member_update_request(d.f, "b").expected_digest, digest_of("222").combined);
  d.ok("b", member_update_request(d.f, "b"));
  EXPECT_EQ(d.refold(), d.f);
}

// Proves a member held to the digest its layout published for the label publishes it on no other
// weights (its engine reading other bytes goes TAINTED, still on rc-0), a member of another layout
// commits on its own digest, and the fold refuses a member request held to a digest no engine
// holds for the target; catches one label published across the fleet for two contents, and a
// forged journal that holds a member to a digest nobody read.
TEST(FleetDigest, AMemberHeldToItsLayoutsDigestPublishesNoOther) {
  FleetDriver d = digest_fleet();
  d.ok("a", member_update_request(d.f, "a"));
  d.ok("c", member_update_request(d.f, "c"));
  d.run_update_reading("a", digest_of("222"));
  UpdateRequested forged = member_update_request(d.f, "b");
  forged.expected_digest = digest_of("333").combined;
  const Result<std::vector<FleetEvent>> decided = fleet_decide(d.f, FleetEvent{"b", forged});
  ASSERT_FALSE(decided.ok());
  EXPECT_EQ(decided.status().code(), Code::kInvalidArgument);
  EXPECT_NE(decided.status().message().find("holds for 'rc-1'"), std::string::npos)
      << decided.status().message();
  d.ok("b", member_update_request(d.f, "b"));
  d.run_update_reading("b", digest_of("444"));
  EXPECT_EQ(d.engine("b").lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(d.engine("b").committed.label, "rc-0");
  EXPECT_EQ(d.engine("b").label_digests.count("rc-1"), 0u);
  d.run_update_reading("c", two_worker_digest("222"));
  EXPECT_EQ(d.engine("c").committed.label, "rc-1");
  FleetUpdateEnded end;
  ASSERT_TRUE(has_end(d.accepted, &end));
  EXPECT_EQ(end.outcome, FleetOutcome::kPartial);
  EXPECT_EQ(end.committed, 2u);
  EXPECT_EQ(end.tainted, 1u);
  const FleetHistoryReport rep = check_fleet_history(d.history);
  EXPECT_TRUE(rep.ok) << rep.message;
}

// Proves a member that validated its digest and then stalled (its engine died paused) holds no
// member of its layout back: they start held to the digest it validated, which the fold accepts;
// catches one dead engine that keeps the rest of its layout out of the fleet update.
TEST(FleetDigest, AValidatedMemberThatStallsLendsItsDigest) {
  FleetDriver d = digest_fleet();
  d.ok("a", member_update_request(d.f, "a"));
  d.run_update_reading("a", digest_of("222"), /*dead_at_resume=*/true);
  ASSERT_EQ(d.f.update->members.at("a"), MemberStatus::kStalled);
  ASSERT_EQ(d.engine("a").committed.label, "rc-0");
  EXPECT_EQ(fleet_next_members(d.f), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(member_update_request(d.f, "b").expected_digest, digest_of("222").combined);
  d.ok("b", member_update_request(d.f, "b"));
  d.run_update_reading("b", digest_of("222"));
  EXPECT_EQ(d.engine("b").committed.label, "rc-1");
  EXPECT_EQ(d.refold(), d.f);
}

// Proves a fleet update whose expected digest differs from the one a member's layout published
// for the target starts no member of that layout, and says why, while a member of another layout
// may start; catches a label published on the trainer's digest on some engines of a layout and
// on another on the rest.
TEST(FleetDigest, AnExpectedDigestOtherThanTheLayoutsIsRefused) {
  FleetDriver d = digest_fleet();
  d.ok("a", member_update_request(d.f, "a"));
  d.run_update_reading("a", digest_of("222"));
  d.ok(FleetEvent{"", FleetUpdateCancelled{"u1", "b and c stay behind"}});
  ASSERT_FALSE(d.f.update.has_value());
  FleetUpdateRequested u2 = d.fleet_update("u2", FleetUpdateMode::kAll, "rc-1");
  u2.expected_digest = digest_of("999").combined;
  d.ok(FleetEvent{"", u2});
  ASSERT_EQ(d.f.update->members.at("a"), MemberStatus::kCommitted);
  EXPECT_EQ(fleet_next_members(d.f), std::vector<std::string>{"c"});
  const Status refused = d.rejected("b", member_update_request(d.f, "b"));
  EXPECT_EQ(refused.code(), Code::kRejected);
  EXPECT_NE(refused.message().find("holds digest " + digest_of("222").combined.substr(0, 16)),
            std::string::npos)
      << refused.message();
}

// digest_fleet once c, the only engine of its layout, committed rc-1 in u1 (a and b have not
// started), with engine j joined and not bootstrapped yet.
FleetDriver fleet_with_c_on_rc1() {
  FleetDriver d = digest_fleet();
  d.ok("c", member_update_request(d.f, "c"));
  d.run_update_reading("c", two_worker_digest("222"));
  EXPECT_EQ(d.engine("c").committed.label, "rc-1");
  d.join("j");
  return d;
}

// Proves a joining engine is held to the digest a TAINTED engine of its layout published for the
// label, the same one a member of that layout is held to, and a joiner that computes no digest is
// refused there; catches a join that counts only untainted holders, so a fresh engine bootstraps
// rc-1 on other weights than its layout published under it.
TEST(FleetJoin, AJoinerIsHeldToATaintedEnginesRecordedDigest) {
  FleetDriver d = fleet_with_c_on_rc1();
  d.ok("a", member_update_request(d.f, "a"));
  d.run_update_reading("a", digest_of("222"));
  ASSERT_EQ(d.engine("a").committed.label, "rc-1");
  d.ok(FleetEvent{"", FleetUpdateCancelled{"u1", "b stays behind"}});
  EngineMonitored drifted{ok_http(), "rc-1", true, false, ""};
  drifted.updates_seen = monitor_epoch(d.engine("a"));
  drifted.digest = digest_of("555");  // a's weights changed behind the fleet's back
  d.ok("a", drifted);
  ASSERT_EQ(d.engine("a").lifecycle, Lifecycle::kTainted);
  ASSERT_EQ(d.engine("a").label_digests.at("rc-1"), digest_of("222").combined);

  const std::string held = digest_of("222").combined;
  EXPECT_EQ(layout_label_digest(d.f, digest_of("999"), "rc-1"), held);
  EXPECT_EQ(layout_digest(d.f, "b", "rc-1"), held) << "members and joiners differ";
  const Result<std::string> joined = join_digest(d.f, "rc-1", digest_of("999"));
  ASSERT_TRUE(joined.ok()) << joined.status().ToString();
  EXPECT_EQ(*joined, held);
  const Result<std::string> other_layout = join_digest(d.f, "rc-1", two_worker_digest("999"));
  ASSERT_TRUE(other_layout.ok());
  EXPECT_EQ(*other_layout, two_worker_digest("222").combined);
  EXPECT_EQ(join_digest(d.f, "rc-1", WeightDigest{}).status().code(), Code::kRejected);

  d.bootstrap("j", "rc-1", 'b', digest_of("999"), *joined);  // other weights: refused by its probe
  EXPECT_EQ(d.engine("j").lifecycle, Lifecycle::kUninitialized);
  d.bootstrap("j", "rc-1", 'b', digest_of("222"), *joined);
  EXPECT_EQ(d.engine("j").lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.refold(), d.f);
}

// Proves a joining engine is refused (retryable) while the first of its layout updates to the
// label and has read no digest yet, then, once that plan validated (and stalled at its resume,
// unpublished), is held to the digest it read and the fold takes that bootstrap; catches a join
// held to nothing beside an open plan of its layout, after which the plan publishes the label on
// one content and the joiner serves it on another.
TEST(FleetJoin, AJoinerWaitsForTheFirstOfItsLayoutThenIsHeldToItsDigest) {
  FleetDriver d = fleet_with_c_on_rc1();
  d.ok("a", member_update_request(d.f, "a"));
  ASSERT_FALSE(d.engine("a").update->validated);
  const Result<std::string> early = join_digest(d.f, "rc-1", digest_of("999"));
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), Code::kRejected);
  EXPECT_NE(early.status().message().find("engine 'a'"), std::string::npos)
      << early.status().message();
  EXPECT_NE(early.status().message().find("has read no digest yet"), std::string::npos)
      << early.status().message();
  const Result<std::string> other_layout = join_digest(d.f, "rc-1", two_worker_digest("999"));
  ASSERT_TRUE(other_layout.ok()) << "a plan of another layout holds the join back";

  d.run_update_reading("a", digest_of("222"), /*dead_at_resume=*/true);
  ASSERT_EQ(d.engine("a").lifecycle, Lifecycle::kResuming);
  ASSERT_TRUE(d.engine("a").update->validated);
  ASSERT_EQ(d.engine("a").label_digests.count("rc-1"), 0u) << "a published";
  const Result<std::string> joined = join_digest(d.f, "rc-1", digest_of("999"));
  ASSERT_TRUE(joined.ok()) << joined.status().ToString();
  EXPECT_EQ(*joined, digest_of("222").combined);
  d.bootstrap("j", "rc-1", 'b', digest_of("222"), *joined);
  EXPECT_EQ(d.engine("j").lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.engine("j").label_digests.at("rc-1"), digest_of("222").combined);
  EXPECT_EQ(d.refold(), d.f);
}

}  // namespace
}  // namespace rc
