// Unit tests of the history checker: it accepts what step() produced and names the first
// violation (seq and reason) of each kind of forged or corrupt history.
#include <gtest/gtest.h>

#include "tests/statemachine/helpers.h"

namespace rc::test {
namespace {

// Index of the first entry at or after `from` holding a T (fails the test if none).
template <class T>
std::size_t find_entry(const std::vector<HistoryEntry>& h, std::size_t from = 0) {
  for (std::size_t i = from; i < h.size(); ++i) {
    if (std::holds_alternative<T>(h[i].event)) return i;
  }
  ADD_FAILURE() << "no such entry";
  return h.size() - 1;
}

void expect_bad(const std::vector<HistoryEntry>& h, std::uint64_t seq, const std::string& needle) {
  HistoryReport r = check_history(h);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.first_bad_seq, seq) << r.message;
  EXPECT_NE(r.message.find(needle), std::string::npos) << r.message;
}

Driver committed_update_with_rollouts() {
  Driver d;
  d.to_ready();
  const std::string a = d.admit();
  const std::string b = d.admit();
  d.ok(RolloutFinished{a, RolloutOutcome::kCompleted, 3, 4});
  d.to_draining();
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  d.ok(RolloutFinished{b, RolloutOutcome::kAborted, 3, 0});
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  d.effect(EffectKind::kPreflight);
  d.ok(d.good_preflight());
  d.effect(EffectKind::kTransfer);
  d.ok(d.good_transfer());
  d.reset_cache(CacheKind::kPrefix);
  d.reset_cache(CacheKind::kEncoder);
  d.reset_cache(CacheKind::kMultimodal);
  d.effect(EffectKind::kValidate);
  d.ok(ValidationObserved{ok_http(), "rc-1", true, "", "i-0", {}, true, true});
  d.resume();
  d.admit();
  return d;
}

// A genuine history passes, its fold equals the live state and the summary counts it; catches a
// checker that rejects valid histories or miscounts.
TEST(History, AcceptsGenuineHistoryAndSummarizes) {
  Driver d = committed_update_with_rollouts();
  // A refused update and a tainted one follow.
  d.to_draining("rc-2");
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{http(Transport::kTimeout), false});
  d.resume();
  d.ok(RecoveryStarted{"exec-2"});  // abandons the rc-1 rollout
  d.reverify();
  d.to_updating("rc-3");
  d.effect(EffectKind::kTransfer);
  d.ok(TransferObserved{false, MutationClass::kPossible, 5, 1, 1, "", "reset"});
  HistoryReport r = check_history(d.history);
  ASSERT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.state, d.s);
  EXPECT_EQ(r.summary.updates_requested, 3u);
  EXPECT_EQ(r.summary.updates_committed, 1u);
  EXPECT_EQ(r.summary.updates_refused, 1u);
  EXPECT_EQ(r.summary.updates_tainted, 1u);
  EXPECT_EQ(r.summary.recoveries, 1u);
  EXPECT_EQ(r.summary.rollouts_by_generation[0].admitted, 2u);
  EXPECT_EQ(r.summary.rollouts_by_generation[0].finished, 2u);
  EXPECT_EQ(r.summary.rollouts_by_generation[1].label, "rc-1");
  EXPECT_EQ(r.summary.rollouts_by_generation[1].admitted, 1u);
  EXPECT_EQ(r.summary.rollouts_by_generation[1].finished, 1u);
  EXPECT_EQ(r.summary.entries, d.history.size());
  EXPECT_TRUE(check_history({}).ok);
}

// An input the fold refuses is reported at its seq; catches a checker that skips bad records.
TEST(History, IllegalEvent) {
  Driver d;
  d.to_ready();
  d.record(UpdateRequested{"u", "rc-0", identity('b'), ""}, {});  // target == committed
  expect_bad(d.history, d.history.back().seq, "illegal UpdateRequested");
}

// Recorded decisions must equal decide(): a missing, extra or altered decision is reported at
// the input's seq; catches non-determinism and tampered decisions.
TEST(History, DecisionsDifferingFromDecide) {
  Driver d = committed_update_with_rollouts();
  {
    auto h = d.history;  // drop the QUIESCED decision
    std::size_t i = find_entry<StateChanged>(h, find_entry<DrainObserved>(h) + 1);
    const std::uint64_t cause = h[i].cause_seq;
    h.erase(h.begin() + static_cast<long>(i));
    expect_bad(h, cause, "differ from decide()");
  }
  {
    auto h = d.history;  // alter the detail of the READY decision
    std::size_t i = find_entry<StateChanged>(h);
    std::get<StateChanged>(h[i].event).detail = "tampered";
    expect_bad(h, h[i].cause_seq, "differ from decide()");
  }
  {
    auto h = d.history;  // an extra decision after a rollout binding
    std::size_t i = find_entry<RolloutAdmitted>(h);
    h.insert(h.begin() + static_cast<long>(i) + 1,
             HistoryEntry{h[i].seq, h[i].seq, UpdateEnded{"u", UpdateOutcome::kRefused, ""}});
    for (std::size_t k = i + 1; k < h.size(); ++k) {
      h[k].seq += 1;
      if (h[k].cause_seq > h[i].seq) h[k].cause_seq += 1;
    }
    h[i + 1].seq = h[i].seq + 1;
    expect_bad(h, h[i].seq, "differ from decide()");
  }
}

// A derived event whose input is not right before it is reported; catches journals where a
// decision was spliced in or its input was lost.
TEST(History, DerivedWithoutInput) {
  Driver d;
  d.to_ready();
  auto h = d.history;
  h.erase(h.begin() +
          static_cast<long>(find_entry<EngineProbed>(h)));  // the READY decision loses its input
  expect_bad(h, h.back().seq, "without its input");
  HistoryEntry first = d.history.front();
  first.cause_seq = 7;
  expect_bad({first}, first.seq, "without its input");
}

// Seqs must increase; catches a reordered or duplicated record.
TEST(History, SeqNotIncreasing) {
  Driver d;
  d.to_ready();
  auto h = d.history;
  h.push_back(h.back());
  h.back().cause_seq = 0;
  expect_bad(h, h.back().seq, "seq not increasing");
}

// A decision recorded as an input is reported; catches forged transitions at top level.
TEST(History, DecisionAsInput) {
  Driver d;
  d.to_ready();
  d.record(StateChanged{Lifecycle::kReady, Lifecycle::kDraining, Cause::kUpdateRequested, ""}, {});
  expect_bad(d.history, d.history.back().seq, "recorded as an input");
}

// An admission outside READY is named as such; catches a binding during an update.
TEST(History, AdmissionOutsideReady) {
  Driver d;
  d.to_ready();
  d.to_draining();
  d.record(make_admission(d.s, "late"), {});
  expect_bad(d.history, d.history.back().seq, "outside READY");
}

// Anything but RecoveryStarted after TAINTED is reported; catches activity after taint.
TEST(History, ActivityAfterTainted) {
  Driver d;
  d.to_ready();
  d.to_updating();
  d.effect(EffectKind::kTransfer);
  d.ok(RecoveryStarted{"exec-2"});
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  d.ok(RecoveryStarted{"exec-3"});
  EXPECT_TRUE(check_history(d.history).ok);
  d.record(UpdateRequested{"u2", "rc-2", identity('c'), ""}, {});
  expect_bad(d.history, d.history.back().seq, "after TAINTED");
}

// A QUIESCED decision recorded while a binding is active is named (the binding would then span
// the mutation); catches a drain confirmed without the local bookkeeping.
TEST(History, QuiescedWhileBindingActive) {
  Driver f;
  f.to_ready();
  f.admit();
  f.to_draining();
  f.effect(EffectKind::kDrain);
  f.record(DrainObserved{ok_http(), true},
           {StateChanged{Lifecycle::kDraining, Lifecycle::kQuiesced, Cause::kDrained, ""}});
  expect_bad(f.history, f.history.back().seq, "QUIESCED while rollout 'r1'");
}

// A publish whose label VALIDATING never saw is named; catches publishing on forged evidence.
TEST(History, PublishWithoutValidation) {
  Driver d;
  d.to_ready();
  d.to_validating();
  d.effect(EffectKind::kValidate);
  d.record(ValidationObserved{http(Transport::kOk, 500, false), "", true, ""},
           {StateChanged{Lifecycle::kValidating, Lifecycle::kResuming, Cause::kValidated, ""}});
  expect_bad(d.history, d.history.back().seq, "never saw the target label");
  // Same, with the publish itself forged after a validation of another label.
  Driver e;
  e.to_ready();
  e.to_validating();
  e.effect(EffectKind::kValidate);
  e.record(ValidationObserved{ok_http(), "rc-0", true, "", "i-0", {}, true, true},
           {VersionPublished{"u-rc-1", WeightVersion{1, "rc-1"}, identity('b')}});
  expect_bad(e.history, e.history.back().seq, "published but VALIDATING never saw it");
}

// The checker reports a rollout that spans two versions at the publish; catches a binding that
// outlives the generation it was admitted under.
TEST(History, RolloutSpanningTwoVersions) {
  Driver d;
  d.to_ready();
  d.admit();
  d.to_draining();
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});  // drain race: bindings active, no QUIESCED
  // Forge the rest of the update as if the binding had been forgotten.
  Driver g;
  g.to_ready();
  g.to_resuming_validated();
  g.effect(EffectKind::kResume);
  const UpdatePlan u = *g.s.update;
  d.record(ResumeObserved{ok_http(), true, false},
           {VersionPublished{u.update_id, u.target, u.identity}});
  // The checker's bookkeeping: VALIDATING never saw it AND r1 is active; either is a violation,
  // the validation rule comes first.
  HistoryReport r = check_history(d.history);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.first_bad_seq, d.history.back().seq) << r.message;
  // With the validation seen (a genuine update whose history gets a stale binding spliced in),
  // the span itself is named.
  std::vector<HistoryEntry> h = g.history;
  h.push_back({g.next_seq++, 0, ResumeObserved{ok_http(), true, false}});
  h.push_back({g.next_seq++, h.back().seq, VersionPublished{u.update_id, u.target, u.identity}});
  // Insert an admission just before the update request (READY, so legal at that point) whose
  // finish never comes.
  std::size_t req = find_entry<UpdateRequested>(h);
  h.insert(h.begin() + static_cast<long>(req),
           HistoryEntry{h[req].seq, 0,
                        RolloutAdmitted{"stale", WeightVersion{0, "rc-0"}, identity('a')}});
  for (std::size_t k = req + 1; k < h.size(); ++k) {
    h[k].seq += 1;
    if (h[k].cause_seq != 0) h[k].cause_seq += 1;
  }
  // Now the drain's QUIESCED decision is recorded while 'stale' is active: first violation.
  HistoryReport r2 = check_history(h);
  EXPECT_FALSE(r2.ok);
  EXPECT_NE(r2.message.find("'stale'"), std::string::npos) << r2.message;
  EXPECT_NE(r2.message.find("span"), std::string::npos) << r2.message;
}

}  // namespace
}  // namespace rc::test
