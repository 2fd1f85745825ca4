// The journal store with a fleet of named engines: groups name their engines, the store folds the
// fleet (statemachine/fleet.h), snapshots it, and reopens, refolds and catches up to the same
// fleet; one-engine journals keep their behaviour.
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <optional>
#include <string>
#include <vector>

#include "journal/codec.h"
#include "journal/journal.h"
#include "tests/journal/test_util.h"
#include "tests/statemachine/fleet_helpers.h"

namespace rc::journal {
namespace {

using test::FleetDriver;
using testing::BootstrapGroups;
using testing::Group;
using testing::TempDir;

std::unique_ptr<Journal> OpenOk(const std::string& path, const Options& options) {
  Result<std::unique_ptr<Journal>> j = Journal::Open(path, options);
  RC_CHECK(j.ok() || (std::fprintf(stderr, "%s\n", j.status().ToString().c_str()), false));
  return std::move(j.value());
}

// A closed journal opened through RocksDB directly, with one of its column families at hand.
struct RawJournal {
  RawJournal(const std::string& path, const std::string& cf, bool read_only) {
    std::vector<rocksdb::ColumnFamilyDescriptor> descs;
    for (const char* name : {"default", "events", "rollouts", "idempotency", "snapshots", "meta"}) {
      if (name == cf) at = descs.size();
      descs.emplace_back(name, rocksdb::ColumnFamilyOptions());
    }
    const rocksdb::Status s =
        read_only ? rocksdb::DB::OpenForReadOnly(rocksdb::DBOptions(), path, descs, &handles, &db)
                  : rocksdb::DB::Open(rocksdb::DBOptions(), path, descs, &handles, &db);
    RC_CHECK(s.ok());
  }
  ~RawJournal() {
    for (auto* h : handles) RC_CHECK(db->DestroyColumnFamilyHandle(h).ok());
    delete db;
  }
  rocksdb::ColumnFamilyHandle* cf() const { return handles[at]; }

  rocksdb::DB* db = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  std::size_t at = 0;
};

// Puts one raw pair into a closed journal's column family (flushed, so it survives any WAL).
void PutRaw(const std::string& path, const std::string& cf, const std::string& key,
            const std::string& value) {
  RawJournal raw(path, cf, /*read_only=*/false);
  ASSERT_TRUE(raw.db->Put(rocksdb::WriteOptions(), raw.cf(), key, value).ok());
  ASSERT_TRUE(raw.db->Flush(rocksdb::FlushOptions(), raw.handles).ok());
}

// Whether a closed journal's column family holds `key`.
bool HasRaw(const std::string& path, const std::string& cf, const std::string& key) {
  RawJournal raw(path, cf, /*read_only=*/true);
  std::string value;
  return raw.db->Get(rocksdb::ReadOptions(), raw.cf(), key, &value).ok();
}

// The value of `key` in a closed journal's column family, if any.
std::optional<std::string> GetRaw(const std::string& path, const std::string& cf,
                                  const std::string& key) {
  RawJournal raw(path, cf, /*read_only=*/true);
  std::string value;
  if (!raw.db->Get(rocksdb::ReadOptions(), raw.cf(), key, &value).ok()) return std::nullopt;
  return value;
}

std::string EncodeBE64(std::uint64_t v) {
  std::string key(8, '\0');
  for (int i = 0; i < 8; ++i) key[7 - i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return key;
}

// A fleet of `engines` bootstrapped at rc-0, two rollouts admitted to each, a rolling update to
// rc-1 committed on the first engine, and the first rollout finished: a history with every kind
// of group (fleet events, per-engine inputs with decisions, bindings, a fleet update's members).
FleetDriver SampleFleet(const std::vector<std::string>& engines) {
  FleetDriver d;
  d.ok(FleetEvent{"", FleetConfigured{1, 1}});
  for (const std::string& id : engines) d.join(id);
  for (const std::string& id : engines) d.bootstrap(id);
  for (const std::string& id : engines) {
    d.admit(id);
    d.admit(id);
  }
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kRolling, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok(engines[0], d.member_update(u));
  d.ok(engines[0], RolloutFinished{"r1", RolloutOutcome::kCompleted, 0});
  d.ok(engines[0], RolloutFinished{"r2", RolloutOutcome::kCompleted, 0});
  d.run_update(engines[0]);
  return d;
}

// Submits every input of the driver's history through the journal; each must derive exactly
// the decisions the fold derived.
void SubmitHistory(Journal& j, const FleetDriver& d) {
  for (std::size_t i = 0; i < d.history.size(); ++i) {
    if (d.history[i].cause_seq != 0) continue;
    const FleetEvent input{d.history[i].engine, d.history[i].event};
    Result<Journal::FleetSubmitted> s = j.SubmitFleet(input, 1000);
    ASSERT_TRUE(s.ok()) << test::fleet_event_name(input) << ": " << s.status().ToString();
    ASSERT_TRUE(j.Wait(s->ticket).ok());
    for (std::size_t k = 0; k < s->decisions.size(); ++k) {
      ASSERT_LT(i + 1 + k, d.history.size());
      EXPECT_EQ(s->decisions[k].engine, d.history[i + 1 + k].engine);
      EXPECT_EQ(s->decisions[k].event, d.history[i + 1 + k].event);
    }
  }
}

Options NoSnapshots() {
  Options o;
  o.snapshot_every = 0;
  return o;
}

// Proves a fleet's journal folds to the very state the fleet fold gives, names each record's
// engine, and reopens, refolds and loads (through fleet snapshots) to it; catches a store that
// drops the engine of a record, folds one engine's events into another, or snapshots a fleet
// incompletely.
TEST(FleetStore, FoldsNamesReopensAndSnapshotsAFleet) {
  const FleetDriver d = SampleFleet({"a", "b", "c"});
  for (std::uint64_t every : {std::uint64_t{0}, std::uint64_t{5}}) {
    TempDir dir;
    Options o;
    o.snapshot_every = every;
    {
      auto j = OpenOk(dir.path(), o);
      SubmitHistory(*j, d);
      EXPECT_EQ(j->fleet_state(), d.f);
      EXPECT_TRUE(j->is_fleet());
      EXPECT_EQ(j->state(), State{}) << "a fleet journal has no unnamed engine";
      EXPECT_EQ(j->LoadState().status().code(), Code::kInvalidArgument);
      std::size_t seq = 0;
      ASSERT_TRUE(j->Scan(1, 0, [&](const Record& r) {
                     EXPECT_EQ(r.engine, d.history[seq].engine) << "seq " << r.seq;
                     EXPECT_EQ(r.event, d.history[seq].event) << "seq " << r.seq;
                     ++seq;
                     return Status::OK();
                   }).ok());
      EXPECT_EQ(seq, d.history.size());
    }
    auto j = OpenOk(dir.path(), o);
    EXPECT_EQ(j->fleet_state(), d.f) << "snapshot_every " << every;
    EXPECT_EQ(*j->RefoldFleet(), d.f);
    EXPECT_EQ(*j->LoadFleetState(), d.f);
  }
}

// Proves the fleet's snapshot is what Open loads: a snapshot whose stored fleet differs from the
// fold (a different policy) is what the reopened journal holds; catches an Open that ignores the
// fleet snapshot and refolds (which would hide a snapshot never read).
TEST(FleetStore, OpenLoadsTheNewestFleetSnapshot) {
  const FleetDriver d = SampleFleet({"a", "b"});
  TempDir dir;
  const Options o = NoSnapshots();
  std::uint64_t head = 0;
  {
    auto j = OpenOk(dir.path(), o);
    SubmitHistory(*j, d);
    head = j->head_seq();
    FleetState marked = j->fleet_state();
    marked.policy.staleness_max = 777;
    ASSERT_TRUE(j->WriteSnapshot(head, marked).ok());
    FleetState wrong = j->fleet_state();
    wrong.events -= 1;
    EXPECT_EQ(j->WriteSnapshot(head, wrong).code(), Code::kInvalidArgument);
  }
  auto j = OpenOk(dir.path(), o);
  EXPECT_EQ(j->fleet_state().policy.staleness_max, 777u);
  EXPECT_EQ(j->RefoldFleet()->policy.staleness_max, 1u);
}

// Proves a group whose engines do not pair up with its events, one naming an engine that never
// joined, or one whose decision names the wrong engine is refused whole and writes nothing;
// catches a store that trusts the caller's engine names.
TEST(FleetStore, RefusesGroupsWithWrongEngines) {
  TempDir dir;
  auto j = OpenOk(dir.path(), NoSnapshots());
  FleetDriver d = SampleFleet({"a", "b"});
  SubmitHistory(*j, d);
  const std::uint64_t head = j->head_seq();
  const FleetState before = j->fleet_state();
  AppendRequest unpaired;
  unpaired.events = {RolloutAdmitted{}, RolloutAdmitted{}};
  unpaired.engines = {"a"};
  EXPECT_EQ(j->Enqueue(unpaired).status().code(), Code::kInvalidArgument);
  AppendRequest stranger;
  stranger.events = {make_fleet_admission(d.f, "b", "x1").event};
  stranger.engines = {"zz"};
  const Result<Ticket> refused = j->Enqueue(stranger);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("no engine 'zz'"), std::string::npos);
  EXPECT_EQ(j->head_seq(), head);
  EXPECT_EQ(j->fleet_state(), before);
  // b leaves: its last finish decides its removal (a fleet event, engine ""). The same group with
  // the removal claimed for engine a is refused. (b is a pending member of u1: cancel it first.)
  ASSERT_TRUE(j->SubmitFleet(FleetEvent{"", FleetUpdateCancelled{"u1", "test"}}, 1000).ok());
  ASSERT_TRUE(j->SubmitFleet(FleetEvent{"", EngineRemovalRequested{"b"}}, 1000).ok());
  ASSERT_TRUE(
      j->SubmitFleet(FleetEvent{"b", RolloutFinished{"r3", RolloutOutcome::kCompleted, 0}}, 1000)
          .ok());
  const FleetEvent last{"b", RolloutFinished{"r4", RolloutOutcome::kCompleted, 0}};
  Result<std::vector<FleetEvent>> decided = fleet_decide(j->fleet_state(), last);
  ASSERT_TRUE(decided.ok() && decided->size() == 1) << decided.status().ToString();
  AppendRequest misnamed;
  misnamed.events = {last.event, (*decided)[0].event};
  misnamed.engines = {"b", "a"};
  const std::uint64_t at = j->head_seq();
  const Result<Ticket> refused_misnamed = j->Enqueue(misnamed);
  ASSERT_FALSE(refused_misnamed.ok());
  EXPECT_NE(refused_misnamed.status().message().find("EngineRemoved@a"), std::string::npos)
      << refused_misnamed.status().message();
  EXPECT_EQ(j->head_seq(), at);
  misnamed.engines = {"b", ""};
  ASSERT_TRUE(j->Append(misnamed).ok());
  EXPECT_EQ(j->fleet_state().engines.count("b"), 0u);
}

// Proves an idempotency key covers the engines of its group: the same events for another engine
// under the same key are a Conflict, and a retry answers with the original seqs and decisions;
// catches a digest that ignores engines (a retried admission bound to the wrong engine).
TEST(FleetStore, IdempotencyKeysCoverEngines) {
  TempDir dir;
  auto j = OpenOk(dir.path(), NoSnapshots());
  const FleetDriver d = SampleFleet({"a", "b"});
  SubmitHistory(*j, d);
  const FleetEvent on_b = make_fleet_admission(j->fleet_state(), "b", "keyed");
  Result<Journal::FleetSubmitted> first = j->SubmitFleet(on_b, 1000, "k1");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(j->Wait(first->ticket).ok());
  Result<Journal::FleetSubmitted> again = j->SubmitFleet(on_b, 1000, "k1");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->ticket.result.duplicate);
  EXPECT_EQ(again->ticket.result.first_seq, first->ticket.result.first_seq);
  const FleetEvent on_a{"a", on_b.event};
  EXPECT_EQ(j->SubmitFleet(on_a, 1000, "k1").status().code(), Code::kConflict);
  AppendRequest raw;
  raw.client_event_id = "k1";
  raw.events = {on_b.event};
  raw.engines = {"a"};
  EXPECT_EQ(j->Enqueue(raw).status().code(), Code::kConflict);
}

// Proves a fleet update recorded before stall_judged_per_group existed (false) is the same input as
// its retry by a newer build (true): the retry answers the recorded seqs, while another body under
// the key is still a Conflict. Catches a trainer's re-POST after an upgrade refused 409 when it
// asked for the outcome the journal holds.
TEST(FleetStore, ARetryOfAnUpdateRecordedBeforeTheStallRuleIsTheSameInput) {
  TempDir dir;
  auto j = OpenOk(dir.path(), NoSnapshots());
  FleetDriver d = SampleFleet({"a", "b"});
  SubmitHistory(*j, d);
  ASSERT_TRUE(j->SubmitFleet(FleetEvent{"", FleetUpdateCancelled{"u1", "test"}}, 1000).ok());
  FleetUpdateRequested older = d.fleet_update("u2", FleetUpdateMode::kAll, "rc-9");
  older.stall_judged_per_group = false;
  Result<Journal::FleetSubmitted> first = j->SubmitFleet(FleetEvent{"", older}, 1000, "k-u2");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(j->Wait(first->ticket).ok());
  FleetUpdateRequested retried = older;
  retried.stall_judged_per_group = true;
  Result<Journal::FleetSubmitted> again = j->SubmitFleet(FleetEvent{"", retried}, 1000, "k-u2");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->ticket.result.duplicate);
  EXPECT_EQ(again->ticket.result.first_seq, first->ticket.result.first_seq);
  retried.target_label = "rc-10";
  EXPECT_EQ(j->SubmitFleet(FleetEvent{"", retried}, 1000, "k-u2").status().code(), Code::kConflict);
}

// Proves a rollout id is used once across the whole fleet: admitting on engine b an id engine a
// used is a Conflict naming its seq; catches per-engine id checks (one id, two engines' records).
TEST(FleetStore, RolloutIdsAreUniqueFleetWide) {
  TempDir dir;
  auto j = OpenOk(dir.path(), NoSnapshots());
  const FleetDriver d = SampleFleet({"a", "b"});
  SubmitHistory(*j, d);
  Result<Journal::FleetSubmitted> reused =
      j->SubmitFleet(make_fleet_admission(j->fleet_state(), "b", "r1"), 1000);
  ASSERT_FALSE(reused.ok());
  EXPECT_EQ(reused.status().code(), Code::kConflict);
  EXPECT_NE(reused.status().message().find("already used at seq"), std::string::npos);
}

// Proves a one-engine journal still folds, submits and snapshots as before fleets (its records
// name no engine, Submit's decisions are the unnamed engine's), and that a State snapshot of the
// older format is passed over rather than loaded, the fleet then snapshotted at the head; catches
// a fleet store that changes one-engine journals, trusts a snapshot that lacks the fleet's label
// order, or refolds such a journal on every open.
TEST(FleetStore, OneEngineJournalsAndOlderSnapshots) {
  TempDir dir;
  Options o;
  o.snapshot_every = 3;
  {
    auto j = OpenOk(dir.path(), o);
    for (const std::vector<Event>& g : BootstrapGroups()) ASSERT_TRUE(j->Append(Group(g)).ok());
    ASSERT_TRUE(j->Append(Group({make_admission(j->state(), "one")})).ok());
    EXPECT_FALSE(j->is_fleet());
    EXPECT_EQ(j->fleet_state().engines.size(), 1u);
    ASSERT_TRUE(j->Scan(1, 0, [](const Record& r) {
                   EXPECT_EQ(r.engine, "");
                   return Status::OK();
                 }).ok());
  }
  std::uint64_t head = 0;
  {
    auto j = OpenOk(dir.path(), o);
    head = j->head_seq();
    ASSERT_TRUE(j->Flush().ok());
  }
  // An older version's snapshot at the head: an 8-byte key holding one engine's State. Its
  // content is deliberately wrong (no rollouts): loading it would lose "one".
  PutRaw(dir.path(), "snapshots", EncodeBE64(head), EncodeState(State{}));
  {
    auto j = OpenOk(dir.path(), o);
    EXPECT_EQ(j->state().active.count("one"), 1u);
    EXPECT_EQ(*j->LoadState(), *j->Refold());
  }
  // The open that passed over it snapshotted the fleet at the head, so the next one loads that.
  EXPECT_TRUE(HasRaw(dir.path(), "snapshots", EncodeBE64(head) + "f"));
}

// Proves a named fleet's snapshot from before removed engines' counters were kept is passed over,
// the fold restarting below it, and the fleet snapshotted again at the head; catches a journal
// that loads the undercount, whose totals and audit refold would then disagree forever.
TEST(FleetStore, AFleetSnapshotWithoutRemovedCountersIsPassedOver) {
  FleetDriver d;
  for (const std::string id : {"a", "b"}) {
    d.join(id);
    d.bootstrap(id);
  }
  const std::string r = d.admit("a");
  d.ok("a", RolloutFinished{r, RolloutOutcome::kCompleted, 1, 1});
  d.ok(FleetEvent{"", EngineRemovalRequested{"a"}});
  ASSERT_EQ(d.f.removed.rollouts_completed, 1u);
  TempDir dir;
  Options o;
  o.snapshot_every = 1000;  // no snapshot of its own until the older one is met
  std::uint64_t head = 0;
  {
    auto j = OpenOk(dir.path(), o);
    SubmitHistory(*j, d);
    head = j->head_seq();
    ASSERT_TRUE(j->Flush().ok());
  }
  const std::string key = EncodeBE64(head) + "f";
  PutRaw(dir.path(), "snapshots", key, EncodeFleetStateWithoutRemoved(d.f, head));
  {
    auto j = OpenOk(dir.path(), o);
    EXPECT_EQ(j->fleet_state(), d.f);
    EXPECT_EQ(j->fleet_state().removed.rollouts_admitted, 1u);
    EXPECT_EQ(*j->RefoldFleet(), j->fleet_state());
  }
  const std::optional<std::string> rewritten = GetRaw(dir.path(), "snapshots", key);
  ASSERT_TRUE(rewritten.has_value());
  Result<FleetSnapshot> now = DecodeFleetState(*rewritten);
  ASSERT_TRUE(now.ok()) << now.status().ToString();
  EXPECT_TRUE(now->counts_removed) << "the open snapshotted the fleet again at the head";
  EXPECT_EQ(now->fleet, d.f);
}

// Proves a journal of one unnamed engine takes no fleet event (Submit refuses one outright,
// SubmitFleet by the fold), and a journal that began as a fleet takes no unnamed engine; catches
// a policy or fleet update slipped into a one-engine journal, which would block its own updates.
TEST(FleetStore, OneEngineAndFleetNeverMix) {
  TempDir one_dir, fleet_dir;
  auto one = OpenOk(one_dir.path(), NoSnapshots());
  for (const std::vector<Event>& g : BootstrapGroups()) ASSERT_TRUE(one->Append(Group(g)).ok());
  const std::uint64_t head = one->head_seq();
  EXPECT_EQ(one->Submit(FleetConfigured{0, 1}, 1000).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(one->SubmitFleet(FleetEvent{"", FleetConfigured{0, 1}}, 1000).status().code(),
            Code::kRejected);
  EXPECT_FALSE(one->SubmitFleet(FleetEvent{"", EngineJoined{"b"}}, 1000).ok());
  EXPECT_EQ(one->head_seq(), head);
  auto fleet = OpenOk(fleet_dir.path(), NoSnapshots());
  ASSERT_TRUE(fleet->SubmitFleet(FleetEvent{"", FleetConfigured{0, 0}}, 1000).ok());
  const Result<Journal::FleetSubmitted> unnamed =
      fleet->SubmitFleet(FleetEvent{"", BootstrapGroups()[0][0]}, 1000);
  ASSERT_FALSE(unnamed.ok());
  EXPECT_EQ(unnamed.status().code(), Code::kNotFound);
}

// Proves a read-only reader beside a live fleet writer catches up to the writer's fleet; catches
// a secondary that folds the tail as one engine.
TEST(FleetStore, SecondaryCatchesUpWithAFleet) {
  TempDir dir;
  auto w = OpenOk(dir.path(), NoSnapshots());
  const FleetDriver d = SampleFleet({"a", "b"});
  Options ro = NoSnapshots();
  ro.read_only = true;
  auto r = OpenOk(dir.path(), ro);
  SubmitHistory(*w, d);
  ASSERT_TRUE(r->CatchUp().ok());
  EXPECT_EQ(r->fleet_state(), d.f);
}

}  // namespace
}  // namespace rc::journal
