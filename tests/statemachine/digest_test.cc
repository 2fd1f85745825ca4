// The weight-digest rules of the fold: a digest recorded at bootstrap and with every publish,
// and VALIDATING refusing a digest that proves nothing changed, that differs from the one
// recorded for the same weights or from the trainer's expected one.
#include <gtest/gtest.h>

#include "tests/statemachine/helpers.h"

namespace rc {
namespace {

using namespace rc::test;

// Walks bootstrap with `boot` digest, then validates `label` with `seen`.
struct DigestDriver : Driver {
  void bootstrap(const WeightDigest& boot, bool require = false,
                 std::uint32_t fold_rules = kFoldRulesCurrent) {
    BootstrapRequested b{"rc-0", identity('a')};
    b.require_digest = require;
    b.fold_rules = fold_rules;
    ok(b);
    effect(EffectKind::kProbeEngine);
    EngineProbed p{ok_http(), "0.25.1", "rc-0", false, false, "i-0"};
    p.digest = boot;
    ok(p);
  }
  std::vector<Event> validate(const std::string& label, const WeightDigest& seen) {
    effect(EffectKind::kValidate);
    ValidationObserved v{ok_http(), label, true, "", "i-0", {}, true, true};
    v.digest = seen;
    return ok(v);
  }
  // The engine the journal verified (its label and process, unpaused) answering a re-verification
  // probe, with `seen` as its digest.
  EngineProbed same_engine(const WeightDigest& seen) const {
    EngineProbed p{ok_http(), "0.25.1", s.committed.label, true, false, s.engine_instance};
    p.digest = seen;
    return p;
  }
  // An identity whose content digest is the hex of its letter (its own bytes).
  UpdateRequested distinct_request(const std::string& label, char ident) const {
    UpdateRequested u = update_request(label, ident);
    u.identity.content_digest = hex(ident);
    return u;
  }
  void walk_to_validating(const UpdateRequested& u) {
    ok(u);
    effect(EffectKind::kDrain);
    ok(DrainObserved{ok_http(), true});
    effect(EffectKind::kPreflight);
    ok(good_preflight());
    effect(EffectKind::kTransfer);
    ok(good_transfer());
    for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
      reset_cache(c);
    }
  }
  void commit(const std::string& label, char ident, const WeightDigest& seen) {
    walk_to_validating(distinct_request(label, ident));
    validate(label, seen);
    ASSERT_EQ(s.lifecycle, Lifecycle::kResuming);
    resume();
    ASSERT_EQ(s.lifecycle, Lifecycle::kReady);
  }
};

void expect_history_ok(const Driver& d) {
  HistoryReport r = check_history(d.history);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.state, d.s) << "the checker's fold differs from the live state";
}

// A digest read that failed: no digest, and why.
WeightDigest unread_digest() {
  WeightDigest d;
  d.error = "rc_weight_digest timed out";
  return d;
}

std::string taint_detail(const std::vector<Event>& ev) {
  const StateChanged c = last_change(ev);
  EXPECT_EQ(c.to, Lifecycle::kTainted);
  EXPECT_EQ(c.cause, Cause::kValidationFailed);
  return c.detail;
}

// Bootstrap and publish record the engine's digest, and the published record carries the one
// VALIDATING saw; catches a digest that is observed but never journaled with the version.
TEST(Digest, RecordedAtBootstrapAndWithEveryPublish) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  EXPECT_EQ(d.s.committed_digest, digest_of("111"));
  EXPECT_EQ(d.s.label_digests.at("rc-0"), digest_of("111").combined);
  d.commit("rc-1", 'b', digest_of("222"));
  EXPECT_EQ(d.s.committed_digest, digest_of("222"));
  EXPECT_EQ(d.s.label_digests.at("rc-1"), digest_of("222").combined);
  bool published = false;
  for (const HistoryEntry& h : d.history) {
    if (const auto* p = std::get_if<VersionPublished>(&h.event)) {
      EXPECT_EQ(p->engine_digest, digest_of("222").combined);
      published = true;
    }
  }
  EXPECT_TRUE(published);
  expect_history_ok(d);
}

// An update whose digest equals the pre-update one changed nothing (a receiver that dropped the
// data but acknowledged): TAINTED, never published; catches publishing on the label alone.
TEST(Digest, UnchangedWeightsTaint) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  d.walk_to_validating(d.distinct_request("rc-1", 'b'));
  const std::string why = taint_detail(d.validate("rc-1", digest_of("111")));
  EXPECT_NE(why.find("did not change"), std::string::npos) << why;
  EXPECT_EQ(d.s.committed.label, "rc-0");
  expect_history_ok(d);
}

// Unchanged weights are fine when the source is declared byte-identical to what was served (same
// content digest over the same manifest); catches refusing a legitimate relabel of identical
// bytes.
TEST(Digest, UnchangedWeightsPassWhenTheSourceIsTheSameBytes) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  UpdateRequested u = d.distinct_request("rc-1", 'b');
  u.identity.manifest_digest = d.s.committed_identity.manifest_digest;
  u.identity.content_digest = d.s.committed_identity.content_digest;
  ASSERT_FALSE(u.identity.content_digest.empty());
  d.walk_to_validating(u);
  d.validate("rc-1", digest_of("111"));
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
}

// Weights served before under another label must come back with the digest recorded then, and
// a mismatch against the committed version names the tensors that differ; catches a restore or
// re-commit of "the same" identity that actually holds other bytes.
TEST(Digest, SameIdentityMustMatchTheRecordedDigestAndNamesTensors) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  d.commit("rc-1", 'b', digest_of("222"));
  // rc-2 declares the identity rc-0 had: its digest must be rc-0's.
  d.commit("rc-2", 'a', digest_of("111"));
  EXPECT_EQ(d.s.committed.label, "rc-2");
  expect_history_ok(d);
  // rc-2 here declares rc-1's identity (committed), but tensor b came back other than rc-1 had it.
  DigestDriver e;
  e.bootstrap(digest_of("111"));
  e.commit("rc-1", 'b', digest_of("222"));
  e.walk_to_validating(e.distinct_request("rc-2", 'b'));
  const std::string why = taint_detail(e.validate("rc-2", digest_of("212")));
  EXPECT_NE(why.find("recorded when these weights were served as 'rc-1'"), std::string::npos)
      << why;
  EXPECT_NE(why.find("1 of 3 tensors differ: b"), std::string::npos) << why;
  expect_history_ok(e);
}

// The trainer's expected digest decides when given, even on a journal without digests; catches
// an update that validated on its label while the trainer's own digest said otherwise.
TEST(Digest, TheTrainersExpectedDigestMustMatch) {
  DigestDriver d;
  d.to_ready();  // an engine without digests
  EXPECT_FALSE(d.s.committed_digest.present());
  UpdateRequested u = d.distinct_request("rc-1", 'b');
  u.expected_digest = digest_of("222").combined;
  d.walk_to_validating(u);
  const std::string why = taint_detail(d.validate("rc-1", digest_of("223")));
  EXPECT_NE(why.find("not the trainer's expected"), std::string::npos) << why;
}

// Once the journal records digests, a validation without one taints; a journal bootstrapped
// without digests validates on the label as before; catches a digest check that an engine can
// skip by not answering the digest call.
TEST(Digest, AMissingDigestTaintsOnlyWhenDigestsAreInUse) {
  DigestDriver with;
  with.bootstrap(digest_of("111"));
  with.walk_to_validating(with.distinct_request("rc-1", 'b'));
  WeightDigest none;
  none.error = "the engine computes no weight digest";
  const std::string why = taint_detail(with.validate("rc-1", none));
  EXPECT_NE(why.find("no weight digest"), std::string::npos) << why;

  DigestDriver without;
  without.to_ready();
  without.to_validating("rc-1");
  without.validate("rc-1", none);
  EXPECT_EQ(without.s.lifecycle, Lifecycle::kResuming);
}

// Proves an identity that claims the content digest of weights committed before under another
// manifest is refused when the update is requested, nothing changing, while the same content
// digest over the same manifest is still a relabel of identical bytes; catches an update to
// {manifest M32, content "aa"} published on rc-1's "aa" although the engine ignored the transfer
// and still holds rc-1's weights.
TEST(Digest, AContentDigestClaimedUnderAnotherManifestIsRefused) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  d.commit("rc-1", 'b', digest_of("222"));
  UpdateRequested other = d.distinct_request("rc-2", 'c');
  other.identity.content_digest = d.s.committed_identity.content_digest;
  ASSERT_NE(other.identity.manifest_digest, d.s.committed_identity.manifest_digest);
  EXPECT_EQ(d.rejected(other), Code::kInvalidArgument);
  other.identity.content_digest = identity('a').content_digest;  // rc-0's bytes, not committed
  EXPECT_EQ(d.rejected(other), Code::kInvalidArgument);
  EXPECT_EQ(d.s.counters.updates_requested, 1u);

  UpdateRequested same = other;
  same.identity.manifest_digest = d.s.committed_identity.manifest_digest;
  same.identity.content_digest = d.s.committed_identity.content_digest;
  d.walk_to_validating(same);
  d.validate("rc-2", digest_of("222"));
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  expect_history_ok(d);
}

// require_digest refuses a bootstrap on an engine that computes none; catches a journal that
// silently starts without the proof the operator asked for.
TEST(Digest, RequiredDigestRefusesABootstrapWithoutOne) {
  DigestDriver d;
  WeightDigest none;
  none.error = "no extension";
  d.bootstrap(none, /*require=*/true);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kUninitialized);
  EngineProbed p{ok_http(), "0.25.1", "rc-0", false, false, "i-0"};
  p.digest = none;
  EXPECT_NE(explain_bootstrap_refusal(BootstrapRequested{"rc-0", identity('a'), false, true}, p)
                .find("no weight digest"),
            std::string::npos);
}

// A bootstrap held to an expected digest (a fleet member of the same layout recorded it) goes
// READY only on an engine whose digest is exactly that one; catches a joining engine that reports
// the fleet's label over other weights, or computes no digest, being taken as holding them.
TEST(Digest, ExpectedDigestHoldsABootstrapToThoseWeights) {
  BootstrapRequested b{"rc-0", identity('a')};
  b.expected_digest = digest_of("111").combined;
  EngineProbed p{ok_http(), "0.25.1", "rc-0", false, false, "i-0"};
  p.digest = digest_of("112");
  EXPECT_NE(explain_bootstrap_refusal(b, p).find("is not the expected"), std::string::npos);
  p.digest = WeightDigest{};
  p.digest.error = "no extension";
  EXPECT_NE(explain_bootstrap_refusal(b, p).find("no weight digest"), std::string::npos);
  p.digest = digest_of("111");
  EXPECT_EQ(explain_bootstrap_refusal(b, p), "");

  DigestDriver d;
  d.ok(b);
  d.effect(EffectKind::kProbeEngine);
  p.digest = digest_of("112");
  d.ok(p);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kUninitialized) << "other weights are not the fleet's";
  d.effect(EffectKind::kProbeEngine);
  p.digest = digest_of("111");
  d.ok(p);
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.label_digests.at("rc-0"), b.expected_digest);

  State fresh;
  BootstrapRequested bad = b;
  bad.expected_digest = "not hex";
  EXPECT_EQ(rc::apply(fresh, Event{bad}).code(), Code::kInvalidArgument);
}

// A re-verification probe in READY that finds other weights (same process, same label) taints
// with weights_changed; catches an update made outside RolloutCore going unnoticed.
TEST(Digest, ProbeInReadyThatFindsOtherWeightsTaints) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  d.ok(RecoveryStarted{"exec-2"});
  d.effect(EffectKind::kProbeEngine);
  EngineProbed p{ok_http(), "0.25.1", "rc-0", false, false, "i-0"};
  p.is_paused_known = true;
  p.engine_instance = d.s.engine_instance;
  p.digest = digest_of("121");
  const auto ev = d.ok(p);
  const StateChanged c = last_change(ev);
  EXPECT_EQ(c.to, Lifecycle::kTainted);
  EXPECT_EQ(c.cause, Cause::kWeightsChanged);
  EXPECT_NE(c.detail.find("1 of 3 tensors differ: b"), std::string::npos) << c.detail;
}

// Malformed digests are refused before they change anything; catches unbounded or unsorted
// tensor lists and non-hex digests entering the journal.
TEST(Digest, MalformedDigestsAreRejected) {
  DigestDriver d;
  d.ok(BootstrapRequested{"rc-0", identity('a')});
  d.effect(EffectKind::kProbeEngine);
  auto probe = [](WeightDigest dg) {
    EngineProbed p{ok_http(), "0.25.1", "rc-0", false, false, "i-0"};
    p.digest = std::move(dg);
    return p;
  };
  WeightDigest unsorted = digest_of("123");
  std::swap(unsorted.tensors[0], unsorted.tensors[1]);
  EXPECT_EQ(d.rejected(probe(unsorted)), Code::kInvalidArgument);
  WeightDigest upper = digest_of("123");
  upper.combined = std::string(32, 'A');
  EXPECT_EQ(d.rejected(probe(upper)), Code::kInvalidArgument);
  WeightDigest too_many = digest_of("123");
  too_many.tensors.clear();
  for (std::size_t i = 0; i <= kTensorDigestsMax; ++i) {
    too_many.tensors.push_back({"t" + std::to_string(100000 + i), std::string(32, '1')});
  }
  EXPECT_EQ(d.rejected(probe(too_many)), Code::kInvalidArgument);
  WeightDigest control = digest_of("123");
  control.tensors[0].name = "a\nb";
  EXPECT_EQ(d.rejected(probe(control)), Code::kInvalidArgument);
}

// Proves that under the current fold rules a re-verification probe that vouches for the process
// (label, instance, unpaused) but read no weight digest leaves the recheck pending, with the
// engine recorded reachable and admissions, updates and sleeps refused, and that the next probe,
// reading the committed digest, clears it; catches a probe whose digest read failed putting
// weights nobody checked back in service.
TEST(Digest, ARecheckNeedsTheCommittedDigest) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  ASSERT_EQ(d.s.fold_rules, kFoldRulesCurrent);
  d.ok(RecoveryStarted{"exec-2"});
  d.effect(EffectKind::kProbeEngine);
  EXPECT_TRUE(d.ok(d.same_engine(unread_digest())).empty()) << "no taint: nothing differs";
  EXPECT_TRUE(d.s.engine_recheck);
  EXPECT_TRUE(d.s.engine_reachable);
  EXPECT_EQ(d.rejected(make_admission(d.s, "x")), Code::kRejected);
  EXPECT_EQ(d.rejected(d.distinct_request("rc-1", 'b')), Code::kRejected);
  EXPECT_EQ(d.rejected(SleepRequested{"s1", 1}), Code::kRejected);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine) << "the probe is tried again";
  d.effect(EffectKind::kProbeEngine);
  EXPECT_TRUE(d.ok(d.same_engine(digest_of("111"))).empty());
  EXPECT_FALSE(d.s.engine_recheck);
  d.admit();
  expect_history_ok(d);
}

// Proves the end of a re-verification whose digest is never read: kEffectAttemptsMax probes, then
// nothing due (no plan stalls, no taint) and admissions refused saying the probes are spent; a
// monitor look without a digest changes nothing, one with the committed digest clears it, and an
// executor restart gives the probes back; catches a probe retried forever, or an engine served
// once the probes ran out.
TEST(Digest, ARecheckWhoseDigestIsNeverReadEndsRefusingAdmissions) {
  DigestDriver d;
  d.bootstrap(digest_of("111"));
  d.ok(RecoveryStarted{"exec-2"});
  for (std::uint32_t i = 0; i < kEffectAttemptsMax; ++i) {
    ASSERT_EQ(next_effect(d.s).kind, EffectKind::kProbeEngine);
    d.effect(EffectKind::kProbeEngine);
    d.ok(d.same_engine(unread_digest()));
  }
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
  EXPECT_EQ(d.rejected(intent(EffectKind::kProbeEngine)), Code::kRejected);
  EXPECT_FALSE(plan_stalled(d.s));
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_NE(admission_block_reason(d.s).find("probes are spent"), std::string::npos)
      << admission_block_reason(d.s);
  EXPECT_EQ(d.rejected(make_admission(d.s, "x")), Code::kRejected);
  {
    DigestDriver restarted = d;
    restarted.ok(RecoveryStarted{"exec-3"});
    EXPECT_EQ(next_effect(restarted.s).kind, EffectKind::kProbeEngine);
  }
  EngineMonitored look{ok_http(),         "rc-0", true, false, d.s.engine_instance, 1000,
                       monitor_epoch(d.s)};
  look.digest = unread_digest();
  EXPECT_FALSE(weights_verified(d.s, look.digest));
  d.ok(look);
  EXPECT_TRUE(d.s.engine_recheck);
  look.digest = digest_of("111");
  EXPECT_TRUE(weights_verified(d.s, look.digest));
  d.ok(look);
  EXPECT_FALSE(d.s.engine_recheck);
  d.admit();
  expect_history_ok(d);
}

// Proves a journal bootstrapped before fold rules were recorded (fold_rules 0, what such a record
// decodes as) folds a digest-less re-verification probe as it always did: the recheck clears and
// the admission after it is legal; and that the same history read under the current rules is
// refused; catches the new rule applied to old journals, which would stop them from refolding.
TEST(Digest, AJournalFromBeforeFoldRulesKeepsItsRecheckRule) {
  DigestDriver d;
  d.bootstrap(digest_of("111"), false, /*fold_rules=*/0);
  ASSERT_EQ(d.s.fold_rules, 0u);
  d.ok(RecoveryStarted{"exec-2"});
  d.effect(EffectKind::kProbeEngine);
  d.ok(d.same_engine(unread_digest()));
  EXPECT_FALSE(d.s.engine_recheck);
  d.admit();
  expect_history_ok(d);

  std::vector<HistoryEntry> current = d.history;
  std::get<BootstrapRequested>(current.front().event).fold_rules = kFoldRulesCurrent;
  const HistoryReport refolded = check_history(current);
  EXPECT_FALSE(refolded.ok) << "under the current rules the recorded admission is refused";
  EXPECT_EQ(refolded.first_bad_seq, d.history.back().seq) << refolded.message;
}

// Proves a bootstrap naming fold rules newer than this build's is refused before it changes
// anything; catches a journal from a newer RolloutCore folded by rules this build does not know.
TEST(Digest, FoldRulesNewerThanThisBuildAreRefused) {
  BootstrapRequested b{"rc-0", identity('a')};
  b.fold_rules = kFoldRulesCurrent + 1;
  State fresh;
  const State before = fresh;
  const Status st = rc::apply(fresh, Event{b});
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("newer"), std::string::npos) << st.message();
  EXPECT_EQ(fresh, before);
}

}  // namespace
}  // namespace rc
