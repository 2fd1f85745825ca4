// Unit tests: illegal inputs are refused by decide/step and forged events by apply, and a refusal
// never changes the state.
#include <gtest/gtest.h>

#include <functional>

#include "tests/statemachine/helpers.h"

namespace rc::test {
namespace {

using Walk = std::function<void(Driver&)>;

// Walks to every reachable non-READY state (with and without an effect in flight).
std::vector<std::pair<std::string, Walk>> non_ready_walks() {
  return {
      {"uninitialized", [](Driver&) {}},
      {"uninitialized-bootstrap",
       [](Driver& d) {
         d.ok(BootstrapRequested{"rc-0", identity('a')});
       }},
      {"draining",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
       }},
      {"draining-awaiting",
       [](Driver& d) {
         d.to_ready();
         d.admit();
         d.to_draining();
         d.effect(EffectKind::kDrain);
         d.ok(DrainObserved{ok_http(), true});
       }},
      {"quiesced",
       [](Driver& d) {
         d.to_ready();
         d.to_quiesced();
       }},
      {"updating",
       [](Driver& d) {
         d.to_ready();
         d.to_updating();
       }},
      {"updating-transfer",
       [](Driver& d) {
         d.to_ready();
         d.to_updating();
         d.effect(EffectKind::kTransfer);
       }},
      {"invalidating",
       [](Driver& d) {
         d.to_ready();
         d.to_invalidating();
       }},
      {"validating",
       [](Driver& d) {
         d.to_ready();
         d.to_validating();
       }},
      {"resuming",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       }},
      {"resuming-aborting",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
         d.effect(EffectKind::kDrain);
         d.ok(DrainObserved{http(Transport::kTimeout), false});
       }},
      {"tainted",
       [](Driver& d) {
         d.to_ready();
         d.to_validating();
         d.effect(EffectKind::kValidate);
         d.ok(ValidationObserved{ok_http(), "x", true, ""});
       }},
  };
}

// Admission is refused in every state but READY, even when bound to the committed version;
// catches a rollout that could straddle a weight mutation.
TEST(Illegal, AdmissionOutsideReady) {
  for (auto& [name, walk] : non_ready_walks()) {
    SCOPED_TRACE(name);
    Driver d;
    walk(d);
    ASSERT_NE(d.s.lifecycle, Lifecycle::kReady);
    EXPECT_EQ(d.rejected(make_admission(d.s, "late")), Code::kRejected);
  }
}

// Admission in READY must carry the committed version and identity and a fresh id; catches a
// client binding itself to a version it chose, or a duplicate binding.
TEST(Illegal, AdmissionBoundToCommittedVersionOnly) {
  Driver d;
  d.to_ready();
  RolloutAdmitted a = make_admission(d.s, "r");
  a.version.generation = 1;
  d.rejected(a);
  a = make_admission(d.s, "r");
  a.identity.step = 99;
  d.rejected(a);
  a = make_admission(d.s, "r");
  a.version.label = "rc-9";
  d.rejected(a);
  d.ok(make_admission(d.s, "r"));
  EXPECT_EQ(d.rejected(make_admission(d.s, "r")), Code::kConflict);
}

// An update request while another runs (or before bootstrap) is refused; catches two plans
// mutating the engine at once.
TEST(Illegal, UpdateRequestWhileOneRuns) {
  for (auto& [name, walk] : non_ready_walks()) {
    SCOPED_TRACE(name);
    Driver d;
    walk(d);
    d.rejected(d.update_request("rc-7", 'c'));
  }
}

// Observations need a durable intent for their own effect; catches an effect performed without
// the write-ahead record (undetectable after a crash).
TEST(Illegal, ObservationWithoutIntent) {
  Driver d;
  d.to_ready();
  d.to_quiesced();
  d.rejected(d.good_preflight());
  d.effect(EffectKind::kPreflight);
  d.ok(d.good_preflight());
  ASSERT_EQ(d.s.lifecycle, Lifecycle::kUpdating);
  d.rejected(d.good_transfer());
  d.rejected(DrainObserved{ok_http(), true});
  d.rejected(EngineProbed{ok_http(), "v", "rc-0"});
  d.rejected(CacheResetObserved{CacheKind::kPrefix, ok_http(), true});
  d.rejected(ValidationObserved{ok_http(), "rc-1", true, ""});
  d.rejected(d.good_resume());
  // Observation of another effect than the one in flight.
  d.effect(EffectKind::kTransfer);
  d.rejected(d.good_preflight());
  d.rejected(CacheResetObserved{CacheKind::kPrefix, ok_http(), true});
}

// An intent must be for the effect next_effect() says is due; catches a runner that skips
// ahead (e.g. transfers before preflight) or retries a transfer.
TEST(Illegal, IntentForTheWrongEffect) {
  Driver d;
  d.to_ready();
  for (std::uint8_t k = 0; k <= kEffectKindMax; ++k) d.rejected(intent(static_cast<EffectKind>(k)));
  d.to_quiesced();
  for (EffectKind k : {EffectKind::kNone, EffectKind::kProbeEngine, EffectKind::kDrain,
                       EffectKind::kAwaitRollouts, EffectKind::kTransfer, EffectKind::kResetCache,
                       EffectKind::kValidate, EffectKind::kResume}) {
    d.rejected(intent(k));
  }
  d.rejected(EffectStarted{static_cast<EffectKind>(200), CacheKind::kPrefix, 0});
  d.effect(EffectKind::kPreflight);
  d.ok(d.good_preflight());
  d.effect(EffectKind::kTransfer);
  d.ok(TransferObserved{false, MutationClass::kNone, 0, 0, 1, "", "refused"});
  // Refused: the transfer is not retried from RESUMING.
  d.rejected(intent(EffectKind::kTransfer));
}

// Cache resets go in order and an observation must name the cache in flight; catches a reset of
// one cache credited to another.
TEST(Illegal, WrongCacheKind) {
  Driver d;
  d.to_ready();
  d.to_invalidating();
  d.rejected(intent(EffectKind::kResetCache, CacheKind::kEncoder));
  d.rejected(intent(EffectKind::kResetCache, static_cast<CacheKind>(9)));
  d.effect(EffectKind::kResetCache, CacheKind::kPrefix);
  d.rejected(CacheResetObserved{CacheKind::kEncoder, ok_http(), true});
  d.rejected(CacheResetObserved{static_cast<CacheKind>(7), ok_http(), true});
  d.ok(CacheResetObserved{CacheKind::kPrefix, ok_http(), true});
  EXPECT_EQ(d.s.update->caches_reset_mask, 1);
}

// A second intent while one is in flight is refused; catches two concurrent attempts of one
// effect (or a transfer intent hiding an unobserved one).
TEST(Illegal, DoubleIntent) {
  Driver d;
  d.to_ready();
  d.to_draining();
  d.effect(EffectKind::kDrain);
  d.rejected(intent(EffectKind::kDrain));
  EXPECT_EQ(d.s.attempts, 1u);
}

// Decisions are derived, never submitted; catches a client forging a transition or a publish
// through the input path.
TEST(Illegal, DecisionsSubmittedAsInput) {
  Driver d;
  d.to_ready();
  d.to_resuming_validated();
  const UpdatePlan u = *d.s.update;
  for (const Event& e :
       {Event{StateChanged{Lifecycle::kResuming, Lifecycle::kReady, Cause::kResumed, ""}},
        Event{VersionPublished{u.update_id, u.target, u.identity}},
        Event{UpdateEnded{u.update_id, UpdateOutcome::kCommitted, ""}}}) {
    EXPECT_EQ(d.rejected(e), Code::kInvalidArgument) << describe(e);
  }
}

// Abandonment is recorded by recovery only; catches a client dropping a rollout as "abandoned"
// to hide it from the audit.
TEST(Illegal, AbandonedSubmittedAsInput) {
  Driver d;
  d.to_ready();
  const std::string r = d.admit();
  EXPECT_EQ(d.rejected(RolloutFinished{r, RolloutOutcome::kAbandoned, 0, 0}),
            Code::kInvalidArgument);
  d.rejected(RolloutFinished{r, static_cast<RolloutOutcome>(5), 0, 0});
}

// Finishing an unknown (or already finished) rollout is refused; catches double counting.
TEST(Illegal, FinishOfUnknownRollout) {
  Driver d;
  d.to_ready();
  EXPECT_EQ(d.rejected(RolloutFinished{"ghost", RolloutOutcome::kCompleted, 0, 0}),
            Code::kNotFound);
  const std::string r = d.admit();
  d.ok(RolloutFinished{r, RolloutOutcome::kCompleted, 0, 0});
  d.rejected(RolloutFinished{r, RolloutOutcome::kCompleted, 0, 0});
}

std::vector<std::string> bad_ids() {
  return {"",
          std::string(kIdBytesMax + 1, 'x'),
          std::string("a\x01"
                      "b"),
          "tab\tid",
          "nl\n",
          std::string("del\x7f"),
          std::string("nul\0x", 5)};
}

// Malformed ids, labels and digests are InvalidArgument; catches unbounded or control-byte
// payloads reaching the journal and logs.
TEST(Illegal, InvalidIdsLabelsDigests) {
  {
    Driver d;
    for (const std::string& bad : bad_ids()) {
      EXPECT_EQ(d.rejected(BootstrapRequested{bad, identity('a')}), Code::kInvalidArgument);
    }
    for (const std::string& dig : {std::string(""), std::string(64, 'A'), std::string(64, 'g'),
                                   std::string(kDigestBytesMax + 2, 'a'), std::string("ab cd")}) {
      WeightIdentity id = identity('a');
      id.manifest_digest = dig;
      EXPECT_EQ(d.rejected(BootstrapRequested{"rc-0", id}), Code::kInvalidArgument) << dig;
    }
    WeightIdentity id = identity('a');
    id.content_digest = "XYZ";
    d.rejected(BootstrapRequested{"rc-0", id});
    id = identity('a');
    id.step = -2;
    d.rejected(BootstrapRequested{"rc-0", id});
    id = identity('a');
    id.checkpoint = std::string(kTextBytesMax + 1, 'c');
    d.rejected(BootstrapRequested{"rc-0", id});
    id = identity('a');
    id.run = "run\x02";
    d.rejected(BootstrapRequested{"rc-0", id});
    // The boundary: an id of exactly kIdBytesMax bytes and an empty content digest are fine.
    id = identity('a');
    id.content_digest = "";
    d.ok(BootstrapRequested{std::string(kIdBytesMax, 'l'), id});
  }
  Driver d;
  d.to_ready();
  for (const std::string& bad : bad_ids()) {
    UpdateRequested u = d.update_request("rc-1");
    u.update_id = bad;
    EXPECT_EQ(d.rejected(u), Code::kInvalidArgument);
    u = d.update_request("rc-1");
    u.target_label = bad;
    EXPECT_EQ(d.rejected(u), Code::kInvalidArgument);
    EXPECT_EQ(d.rejected(make_admission(d.s, bad)), Code::kInvalidArgument);
    EXPECT_EQ(d.rejected(RecoveryStarted{bad}), Code::kInvalidArgument);
  }
  UpdateRequested u = d.update_request("rc-1");
  u.source_uri = std::string(kTextBytesMax + 1, 's');
  d.rejected(u);
  u = d.update_request("rc-1");
  u.identity.manifest_digest = "not-hex";
  d.rejected(u);
  // Evidence out of range.
  d.to_draining();
  d.effect(EffectKind::kDrain);
  HttpEvidence h = ok_http();
  h.http_status = 1000;
  d.rejected(DrainObserved{h, true});
  h = ok_http();
  h.transport = static_cast<Transport>(4);
  d.rejected(DrainObserved{h, true});
  h = ok_http();
  h.error = std::string(kTextBytesMax + 1, 'e');
  d.rejected(DrainObserved{h, true});
}

// Proves what a RecoveryStarted records of the journal's open is checked (a torn tail's sentence
// bounded UTF-8, present exactly with a torn_tail ending, as its unread bytes) and changes
// nothing the fold decides; catches an unbounded or ill-formed sentence from outside journaled,
// a torn tail recorded without saying what was torn, and a fold that reads the new fields.
TEST(Illegal, RecoveryStartedRecordsOnlyAWellFormedJournalEnding) {
  Driver d;
  d.to_ready();
  const RecoveryStarted torn{"exec-2", JournalEnding::kTornTail, 9, "torn WAL tail in /j"};
  RecoveryStarted bad = torn;
  bad.journal_torn_tail.clear();
  EXPECT_EQ(d.rejected(bad), Code::kInvalidArgument) << "a torn tail that names nothing";
  bad = torn;
  bad.journal_torn_tail = std::string(kTextBytesMax + 1, 't');
  EXPECT_EQ(d.rejected(bad), Code::kInvalidArgument) << "over kTextBytesMax";
  bad = torn;
  bad.journal_torn_tail = "torn \xff tail";
  EXPECT_EQ(d.rejected(bad), Code::kInvalidArgument) << "not UTF-8";
  bad = RecoveryStarted{"exec-2", JournalEnding::kCrash, 0, "torn WAL tail in /j"};
  EXPECT_EQ(d.rejected(bad), Code::kInvalidArgument) << "a sentence without a torn tail";
  bad = RecoveryStarted{"exec-2", JournalEnding::kCleanClose, 9, ""};
  EXPECT_EQ(d.rejected(bad), Code::kInvalidArgument) << "unread bytes without a torn tail";
  bad = RecoveryStarted{"exec-2", static_cast<JournalEnding>(kJournalEndingMax + 1), 0, ""};
  EXPECT_EQ(d.rejected(bad), Code::kInvalidArgument) << "an ending past the enum";
  // The boundary is accepted, and the fold decides as for a recovery that recorded nothing.
  Driver plain = d;
  RecoveryStarted longest = torn;
  longest.journal_torn_tail = std::string(kTextBytesMax, 't');
  EXPECT_EQ(d.ok(longest), plain.ok(RecoveryStarted{"exec-2"}));
  EXPECT_EQ(d.s, plain.s);
}

// The target label must differ from the committed one; catches an update that validation could
// "confirm" without any change.
TEST(Illegal, TargetLabelEqualToCommitted) {
  Driver d;
  d.to_ready("rc-0");
  EXPECT_EQ(d.rejected(d.update_request("rc-0")), Code::kInvalidArgument);
}

// Forged decisions applied directly are refused and leave the state byte-identical; catches a
// fold that trusts whatever the journal holds.
TEST(Illegal, ForgedDecisionsRefusedByApply) {
  struct Forgery {
    std::string name;
    Walk walk;
    Event event;
  };
  const WeightIdentity idb = identity('b');
  const std::vector<Forgery> forgeries = {
      {"ready->draining without a request", [](Driver& d) { d.to_ready(); },
       StateChanged{Lifecycle::kReady, Lifecycle::kDraining, Cause::kUpdateRequested, ""}},
      {"wrong from",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
       },
       StateChanged{Lifecycle::kQuiesced, Lifecycle::kUpdating, Cause::kPreflightPassed, ""}},
      {"skip to updating",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
       },
       StateChanged{Lifecycle::kDraining, Lifecycle::kUpdating, Cause::kPreflightPassed, ""}},
      {"edge with the wrong cause",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
       },
       StateChanged{Lifecycle::kDraining, Lifecycle::kQuiesced, Cause::kValidated, ""}},
      {"quiesced with bindings",
       [](Driver& d) {
         d.to_ready();
         d.admit();
         d.to_draining();
       },
       StateChanged{Lifecycle::kDraining, Lifecycle::kQuiesced, Cause::kDrained, ""}},
      {"transition with effect in flight",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
         d.effect(EffectKind::kDrain);
       },
       StateChanged{Lifecycle::kDraining, Lifecycle::kQuiesced, Cause::kDrained, ""}},
      {"validating before resets",
       [](Driver& d) {
         d.to_ready();
         d.to_invalidating();
       },
       StateChanged{Lifecycle::kInvalidating, Lifecycle::kValidating, Cause::kCachesReset, ""}},
      {"invalidating without transfer intent",
       [](Driver& d) {
         d.to_ready();
         d.to_updating();
       },
       StateChanged{Lifecycle::kUpdating, Lifecycle::kInvalidating, Cause::kTransferred, ""}},
      {"refusal while the transfer is in flight",
       [](Driver& d) {
         d.to_ready();
         d.to_updating();
         d.effect(EffectKind::kTransfer);
       },
       StateChanged{Lifecycle::kUpdating, Lifecycle::kResuming, Cause::kTransferRefused, ""}},
      {"leave tainted",
       [](Driver& d) {
         d.to_ready();
         d.to_updating();
         d.effect(EffectKind::kTransfer);
         d.ok(RecoveryStarted{"x"});
       },
       StateChanged{Lifecycle::kTainted, Lifecycle::kReady, Cause::kResumed, ""}},
      {"ready twice", [](Driver& d) { d.to_ready(); },
       StateChanged{Lifecycle::kUninitialized, Lifecycle::kReady, Cause::kBootstrapped, ""}},
      {"bootstrap without request", [](Driver&) {},
       StateChanged{Lifecycle::kUninitialized, Lifecycle::kReady, Cause::kBootstrapped, ""}},
      {"lifecycle out of range", [](Driver& d) { d.to_ready(); },
       StateChanged{Lifecycle::kReady, static_cast<Lifecycle>(42), Cause::kUpdateRequested, ""}},
      {"publish in ready", [](Driver& d) { d.to_ready(); },
       VersionPublished{"u", WeightVersion{1, "rc-1"}, idb}},
      {"publish in validating",
       [](Driver& d) {
         d.to_ready();
         d.to_validating();
       },
       VersionPublished{"u-rc-1", WeightVersion{1, "rc-1"}, idb}},
      {"publish while aborting",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
         d.effect(EffectKind::kDrain);
         d.ok(DrainObserved{http(Transport::kTimeout), false});
       },
       VersionPublished{"u-rc-1", WeightVersion{1, "rc-1"}, idb}},
      {"publish other label",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       VersionPublished{"u-rc-1", WeightVersion{1, "rc-9"}, idb}},
      {"publish other identity",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       VersionPublished{"u-rc-1", WeightVersion{1, "rc-1"}, identity('c')}},
      {"publish skipping a generation",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       VersionPublished{"u-rc-1", WeightVersion{2, "rc-1"}, idb}},
      {"publish other update",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       VersionPublished{"u-other", WeightVersion{1, "rc-1"}, idb}},
      {"ready before publish",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       StateChanged{Lifecycle::kResuming, Lifecycle::kReady, Cause::kResumed, ""}},
      {"committed before publish",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       UpdateEnded{"u-rc-1", UpdateOutcome::kCommitted, ""}},
      {"refused while validated",
       [](Driver& d) {
         d.to_ready();
         d.to_resuming_validated();
       },
       UpdateEnded{"u-rc-1", UpdateOutcome::kRefused, ""}},
      {"ended unknown update",
       [](Driver& d) {
         d.to_ready();
         d.to_updating();
       },
       UpdateEnded{"u-other", UpdateOutcome::kTainted, ""}},
      {"tainted outcome outside mutation",
       [](Driver& d) {
         d.to_ready();
         d.to_draining();
       },
       UpdateEnded{"u-rc-1", UpdateOutcome::kTainted, ""}},
  };
  for (const Forgery& f : forgeries) {
    SCOPED_TRACE(f.name);
    Driver d;
    f.walk(d);
    const State before = d.s;
    Status st = apply(d.s, f.event);
    EXPECT_FALSE(st.ok()) << describe(f.event) << " accepted in " << describe(before);
    EXPECT_EQ(d.s, before);
  }
}

// A rejected input never changes the state, for a broad mix of inputs in every state; catches
// an apply handler that mutates before it validates.
TEST(Illegal, RejectionLeavesStateUnchanged) {
  const std::vector<Event> junk = {
      BootstrapRequested{"rc-0", identity('a')},
      UpdateRequested{"u", "rc-0", identity('b'), ""},
      DrainTimedOut{1, 1},
      EngineProbed{ok_http(), "v", "rc-0"},
      TransferObserved{true, static_cast<MutationClass>(9), 0, 0, 0, "", ""},
      RolloutFinished{"nobody", RolloutOutcome::kCompleted, 0, 0},
      EffectStarted{EffectKind::kAwaitRollouts, CacheKind::kPrefix, 0},
  };
  for (auto& [name, walk] : non_ready_walks()) {
    SCOPED_TRACE(name);
    Driver d;
    walk(d);
    for (const Event& e : junk) {
      const State before = d.s;
      Result<std::vector<Event>> r = step(d.s, e);
      if (!r.ok()) {
        EXPECT_EQ(d.s, before) << describe(e);
      } else {
        d = Driver{};  // accepted (e.g. bootstrap in UNINITIALIZED): restart the walk
        walk(d);
      }
    }
  }
}

}  // namespace
}  // namespace rc::test
