// The audit's two-part verdict on real RocksDB journals (no engine): "the journal is intact"
// apart from "the engine is healthy", the suspect rollouts of a READY taint, the exit codes, and
// the rollout index checked against the records.
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <algorithm>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "journal/codec.h"
#include "journal/journal.h"
#include "statemachine/text.h"
#include "tests/audit/quoting.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"

namespace rc {
namespace {

using journal::testing::EditRaw;
using journal::testing::OverwriteEvent;
using journal::testing::SeqKey;
using journal::testing::TempDir;
using Cf = std::vector<rocksdb::ColumnFamilyHandle*>;

const HttpEvidence kOk{Transport::kOk, 200, true, 10, ""};
const WeightIdentity kIdentity{"ab12cd34ef56", "", "ckpt/step-0", "run-1", 0};

void SubmitAt(journal::Journal& j, const Event& e, std::int64_t wall_ms) {
  auto s = j.Submit(e, wall_ms);
  ASSERT_TRUE(s.ok()) << text::escape_line(s.status().ToString());
  ASSERT_TRUE(j.Wait(s->ticket).ok());
}

EngineProbed Probe(const std::string& label, const std::string& instance) {
  EngineProbed p{kOk, "0.25.1", label};
  p.is_paused_known = true;
  p.engine_instance = instance;
  return p;
}

// Bootstrap to READY at wall 1000 on engine instance "i-1".
void Bootstrap(journal::Journal& j) {
  SubmitAt(j, BootstrapRequested{"rc-0", kIdentity}, 1000);
  SubmitAt(j, EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000}, 1000);
  SubmitAt(j, Probe("rc-0", "i-1"), 1000);
  ASSERT_EQ(j.state().lifecycle, Lifecycle::kReady);
}

void Admit(journal::Journal& j, const std::string& id, std::int64_t wall_ms) {
  SubmitAt(j, make_admission(j.state(), id), wall_ms);
}

void Finish(journal::Journal& j, const std::string& id, std::int64_t wall_ms,
            RolloutOutcome outcome = RolloutOutcome::kCompleted) {
  SubmitAt(j, RolloutFinished{id, outcome, 1, 1}, wall_ms);
}

// Opens `dir` read-only (as `rolloutcore audit` does) and audits it.
audit::AuditReport AuditDir(const std::string& dir) {
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  auto opened = journal::Journal::Open(dir, ro);
  RC_CHECK(opened.ok());
  auto report = audit::AuditJournal(**opened);
  RC_CHECK(report.ok());
  return std::move(report.value());
}

std::vector<std::string> Ids(const std::vector<audit::RolloutNote>& notes) {
  std::vector<std::string> out;
  for (const auto& n : notes) out.push_back(n.rollout_id);
  std::sort(out.begin(), out.end());
  return out;
}

std::string LastLine(const std::string& text) {
  const std::size_t end = text.find_last_of('\n');
  const std::size_t start = text.find_last_of('\n', end == 0 ? 0 : end - 1);
  return text.substr(start == std::string::npos ? 0 : start + 1, end - (start + 1));
}

// Proves a monitor taint in READY makes exactly the rollouts active at the taint or finished
// after the monitor's last good sight suspect, with "journal intact, engine TAINTED" and exit 1;
// catches the audit that printed "audit: OK" and exited 0 on a TAINTED journal, and a window
// that misses (or over-reaches to) a rollout.
TEST(Verdict, MonitorTaintInReadyNamesTheSuspectRollouts) {
  TempDir dir;
  {
    auto opened = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    journal::Journal& j = **opened;
    Bootstrap(j);
    Admit(j, "before", 2000);
    Finish(j, "before", 3000);  // before last_ok (5000): served by the verified engine
    Admit(j, "inside", 4000);
    Admit(j, "active", 4000);
    Finish(j, "inside", 6000);  // after last_ok: may have been served by the new process
    EngineMonitored m{kOk, "default", true, false, "i-2", 5000, monitor_epoch(j.state())};
    SubmitAt(j, m, 7000);
    ASSERT_EQ(j.state().lifecycle, Lifecycle::kTainted);
    Finish(j, "active", 8000);  // a rollout active at the taint still ends as usual
  }
  const audit::AuditReport report = AuditDir(dir.path());
  EXPECT_TRUE(report.ok) << audit::FormatReport(report);
  const audit::EngineHealth& e = report.engine;
  EXPECT_TRUE(e.tainted);
  EXPECT_EQ(e.taint_cause, Cause::kEngineReplaced);
  EXPECT_EQ(e.window_start_wall_ms, 5000);
  EXPECT_EQ(e.suspect_count, 2u);
  EXPECT_EQ(Ids(e.suspect), (std::vector<std::string>{"active", "inside"}));
  const audit::Verdict v = audit::MakeVerdict(report);
  EXPECT_TRUE(v.journal_intact());
  EXPECT_FALSE(v.engine_healthy());
  const audit::AuditOutput out = audit::RenderAudit(report, v, "/j/path");
  EXPECT_EQ(out.exit_code, audit::kExitEngineUnhealthy);
  EXPECT_EQ(out.text.find("audit: OK"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("journal: INTACT\n"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("SUSPECT 'inside'"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("SUSPECT 'active'"), std::string::npos) << out.text;
  EXPECT_EQ(out.text.find("SUSPECT 'before'"), std::string::npos) << out.text;
  EXPECT_NE(LastLine(out.text).find("rolloutcore replay -- /j/path"), std::string::npos)
      << out.text;
  const auto json = nlohmann::json::parse(audit::VerdictJson(report, v, -1), nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  EXPECT_EQ(json["exit_code"], 1);
  EXPECT_EQ(json["engine"]["suspect"].size(), 2u);
}

// Proves a taint found by the probe after an executor restart opens its window at the last
// record before RecoveryStarted (nobody watched in between); catches a window taken from the
// probe's own time, which would clear rollouts that finished while the executor was down.
TEST(Verdict, ProbeTaintAfterRestartOpensAtTheLastRecordBeforeIt) {
  TempDir dir;
  {
    auto opened = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    journal::Journal& j = **opened;
    Bootstrap(j);
    Admit(j, "early", 2000);
    Finish(j, "early", 2500);  // before the window: nothing is suspect about it
    SubmitAt(j, make_admission(j.state(), "leased", 60000), 2600);  // survives the restart
    SubmitAt(j, make_admission(j.state(), "expiring", 60000), 2600);
    Admit(j, "proxied", 2650);  // the restart records it abandoned
    // The last record before the restart: the window opens here (inclusive).
    SubmitAt(j, RolloutFinished{"expiring", RolloutOutcome::kExpired, 0, 0}, 2700);
    SubmitAt(j, RecoveryStarted{"x-2"}, 9000);
    SubmitAt(j, EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000}, 9000);
    SubmitAt(j, Probe("rc-9", "i-1"), 9000);
    ASSERT_EQ(j.state().lifecycle, Lifecycle::kTainted);
  }
  const audit::AuditReport report = AuditDir(dir.path());
  EXPECT_TRUE(report.ok) << audit::FormatReport(report);
  EXPECT_EQ(report.engine.taint_cause, Cause::kEngineRelabelled);
  EXPECT_EQ(report.engine.window_start_wall_ms, 2700);
  EXPECT_EQ(Ids(report.engine.suspect),
            (std::vector<std::string>{"expiring", "leased", "proxied"}));
  EXPECT_EQ(Ids(report.engine.expired), std::vector<std::string>{"expiring"});
  EXPECT_EQ(Ids(report.engine.abandoned), std::vector<std::string>{"proxied"});
  EXPECT_EQ(audit::RenderAudit(report, audit::MakeVerdict(report), "j").exit_code,
            audit::kExitEngineUnhealthy);
}

// Drives an update from READY through drain and preflight to a transfer that fails as a possible
// mutation, `foreign_session` telling whether its start met someone else's weight session.
void UpdateEndingInAPossibleMutation(journal::Journal& j, bool foreign_session,
                                     std::int64_t wall_ms) {
  const WeightIdentity target{"ab12cd34ef57", "", "ckpt/step-1", "run-1", 1};
  SubmitAt(j, UpdateRequested{"u-1", "rc-1", target, "synthetic:8x64:1"}, wall_ms);
  for (int step = 0; step < 16 && j.state().lifecycle != Lifecycle::kTainted; ++step) {
    const Effect e = next_effect(j.state());
    ASSERT_NE(e.kind, EffectKind::kNone) << "the update settled before its transfer";
    SubmitAt(j, EffectStarted{e.kind, e.cache, 1000}, wall_ms);
    if (e.kind == EffectKind::kDrain) {
      SubmitAt(j, DrainObserved{kOk, true}, wall_ms);
    } else if (e.kind == EffectKind::kPreflight) {
      SubmitAt(j, PreflightObserved{target.manifest_digest, true, true, ""}, wall_ms);
    } else {
      ASSERT_EQ(e.kind, EffectKind::kTransfer) << effect_name(e.kind);
      TransferObserved t{false, MutationClass::kPossible, 0, 0, 10, "", "start refused"};
      t.foreign_session = foreign_session;
      SubmitAt(j, t, wall_ms);
    }
  }
  ASSERT_EQ(j.state().lifecycle, Lifecycle::kTainted);
}

// Proves an update whose start met someone else's open weight session opens the suspect window
// at the engine's last verification, as a taint found in READY does (someone may have changed
// the weights while it served), while an update's own ambiguous transfer opens none; catches an
// audit that reports such a journal with no suspect rollout, hiding what the outsider served.
TEST(Verdict, AnUpdateThatMetSomeoneElsesWeightSessionMakesTheServedRolloutsSuspect) {
  for (const bool foreign : {true, false}) {
    SCOPED_TRACE(foreign ? "foreign session" : "own transfer");
    TempDir dir;
    {
      auto opened = journal::Journal::Open(dir.path(), journal::Options{});
      ASSERT_TRUE(opened.ok()) << opened.status().ToString();
      journal::Journal& j = **opened;
      Bootstrap(j);
      Admit(j, "served", 2000);
      Finish(j, "served", 3000);
      ASSERT_NO_FATAL_FAILURE(UpdateEndingInAPossibleMutation(j, foreign, 4000));
    }
    const audit::AuditReport report = AuditDir(dir.path());
    EXPECT_TRUE(report.ok) << audit::FormatReport(report);
    const audit::EngineHealth& e = report.engine;
    EXPECT_TRUE(e.tainted);
    EXPECT_EQ(e.taint_cause, Cause::kTransferAmbiguous);
    if (foreign) {
      EXPECT_EQ(e.window_start_wall_ms, 1000);
      EXPECT_EQ(Ids(e.suspect), std::vector<std::string>{"served"});
      EXPECT_NE(e.window_source.find("someone else's weight session"), std::string::npos)
          << e.window_source;
    } else {
      EXPECT_EQ(e.suspect_count, 0u);
    }
  }
}

// Proves a healthy journal (rollouts served, no taint) audits "audit: OK" with exit 0; catches
// a verdict that flags healthy journals (an exit code nobody can script against).
TEST(Verdict, HealthyJournalIsOk) {
  TempDir dir;
  {
    auto opened = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    Bootstrap(**opened);
    Admit(**opened, "r", 2000);
    Finish(**opened, "r", 3000);
  }
  const audit::AuditReport report = AuditDir(dir.path());
  const audit::AuditOutput out = audit::RenderAudit(report, audit::MakeVerdict(report), "j");
  EXPECT_EQ(out.exit_code, audit::kExitOk) << out.text;
  EXPECT_EQ(LastLine(out.text), "audit: OK") << out.text;
  EXPECT_EQ(report.engine.suspect_count, 0u);
}

// Proves a forged record (the hash chain breaks after it) is "journal DAMAGED" with exit 3 even
// though the engine looks healthy; catches a damaged journal reported as OK, or as the engine's
// problem (exit 1) with a replay command that would trust it.
TEST(Verdict, DamagedJournalIsExit3) {
  TempDir dir;
  journal::Options o;
  o.snapshot_every = 8;  // a snapshot past the forgery lets the journal open; the scan sees it
  std::uint64_t forged_seq = 0;
  {
    auto opened = journal::Journal::Open(dir.path(), o);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    Bootstrap(**opened);
    Admit(**opened, "r", 2000);
    forged_seq = (*opened)->head_seq();
    for (int i = 0; i < 12; ++i) Admit(**opened, "r" + std::to_string(i), 3000 + i);
  }
  {
    auto opened = journal::Journal::Open(dir.path(), o);
    ASSERT_TRUE(opened.ok());
    auto rec = (*opened)->Read(forged_seq);
    ASSERT_TRUE(rec.ok());
    journal::Record forged = *rec;
    std::get<RolloutAdmitted>(forged.event).rollout_id = "forged";
    opened->reset();
    OverwriteEvent(dir.path(), forged_seq, journal::EncodeRecord(forged));
  }
  const audit::AuditReport report = AuditDir(dir.path());
  EXPECT_FALSE(report.ok);
  const audit::Verdict v = audit::MakeVerdict(report);
  EXPECT_FALSE(v.journal_intact());
  const audit::AuditOutput out = audit::RenderAudit(report, v, "j");
  EXPECT_EQ(out.exit_code, audit::kExitJournalDamaged) << out.text;
  EXPECT_NE(out.text.find("journal: DAMAGED\n"), std::string::npos) << out.text;
  EXPECT_EQ(LastLine(out.text).rfind("audit: JOURNAL DAMAGED", 0), 0u) << out.text;
}

// Proves a caller's journal-level finding (a torn WAL tail, an --expect-head mismatch) turns an
// otherwise clean verdict into exit 3 and an engine-level one (a failed re-verification) into
// exit 1, each on one escaped line; catches CLI findings that bypass the verdict.
TEST(Verdict, CallerFindingsJoinTheVerdict) {
  TempDir dir;
  {
    auto opened = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    Bootstrap(**opened);
  }
  const audit::AuditReport report = AuditDir(dir.path());
  audit::Verdict engine = audit::MakeVerdict(report);
  engine.engine_findings.push_back("REVERIFY FAILED r\nforged: 1 mismatch");
  const audit::AuditOutput e = audit::RenderAudit(report, engine, "j");
  EXPECT_EQ(e.exit_code, audit::kExitEngineUnhealthy);
  EXPECT_NE(e.text.find("audit ENGINE: REVERIFY FAILED r\\nforged"), std::string::npos) << e.text;
  audit::Verdict torn = engine;
  torn.journal_failures.push_back("torn WAL tail");
  EXPECT_EQ(audit::RenderAudit(report, torn, "j").exit_code, audit::kExitJournalDamaged);
}

// Proves the `rolloutcore replay` command on an unhealthy audit's final line hands the shell the
// journal's path as exactly one argument (spaces, a quote, `;` and `$(...)` in it) after `--`, so
// that a path beginning with `-` is an operand, and prints a plain path as typed; catches the path
// printed bare, where a space split it and a `;` ran the rest, and a `-j` printed where the CLI
// reads an option.
TEST(Verdict, TheReplayCommandTakesTheJournalPathAsOneShellArgument) {
  TempDir dir;
  {
    auto opened = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    Bootstrap(**opened);
  }
  const audit::AuditReport report = AuditDir(dir.path());
  audit::Verdict v = audit::MakeVerdict(report);
  v.engine_findings.push_back("REVERIFY FAILED r");
  const std::string prefix =
      "audit: ENGINE NOT HEALTHY: the journal is intact and explains it: rolloutcore replay ";
  for (const std::string& path :
       {std::string("/var/lib/rc/my journal; echo INJECTED $(echo sub) 'x'"),
        std::string("/var/lib/rc/journal"), std::string("-j"), std::string("--until=1 x")}) {
    const std::string last = LastLine(audit::RenderAudit(report, v, path).text);
    ASSERT_EQ(last.rfind(prefix, 0), 0u) << last;
    EXPECT_EQ(quoting_testing::ShellWords(last.substr(prefix.size())),
              (std::vector<std::string>{"--", path}))
        << last;
  }
  EXPECT_EQ(LastLine(audit::RenderAudit(report, v, "/var/lib/rc/journal").text),
            prefix + "-- /var/lib/rc/journal");
}

// r0 admitted at seq 5, r1 at 6, r0 finished at 7, r1 at 8, r2 admitted at 9 and never finished;
// closed cleanly.
void WriteRollouts(const std::string& dir) {
  auto opened = journal::Journal::Open(dir, journal::Options{});
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  Bootstrap(**opened);
  Admit(**opened, "r0", 2000);
  Admit(**opened, "r1", 2001);
  Finish(**opened, "r0", 2002);
  Finish(**opened, "r1", 2003);
  Admit(**opened, "r2", 2004);
  ASSERT_EQ((*opened)->head_seq(), 9u);
}

// The rollout index's key for `seq` under `rollout_id` (journal/rocks_journal.cc: the id's length
// byte, the id, BE64(seq)).
std::string IndexKey(const std::string& rollout_id, std::uint64_t seq) {
  return std::string(1, static_cast<char>(rollout_id.size())) + rollout_id + SeqKey(seq);
}

// Proves the whole-journal audit finds a record its rollout index does not list (r0's finish
// deleted from the index) as a journal failure naming the seq and the rollout, exit 3, while the
// same journal with its index whole is OK; catches the audit that never read the index, which
// said OK of a journal whose `audit --rollout r0` showed r0 unfinished.
TEST(Verdict, ARecordTheRolloutIndexDoesNotListIsDamage) {
  TempDir dir;
  WriteRollouts(dir.path());
  const audit::AuditReport whole = AuditDir(dir.path());
  EXPECT_TRUE(whole.ok) << audit::FormatReport(whole);
  EditRaw(dir.path(), [](rocksdb::DB& db, const Cf& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[2], IndexKey("r0", 7)).ok());
  });
  const audit::AuditReport report = AuditDir(dir.path());
  const audit::AuditOutput out = audit::RenderAudit(report, audit::MakeVerdict(report), "j");
  EXPECT_EQ(out.exit_code, audit::kExitJournalDamaged) << out.text;
  EXPECT_NE(out.text.find("\naudit FAILURE: rollout index: seq 7 (RolloutFinished) names rollout "
                          "'r0' but the index does not list it under that id\n"),
            std::string::npos)
      << out.text;
}

// Proves the whole-journal audit finds the seqs its rollout index lists under a rollout that hold
// no record of it: r0's admission listed under r1, and a seq past the head under r2 (never
// finished, so only the end of the scan can tell), one journal failure each, exit 3; catches an
// index that lists more than a rollout's own records (what `audit --rollout` reads) passing the
// whole audit.
TEST(Verdict, SeqsTheRolloutIndexListsForAnotherRolloutAreDamage) {
  TempDir dir;
  WriteRollouts(dir.path());
  EditRaw(dir.path(), [](rocksdb::DB& db, const Cf& cf) {
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[2], IndexKey("r1", 5), "").ok());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[2], IndexKey("r2", 99), "").ok());
  });
  const audit::AuditReport report = AuditDir(dir.path());
  const audit::AuditOutput out = audit::RenderAudit(report, audit::MakeVerdict(report), "j");
  EXPECT_EQ(out.exit_code, audit::kExitJournalDamaged) << out.text;
  EXPECT_NE(out.text.find("\naudit FAILURE: rollout index: seq 5 is listed under 'r1' but the "
                          "record there is RolloutAdmitted of 'r0'\n"),
            std::string::npos)
      << out.text;
  EXPECT_NE(out.text.find("\naudit FAILURE: rollout index: seq 99 is listed under 'r2' but no "
                          "record is there"),
            std::string::npos)
      << out.text;
  EXPECT_EQ(report.failures.size(), 2u) << out.text;
}

// Proves a rollout id holding a quote is printed with the quote doubled inside its quotes, in a
// REVERIFY line and in a re-verification finding, so it cannot close the field and forge the
// line's verdict; catches `REVERIFY 'a': OK: 9 tokens compared': SKIPPED` from rollout
// "a': OK: 9 tokens compared" reading as an OK rollout 'a'.
TEST(Verdict, AQuoteInARolloutIdCannotForgeItsLine) {
  audit::ReverifyResult r;
  r.rollout_id = "a': OK: 9 tokens compared";
  r.detail = "engine unreachable";
  EXPECT_EQ(audit::FormatReverify(r),
            "REVERIFY 'a'': OK: 9 tokens compared': SKIPPED: engine unreachable");
  EXPECT_EQ(audit::FormatReverify(r).rfind("REVERIFY 'a': OK", 0), std::string::npos);

  audit::ReverifySummary s;
  r.checked = true;
  r.detail = "1 over tolerance";
  s.rollouts.push_back(r);
  s.trajectories = s.checked = s.failed = 1;
  const std::vector<std::string> findings = audit::ReverifyFindings(s);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0],
            "re-verification of rollout 'a'': OK: 9 tokens compared' failed: 1 over tolerance");
  EXPECT_EQ(audit::Quoted("it's"), "'it''s'");
}

// Proves the label the engine reports on /weight_info (the engine's text) is printed between
// quotes with each quote inside doubled in the digest check's line and finding, so it cannot close
// its field and forge the sentence; catches a plain-quoted label reading as "the engine reports
// 'x', which this journal committed; its weights are those of 'rc-0'".
TEST(Verdict, AQuoteInTheEnginesLabelCannotForgeTheDigestLine) {
  State s;
  s.label_digests = {{"rc-0", std::string(32, 'a')}};
  WeightDigest live;
  live.algorithm = "rcd1";
  live.combined = std::string(32, 'c');
  const std::string label = "x', which this journal committed; its weights are those of 'rc-0";
  const audit::DigestCheck c = audit::CheckEngineDigest(s, label, live);
  EXPECT_EQ(c.line,
            "weight digest: the engine reports 'x'', which this journal committed; its weights "
            "are those of ''rc-0', which this journal never committed with a digest; its weights "
            "cccccccccccccccc match no committed version");
  ASSERT_EQ(c.findings.size(), 1u);
  EXPECT_EQ(c.findings[0], c.line);
}

}  // namespace
}  // namespace rc
