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
  void bootstrap(const WeightDigest& boot, bool require = false) {
    BootstrapRequested b{"rc-0", identity('a')};
    b.require_digest = require;
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

}  // namespace
}  // namespace rc
