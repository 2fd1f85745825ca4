// `rolloutcore replay` and `rolloutcore audit` as child processes on real RocksDB journals (no
// engine): a journal its open refuses exits as damaged, naming the damage; `replay --events`
// names each record's engine; every JSON line is printable ASCII that parses back to the text the
// journal holds; a torn WAL tail an executor's start recorded is reported after its WAL is gone;
// `replay --until` inside a group folds through its end; a report that cannot be written exits 4;
// a trajectories file is audited around its torn lines, and a binding mismatch names each field
// that differs; `audit --rollout` checks the rollout index; usage errors are refused before the
// audit runs; the replay command an unhealthy audit prints names a journal whose path begins with
// `-`; a FIFO where a file is read is refused at once.
#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "effects/clock.h"
#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/http/sequence_transfer.h"
#include "effects/runner.h"
#include "journal/journal.h"
#include "journal/json.h"
#include "replay/replay.h"
#include "tests/audit/cli_journals.h"
#include "tests/audit/printable_json.h"
#include "tests/audit/run_cli.h"
#include "statemachine/text.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"
#include "tests/statemachine/fleet_helpers.h"

namespace rc {
namespace {

namespace fs = std::filesystem;
using cli_testing::CliRun;
using cli_testing::HashOf;
using cli_testing::Lines;
using cli_testing::ReadOnly;
using cli_testing::RunCli;
using cli_testing::RunCliIn;
using cli_testing::RunCliStdoutTo;
using cli_testing::RunCliStdoutToClosedPipe;
using cli_testing::TrajectoryLine;
using cli_testing::WriteCleanJournal;
using journal::testing::EditRaw;
using journal::testing::SeqKey;
using journal::testing::TempDir;

// Bootstrap (4 records) + `admissions` admissions of one record each, snapshots every 10; closed
// cleanly, then its CLOSED record removed (as if it had crashed: the journal itself must tell).
void WriteCrashedJournal(const std::string& path, int admissions) {
  WriteCleanJournal(path, admissions, /*snapshot_every=*/10);
  fs::remove(path + "/CLOSED");
}

// Proves `audit` and `replay` exit 3 (journal damaged), both naming the damage, for a
// journal whose head lies below a stored snapshot and for one missing the record its snapshot
// continues from; catches the healthy, shorter journal the first read as, and the NotFound that
// made the second exit 2 (usage error).
TEST(Cli, JournalsTheOpenRefusesExitAsDamaged) {
  TempDir below;  // head 17 below the snapshot at 20: records 18..24 and the head lost
  WriteCrashedJournal(below.path(), 20);
  const journal::Hash hash_17 = HashOf(below.path(), 17);
  EditRaw(below.path(), [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    for (std::uint64_t seq = 18; seq <= 24; ++seq) {
      ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(seq)).ok());
    }
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_seq", SeqKey(17)).ok());
    const std::string hash(reinterpret_cast<const char*>(hash_17.data()), hash_17.size());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_hash", hash).ok());
  });
  TempDir hole;  // the record at seq 20, where the snapshot at 20 continues from, lost
  WriteCrashedJournal(hole.path(), 20);
  EditRaw(hole.path(), [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(20)).ok());
  });
  const std::vector<std::pair<std::string, std::string>> cases = {
      {below.path(), "snapshot at seq 20 lies past the head seq 17"},
      {hole.path(), "the record at seq 20 is missing, but the snapshot at seq 20 says it exists"}};
  for (const auto& [path, damage] : cases) {
    const CliRun audited = RunCli({"audit", path}, /*with_stderr=*/true);
    EXPECT_EQ(audited.exit_code, 3) << audited.out;
    EXPECT_NE(audited.out.find(damage), std::string::npos) << audited.out;
    const CliRun replayed = RunCli({"replay", path}, /*with_stderr=*/true);
    EXPECT_EQ(replayed.exit_code, 3) << replayed.out;  // damaged, as audit says
    EXPECT_NE(replayed.out.find(damage), std::string::npos) << replayed.out;
    EXPECT_EQ(replayed.out.find("verification: OK"), std::string::npos) << replayed.out;
  }
}

// Proves a record lost below the last snapshot, which the open does not read, makes `replay`
// exit 3 like `audit` once its full scan meets the gap; catches the exit 1 ("a decision
// differs") that replay gave for a damaged journal its open had accepted.
TEST(Cli, DamageOnlyAFullScanFindsExitsAsDamaged) {
  TempDir dir;
  WriteCrashedJournal(dir.path(), 20);
  EditRaw(dir.path(), [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(6)).ok());
  });
  const CliRun audited = RunCli({"audit", dir.path()}, /*with_stderr=*/true);
  EXPECT_EQ(audited.exit_code, 3) << audited.out;
  const CliRun replayed = RunCli({"replay", dir.path()}, /*with_stderr=*/true);
  EXPECT_EQ(replayed.exit_code, 3) << replayed.out;
  EXPECT_EQ(replayed.out.find("verification: OK"), std::string::npos) << replayed.out;
}

// Proves `replay --events` prints each record with the formatter the rest of replay uses, so a
// fleet's records name their engine ("[a] ", "[b] "); catches the command's own line format,
// which dropped the engine of every fleet record.
// A fleet's journal: engines "a" and "b" joined and bootstrapped; closed cleanly.
void WriteFleetJournal(const std::string& path) {
  test::FleetDriver d;
  d.join("a");
  d.join("b");
  d.bootstrap("a");
  d.bootstrap("b");
  journal::Options o;
  o.snapshot_every = 0;
  auto j = journal::Journal::Open(path, o);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (const FleetHistoryEntry& e : d.history) {
    if (e.cause_seq != 0) continue;
    auto s = (*j)->SubmitFleet(FleetEvent{e.engine, e.event}, 1700000000000);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*j)->Wait(s->ticket).ok());
  }
}

TEST(Cli, EventsLinesNameTheirEngine) {
  TempDir dir;
  WriteFleetJournal(dir.path());
  std::string expected;
  {
    auto j = journal::Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    ASSERT_TRUE((*j)->Scan(1, 0,
                           [&](const journal::Record& r) {
                             expected += replay::FormatRecordLine(r) + "\n";
                             return Status::OK();
                           })
                    .ok());
  }
  EXPECT_NE(expected.find("[a] "), std::string::npos) << expected;
  EXPECT_NE(expected.find("[b] "), std::string::npos) << expected;
  const CliRun run = RunCli({"replay", dir.path(), "--events"}, /*with_stderr=*/false);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  EXPECT_EQ(run.out.substr(0, expected.size()), expected);
}

using json_testing::CollectStrings;
using json_testing::PrintableAscii;

// Proves every line `replay --events --json`, `replay --json` and `audit --json` print is
// printable ASCII and parses, and that an engine's answer holding U+2028, NEL and DEL parses
// back to exactly what was recorded; catches raw line separators that split one JSON line.
TEST(Cli, JsonLinesArePrintableAscii) {
  const std::string answer =
      "0.25.1 line\xe2\x80\xa8"
      "sep\xc2\x85"
      "nel\x7f"
      "del";
  TempDir dir;
  {
    auto j = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    const HttpEvidence http{Transport::kOk, 200, true, 10, answer};
    for (const Event& e :
         std::vector<Event>{BootstrapRequested{"rc-0", journal::testing::SampleIdentity()},
                            EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000},
                            EngineProbed{http, answer, "rc-0", false, false, "i-0"}}) {
      auto s = (*j)->Submit(e, 1700000000000);
      ASSERT_TRUE(s.ok()) << text::escape_line(s.status().ToString());
      ASSERT_TRUE((*j)->Wait(s->ticket).ok());
    }
  }
  std::size_t round_trips = 0;
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"replay", dir.path(), "--events", "--json"},
        std::vector<std::string>{"replay", dir.path(), "--json"},
        std::vector<std::string>{"audit", dir.path(), "--json"}}) {
    const CliRun run = RunCli(args, /*with_stderr=*/false);
    ASSERT_FALSE(run.out.empty()) << args[0] << " printed nothing (exit " << run.exit_code << ")";
    for (const std::string& line : Lines(run.out)) {
      EXPECT_TRUE(PrintableAscii(line)) << args[0] << ": " << text::escape_line(line);
      const nlohmann::json parsed = nlohmann::json::parse(line, nullptr, false);
      ASSERT_FALSE(parsed.is_discarded()) << args[0] << ": " << text::escape_line(line);
      std::vector<std::string> strings;
      CollectStrings(parsed, strings);
      round_trips += static_cast<std::size_t>(std::count(strings.begin(), strings.end(), answer));
    }
  }
  EXPECT_GT(round_trips, 0u) << "the engine's answer never parsed back as recorded";
}

// Proves `audit --engine URL` on a journal whose full scan meets damage (a record lost below the
// last snapshot) prints the whole report, the unreadable trajectories among its journal
// failures, and exits 3; catches the exit 2 with no report, when the journal's trajectories
// could not be read and that was taken for a usage error.
TEST(Cli, AuditWithAnEngineReportsADamagedJournalAsDamaged) {
  TempDir dir;
  WriteCrashedJournal(dir.path(), 20);
  EditRaw(dir.path(), [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(6)).ok());
  });
  for (bool json : {false, true}) {
    std::vector<std::string> args = {"audit", "--engine", "http://127.0.0.1:1", dir.path()};
    if (json) args.push_back("--json");
    const CliRun run = RunCli(args, /*with_stderr=*/!json);
    EXPECT_EQ(run.exit_code, 3) << run.out;
    if (json) {
      const nlohmann::json verdict = nlohmann::json::parse(run.out, nullptr, false);
      ASSERT_FALSE(verdict.is_discarded()) << run.out;
      EXPECT_NE(verdict.dump().find("trajectories in the journal: "), std::string::npos) << run.out;
      continue;
    }
    EXPECT_NE(run.out.find("audit FAILURE: trajectories in the journal: "), std::string::npos)
        << run.out;
    EXPECT_NE(run.out.find("seq 6 is missing"), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("\naudit: JOURNAL DAMAGED"), std::string::npos) << run.out;
  }
}

// Bootstrap + `admissions` admissions, never closed cleanly (the journal is stopped: its records
// live in the WAL only), then the WAL cut 9 bytes into its last batch: a torn tail.
void WriteTornJournal(const std::string& path, int admissions, const std::string& label = "rc-0") {
  fs::path wal;
  std::uintmax_t before_last = 0;
  {
    journal::Options o;
    o.snapshot_every = 0;
    // The durable mark covers the first group only: the cut last batch reads as a crash's torn
    // tail, never as acknowledged records lost (which the open refuses).
    o.durable_mark_interval_ms = 600000;
    auto j = journal::Journal::Open(path, o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : journal::testing::BootstrapGroups()) {
      for (Event& e : g) {
        if (auto* b = std::get_if<BootstrapRequested>(&e)) b->label = label;
        if (auto* p = std::get_if<EngineProbed>(&e)) p->reported_label = label;
        if (auto* c = std::get_if<StateChanged>(&e)) {
          c->detail = "engine 0.25.1 reports '" + label + "', instance 'i-0'";
        }
      }
      ASSERT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
    }
    for (const auto& e : fs::directory_iterator(path)) {
      if (e.path().extension() == ".log") wal = e.path();
    }
    ASSERT_FALSE(wal.empty());
    for (int i = 0; i < admissions; ++i) {
      before_last = fs::file_size(wal);
      ASSERT_TRUE((*j)->Append(journal::testing::Group(
                                   {make_admission((*j)->state(), "r" + std::to_string(i))}))
                      .ok());
    }
    (*j)->Stop(Status::Unavailable("stopped by the test: no clean close"));
  }
  fs::resize_file(wal, before_last + 9);
}

// Proves replay's verdict line is chosen from what it verified, not found in its text: a torn
// journal whose committed label reads "verification: OK" prints one verdict, FAILED, and no line
// starting with OK. Catches the torn verdict appended after a report whose state line held the
// words, leaving the intact-journal "verification: OK" line in place above it.
TEST(Cli, ALabelReadingVerificationOkKeepsNoOkVerdictOnATornJournal) {
  TempDir dir;
  WriteTornJournal(dir.path(), 8, "verification: OK (hash chain)");
  const CliRun replayed = RunCli({"replay", dir.path()}, /*with_stderr=*/false);
  EXPECT_EQ(replayed.exit_code, 1) << replayed.out;
  ASSERT_NE(replayed.out.find("'verification: OK (hash chain)'"), std::string::npos)
      << "the label is not in the report: " << replayed.out;
  int ok_lines = 0;
  int failed_lines = 0;
  std::istringstream lines(replayed.out);
  for (std::string line; std::getline(lines, line);) {
    ok_lines += line.rfind("verification: OK", 0) == 0 ? 1 : 0;
    failed_lines += line.rfind("verification: FAILED", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(ok_lines, 0) << replayed.out;
  EXPECT_EQ(failed_lines, 1) << replayed.out;
}

// Proves `audit --rollout ID --json` on a journal with a torn WAL tail prints exactly one JSON
// document on stdout (the damage on stderr) and exits 3; catches the torn-tail line printed on
// stdout after the JSON, which no JSON reader of stdout could parse.
TEST(Cli, ProvenanceJsonOfATornJournalIsOneDocument) {
  TempDir dir;
  WriteTornJournal(dir.path(), 8);
  const CliRun out = RunCli({"audit", "--rollout", "r0", "--json", dir.path()}, false);
  EXPECT_EQ(out.exit_code, 3) << out.out;
  const nlohmann::json p = nlohmann::json::parse(out.out, nullptr, false);
  ASSERT_FALSE(p.is_discarded()) << out.out;
  EXPECT_NE(out.out.find("\"r0\""), std::string::npos) << out.out;
  const CliRun all = RunCli({"audit", "--rollout", "r0", "--json", dir.path()}, true);
  EXPECT_NE(all.out.find("audit: JOURNAL DAMAGED: torn WAL tail"), std::string::npos) << all.out;
}

// Starts an executor on the journal at `path` as serve does (the writer's open, then the runner's
// recovery given what the open found), then closes it cleanly: its WAL, torn tail included, is
// gone. The engine is never called: the start only journals. Returns the open's torn tail and the
// seq of the RecoveryStarted that recorded it.
std::pair<std::string, std::uint64_t> StartExecutorAndClose(const std::string& path) {
  auto j = journal::Journal::Open(path, journal::Options{});
  EXPECT_TRUE(j.ok()) << j.status().ToString();
  if (!j.ok()) return {};
  const journal::Recovery opened = (*j)->recovery();
  effects::EngineClient client("http://127.0.0.1:1");
  effects::HttpEngineControl control(client);
  effects::HttpSequenceTransfer transfer(client);
  effects::RunnerOptions ro;
  ro.executor_id = "serve-2";
  effects::Runner runner(**j, control, transfer, effects::system_clock(), ro);
  const std::uint64_t seq = (*j)->head_seq() + 1;
  const Status begun = runner.BeginRecovery(opened);
  EXPECT_TRUE(begun.ok()) << begun.ToString();
  const Status closed = (*j)->Close();
  EXPECT_TRUE(closed.ok()) << closed.ToString();
  return {opened.torn_tail, seq};
}

// Proves a torn WAL tail found by an executor's start is reported by `replay` and `audit` after
// the journal was written on and closed cleanly, when no open sees the tail any more: the start's
// RecoveryStarted records it, replay lists it with that seq and fails its verdict (exit 1, JSON
// recorded_torn_tails), audit names the record as a journal failure (exit 3). Catches the incident
// forgotten once the WAL that showed it was flushed away (both commands then said OK).
TEST(Cli, ATornTailAnExecutorStartRecordedIsReportedAfterItsWalIsGone) {
  TempDir dir;
  WriteTornJournal(dir.path(), 8);
  const auto [torn, seq] = StartExecutorAndClose(dir.path());
  ASSERT_FALSE(torn.empty()) << "the setup tore no WAL tail";
  {
    auto reopened = journal::Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
    ASSERT_TRUE((*reopened)->recovery().torn_tail.empty()) << "the WAL still shows the tail";
    ASSERT_TRUE((*reopened)->recovery().clean_close);
    const Result<journal::Record> record = (*reopened)->Read(seq);
    ASSERT_TRUE(record.ok()) << record.status().ToString();
    const auto* rs = std::get_if<RecoveryStarted>(&record->event);
    ASSERT_NE(rs, nullptr) << "seq " << seq << " is not the start's RecoveryStarted";
    EXPECT_EQ(rs->journal_ending, JournalEnding::kTornTail);
    EXPECT_EQ(rs->journal_torn_tail, torn);
  }
  const std::string at = "seq " + std::to_string(seq);
  const CliRun replayed = RunCli({"replay", dir.path()}, /*with_stderr=*/true);
  EXPECT_EQ(replayed.exit_code, 1) << replayed.out;
  EXPECT_NE(
      replayed.out.find("verification: FAILED: torn WAL tail recorded at " + at + ": " + torn),
      std::string::npos)
      << replayed.out;
  EXPECT_NE(replayed.out.find("TORN WAL TAIL recorded at " + at), std::string::npos)
      << replayed.out;
  const CliRun events = RunCli({"replay", dir.path(), "--events"}, false);
  EXPECT_NE(events.out.find("journal=torn_tail"), std::string::npos) << events.out;
  const nlohmann::json report =
      nlohmann::json::parse(RunCli({"replay", dir.path(), "--json"}, false).out, nullptr, false);
  ASSERT_FALSE(report.is_discarded());
  EXPECT_EQ(report["ok"], false) << report.dump();
  EXPECT_FALSE(report.contains("torn_tail")) << "this open found no torn tail: " << report.dump();
  ASSERT_EQ(report["recorded_torn_tails"].size(), 1u) << report.dump();
  EXPECT_EQ(report["recorded_torn_tails"][0]["seq"], seq);
  EXPECT_EQ(report["recorded_torn_tails"][0]["sentence"], torn);
  const CliRun audited = RunCli({"audit", dir.path()}, /*with_stderr=*/true);
  EXPECT_EQ(audited.exit_code, 3) << audited.out;
  EXPECT_NE(audited.out.find("audit FAILURE: " + at +
                             " (RecoveryStarted) recorded what the "
                             "journal's open before that executor start found: " +
                             torn),
            std::string::npos)
      << audited.out;
  const nlohmann::json verdict =
      nlohmann::json::parse(RunCli({"audit", dir.path(), "--json"}, false).out, nullptr, false);
  ASSERT_FALSE(verdict.is_discarded());
  EXPECT_EQ(verdict["journal_intact"], false) << verdict.dump();
  ASSERT_EQ(verdict["recorded_torn_tails"].size(), 1u) << verdict.dump();
  EXPECT_EQ(verdict["recorded_torn_tails"][0]["seq"], seq);
}

// Proves `replay --until 3`, where seq 3 is the input of a group that ends at seq 4, verifies a
// healthy journal (exit 0), folds through seq 4 and says so, with --events and --json listing the
// same records; and that an --until past the head is a usage error (exit 2) naming the head, never
// "verification: FAILED". Catches the cut group reported as "non-determinism: decide() derives 1
// decisions for seq 3 but 0 were recorded" (exit 1), and the scan's InvalidArgument printed as
// "verification: FAILED at seq 1".
TEST(Cli, ReplayUntilInsideAGroupFoldsThroughItsEnd) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);  // head 6
  const CliRun text = RunCli({"replay", dir.path(), "--until", "3"}, /*with_stderr=*/true);
  EXPECT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("records: 4 (inputs re-decided: 3), last seq 4\n"
                          "until: seq 3 lies inside the group of input seq 3 (seqs 3-4)"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("state: READY"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("verification: OK"), std::string::npos) << text.out;
  const CliRun at_end = RunCli({"replay", dir.path(), "--until", "4"}, true);
  EXPECT_EQ(at_end.exit_code, 0) << at_end.out;
  EXPECT_NE(at_end.out.find("until: the state after seq 4, the end of the group of input seq 3"),
            std::string::npos)
      << at_end.out;
  const CliRun events = RunCli({"replay", dir.path(), "--until", "3", "--events"}, false);
  EXPECT_EQ(events.exit_code, 0) << events.out;
  const std::vector<std::string> lines = Lines(events.out);
  ASSERT_GE(lines.size(), 5u) << events.out;
  EXPECT_EQ(lines[3].rfind("       4   -> StateChanged", 0), 0u) << events.out;
  EXPECT_EQ(lines[4].rfind("records: 4 ", 0), 0u) << events.out;
  const CliRun json = RunCli({"replay", dir.path(), "--until", "3", "--json"}, false);
  EXPECT_EQ(json.exit_code, 0) << json.out;
  const nlohmann::json parsed = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << json.out;
  EXPECT_EQ(parsed["ok"], true) << json.out;
  EXPECT_EQ(parsed["until"]["requested"], 3) << json.out;
  EXPECT_EQ(parsed["until"]["group_input_seq"], 3) << json.out;
  EXPECT_EQ(parsed["until"]["folded_through"], 4) << json.out;
  for (bool as_json : {false, true}) {
    std::vector<std::string> args = {"replay", dir.path(), "--until", "7", "--events"};
    if (as_json) args.push_back("--json");
    const CliRun past = RunCli(args, /*with_stderr=*/true);
    EXPECT_EQ(past.exit_code, 2) << past.out;
    EXPECT_NE(past.out.find("rolloutcore replay: --until '7': seq 7 lies past the journal's head "
                            "(seq 6)"),
              std::string::npos)
        << past.out;
    EXPECT_EQ(past.out.find("FAILED"), std::string::npos) << past.out;
    EXPECT_EQ(past.out.find("records:"), std::string::npos) << past.out;
  }
}

// Proves `replay` and `audit` whose stdout cannot take their report (/dev/full) exit 4, distinct
// from every verdict, with one line on stderr saying so, while the same commands with a writable
// stdout exit 0; catches the exit 0 they gave when no printf was checked and stdout was never
// flushed before exit.
TEST(Cli, AReportThatCannotBeWrittenExitsFour) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);
  const std::vector<std::vector<std::string>> commands = {{"replay", dir.path()},
                                                          {"replay", dir.path(), "--json"},
                                                          {"replay", dir.path(), "--events"},
                                                          {"audit", dir.path()},
                                                          {"audit", dir.path(), "--json"},
                                                          {"audit", dir.path(), "--rollout", "r0"}};
  for (const std::vector<std::string>& args : commands) {
    const std::string what = args[0] + (args.size() > 2 ? " " + args[2] : "");
    const CliRun written = RunCliStdoutTo(args, "/dev/null");
    EXPECT_EQ(written.exit_code, 0) << what << ": " << written.out;
    const CliRun full = RunCliStdoutTo(args, "/dev/full");
    EXPECT_EQ(full.exit_code, 4) << what << ": " << full.out;
    const std::string expected =
        "rolloutcore " + args[0] + ": the report could not be written to stdout";
    EXPECT_NE(full.out.find(expected), std::string::npos) << what << ": " << full.out;
  }
}

// Proves a report sent into a pipe whose reader has gone (`| head` that exited) ends with exit 4
// and the message on stderr. Catches the process killed by SIGPIPE (exit 141 in the shell), with
// nothing said and no verdict's code.
TEST(Cli, AReportIntoAClosedPipeExitsFour) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 400);  // its --events listing is far larger than a pipe's buffer
  const CliRun run = RunCliStdoutToClosedPipe({"replay", dir.path(), "--events"});
  EXPECT_NE(run.out.find("exit 4"), std::string::npos) << run.out.substr(0, 400);
  EXPECT_NE(run.out.find("rolloutcore replay: the report could not be written to stdout"),
            std::string::npos)
      << run.out.substr(0, 400);
}

// Proves `audit --trajectories` reads a file around its torn lines (one mid-file, as the writer
// leaves after a crash and starts the next record on a fresh line, and one at its end with no
// newline): the two trajectories are cross-checked, the torn lines are a note naming them and the
// verdict stays OK (exit 0); a damaged line (complete, not a trajectory) is an engine finding
// (exit 1) and the rest is still read. Catches the whole file refused as a usage error (exit 2).
TEST(Cli, AuditReadsATrajectoriesFileAroundItsTornLines) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);  // r0 admitted at seq 5, r1 at seq 6
  // Lines of rollouts that recorded no tokens yet, as the journal holds none for them.
  const auto tokenless = [&](std::uint64_t seq) {
    nlohmann::json line = cli_testing::TrajectoryJson(dir.path(), seq);
    line["prompt_token_ids"] = nlohmann::json::array();
    line["outputs"] = nlohmann::json::array();
    return line.dump();
  };
  const std::string r0 = tokenless(5);
  const std::string r1 = tokenless(6);
  const std::string file = dir.sub("t.jsonl");
  std::ofstream(file) << r0 << "\n" << r1.substr(0, 40) << "\n" << r1 << "\n" << r0.substr(0, 25);
  const CliRun torn = RunCli({"audit", dir.path(), "--trajectories", file}, /*with_stderr=*/true);
  EXPECT_EQ(torn.exit_code, 0) << torn.out;
  EXPECT_NE(torn.out.find("trajectories file: 2, binding mismatches: 0, lines skipped: 2 (torn 2, "
                          "damaged 0)"),
            std::string::npos)
      << torn.out;
  EXPECT_NE(torn.out.find("audit NOTE: trajectories file " + file + ": 2 torn lines skipped"),
            std::string::npos)
      << torn.out;
  EXPECT_NE(torn.out.find("line 2 (cut short after 40 bytes), line 4 (cut short after 25 bytes)"),
            std::string::npos)
      << torn.out;
  EXPECT_NE(torn.out.find("\naudit: OK\n"), std::string::npos) << torn.out;

  std::ofstream(file, std::ios::trunc) << r0 << "\n{\"rollout_id\": 7}\n"
                                       << r1 << "\n"
                                       << r0.substr(0, 25);
  const CliRun damaged = RunCli({"audit", dir.path(), "--trajectories", file}, true);
  EXPECT_EQ(damaged.exit_code, 1) << damaged.out;
  EXPECT_NE(damaged.out.find("lines skipped: 2 (torn 1, damaged 1)"), std::string::npos)
      << damaged.out;
  EXPECT_NE(damaged.out.find("audit ENGINE: trajectories file " + file +
                             ": 1 lines hold no trajectory and are not what its writer leaves "
                             "(the file was damaged or edited), skipped: line 2 (a field has the "
                             "wrong type or range)"),
            std::string::npos)
      << damaged.out;
  const CliRun json = RunCli({"audit", dir.path(), "--trajectories", file, "--json"}, false);
  EXPECT_EQ(json.exit_code, 1) << json.out;
  const nlohmann::json verdict = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(verdict.is_discarded()) << json.out;
  ASSERT_EQ(verdict["notes"].size(), 1u) << json.out;
  EXPECT_NE(verdict["notes"][0].get<std::string>().find("line 4 (cut short after 25 bytes)"),
            std::string::npos)
      << json.out;
  EXPECT_EQ(verdict["exit_code"], 1) << json.out;
}

// A trajectory's field as a binding finding quotes it: a string in quotes, a number as is.
std::string Quoted(const nlohmann::json& v) {
  return v.is_string() ? "'" + v.get<std::string>() + "'" : v.dump();
}

// Runs `audit --trajectories` over `lines` (written to a file in `dir`) on the journal at `dir`.
CliRun AuditTrajectories(const TempDir& dir, const std::vector<nlohmann::json>& lines, bool json) {
  const std::string file = dir.sub("t.jsonl");
  std::ofstream out(file, std::ios::trunc);
  for (const nlohmann::json& l : lines) out << l.dump() << "\n";
  out.close();
  std::vector<std::string> args = {"audit", dir.path(), "--trajectories", file};
  if (json) args.push_back("--json");
  return RunCli(args, /*with_stderr=*/false);
}

// Proves `audit --trajectories` names every binding field a trajectory line changed with the value
// the line claims and the value the journal bound (each of the seven alone, two at once, and a
// hostile checkpoint as one escaped line that --json parses back whole), catching "claims version
// 'rc-0' but the journal bound it to 'rc-0' (seq 6)" for an edited manifest digest or checkpoint.
TEST(Cli, AuditNamesEveryBindingFieldATrajectoryChanged) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);  // r0 admitted at seq 5, r1 at seq 6
  const nlohmann::json bound = cli_testing::TrajectoryJson(dir.path(), 6);
  using Pointer = nlohmann::json::json_pointer;
  const std::vector<std::pair<std::string, nlohmann::json>> edits = {
      {"/version/generation", bound["version"]["generation"].get<std::uint64_t>() + 5},
      {"/version/label", "rc-forged"},
      {"/identity/manifest_digest", "forged-manifest"},
      {"/identity/content_digest", "forged-content"},
      {"/identity/checkpoint", "/ckpt/forged"},
      {"/identity/run", "run-forged"},
      {"/identity/step", bound["identity"]["step"].get<std::int64_t>() + 1}};
  // "FIELD is CLAIMED in the trajectory, BOUND in the journal" for the edit at `at`.
  auto differs = [&](const std::string& at, const nlohmann::json& claimed) {
    std::string field = at.substr(1);
    field[field.find('/')] = '.';
    return field + " is " + Quoted(claimed) + " in the trajectory, " + Quoted(bound[Pointer(at)]) +
           " in the journal";
  };
  const std::string prefix = "  MISMATCH: trajectory 'r1' differs from its binding at seq 6: ";
  for (const auto& [at, claimed] : edits) {
    nlohmann::json edited = bound;
    edited[Pointer(at)] = claimed;
    const CliRun run = AuditTrajectories(dir, {edited}, /*json=*/false);
    EXPECT_EQ(run.exit_code, 1) << at << ": " << run.out;
    EXPECT_NE(run.out.find(prefix + differs(at, claimed) + "\n"), std::string::npos)
        << at << ": " << run.out;
  }
  nlohmann::json two = bound;
  two["identity"]["manifest_digest"] = "forged-manifest";
  two["identity"]["checkpoint"] = "/ckpt/forged";
  const CliRun both = AuditTrajectories(dir, {two}, /*json=*/false);
  EXPECT_NE(both.out.find(prefix + differs("/identity/manifest_digest", "forged-manifest") + "; " +
                          differs("/identity/checkpoint", "/ckpt/forged") + "\n"),
            std::string::npos)
      << both.out;

  const std::string hostile = "/ckpt/a\n  MISMATCH: none\x1b[2K\\n";
  nlohmann::json forged = bound;
  forged["identity"]["checkpoint"] = hostile;
  const std::string finding =
      prefix.substr(std::string("  MISMATCH: ").size()) + differs("/identity/checkpoint", hostile);
  const CliRun text_run = AuditTrajectories(dir, {forged}, /*json=*/false);
  EXPECT_NE(text_run.out.find("  MISMATCH: " + text::escape_line(finding) + "\n"),
            std::string::npos)
      << text_run.out;
  EXPECT_NE(text_run.out.find("audit ENGINE: " + text::escape_line(finding) + "\n"),
            std::string::npos)
      << text_run.out;
  const CliRun json_run = AuditTrajectories(dir, {forged}, /*json=*/true);
  EXPECT_EQ(json_run.exit_code, 1) << json_run.out;
  const nlohmann::json verdict = nlohmann::json::parse(json_run.out, nullptr, false);
  ASSERT_FALSE(verdict.is_discarded()) << json_run.out;
  EXPECT_NE(std::find(verdict["engine_findings"].begin(), verdict["engine_findings"].end(),
                      nlohmann::json(finding)),
            verdict["engine_findings"].end())
      << json_run.out;
}

// Proves a trajectory line whose admission_seq is not its rollout's admission is reported with
// what that seq holds (another rollout's admission, named; a record of another kind, named);
// catches the bare "which is not its admission" that left the reader to find out why.
TEST(Cli, AuditSaysWhatTheSeqATrajectoryNamesHolds) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);  // r0 admitted at seq 5, r1 at seq 6; seq 4 a StateChanged
  nlohmann::json other = cli_testing::TrajectoryJson(dir.path(), 5);
  other["admission_seq"] = 6;
  nlohmann::json decision = cli_testing::TrajectoryJson(dir.path(), 5);
  decision["admission_seq"] = 4;
  const CliRun run = AuditTrajectories(dir, {other, decision}, /*json=*/false);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("  MISMATCH: trajectory 'r0' names admission seq 6, which is not its "
                         "admission: seq 6 admits rollout 'r1'\n"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("  MISMATCH: trajectory 'r0' names admission seq 4, which is not its "
                         "admission: seq 4 holds StateChanged, no admission\n"),
            std::string::npos)
      << run.out;
}

// Proves replay and audit of a journal a writer holds say on stderr that its WAL tail and
// leftover-table checks were skipped, and say nothing of it once the writer has closed it; catches
// the "verification: OK" of a live journal that a reader took for the full check.
TEST(Cli, AJournalAWriterHoldsIsSaidToSkipItsTailChecks) {
  TempDir dir;
  const std::string note = "another process holds this journal's LOCK";
  std::map<std::string, int> live_exit;
  {
    auto writer = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    for (auto& g : journal::testing::BootstrapGroups()) {
      ASSERT_TRUE((*writer)->Append(journal::testing::Group(g)).ok());
    }
    for (const char* command : {"replay", "audit"}) {
      const CliRun live = RunCli({command, dir.path()}, /*with_stderr=*/true);
      EXPECT_NE(live.out.find(std::string("rolloutcore ") + command + ": note: " + note),
                std::string::npos)
          << live.out;
      live_exit[command] = live.exit_code;
    }
  }
  for (const char* command : {"replay", "audit"}) {
    const CliRun closed = RunCli({command, dir.path()}, /*with_stderr=*/true);
    EXPECT_EQ(closed.out.find(note), std::string::npos) << closed.out;
    EXPECT_EQ(closed.exit_code, live_exit[command]) << closed.out;  // the same verdict
  }
}

// Bootstrap (seqs 1..4), r0 admitted at seq 5, r1 at 6, r0 finished at 7, r1 at 8; closed
// cleanly.
void WriteFinishedJournal(const std::string& path) {
  auto j = journal::Journal::Open(path, journal::Options{});
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (auto& g : journal::testing::BootstrapGroups()) {
    ASSERT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
  }
  for (const Event& e :
       std::vector<Event>{make_admission((*j)->state(), "r0"), make_admission((*j)->state(), "r1"),
                          RolloutFinished{"r0", RolloutOutcome::kCompleted, 1, 1},
                          RolloutFinished{"r1", RolloutOutcome::kCompleted, 1, 1}}) {
    ASSERT_TRUE((*j)->Append(journal::testing::Group({e})).ok());
  }
  ASSERT_EQ((*j)->head_seq(), 8u);
}

// The rollout index's key for `seq` under `rollout_id` (journal/rocks_journal.cc: the id's length
// byte, the id, BE64(seq)).
std::string IndexKey(const std::string& rollout_id, std::uint64_t seq) {
  return std::string(1, static_cast<char>(rollout_id.size())) + rollout_id + SeqKey(seq);
}

void DeleteIndexKey(const std::string& path, const std::string& rollout_id, std::uint64_t seq) {
  EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[2], IndexKey(rollout_id, seq)).ok());
  });
}

// Proves `audit --rollout r0` checks its rollout index against the records: an index that lost
// r0's finish, then r0's admission too, exits 3 naming the record it does not list, and prints
// no provenance; catches the provenance that trusted the index and showed r0 unfinished (exit 0),
// then said there was no rollout 'r0' (exit 2).
TEST(Cli, ProvenanceChecksTheRolloutIndexAgainstTheRecords) {
  TempDir dir;
  WriteFinishedJournal(dir.path());
  const CliRun whole = RunCli({"audit", "--rollout", "r0", "--json", dir.path()}, false);
  EXPECT_EQ(whole.exit_code, 0) << whole.out;
  const nlohmann::json p = nlohmann::json::parse(whole.out, nullptr, false);
  ASSERT_FALSE(p.is_discarded()) << whole.out;
  EXPECT_EQ(p["finished_seq"], 7) << whole.out;
  const std::vector<std::pair<std::uint64_t, std::string>> lost = {
      {7, "seq 7 (RolloutFinished) names rollout 'r0' but the rollout index does not list it"},
      {5, "seq 5 (RolloutAdmitted) names rollout 'r0' but the rollout index does not list it"}};
  for (const auto& [seq, damage] : lost) {
    DeleteIndexKey(dir.path(), "r0", seq);
    const CliRun out = RunCli({"audit", "--rollout", "r0", "--json", dir.path()}, false);
    EXPECT_EQ(out.exit_code, 3) << seq << ": " << out.out;
    EXPECT_EQ(out.out, "") << seq;
    const CliRun all = RunCli({"audit", "--rollout", "r0", dir.path()}, true);
    EXPECT_EQ(all.exit_code, 3) << seq << ": " << all.out;
    EXPECT_NE(all.out.find("rolloutcore audit: Corruption: " + damage), std::string::npos)
        << seq << ": " << all.out;
  }
}

// Proves every usage error of `audit` is refused before the audit runs: one `rolloutcore audit:`
// line on stderr naming it, nothing on stdout, exit 2 (--engine on a fleet's journal without
// --fleet-engine or with one naming no engine of it, --fleet-engine on a journal of one engine or
// without --engine, --rollout with --engine, a malformed --expect-head, a --trajectories file that
// cannot be read). Catches the report lines printed before a usage error found after the audit
// dropped its verdict ("trajectories in the journal: N" on stdout, exit 2), and a malformed
// --expect-head audited as damage (the whole report, exit 3).
TEST(Cli, AuditUsageErrorsAreRefusedBeforeTheAudit) {
  TempDir fleet;
  WriteFleetJournal(fleet.path());
  TempDir one;
  WriteCleanJournal(one.path(), 1);
  const std::string engine = "http://127.0.0.1:1";
  const std::string missing = one.sub("missing.jsonl");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"audit", fleet.path(), "--engine", engine},
       "the journal holds a fleet: name the engine with --fleet-engine"},
      {{"audit", fleet.path(), "--engine", engine, "--fleet-engine", "c"},
       "no engine 'c' in the fleet"},
      {{"audit", one.path(), "--engine", engine, "--fleet-engine", "a"},
       "--fleet-engine names an engine of a fleet's journal"},
      {{"audit", one.path(), "--fleet-engine", "a"},
       "--fleet-engine names the engine --engine is: give --engine too"},
      {{"audit", one.path(), "--rollout", "r0", "--engine", engine},
       "--rollout shows one rollout's provenance: "},
      {{"audit", one.path(), "--expect-head", "7"},
       "--expect-head: '7' is not SEQ:HEXHASH (missing ':')"},
      {{"audit", one.path(), "--trajectories", missing},
       "NotFound: cannot open trajectories file " + missing}};
  for (const auto& [args, why] : cases) {
    const CliRun out = RunCli(args, /*with_stderr=*/false);
    EXPECT_EQ(out.exit_code, 2) << why << ": " << out.out;
    EXPECT_EQ(out.out, "") << why;
    const CliRun all = RunCli(args, /*with_stderr=*/true);
    EXPECT_EQ(all.out.rfind("rolloutcore audit: " + why, 0), 0u) << all.out;
    EXPECT_EQ(Lines(all.out).size(), 1u) << all.out;
  }
}

// Bootstrap, then r0 and r1 each admitted, given one trajectory part (prompt 1,2,3; output 4,5
// with logprobs -0.25, -1.5) and finished, and r2 admitted and finished with no trajectory;
// closed cleanly. Returns each rollout's seqs (its admission first, then its part).
std::map<std::string, std::vector<std::uint64_t>> WriteTrajectoryJournal(
    const std::string& path, const std::vector<float>& logprobs = {-0.25f, -1.5f}) {
  std::map<std::string, std::vector<std::uint64_t>> seqs;
  auto j = journal::Journal::Open(path, journal::Options{});
  EXPECT_TRUE(j.ok()) << j.status().ToString();
  if (!j.ok()) return seqs;
  for (auto& g : journal::testing::BootstrapGroups()) {
    EXPECT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
  }
  const auto submit = [&](const Event& e) {
    auto s = (*j)->Submit(e, 1700000000000);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*j)->Wait(s->ticket).ok());
  };
  for (const std::string id : {"r0", "r1", "r2"}) {
    submit(make_admission((*j)->state(), id));
    if (id != "r2") submit(TrajectoryRecorded{id, 0, {1, 2, 3}, {4, 5}, logprobs});
    submit(RolloutFinished{id, RolloutOutcome::kCompleted, 3, 2});
    seqs[id] = (*j)->RolloutSeqs(id).value();
  }
  EXPECT_TRUE((*j)->Close().ok());
  return seqs;
}

// r0's, r1's or r2's line as serve writes it for the journal above (r2: no tokens).
nlohmann::json JournaledLine(const std::string& path, std::uint64_t admission_seq, bool tokens) {
  nlohmann::json line = cli_testing::TrajectoryJson(path, admission_seq);
  line["truncated"] = false;
  if (!tokens) {
    line["prompt_token_ids"] = nullptr;
    line["outputs"] = nlohmann::json::array();
    return line;
  }
  line["outputs"][0]["logprobs"] = {-0.25, -1.5};
  return line;
}

// Proves `audit --trajectories` holds each line against the journal's own trajectory of its
// rollout: forged tokens and logprobs, emptied outputs, a nulled prompt, a duplicated line, tokens
// for a rollout the journal recorded none for and an admitting engine the journal never named are
// findings naming the rollout, its line and the seq of its TrajectoryRecorded, and a deleted or
// torn line is a note naming the rollout the file lacks. Catches the audit that compared only the
// binding and re-verified the file's tokens in place of the journal's (forgeries passed, an
// emptied line turned a failing rollout SKIPPED, a deleted line went unnoticed).
TEST(Cli, AuditHoldsTrajectoryLinesAgainstTheJournal) {
  TempDir dir;
  const auto seqs = WriteTrajectoryJournal(dir.path());
  ASSERT_EQ(seqs.size(), 3u);
  const std::uint64_t part1 = seqs.at("r1").at(1);
  const nlohmann::json r0 = JournaledLine(dir.path(), seqs.at("r0").at(0), true);
  const nlohmann::json r1 = JournaledLine(dir.path(), seqs.at("r1").at(0), true);
  const nlohmann::json r2 = JournaledLine(dir.path(), seqs.at("r2").at(0), false);
  const CliRun honest = AuditTrajectories(dir, {r0, r1, r2}, /*json=*/false);
  EXPECT_EQ(honest.exit_code, 0) << honest.out;
  EXPECT_NE(honest.out.find("lines the journal contradicts: 0, journal trajectories without a "
                            "line: 0\n"),
            std::string::npos)
      << honest.out;
  EXPECT_NE(honest.out.find("\naudit: OK\n"), std::string::npos) << honest.out;

  const std::string differs =
      "  MISMATCH: trajectory 'r1' (line 2) differs from the journal's "
      "trajectory (TrajectoryRecorded from seq " +
      std::to_string(part1) + "): ";
  nlohmann::json forged = r1;
  forged["outputs"][0]["token_ids"] = {4, 6};
  forged["outputs"][0]["logprobs"] = {-0.25, -0.5};
  nlohmann::json emptied = r1;
  emptied["outputs"] = nlohmann::json::array();
  nlohmann::json nulled = r1;
  nulled["prompt_token_ids"] = nullptr;
  const std::vector<std::pair<nlohmann::json, std::string>> edits = {
      {forged,
       "outputs[0].token_ids[1] is 6 in the line, 5 in the journal; outputs[0].logprobs[1] is "
       "-0.5 in the line, -1.5 in the journal"},
      {emptied,
       "outputs[0].token_ids has 0 entries in the line, 2 in the journal; "
       "outputs[0].logprobs[0] is null in the line, -0.25 in the journal (and 1 more)"},
      {nulled, "prompt_token_ids has 0 entries in the line, 3 in the journal"}};
  for (const auto& [line, why] : edits) {
    const CliRun run = AuditTrajectories(dir, {r0, line, r2}, /*json=*/false);
    EXPECT_EQ(run.exit_code, 1) << why << ": " << run.out;
    EXPECT_NE(run.out.find(differs + why + "\n"), std::string::npos) << run.out;
  }

  const CliRun deleted = AuditTrajectories(dir, {r0, r2}, /*json=*/false);
  EXPECT_NE(deleted.out.find("journal trajectories without a line: 1\n"), std::string::npos)
      << deleted.out;
  EXPECT_NE(deleted.out.find("audit NOTE: trajectories file " + dir.sub("t.jsonl") +
                             ": 1 of the journal's trajectories have no line in the file"),
            std::string::npos)
      << deleted.out;
  EXPECT_NE(deleted.out.find("): 'r1' (TrajectoryRecorded at seq " + std::to_string(part1) + ")\n"),
            std::string::npos)
      << deleted.out;

  const std::string torn_file = dir.sub("torn.jsonl");
  std::ofstream(torn_file) << r0.dump() << "\n"
                           << r1.dump().substr(0, 30) << "\n"
                           << r2.dump() << "\n";
  const CliRun torn = RunCli({"audit", dir.path(), "--trajectories", torn_file}, false);
  EXPECT_NE(torn.out.find("'r1' (TrajectoryRecorded at seq " + std::to_string(part1) + ")\n"),
            std::string::npos)
      << torn.out;

  const CliRun twice = AuditTrajectories(dir, {r0, r1, r2, r1}, /*json=*/false);
  EXPECT_EQ(twice.exit_code, 1) << twice.out;
  EXPECT_NE(twice.out.find("  MISMATCH: trajectory 'r1' admitted at seq " +
                           std::to_string(seqs.at("r1").at(0)) +
                           " has 2 lines in the file (lines 2, 4): its writer writes one per "
                           "rollout\n"),
            std::string::npos)
      << twice.out;

  nlohmann::json claims = JournaledLine(dir.path(), seqs.at("r2").at(0), true);
  const CliRun unjournaled = AuditTrajectories(dir, {r0, r1, claims}, /*json=*/false);
  EXPECT_EQ(unjournaled.exit_code, 1) << unjournaled.out;
  EXPECT_NE(unjournaled.out.find("  MISMATCH: trajectory 'r2' (line 3) holds token ids, but the "
                                 "journal recorded no trajectory for its rollout"),
            std::string::npos)
      << unjournaled.out;
  claims["truncated"] = true;
  const CliRun cut = AuditTrajectories(dir, {r0, r1, claims}, /*json=*/false);
  EXPECT_EQ(cut.exit_code, 0) << cut.out;
  EXPECT_NE(cut.out.find("1 lines hold tokens the journal recorded no trajectory for"),
            std::string::npos)
      << cut.out;

  nlohmann::json engine = r0;
  engine["engine"] = "a";
  engine["fleet_generation"] = 3;
  const CliRun admitter = AuditTrajectories(dir, {engine, r1, r2}, /*json=*/false);
  EXPECT_EQ(admitter.exit_code, 1) << admitter.out;
  EXPECT_NE(admitter.out.find("  MISMATCH: trajectory 'r0' (line 1) differs from its admitting "
                              "record at seq " +
                              std::to_string(seqs.at("r0").at(0)) +
                              ": engine is 'a' in the line, '' in the journal; fleet_generation "
                              "is 3 in the line, 0 in the journal\n"),
            std::string::npos)
      << admitter.out;
}

// Proves a line holding the engine's logprob as a double (as files written before serve rounded
// them do) matches the journal's float32 of it, while a logprob that differs after that rounding
// is still a finding; catches every line of an older healthy file reported as contradicting the
// journal (-0.1 against the journal's -0.100000001).
TEST(Cli, AuditComparesALinesLogprobsAsTheJournalHoldsThem) {
  TempDir dir;
  const auto seqs = WriteTrajectoryJournal(dir.path(), {-0.1f, -1.3f});
  ASSERT_EQ(seqs.size(), 3u);
  nlohmann::json r0 = JournaledLine(dir.path(), seqs.at("r0").at(0), true);
  nlohmann::json r1 = JournaledLine(dir.path(), seqs.at("r1").at(0), true);
  const nlohmann::json r2 = JournaledLine(dir.path(), seqs.at("r2").at(0), false);
  r0["outputs"][0]["logprobs"] = {-0.1, -1.3};
  r1["outputs"][0]["logprobs"] = {static_cast<double>(-0.1f), static_cast<double>(-1.3f)};
  const CliRun older = AuditTrajectories(dir, {r0, r1, r2}, /*json=*/false);
  EXPECT_EQ(older.exit_code, 0) << older.out;
  EXPECT_NE(older.out.find("lines the journal contradicts: 0,"), std::string::npos) << older.out;
  r1["outputs"][0]["logprobs"] = {-0.1, -1.2};
  const CliRun differs = AuditTrajectories(dir, {r0, r1, r2}, /*json=*/false);
  EXPECT_EQ(differs.exit_code, 1) << differs.out;
  EXPECT_NE(differs.out.find("outputs[0].logprobs[1] is -1.20000005 in the line"),
            std::string::npos)
      << differs.out;
}

// r0's, r1's or r2's line as serve writes it for the journal above, with the end serve journals
// in each RolloutFinished: completed, 3 prompt tokens, 2 completion tokens.
nlohmann::json LineWithEnd(const std::string& path, std::uint64_t admission_seq, bool tokens) {
  nlohmann::json line = JournaledLine(path, admission_seq, tokens);
  line["outcome"] = "completed";
  line["prompt_tokens"] = 3;
  line["completion_tokens"] = 2;
  return line;
}

// Proves a line's outcome, prompt_tokens and completion_tokens are held against its rollout's
// RolloutFinished (naming its seq), that a truncated line holding more token ids than that finish
// counts and a line saying how a rollout the journal never finished ended are findings, while
// serve's own lines (a truncated one within the counts included) pass; catches the comparison
// that read none of the three, took any truncated line's tokens as a note, and passed a line for
// an end the journal never recorded.
TEST(Cli, AuditHoldsALinesEndAgainstItsRolloutFinished) {
  TempDir dir;
  const auto seqs = WriteTrajectoryJournal(dir.path());
  ASSERT_EQ(seqs.size(), 3u);
  const nlohmann::json r0 = LineWithEnd(dir.path(), seqs.at("r0").at(0), true);
  const nlohmann::json r1 = LineWithEnd(dir.path(), seqs.at("r1").at(0), true);
  const nlohmann::json r2 = LineWithEnd(dir.path(), seqs.at("r2").at(0), false);
  const CliRun honest = AuditTrajectories(dir, {r0, r1, r2}, /*json=*/false);
  EXPECT_EQ(honest.exit_code, 0) << honest.out;

  nlohmann::json ended = r1;
  ended["outcome"] = "aborted";
  ended["completion_tokens"] = 9;
  const CliRun differs = AuditTrajectories(dir, {r0, ended, r2}, /*json=*/false);
  EXPECT_EQ(differs.exit_code, 1) << differs.out;
  EXPECT_NE(differs.out.find("  MISMATCH: trajectory 'r1' (line 2) differs from its rollout's "
                             "RolloutFinished at seq " +
                             std::to_string(seqs.at("r1").back()) +
                             ": outcome is 'aborted' in the line, 'completed' in the journal; "
                             "completion_tokens is 9 in the line, 2 in the journal\n"),
            std::string::npos)
      << differs.out;

  nlohmann::json cut = LineWithEnd(dir.path(), seqs.at("r2").at(0), true);
  cut["truncated"] = true;
  const CliRun within = AuditTrajectories(dir, {r0, r1, cut}, /*json=*/false);
  EXPECT_EQ(within.exit_code, 0) << within.out;
  EXPECT_NE(within.out.find("1 lines hold tokens the journal recorded no trajectory for"),
            std::string::npos)
      << within.out;
  cut["outputs"].push_back({{"index", 1}, {"token_ids", {7, 8, 9}}});
  const CliRun invented = AuditTrajectories(dir, {r0, r1, cut}, /*json=*/false);
  EXPECT_EQ(invented.exit_code, 1) << invented.out;
  EXPECT_NE(invented.out.find("  MISMATCH: trajectory 'r2' (line 3) differs from its rollout's "
                              "RolloutFinished at seq " +
                              std::to_string(seqs.at("r2").back()) +
                              ": the line holds 3 prompt and 5 output token ids, more than the "
                              "journal's prompt_tokens 3 or completion_tokens 2 count\n"),
            std::string::npos)
      << invented.out;

  TempDir unfinished_dir;
  WriteCleanJournal(unfinished_dir.path(), 1);  // r0 admitted at seq 5, never finished
  nlohmann::json unfinished = cli_testing::TrajectoryJson(unfinished_dir.path(), 5);
  unfinished["prompt_token_ids"] = nlohmann::json::array();
  unfinished["outputs"] = nlohmann::json::array();
  unfinished["outcome"] = "completed";
  const CliRun never = AuditTrajectories(unfinished_dir, {unfinished}, /*json=*/false);
  EXPECT_EQ(never.exit_code, 1) << never.out;
  EXPECT_NE(never.out.find("  MISMATCH: trajectory 'r0' (line 1) says how its rollout ended, but "
                           "the journal has not finished it (admitted at seq 5, no "
                           "RolloutFinished through the journal's head at seq "),
            std::string::npos)
      << never.out;
}

// Proves `audit --trajectories --json` gives the file's counts as the text summary line does,
// counting a line with two differences once among the lines the journal contradicts; catches a
// JSON verdict without the counts and `differing` counted per finding (2 for one line).
TEST(Cli, AuditJsonCountsTheFileAsItsSummaryLineDoes) {
  TempDir dir;
  const auto seqs = WriteTrajectoryJournal(dir.path());
  ASSERT_EQ(seqs.size(), 3u);
  nlohmann::json twice = JournaledLine(dir.path(), seqs.at("r0").at(0), true);
  twice["engine"] = "a";                      // its admitting record names no engine
  twice["outputs"][0]["token_ids"] = {4, 6};  // the journal's part holds 4, 5
  const nlohmann::json r2 = JournaledLine(dir.path(), seqs.at("r2").at(0), false);
  const CliRun text_run = AuditTrajectories(dir, {twice, r2}, /*json=*/false);  // r1's is gone
  EXPECT_EQ(text_run.exit_code, 1) << text_run.out;
  EXPECT_NE(text_run.out.find("trajectories file: 2, binding mismatches: 0, lines skipped: 0 "
                              "(torn 0, damaged 0), lines the journal contradicts: 1, journal "
                              "trajectories without a line: 1\n"),
            std::string::npos)
      << text_run.out;
  const CliRun json_run = AuditTrajectories(dir, {twice, r2}, /*json=*/true);
  EXPECT_EQ(json_run.exit_code, 1) << json_run.out;
  const nlohmann::json verdict = nlohmann::json::parse(json_run.out, nullptr, false);
  ASSERT_FALSE(verdict.is_discarded()) << json_run.out;
  const nlohmann::json counts = {{"trajectories", 2},
                                 {"binding_mismatches", 0},
                                 {"lines_skipped", 0},
                                 {"torn", 0},
                                 {"damaged", 0},
                                 {"lines_the_journal_contradicts", 1},
                                 {"journal_trajectories_without_a_line", 1}};
  EXPECT_EQ(verdict.value("trajectories_file", nlohmann::json()), counts) << json_run.out;
  EXPECT_EQ(verdict["engine_findings"].size(), 2u) << json_run.out;
}

// Proves a trajectories file holding only a torn line (a writer's first write cut by a crash) is
// a note, exit 0, as torn lines never change the exit code; catches the "holds no trajectory"
// engine finding that failed the audit of a healthy journal (exit 1).
TEST(Cli, AFileOfOnlyATornLineIsANote) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 1);
  const std::string file = dir.sub("t.jsonl");
  std::ofstream(file) << TrajectoryLine(dir.path(), 5).substr(0, 30);
  const CliRun run = RunCli({"audit", dir.path(), "--trajectories", file}, /*with_stderr=*/true);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("audit NOTE: trajectories file " + file +
                         " holds no trajectory: no line was checked"),
            std::string::npos)
      << run.out;
}

// Proves the `rolloutcore replay` command an unhealthy audit prints names the journal audited when
// its path begins with `-` (`-j`, `--config`): pasted back through /bin/sh and the CLI's own
// parser, it replays that journal (its 6 records, verified). Catches the command printed as
// `rolloutcore replay -j`, which CLI11 reads as an option it does not know (exit 2, nothing read).
TEST(Cli, TheReplayCommandAnAuditPrintsNamesAJournalBeginningWithADash) {
  TempDir dir;
  const std::string prefix = "audit: ENGINE NOT HEALTHY: the journal is intact and explains it: ";
  for (const std::string journal : {"-j", "--config"}) {
    WriteCleanJournal(dir.sub(journal), 2);  // r0 admitted at seq 5, r1 at seq 6
    nlohmann::json forged = cli_testing::TrajectoryJson(dir.sub(journal), 6);
    forged["version"]["label"] = "rc-forged";  // a binding mismatch: an engine finding, exit 1
    std::ofstream(dir.sub("t.jsonl"), std::ios::trunc) << forged.dump() << "\n";
    const CliRun audit = RunCliIn(dir.path(), {"audit", "--trajectories=t.jsonl", "--", journal});
    EXPECT_EQ(audit.exit_code, 1) << audit.out;
    const std::vector<std::string> lines = Lines(audit.out);
    const auto verdict = std::find_if(
        lines.begin(), lines.end(), [&](const std::string& l) { return l.rfind(prefix, 0) == 0; });
    ASSERT_NE(verdict, lines.end()) << audit.out;
    const std::string printed = verdict->substr(prefix.size());
    EXPECT_EQ(printed, "rolloutcore replay -- " + journal);
    const CliRun replay = cli_testing::RunPrinted(dir.path(), printed);
    EXPECT_EQ(replay.exit_code, 0) << printed << ": " << replay.out;
    EXPECT_NE(replay.out.find("records: 6 "), std::string::npos) << printed << ": " << replay.out;
    EXPECT_NE(replay.out.find("verification: OK"), std::string::npos) << replay.out;
  }
}

// Proves a FIFO where audit or replay reads a file (`audit --trajectories`, or a file of the
// journal's directory: CURRENT) is refused at once, before anything is read: exit 2 and one line
// naming the FIFO. Catches the open that waited for ever for a writer: each command runs under a
// 20 s limit, so that regression exits 124 or 137 here rather than hanging the test.
TEST(Cli, AFifoWhereAFileIsReadIsRefusedAtOnce) {
  TempDir dir;
  WriteCleanJournal(dir.sub("j"), 1);
  ASSERT_EQ(::mkfifo(dir.sub("fifo").c_str(), 0600), 0) << std::strerror(errno);
  const CliRun file = RunCliIn(dir.path(), {"audit", "j", "--trajectories", "fifo"}, 20);
  EXPECT_EQ(file.exit_code, 2) << file.out;
  EXPECT_EQ(file.out,
            "rolloutcore audit: InvalidArgument: trajectories file 'fifo' is a FIFO, not a regular "
            "file: refused before reading it\n");

  ASSERT_EQ(::mkdir(dir.sub("held").c_str(), 0700), 0) << std::strerror(errno);
  ASSERT_EQ(::mkfifo(dir.sub("held/CURRENT").c_str(), 0600), 0) << std::strerror(errno);
  for (const std::string command : {"audit", "replay"}) {
    const CliRun journal = RunCliIn(dir.path(), {command, "held"}, 20);
    EXPECT_EQ(journal.exit_code, 2) << command << ": " << journal.out;
    EXPECT_EQ(journal.out, "rolloutcore " + command +
                               ": InvalidArgument: journal 'held' holds 'CURRENT', a FIFO: refused "
                               "before opening the journal (its open would wait on it)\n");
  }
}

}  // namespace
}  // namespace rc
