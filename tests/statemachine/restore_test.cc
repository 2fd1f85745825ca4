// Restore with proof: a TAINTED engine goes back to a version committed earlier in the same
// journal only when its weight digest equals the one recorded for that version; anything that
// fails before the weights may have changed leaves it TAINTED, never serving.
#include <gtest/gtest.h>

#include "tests/statemachine/helpers.h"

namespace rc {
namespace {

using namespace rc::test;

struct RestoreDriver : Driver {
  // READY on rc-1 (digest 222) after a bootstrap on rc-0 (digest 111).
  void to_committed_rc1() {
    ok(BootstrapRequested{"rc-0", identity('a')});
    effect(EffectKind::kProbeEngine);
    EngineProbed p{ok_http(), "0.25.1", "rc-0"};
    p.engine_instance = "i-1";
    p.digest = digest_of("111");
    ok(p);
    to_validating("rc-1");
    validate("rc-1", digest_of("222"));
    resume();
    ASSERT_EQ(s.lifecycle, Lifecycle::kReady);
  }
  // An update to rc-2 whose transfer ends ambiguously: TAINTED.
  void taint_by_transfer() {
    to_updating("rc-2");
    effect(EffectKind::kTransfer);
    ok(TransferObserved{false, MutationClass::kPossible, 1 << 19, 5, 100, "", "broken"});
    ASSERT_EQ(s.lifecycle, Lifecycle::kTainted);
  }
  std::vector<Event> validate(const std::string& label, const WeightDigest& seen,
                              const std::string& instance = "i-1") {
    effect(EffectKind::kValidate);
    ValidationObserved v{ok_http(), label, true, ""};
    v.is_paused_known = true;  // read while paused
    v.digest = seen;
    v.engine_instance = instance;
    return ok(v);
  }
  RestoreRequested restore(const std::string& label, const std::string& source) const {
    return RestoreRequested{"restore-1", label, source, source.empty()};
  }
  // From TAINTED through drain and preflight to UPDATING.
  void restore_to_updating(const RestoreRequested& r) {
    ok(r);
    ASSERT_EQ(s.lifecycle, Lifecycle::kDraining);
    effect(EffectKind::kDrain);
    ok(DrainObserved{ok_http(), true});
    effect(EffectKind::kPreflight);
    PreflightObserved pre = good_preflight();
    if (r.adopt) pre.source_manifest_digest.clear();
    ok(pre);
    ASSERT_EQ(s.lifecycle, Lifecycle::kUpdating);
  }
  void restore_to_validating(const RestoreRequested& r) {
    restore_to_updating(r);
    effect(EffectKind::kTransfer);
    TransferObserved t = good_transfer();
    if (r.adopt) t.bytes_sent = t.tensors_sent = 0;
    ok(t);
    for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
      reset_cache(c);
    }
    ASSERT_EQ(s.lifecycle, Lifecycle::kValidating);
  }
};

void expect_history_ok(const Driver& d) {
  HistoryReport r = check_history(d.history);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.state, d.s) << "the checker's fold differs from the live state";
}

template <class T>
const T* last_of(const std::vector<HistoryEntry>& history) {
  const T* out = nullptr;
  for (const HistoryEntry& h : history) {
    if (const auto* e = std::get_if<T>(&h.event)) out = e;
  }
  return out;
}

// The whole path: ambiguous transfer -> TAINTED -> restore to the committed version from its
// source -> digest equals the recorded one -> READY on a new generation of that label, untainted,
// with the incident, the restore and the proof in one history; catches a restore that publishes
// without the recorded digest or leaves the taint record behind.
TEST(Restore, ProvenRestoreReturnsToReadyOnTheRecordedVersion) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.taint_by_transfer();
  d.restore_to_validating(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
  d.validate("rc-1", digest_of("222"));
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kResuming);
  d.resume();
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed, (WeightVersion{2, "rc-1"}));
  EXPECT_EQ(d.s.committed_digest, digest_of("222"));
  EXPECT_FALSE(d.s.taint.has_value());
  EXPECT_EQ(d.s.counters.restores_requested, 1u);
  EXPECT_EQ(d.s.counters.restores_committed, 1u);
  EXPECT_EQ(d.s.counters.updates_committed, 1u);
  const auto* published = last_of<VersionPublished>(d.history);
  ASSERT_NE(published, nullptr);
  EXPECT_EQ(published->engine_digest, digest_of("222").combined);
  EXPECT_EQ(published->update_id, "restore-1");
  EXPECT_TRUE(admits(d.s));
  expect_history_ok(d);
}

// A restore to an older version than the committed one is proven against that version's digest;
// catches comparing with the committed (pre-taint) digest instead.
TEST(Restore, OlderVersionIsProvenAgainstItsOwnDigest) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.taint_by_transfer();
  d.restore_to_validating(d.restore("rc-0", "safetensors:/ckpt/rc-0"));
  d.validate("rc-0", digest_of("111"));
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.committed.label, "rc-0");
  expect_history_ok(d);
}

// A wrong source reloads other weights: the digest differs, the engine stays TAINTED and the
// detail names the tensors that differ; catches a restore published on its label alone.
TEST(Restore, DigestMismatchStaysTaintedNamingTensors) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.taint_by_transfer();
  d.restore_to_validating(d.restore("rc-1", "safetensors:/ckpt/wrong"));
  const std::vector<Event> ev = d.validate("rc-1", digest_of("2f2"));
  const StateChanged c = last_change(ev);
  EXPECT_EQ(c.to, Lifecycle::kTainted);
  EXPECT_EQ(c.cause, Cause::kValidationFailed);
  EXPECT_NE(c.detail.find("recorded when 'rc-1' was served"), std::string::npos) << c.detail;
  EXPECT_NE(c.detail.find("1 of 3 tensors differ: b"), std::string::npos) << c.detail;
  ASSERT_TRUE(d.s.taint.has_value());
  EXPECT_EQ(d.s.taint->update_id, "restore-1");
  EXPECT_EQ(d.s.committed.label, "rc-1");
  EXPECT_EQ(d.s.counters.restores_committed, 0u);
  expect_history_ok(d);
}

// A restore refused before the weights may have changed (wrong manifest at preflight, transfer
// refused with nothing sent, drain failed) returns to TAINTED and never resumes the engine;
// catches the update path's "refused -> resume the old version", which would serve the suspect
// weights.
TEST(Restore, RefusedBeforeMutationReturnsToTainted) {
  {
    RestoreDriver d;
    d.to_committed_rc1();
    d.taint_by_transfer();
    d.ok(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
    d.effect(EffectKind::kDrain);
    d.ok(DrainObserved{ok_http(), true});
    d.effect(EffectKind::kPreflight);
    const auto ev = d.ok(PreflightObserved{hex('f'), true, true, ""});
    EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
    EXPECT_EQ(last_change(ev).cause, Cause::kPreflightRefused);
    ASSERT_EQ(count_of<UpdateEnded>(ev), 1);
    EXPECT_EQ(std::get<UpdateEnded>(ev.front()).outcome, UpdateOutcome::kRefused);
    EXPECT_EQ(next_effect(d.s).kind, EffectKind::kNone);
    expect_history_ok(d);
  }
  {
    RestoreDriver d;
    d.to_committed_rc1();
    d.taint_by_transfer();
    d.restore_to_updating(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
    d.effect(EffectKind::kTransfer);
    const auto ev =
        d.ok(TransferObserved{false, MutationClass::kNone, 0, 0, 10, "", "connection refused"});
    EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
    EXPECT_EQ(last_change(ev).cause, Cause::kTransferRefused);
    expect_history_ok(d);
  }
  {
    RestoreDriver d;
    d.to_committed_rc1();
    d.taint_by_transfer();
    d.ok(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
    d.effect(EffectKind::kDrain);
    const auto ev = d.ok(DrainObserved{http(Transport::kTimeout), false});
    EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
    EXPECT_EQ(last_change(ev).cause, Cause::kDrainFailed);
    expect_history_ok(d);
  }
}

// A reload that fails ambiguously taints again under the restore's id; a second restore may
// follow; catches a restore that can only be tried once.
TEST(Restore, AmbiguousReloadTaintsAgainAndCanBeRetried) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.taint_by_transfer();
  d.restore_to_updating(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
  d.effect(EffectKind::kTransfer);
  d.ok(TransferObserved{false, MutationClass::kPossible, 100, 1, 10, "", "500"});
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(d.s.taint->cause, Cause::kTransferAmbiguous);
  EXPECT_EQ(d.s.taint->update_id, "restore-1");
  RestoreRequested again = d.restore("rc-1", "safetensors:/ckpt/rc-1");
  again.restore_id = "restore-2";
  d.restore_to_validating(again);
  d.validate("rc-1", digest_of("222"));
  d.resume();
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.counters.restores_requested, 2u);
  expect_history_ok(d);
}

// An engine restarted outside RolloutCore (the monitor saw another instance: TAINTED) is
// re-adopted without a transfer: labelled, caches reset, and published only because its digest
// equals the recorded one; the new instance is the verified one afterwards. Catches an adoption
// refused because the process changed, or one taken on the label alone.
TEST(Restore, AdoptsARestartedEngineOnItsDigest) {
  RestoreDriver d;
  d.to_committed_rc1();
  EngineMonitored m{ok_http(), "default", true, false, "i-2", 1, monitor_epoch(d.s)};
  d.ok(m);
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  ASSERT_EQ(d.s.taint->cause, Cause::kEngineReplaced);
  d.restore_to_validating(d.restore("rc-1", ""));
  d.validate("rc-1", digest_of("222"), "i-2");
  d.resume();
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(d.s.engine_instance, "i-2");
  // The monitor's view from before the restore is stale now.
  EngineMonitored stale{ok_http(), "rc-1", true, false, "i-9", 1, m.updates_seen};
  EXPECT_EQ(d.rejected(stale), Code::kRejected);
  expect_history_ok(d);
}

// Adopting an engine that holds other weights is refused by its digest; catches adopt being a
// way around the proof.
TEST(Restore, AdoptWithOtherWeightsStaysTainted) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.ok(EngineMonitored{ok_http(), "default", true, false, "i-2", 1, monitor_epoch(d.s)});
  d.restore_to_validating(d.restore("rc-1", ""));
  const auto ev = d.validate("rc-1", digest_of("999"), "i-2");
  EXPECT_EQ(last_change(ev).to, Lifecycle::kTainted);
  expect_history_ok(d);
}

// Rollouts still bound when an engine taint struck are waited for before the restore mutates;
// catches a restore that reloads under a live rollout.
TEST(Restore, WaitsForRolloutsBoundBeforeTheTaint) {
  RestoreDriver d;
  d.to_committed_rc1();
  const std::string r = d.admit();
  d.ok(EngineMonitored{ok_http(), "rc-1", true, true, "i-1", 1, monitor_epoch(d.s)});
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kTainted);
  d.ok(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kDraining);
  EXPECT_EQ(next_effect(d.s).kind, EffectKind::kAwaitRollouts);
  d.ok(RolloutFinished{r, RolloutOutcome::kAborted, 0, 0});
  d.effect(EffectKind::kDrain);
  d.ok(DrainObserved{ok_http(), true});
  EXPECT_EQ(d.s.lifecycle, Lifecycle::kQuiesced);
  expect_history_ok(d);
}

// Bad restore requests are refused and change nothing: outside TAINTED, a label never committed,
// a label without a recorded digest, adopt with a source, neither source nor adopt, bad ids.
TEST(Restore, BadRequestsChangeNothing) {
  RestoreDriver d;
  d.to_committed_rc1();
  EXPECT_EQ(d.rejected(d.restore("rc-0", "safetensors:/x")), Code::kRejected);  // READY
  d.taint_by_transfer();
  EXPECT_EQ(d.rejected(d.restore("rc-7", "safetensors:/x")), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(RestoreRequested{"r", "rc-1", "safetensors:/x", true}),
            Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(RestoreRequested{"r", "rc-1", "", false}), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(RestoreRequested{"", "rc-1", "safetensors:/x", false}),
            Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(RestoreRequested{"r", "rc-1", "a\nb", false}), Code::kInvalidArgument);

  Driver nodigest;  // bootstrapped on an engine that computes no digest
  nodigest.to_ready();
  nodigest.to_updating("rc-1");
  nodigest.effect(EffectKind::kTransfer);
  nodigest.ok(TransferObserved{false, MutationClass::kPossible, 1, 1, 1, "", "x"});
  ASSERT_EQ(nodigest.s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(nodigest.rejected(RestoreRequested{"r", "rc-0", "safetensors:/x", false}),
            Code::kRejected);
}

// Forged histories around restores are refused by the fold: leaving TAINTED without a restore
// request, a refused restore resuming the engine, an update's refusal going to TAINTED, and a
// restore publishing another digest; catches edges legal only in a restore leaking into updates.
TEST(Restore, ForgedEdgesAreRefused) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.taint_by_transfer();
  EXPECT_FALSE(apply(d.s, StateChanged{Lifecycle::kTainted, Lifecycle::kDraining,
                                       Cause::kRestoreRequested, ""})
                   .ok());
  {
    State s = d.s;
    ASSERT_TRUE(step(s, d.restore("rc-1", "safetensors:/ckpt/rc-1")).ok());
    EXPECT_FALSE(
        apply(s, StateChanged{Lifecycle::kDraining, Lifecycle::kResuming, Cause::kDrainFailed, ""})
            .ok());
  }
  {
    RestoreDriver u;
    u.to_committed_rc1();
    u.to_draining("rc-2");
    EXPECT_FALSE(
        apply(u.s, StateChanged{Lifecycle::kDraining, Lifecycle::kTainted, Cause::kDrainFailed, ""})
            .ok());
  }
  {
    RestoreDriver r;
    r.to_committed_rc1();
    r.taint_by_transfer();
    r.restore_to_validating(r.restore("rc-1", "safetensors:/ckpt/rc-1"));
    r.validate("rc-1", digest_of("222"));
    EXPECT_FALSE(apply(r.s, VersionPublished{"restore-1", r.s.update->target, r.s.update->identity,
                                             digest_of("333").combined})
                     .ok());
  }
}

// The history checker refuses a restore whose journal claims another digest at validation and
// publish than the one the label was served with; catches a journal edited to pass off other
// weights as the restored version.
TEST(Restore, HistoryCheckerRefusesAForgedRestoreDigest) {
  RestoreDriver d;
  d.to_committed_rc1();
  d.taint_by_transfer();
  d.restore_to_validating(d.restore("rc-1", "safetensors:/ckpt/rc-1"));
  d.validate("rc-1", digest_of("222"));
  d.resume();
  std::vector<HistoryEntry> forged = d.history;
  const std::string other = digest_of("333").combined;
  bool in_restore = false;
  for (HistoryEntry& h : forged) {
    if (std::holds_alternative<RestoreRequested>(h.event)) in_restore = true;
    if (auto* v = std::get_if<ValidationObserved>(&h.event); v && in_restore) {
      v->digest = digest_of("333");
    }
    if (auto* p = std::get_if<VersionPublished>(&h.event); p && in_restore) {
      p->engine_digest = other;
    }
  }
  HistoryReport r = check_history(forged);
  EXPECT_FALSE(r.ok);
  EXPECT_GT(r.first_bad_seq, 0u);
  EXPECT_EQ(r.state.committed.generation, 1u) << "the forged restore must not be folded";
}

}  // namespace
}  // namespace rc
