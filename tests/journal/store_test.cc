// RocksDB journal unit tests on real on-disk databases (temp dirs): appends, expected-seq and
// idempotency semantics, refusal of illegal groups, the single-writer lock, secondary readers,
// the rollout index, snapshots, group commit under concurrency, checkpoints.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "journal/codec.h"
#include "journal/journal.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"

namespace rc::journal {
namespace {

using testing::BootstrapGroups;
using testing::Group;
using testing::TempDir;

std::unique_ptr<Journal> OpenOk(const std::string& path, Options options = {}) {
  Result<std::unique_ptr<Journal>> j = Journal::Open(path, options);
  RC_CHECK(j.ok() || (std::fprintf(stderr, "%s\n", j.status().ToString().c_str()), false));
  return std::move(j.value());
}

void Bootstrap(Journal& j) {
  for (auto& g : BootstrapGroups()) ASSERT_TRUE(j.Append(Group(g)).ok());
}

// Proves appended groups get dense seqs, cause_seq links and a verified hash chain; catches
// seq gaps, a wrong cause_seq or a chain that is not over the stored bytes.
TEST(Store, AppendsReadsAndScansWithChain) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  EXPECT_EQ(j->head_seq(), 4u);
  EXPECT_EQ(j->state().lifecycle, Lifecycle::kReady);
  Result<Record> r4 = j->Read(4);
  ASSERT_TRUE(r4.ok());
  EXPECT_EQ(r4->cause_seq, 3u);
  EXPECT_TRUE(std::holds_alternative<StateChanged>(r4->event));
  std::vector<std::uint64_t> seqs;
  Hash prev{};
  ASSERT_TRUE(j->Scan(0, 0, [&](const Record& r) {
                 EXPECT_EQ(r.prev_hash, prev);
                 prev = r.hash;
                 seqs.push_back(r.seq);
                 return Status::OK();
               }).ok());
  EXPECT_EQ(seqs, (std::vector<std::uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(prev, j->head_hash());
  EXPECT_EQ(j->Read(5).status().code(), Code::kNotFound);
}

// Proves durable_seq() counts only groups whose group commit returned, while head_seq() counts
// enqueued ones too; catches a durability gauge (rolloutcore_journal_head_seq) that reports groups
// a crash could still take back.
TEST(Store, DurableSeqLagsTheHeadUntilTheCommit) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  EXPECT_EQ(j->durable_seq(), 4u);
  Result<Ticket> t = j->Enqueue(Group({make_admission(j->state(), "r1")}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(j->head_seq(), 5u);
  EXPECT_EQ(j->durable_seq(), 4u) << "a group no Wait asked for was counted durable";
  ASSERT_TRUE(j->Wait(*t).ok());
  EXPECT_EQ(j->durable_seq(), 5u);
}

// Proves a stale expected head is a Conflict naming both seqs and writes nothing; catches
// lost-update races between controllers.
TEST(Store, ExpectedSeqConflict) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  AppendRequest req = Group({make_admission(j->state(), "r1")});
  req.expected_head_seq = 2;
  Result<AppendResult> r = j->Append(req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kConflict);
  EXPECT_NE(r.status().message().find("expected head seq 2 but the head is 4"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(j->head_seq(), 4u);
  req.expected_head_seq = 4;
  ASSERT_TRUE(j->Append(req).ok());
  EXPECT_EQ(j->head_seq(), 5u);
}

// Proves a retried key with the same events returns the original seqs without writing (even
// with a stale expected head) and a reused key with other events is a Conflict; catches double
// admissions on client retries.
TEST(Store, IdempotentDuplicateAndConflictingDuplicate) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  AppendRequest req = Group({make_admission(j->state(), "r1")}, "client-7");
  req.expected_head_seq = 4;
  Result<AppendResult> first = j->Append(req);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first->duplicate);
  ASSERT_TRUE(j->Append(Group({make_admission(j->state(), "r2")})).ok());
  Result<AppendResult> again = j->Append(req);  // expected head 4 is stale now
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(again->first_seq, first->first_seq);
  EXPECT_EQ(again->last_seq, first->last_seq);
  EXPECT_EQ(j->head_seq(), 6u);
  Result<AppendResult> other = j->Append(Group({make_admission(j->state(), "r3")}, "client-7"));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), Code::kConflict);
  EXPECT_NE(other.status().message().find("client-7"), std::string::npos);
  // The key survives a reopen.
  j.reset();
  j = OpenOk(dir.path());
  Result<AppendResult> after = j->Append(req);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->duplicate);
  EXPECT_EQ(j->head_seq(), 6u);
}

// Proves KeyHeld answers whether a key was used (pending its group commit, durable, and after a
// reopen) and writes nothing; catches a lookup that misses a pending key (a retry then looked at
// the engine before its recorded answer) or one that reports unused keys as held.
TEST(Store, KeyHeldSeesPendingAndDurableKeysAndWritesNothing) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  Result<bool> before = j->KeyHeld("client-7");
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  EXPECT_FALSE(*before);
  Result<Ticket> t = j->Enqueue(Group({make_admission(j->state(), "r1")}, "client-7"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  Result<bool> pending = j->KeyHeld("client-7");
  ASSERT_TRUE(pending.ok());
  EXPECT_TRUE(*pending) << "a key pending its group commit was not seen";
  ASSERT_TRUE(j->Wait(*t).ok());
  EXPECT_TRUE(*j->KeyHeld("client-7"));
  EXPECT_FALSE(*j->KeyHeld("client-8"));
  EXPECT_EQ(j->KeyHeld("").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(j->KeyHeld(std::string(4096, 'k')).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(j->head_seq(), 5u);
  j.reset();
  j = OpenOk(dir.path());
  EXPECT_TRUE(*j->KeyHeld("client-7"));
  EXPECT_EQ(j->head_seq(), 5u);
}

// Proves illegal groups and groups whose decisions differ from decide() are refused whole with
// nothing written or folded; catches a forged history entering the journal.
TEST(Store, IllegalGroupRefusedAndNothingWritten) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  const State before = j->state();
  Result<AppendResult> r = j->Append(Group({RolloutAdmitted{"r1", {}, testing::SampleIdentity()}}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kRejected);
  Bootstrap(*j);
  const State ready = j->state();
  // An update request without its DRAINING decision.
  Result<AppendResult> bad =
      j->Append(Group({UpdateRequested{"u1", "rc-1", testing::SampleIdentity(), "x"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("not its decisions"), std::string::npos);
  // A decision submitted as input.
  Result<AppendResult> dec = j->Append(
      Group({StateChanged{Lifecycle::kReady, Lifecycle::kDraining, Cause::kUpdateRequested, ""}}));
  EXPECT_EQ(dec.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(j->head_seq(), 4u);
  EXPECT_EQ(j->state(), ready);
  j.reset();
  j = OpenOk(dir.path());
  EXPECT_EQ(j->head_seq(), 4u);
  EXPECT_EQ(j->state(), ready);
  EXPECT_NE(before, ready);
}

// Proves Submit derives and journals the decisions atomically and returns them; catches a
// controller acting on decisions that were never journaled.
TEST(Store, SubmitJournalsDecisions) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  Result<Journal::Submitted> s =
      j->Submit(UpdateRequested{"u1", "rc-1", testing::SampleIdentity(), "x"}, 1, "upd-1");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(j->Wait(s->ticket).ok());
  ASSERT_EQ(s->decisions.size(), 1u);
  EXPECT_EQ(std::get<StateChanged>(s->decisions[0]).to, Lifecycle::kDraining);
  EXPECT_EQ(j->state().lifecycle, Lifecycle::kDraining);
  EXPECT_EQ(s->ticket.result.first_seq, 5u);
  EXPECT_EQ(s->ticket.result.last_seq, 6u);
  // A retry of the same submission is a duplicate with the recorded decisions.
  Result<Journal::Submitted> again =
      j->Submit(UpdateRequested{"u1", "rc-1", testing::SampleIdentity(), "x"}, 2, "upd-1");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->ticket.result.duplicate);
  EXPECT_EQ(again->decisions, s->decisions);
  EXPECT_EQ(j->head_seq(), 6u);
  Result<Journal::Submitted> rejected = j->Submit(make_admission(j->state(), "r9"), 3);
  EXPECT_EQ(rejected.status().code(), Code::kRejected);
}

// Proves SubmitFleetIf checks its precondition on the state the submit decides on, and that a
// refused precondition writes nothing; catches a check-then-submit race (a caller's check made
// outside the journal's lock, which another submit can invalidate before the write).
TEST(Store, APreconditionIsCheckedWithTheSubmit) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  Result<Journal::Submitted> admitted = j->Submit(make_admission(j->state(), "r1"), 1);
  ASSERT_TRUE(admitted.ok()) << admitted.status().ToString();
  const std::uint64_t head = j->head_seq();
  const FleetEvent finish{"", RolloutFinished{"r1", RolloutOutcome::kCompleted, 1, 1}};
  std::size_t seen_active = 0;
  auto refuse = [&](const FleetState& f) {
    seen_active = engine_state(f, "").active.size();
    return Status::Conflict("not this one");
  };
  Result<Journal::FleetSubmitted> refused = j->SubmitFleetIf(finish, 2, refuse);
  EXPECT_EQ(refused.status().code(), Code::kConflict);
  EXPECT_EQ(seen_active, 1u) << "the precondition did not see the admission";
  EXPECT_EQ(j->head_seq(), head);
  EXPECT_EQ(j->state().active.count("r1"), 1u);
  Result<Journal::FleetSubmitted> done =
      j->SubmitFleetIf(finish, 3, [](const FleetState&) { return Status::OK(); });
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  ASSERT_TRUE(j->Wait(done->ticket).ok());
  EXPECT_TRUE(j->state().active.empty());
}

// Proves the fold speaks first when the group-commit queue is full: an input the fold refuses is
// answered Rejected (nothing was journaled, a caller may say so), a binding it would accept Busy,
// and the journal is unchanged by both, while a finish and the executor's own inputs still find
// room (their reserves, and no more); catches admissions starving a finish (serve fail-stops on
// one it cannot make durable), a full queue turning a plain refusal into an unknown
// outcome (which makes serve fail-stop), and clients' admissions crowding out an effect's intent or
// observation (an effect performed without its observation goes TAINTED at the next recovery).
TEST(Store, AFullQueueDoesNotHideTheFoldsRefusal) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  // Nobody waits, so nothing commits: each admission stays pending.
  std::uint64_t n = 0;
  while (true) {
    Result<Journal::Submitted> s =
        j->Submit(make_admission(j->state(), "r" + std::to_string(n)), 1);
    if (!s.ok()) {
      ASSERT_EQ(s.status().code(), Code::kBusy) << s.status().ToString();
      break;
    }
    ASSERT_LT(++n, kPendingAppendsMax + 1);
  }
  EXPECT_EQ(n, kPendingAppendsMax);
  const std::uint64_t head = j->head_seq();
  Result<Journal::Submitted> refused =
      j->Submit(BootstrapRequested{"rc-9", testing::SampleIdentity()}, 2);  // READY: refused
  EXPECT_EQ(refused.status().code(), Code::kRejected) << refused.status().ToString();
  Result<Journal::Submitted> busy = j->Submit(make_admission(j->state(), "late"), 3);
  EXPECT_EQ(busy.status().code(), Code::kBusy) << busy.status().ToString();
  EXPECT_EQ(j->head_seq(), head);
  EXPECT_EQ(j->state().lifecycle, Lifecycle::kReady);
  // A finish still finds room: admissions never take the finishes' reserve.
  Result<Journal::Submitted> finish =
      j->Submit(RolloutFinished{"r0", RolloutOutcome::kCompleted, 1, 1}, 3);
  ASSERT_TRUE(finish.ok()) << finish.status().ToString();
  // The executor's inputs (here the monitor's) take their reserve, and no more.
  const State ready = j->state();
  EngineMonitored seen{HttpEvidence{Transport::kOk, 200, true, 10, ""},
                       ready.committed.label,
                       true,
                       false,
                       ready.engine_instance,
                       0,
                       monitor_epoch(ready)};
  std::size_t control = 0;
  while (j->Submit(seen, 3).ok()) ASSERT_LE(++control, 2 * kControlGroupsReserve);
  EXPECT_EQ(control, 2 * kControlGroupsReserve - 1);  // the finish took one
  EXPECT_EQ(j->head_seq(), head + 2 * kControlGroupsReserve);
  Result<Journal::Submitted> full =
      j->Submit(UpdateRequested{"u1", "rc-1", testing::SampleIdentity(), "x"}, 3);
  EXPECT_EQ(full.status().code(), Code::kBusy) << full.status().ToString();
  EXPECT_EQ(j->state().lifecycle, Lifecycle::kReady);
}

// Proves a second opener of a live journal gets Busy naming the LOCK file; catches two writers
// interleaving seqs in one journal.
TEST(Store, SecondOpenerIsBusy) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Result<std::unique_ptr<Journal>> second = Journal::Open(dir.path(), Options{});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kBusy);
  EXPECT_NE(second.status().message().find(
                "journal already open by another process: " + dir.path() + "/LOCK"),
            std::string::npos)
      << second.status().message();
}

// Proves a secondary reader sees a live writer's new events after CatchUp and folds them to the
// writer's state; catches `replay` reading a stale or inconsistent view.
TEST(Store, SecondaryReaderCatchesUpWithLiveWriter) {
  TempDir dir;
  auto writer = OpenOk(dir.path());
  Bootstrap(*writer);
  Options ro;
  ro.read_only = true;
  ro.secondary_path = dir.sub("secondary");
  auto reader = OpenOk(dir.path(), ro);
  EXPECT_EQ(reader->head_seq(), 4u);
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(
        writer->Append(Group({make_admission(writer->state(), "r" + std::to_string(i))})).ok());
  }
  EXPECT_EQ(reader->head_seq(), 4u);
  ASSERT_TRUE(reader->CatchUp().ok());
  EXPECT_EQ(reader->head_seq(), 24u);
  EXPECT_EQ(reader->state(), writer->state());
  EXPECT_EQ(reader->head_hash(), writer->head_hash());
  EXPECT_EQ(reader->Enqueue(Group({make_admission(reader->state(), "x")})).status().code(),
            Code::kInvalidArgument);
}

// Proves RolloutSeqs lists exactly one rollout's admission and finish in order, not those of a
// rollout whose id it prefixes; catches a prefix-scan bug in the index key.
TEST(Store, RolloutSeqs) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  Bootstrap(*j);
  ASSERT_TRUE(j->Append(Group({make_admission(j->state(), "r1")})).ok());   // 5
  ASSERT_TRUE(j->Append(Group({make_admission(j->state(), "r10")})).ok());  // 6
  ASSERT_TRUE(
      j->Append(Group({RolloutFinished{"r1", RolloutOutcome::kCompleted, 1, 2}})).ok());  // 7
  EXPECT_EQ(*j->RolloutSeqs("r1"), (std::vector<std::uint64_t>{5, 7}));
  EXPECT_EQ(*j->RolloutSeqs("r10"), (std::vector<std::uint64_t>{6}));
  EXPECT_TRUE(j->RolloutSeqs("r2")->empty());
}

// Proves concurrent appenders through group commit get unique contiguous seqs and a valid
// chain, and reopen reproduces the state; catches races in seq assignment or batch ordering.
TEST(Store, GroupCommitUnderConcurrency) {
  TempDir dir;
  Options o;
  o.snapshot_every = 50;
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  constexpr int kThreads = 8, kPerThread = 60;
  std::vector<std::thread> threads;
  std::vector<std::vector<std::uint64_t>> got(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::string id = "t" + std::to_string(t) + "-" + std::to_string(i);
        Result<Journal::Submitted> s = j->Submit(make_admission(j->state(), id), i);
        RC_CHECK(s.ok());
        RC_CHECK(j->Wait(s->ticket).ok());
        got[t].push_back(s->ticket.result.first_seq);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::set<std::uint64_t> all;
  for (auto& v : got) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), static_cast<std::size_t>(kThreads * kPerThread));
  EXPECT_EQ(*all.begin(), 5u);
  EXPECT_EQ(*all.rbegin(), 4u + kThreads * kPerThread);
  const State live = j->state();
  Result<State> refold = j->Refold();
  ASSERT_TRUE(refold.ok()) << refold.status().ToString();
  EXPECT_EQ(*refold, live);
  EXPECT_EQ(*j->LoadState(), live);
  j.reset();
  j = OpenOk(dir.path(), o);
  EXPECT_EQ(j->state(), live);
}

// Proves an explicit snapshot is used by LoadState and that a snapshot for the wrong point is
// refused; catches a snapshot that silently diverges from the fold.
TEST(Store, WriteSnapshotAndCheckpoint) {
  TempDir dir;
  Options o;
  o.snapshot_every = 0;
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  Result<FleetState> at3 = j->RefoldFleet(3);
  ASSERT_TRUE(at3.ok());
  EXPECT_EQ(j->WriteSnapshot(4, *at3).code(), Code::kInvalidArgument);
  ASSERT_TRUE(j->WriteSnapshot(3, *at3).ok());
  EXPECT_EQ(*j->LoadState(), j->state());
  EXPECT_EQ(*j->LoadFleetState(), j->fleet_state());
  ASSERT_TRUE(j->Checkpoint(dir.sub("cp")).ok());
  ASSERT_TRUE(j->Append(Group({make_admission(j->state(), "after")})).ok());
  ASSERT_TRUE(j->VerifyChecksum().ok());
  auto cp = OpenOk(dir.sub("cp"), o);
  EXPECT_EQ(cp->head_seq(), 4u);
  EXPECT_EQ(*cp->Refold(), *j->Refold(4));
}

// Proves a recovery with more proxied rollouts active (1100) than a group held before the bound
// followed the fold commits as one group that abandons every one of them, and that the journal
// reopens with none active; catches the RC_CHECK on the group's size that aborted serve on every
// restart once 1024 proxied rollouts were active at a crash.
TEST(Store, ARecoveryAbandonsMoreRolloutsThanAThousand) {
  constexpr std::size_t kRollouts = 1100;
  TempDir dir;
  {
    Options o;
    o.sync = false;  // the admissions are set-up: one fsync each would only slow the test
    auto j = OpenOk(dir.path(), o);
    Bootstrap(*j);
    for (std::size_t i = 0; i < kRollouts; ++i) {
      auto s = j->Submit(make_admission(j->state(), "r" + std::to_string(i)), 1700000000000);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
    }
    ASSERT_TRUE(j->WaitForHead().ok());
  }
  auto j = OpenOk(dir.path());
  ASSERT_EQ(j->state().active.size(), kRollouts);
  // As effects/runner.cc's BeginRecovery submits it when serve starts again.
  auto recovered = j->Submit(RecoveryStarted{"exec-1"}, 1700000000001);
  ASSERT_TRUE(recovered.ok()) << recovered.status().ToString();
  ASSERT_TRUE(j->Wait(recovered->ticket).ok());
  ASSERT_EQ(recovered->decisions.size(), kRollouts);
  for (const Event& d : recovered->decisions) {
    const auto* f = std::get_if<RolloutFinished>(&d);
    ASSERT_NE(f, nullptr) << event_name(d);
    EXPECT_EQ(f->outcome, RolloutOutcome::kAbandoned);
  }
  const std::uint64_t head = 4 + kRollouts + 1 + kRollouts;
  EXPECT_EQ(recovered->ticket.result.last_seq, head);
  EXPECT_TRUE(j->state().active.empty());
  j.reset();
  j = OpenOk(dir.path());
  EXPECT_EQ(j->head_seq(), head);
  EXPECT_TRUE(j->state().active.empty());
  EXPECT_EQ(j->state().counters.rollouts_abandoned, kRollouts);
  EXPECT_EQ(*j->Refold(), j->state());
}

// Proves the largest abandonment (an id and an engine name of kIdBytesMax bytes, every envelope
// field at its largest) encodes under kAbandonRecordBytesMax; catches a record grown past the
// bound that kGroupBytesMax (a recovery's group fits one WriteBatch) rests on.
TEST(Store, TheLargestAbandonmentFitsItsBound) {
  Record r;
  r.seq = r.cause_seq = ~std::uint64_t{0};
  r.wall_time_ms = INT64_MAX;
  r.prev_hash.fill(0xff);
  r.engine = std::string(kIdBytesMax, 'e');
  r.event = RolloutFinished{std::string(kIdBytesMax, 'r'), RolloutOutcome::kAbandoned, UINT32_MAX,
                            UINT32_MAX};
  EXPECT_LT(EncodeRecord(r).size(), kAbandonRecordBytesMax);
}

// Proves an idempotency entry whose seqs are not one durable group (first past last, first 0, or
// last past the head) is Corruption naming the key when the key is retried; catches the entry
// trusted as read, which answered a retry with seqs the journal never gave it, or read (and
// copied under the lock) every record of a range as large as the damage made it.
TEST(Store, AnIdempotencyEntryOfDamagedSeqsIsCorruption) {
  TempDir dir;
  AppendRequest req;
  {
    auto j = OpenOk(dir.path());
    Bootstrap(*j);
    req = Group({make_admission(j->state(), "r1")}, "client-7");
    ASSERT_TRUE(j->Append(req).ok());  // seq 5
    ASSERT_TRUE(j->Append(Group({make_admission(j->state(), "r2")})).ok());
  }
  std::string entry;
  testing::EditRaw(dir.path(), [&](rocksdb::DB& db, const auto& cf) {
    ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[3], "client-7", &entry).ok());
  });
  ASSERT_EQ(entry.size(), 48u);
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> damaged = {
      {6, 5}, {0, 5}, {5, 1ull << 40}};
  for (const auto& [first, last] : damaged) {
    const std::string forged = testing::SeqKey(first) + testing::SeqKey(last) + entry.substr(16);
    testing::EditRaw(dir.path(), [&](rocksdb::DB& db, const auto& cf) {
      ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[3], "client-7", forged).ok());
    });
    auto j = OpenOk(dir.path());
    Result<AppendResult> again = j->Append(req);
    ASSERT_FALSE(again.ok()) << first << ".." << last << " answered seqs " << again->first_seq
                             << ".." << again->last_seq;
    EXPECT_EQ(again.status().code(), Code::kCorruption) << again.status().ToString();
    EXPECT_NE(again.status().message().find("idempotency entry for 'client-7'"), std::string::npos)
        << again.status().message();
    EXPECT_EQ(j->head_seq(), 6u);
  }
}

}  // namespace
}  // namespace rc::journal
