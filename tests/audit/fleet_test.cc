// Replay and audit of a fleet's journal (real RocksDB): every recorded decision is re-derived by
// the fleet fold, each engine's TAINTED incident, versions and health are reported under its own
// name, and a one-engine journal reads exactly as before fleets.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "audit/audit.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "tests/journal/test_util.h"
#include "tests/statemachine/fleet_helpers.h"

namespace rc {
namespace {

using journal::testing::TempDir;
using test::FleetDriver;

std::unique_ptr<journal::Journal> OpenOk(const std::string& path) {
  journal::Options o;
  o.snapshot_every = 0;
  auto j = journal::Journal::Open(path, o);
  RC_CHECK(j.ok());
  return std::move(j.value());
}

// Engines a and b joined and bootstrapped at rc-0.
FleetDriver TwoEngines() {
  FleetDriver d;
  d.join("a");
  d.join("b");
  d.bootstrap("a");
  d.bootstrap("b");
  return d;
}

// TwoEngines with a rollout each; an `all` update to rc-1 commits on a and breaks b's transfer
// ambiguously (b is TAINTED, the fleet update ends partial).
FleetDriver PartialFleetUpdate() {
  FleetDriver d = TwoEngines();
  d.admit("a");
  d.admit("b");
  d.ok("a", RolloutFinished{"r1", RolloutOutcome::kCompleted, 0});
  d.ok("b", RolloutFinished{"r2", RolloutOutcome::kCompleted, 0});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  d.ok("a", d.member_update(u));
  d.ok("b", d.member_update(u));
  d.run_update("a");
  d.run_update("b", /*ambiguous=*/true);
  return d;
}

void Submit(journal::Journal& j, const FleetDriver& d) {
  for (const FleetHistoryEntry& e : d.history) {
    if (e.cause_seq != 0) continue;
    auto s = j.SubmitFleet(FleetEvent{e.engine, e.event}, 1700000000000);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(j.Wait(s->ticket).ok());
  }
}

// Proves replay verifies a fleet's journal with the fleet fold and explains the TAINTED engine by
// name while the other commits; catches a replay that folds a fleet as one engine (every named
// record would be refused) or attributes b's incident to the fleet as a whole.
TEST(FleetReplay, VerifiesAFleetAndNamesTheTaintedEngine) {
  const FleetDriver d = PartialFleetUpdate();
  ASSERT_EQ(d.engine("b").lifecycle, Lifecycle::kTainted);
  ASSERT_EQ(d.engine("a").committed.label, "rc-1");
  TempDir dir;
  auto j = OpenOk(dir.path());
  Submit(*j, d);
  Result<replay::ReplayReport> r = replay::Replay(*j, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->ok) << r->error;
  EXPECT_EQ(r->fleet, d.f);
  EXPECT_EQ(r->records, d.history.size());
  ASSERT_EQ(r->incidents.size(), 1u);
  EXPECT_EQ(r->incidents[0].engine, "b");
  EXPECT_EQ(r->incidents[0].update_id, "u1");
  EXPECT_EQ(r->incidents[0].explanation.rfind("engine 'b': TAINTED at seq ", 0), 0u)
      << r->incidents[0].explanation;
  const std::string text = replay::FormatReport(*r);
  EXPECT_NE(text.find("fleet: 2 engines"), std::string::npos) << text;
  EXPECT_NE(text.find("engine 'a' (fleet generation 1): state: READY"), std::string::npos) << text;
  EXPECT_NE(text.find("engine 'b' (fleet generation 0): state: TAINTED"), std::string::npos)
      << text;
  EXPECT_NE(text.find("verification: OK"), std::string::npos) << text;
  const std::string json = replay::ReportJson(*r);
  EXPECT_NE(json.find("\"fleet\""), std::string::npos);
  EXPECT_NE(json.find("\"engine\": \"b\""), std::string::npos);
}

// Proves `replay --until` stops a fleet mid-update with its members as they were, and that each
// record line names its engine; catches a fleet replay that cannot stop inside a group or loses
// the engine in `--events` output.
TEST(FleetReplay, StopsMidUpdateAndNamesEnginesPerRecord) {
  const FleetDriver d = PartialFleetUpdate();
  TempDir dir;
  auto j = OpenOk(dir.path());
  Submit(*j, d);
  // The end of the group in which b's own update starts.
  std::uint64_t member_b = 0, group_end = 0;
  for (const FleetHistoryEntry& e : d.history) {
    if (e.engine == "b" && std::holds_alternative<UpdateRequested>(e.event)) member_b = e.seq;
    if (member_b != 0 && (e.seq == member_b || e.cause_seq == member_b)) group_end = e.seq;
  }
  ASSERT_NE(member_b, 0u);
  Result<replay::ReplayReport> r = replay::Replay(*j, {group_end});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->ok) << r->error;
  ASSERT_TRUE(r->fleet.update.has_value());
  EXPECT_EQ(r->fleet.update->members.at("b"), MemberStatus::kUpdating);
  EXPECT_NE(replay::FormatReport(*r).find("'b'=updating"), std::string::npos);
  Result<journal::Record> rec = j->Read(member_b);
  ASSERT_TRUE(rec.ok());
  EXPECT_NE(replay::FormatRecordLine(*rec).find("[b] "), std::string::npos)
      << replay::FormatRecordLine(*rec);
}

// Proves a one-engine journal's report has no fleet lines and keeps the unnamed engine's state;
// catches fleet output leaking into the reports of every existing journal.
TEST(FleetReplay, OneEngineReportsAreUnchanged) {
  TempDir dir;
  auto j = OpenOk(dir.path());
  for (const auto& g : journal::testing::BootstrapGroups()) {
    ASSERT_TRUE(j->Append(journal::testing::Group(g)).ok());
  }
  Result<replay::ReplayReport> r = replay::Replay(*j, {});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->ok) << r->error;
  EXPECT_EQ(r->state, j->state());
  EXPECT_EQ(r->state.lifecycle, Lifecycle::kReady);
  const std::string text = replay::FormatReport(*r);
  EXPECT_EQ(text.find("fleet:"), std::string::npos) << text;
  EXPECT_EQ(text.rfind("records: 4 (inputs re-decided: 3), last seq 4\nstate: READY", 0), 0u)
      << text;
  EXPECT_EQ(replay::ReportJson(*r).find("\"fleet\""), std::string::npos);
}

// Proves the audit checks a fleet's history with the fleet's checker and reports each engine:
// a's versions and health, b TAINTED as b's finding, the partial fleet update; catches an audit
// that reads a fleet as one engine (its history check would refuse every named record).
TEST(FleetAudit, ReportsEachEngineAndTheFleet) {
  const FleetDriver d = PartialFleetUpdate();
  TempDir dir;
  auto j = OpenOk(dir.path());
  Submit(*j, d);
  Result<audit::AuditReport> r = audit::AuditJournal(*j);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->ok) << (r->failures.empty() ? "" : r->failures[0]);
  EXPECT_TRUE(r->history.ok) << r->history.message;
  ASSERT_TRUE(r->fleet);
  ASSERT_EQ(r->engines.size(), 2u);
  const audit::EngineAudit& a = r->engines.at("a");
  ASSERT_EQ(a.versions.size(), 2u);
  EXPECT_EQ(a.versions[1].version.label, "rc-1");
  EXPECT_EQ(a.versions[1].update_id, "u1");
  EXPECT_FALSE(a.health.tainted);
  EXPECT_TRUE(r->engines.at("b").health.tainted);
  EXPECT_EQ(r->fleet_updates.at(FleetOutcome::kPartial), 1u);
  EXPECT_EQ(r->history.summary.updates_committed, 1u);
  EXPECT_EQ(r->history.summary.updates_tainted, 1u);
  const audit::Verdict v = audit::MakeVerdict(*r);
  EXPECT_TRUE(v.journal_intact());
  ASSERT_EQ(v.engine_findings.size(), 1u);
  EXPECT_EQ(v.engine_findings[0].rfind("engine 'b' is TAINTED since seq", 0), 0u)
      << v.engine_findings[0];
  const std::string text = audit::FormatReport(*r);
  EXPECT_NE(text.find("fleet: 2 engines audited; fleet updates ended: partial 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("engine 'b':\nversions:"), std::string::npos) << text;
  EXPECT_NE(text.find("audit: ENGINE NOT HEALTHY"), std::string::npos) << text;
  const std::string json = audit::VerdictJson(*r, v, -1);
  EXPECT_NE(json.find("\"engines\":{\"a\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"engine\":null"), std::string::npos) << "a fleet has no one engine";
}

// Proves a rollout's provenance in a fleet names its engine and that engine's own generation: a
// rollout on a (generation 1 = rc-1, published by u1) resolves there, where b never had a
// generation 1; catches provenance that looks a generation up in another engine's versions.
TEST(FleetAudit, ProvenanceNamesTheEngine) {
  FleetDriver d = PartialFleetUpdate();
  const std::string on_a = d.admit("a");
  TempDir dir;
  auto j = OpenOk(dir.path());
  Submit(*j, d);
  Result<audit::RolloutProvenance> p = audit::Provenance(*j, on_a);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->engine, "a");
  EXPECT_EQ(p->version.version.label, "rc-1");
  EXPECT_EQ(p->version.update_id, "u1");
  EXPECT_NE(audit::ProvenanceJson(*p, -1).find("\"engine\":\"a\""), std::string::npos);
  Result<audit::RolloutProvenance> old = audit::Provenance(*j, "r2");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(old->engine, "b");
  EXPECT_EQ(old->version.version.label, "rc-0");
}

// Proves an engine that left and joined again is audited as two lives, each with its own
// versions and state; catches an audit that merges the lives (the second life's generation 0
// overwriting the first's, its counts added to the first's).
TEST(FleetAudit, ARejoinedEngineIsANewLife) {
  FleetDriver d = TwoEngines();
  d.admit("a");
  d.ok("a", RolloutFinished{"r1", RolloutOutcome::kCompleted, 0});
  d.ok(FleetEvent{"", EngineRemovalRequested{"a"}});  // idle: removed in the same group
  ASSERT_EQ(d.f.engines.count("a"), 0u);
  d.join("a");
  d.bootstrap("a");
  TempDir dir;
  auto j = OpenOk(dir.path());
  Submit(*j, d);
  Result<audit::AuditReport> r = audit::AuditJournal(*j);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->ok) << (r->failures.empty() ? "" : r->failures[0]);
  ASSERT_EQ(r->engines.size(), 3u);
  const audit::EngineAudit& first = r->engines.at("a");
  EXPECT_TRUE(first.removed);
  ASSERT_EQ(first.versions.size(), 1u);
  EXPECT_EQ(first.versions[0].rollouts_admitted, 1u);
  const audit::EngineAudit& second = r->engines.at("a (life 2)");
  EXPECT_FALSE(second.removed);
  EXPECT_EQ(second.state.lifecycle, Lifecycle::kReady);
  ASSERT_EQ(second.versions.size(), 1u);
  EXPECT_EQ(second.versions[0].rollouts_admitted, 0u);
}

// The seq of every RecoveryStarted in the journal, in order.
std::vector<std::uint64_t> RecoverySeqs(journal::Journal& j) {
  std::vector<std::uint64_t> out;
  EXPECT_TRUE(j.Scan(1, 0, [&](const journal::Record& r) {
                 if (std::holds_alternative<RecoveryStarted>(r.event)) out.push_back(r.seq);
                 return Status::OK();
               }).ok());
  return out;
}

// Proves the torn WAL tail that every member's RecoveryStarted of one executor start records is
// reported once, at the first member's record, by replay and by audit (one journal failure),
// while a later start's torn tail is reported on its own and a crash without one is not; catches
// a fleet's torn tail counted once per member, and a later start's taken for the first's.
TEST(FleetAudit, ATornTailEveryMemberRecordedIsReportedOnce) {
  FleetDriver d = TwoEngines();
  const std::string first = "torn WAL tail in /j: 000009.log: 9 of 90 bytes; recovered through 9";
  const std::string later = "torn WAL tail in /j: 000012.log: 3 of 70 bytes; recovered through 14";
  for (const char* engine : {"a", "b"}) {
    d.ok(engine, RecoveryStarted{"exec-2", JournalEnding::kTornTail, 9, first});
  }
  for (const char* engine : {"a", "b"}) {
    d.ok(engine, RecoveryStarted{"exec-3", JournalEnding::kCrash});
  }
  for (const char* engine : {"a", "b"}) {
    d.ok(engine, RecoveryStarted{"exec-4", JournalEnding::kTornTail, 3, later});
  }
  TempDir dir;
  auto j = OpenOk(dir.path());
  Submit(*j, d);
  const std::vector<std::uint64_t> starts = RecoverySeqs(*j);
  ASSERT_EQ(starts.size(), 6u);
  Result<replay::ReplayReport> r = replay::Replay(*j, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->ok) << r->error << ": the records themselves verify";
  EXPECT_EQ(r->torn_tails_count, 2u);
  ASSERT_EQ(r->torn_tails.size(), 2u);
  EXPECT_EQ(r->torn_tails[0].seq, starts[0]);
  EXPECT_EQ(r->torn_tails[0].engine, "a");
  EXPECT_EQ(r->torn_tails[0].bytes_unread, 9u);
  EXPECT_EQ(r->torn_tails[0].sentence, first);
  EXPECT_EQ(r->torn_tails[1].seq, starts[4]);
  EXPECT_EQ(r->torn_tails[1].sentence, later);
  const std::string text = replay::FormatReport(*r);
  EXPECT_NE(text.find("TORN WAL TAIL recorded at seq " + std::to_string(starts[0]) +
                      " by engine 'a' (the journal's open before that executor start): " + first),
            std::string::npos)
      << text;
  Result<audit::AuditReport> a = audit::AuditJournal(*j);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_FALSE(a->ok);
  EXPECT_EQ(a->torn_tails_count, 2u);
  const audit::Verdict v = audit::MakeVerdict(*a);
  ASSERT_EQ(v.journal_failures.size(), 2u);
  EXPECT_EQ(v.journal_failures[0], "seq " + std::to_string(starts[0]) +
                                       " (RecoveryStarted of engine 'a') recorded what "
                                       "the journal's open before that executor start found: " +
                                       first);
  EXPECT_EQ(v.exit_code(), audit::kExitJournalDamaged);
}

}  // namespace
}  // namespace rc
