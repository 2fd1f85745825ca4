// What audit and replay read must be vouched for (real RocksDB journals, no engine): a
// rollout's provenance rests only on records that name it and that the hash chain covers; a
// trajectories file is read line by line within the writer's bound, a read error reported, its
// torn and damaged lines skipped and counted, and one that is no regular file refused before any
// read; one rollout's joined trajectory stays within its parts and token bounds; replay's first
// failure stays the one it reports.
#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "audit/audit.h"
#include "journal/codec.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "service/proxy_stream.h"
#include "service/trajectories.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"

namespace rc {
namespace {

namespace fs = std::filesystem;
using journal::testing::EditRaw;
using journal::testing::SeqKey;
using journal::testing::TempDir;

// The reader's bound is the writer's: every line serve writes is read, nothing longer buffered.
static_assert(audit::kTrajectoryLineBytesMax == service::kTrajectoryLineBytesMax);
// The parts the audit joins of one rollout are at most what its writer journals, no fewer.
static_assert(audit::kTrajectoryPartsPerRolloutMax == service::kTrajectoryPartsMax);

using Cf = std::vector<rocksdb::ColumnFamilyHandle*>;

journal::Options ReadOnly() {
  journal::Options o;
  o.read_only = true;
  o.create_if_missing = false;
  return o;
}

// Bootstrap (seqs 1..4), then one group per step: "+id" admits a rollout, "-id" finishes it;
// snapshots every 10; closed cleanly.
void WriteJournal(const std::string& path, const std::vector<std::string>& steps) {
  journal::Options o;
  o.snapshot_every = 10;
  auto j = journal::Journal::Open(path, o);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (auto& g : journal::testing::BootstrapGroups()) {
    ASSERT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
  }
  for (const std::string& step : steps) {
    const std::string id = step.substr(1);
    const Event e = step[0] == '+' ? Event{make_admission((*j)->state(), id)}
                                   : Event{RolloutFinished{id, RolloutOutcome::kCompleted, 1, 1}};
    auto s = (*j)->Submit(e, 1700000000000);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*j)->Wait(s->ticket).ok());
  }
}

// The replay of the journal at `path`, opened read-only (its open's failure as the error).
Result<replay::ReplayReport> ReplayOf(const std::string& path) {
  auto j = journal::Journal::Open(path, ReadOnly());
  if (!j.ok()) return j.status();
  return replay::Replay(**j, replay::ReplayOptions{});
}

Result<audit::RolloutProvenance> ProvenanceOf(const std::string& path, const std::string& id) {
  auto j = journal::Journal::Open(path, ReadOnly());
  if (!j.ok()) return j.status();
  return audit::Provenance(**j, id);
}

// Proves a provenance whose rollout index names a record of another rollout (r0's finish filed
// under r1) is Corruption naming both; catches the audit that took any admission or finish at
// an indexed seq as the rollout's own, and showed r0's finish as r1's.
TEST(Provenance, AnIndexedRecordOfAnotherRolloutIsCorruption) {
  TempDir dir;
  WriteJournal(dir.path(), {"+r0", "+r1", "-r0", "-r1"});  // seqs 5..8
  ASSERT_TRUE(ProvenanceOf(dir.path(), "r1").ok());
  EditRaw(dir.path(), [](rocksdb::DB& db, const Cf& cf) {  // index key: length, id, seq
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[2], std::string("\x02r1") + SeqKey(7), "").ok());
  });
  Result<audit::RolloutProvenance> p = ProvenanceOf(dir.path(), "r1");
  ASSERT_FALSE(p.ok()) << "r1 finished at seq " << p->finished_seq;
  EXPECT_EQ(p.status().code(), Code::kCorruption) << p.status().ToString();
  EXPECT_NE(p.status().message().find("names seq 7 for 'r1' but the record there is "),
            std::string::npos)
      << p.status().message();
  EXPECT_NE(p.status().message().find(" of 'r0'"), std::string::npos) << p.status().message();
}

// Proves a rollout's finish that was altered after the fact (valid bytes, so the chain breaks at
// the next record, below the snapshot the open starts from) makes its provenance Corruption;
// catches the audit that read the records past the admission without checking the chain and
// showed the forged finish.
TEST(Provenance, AForgedFinishPastTheAdmissionIsCorruption) {
  TempDir dir;  // r1 admitted at 5, finished at 6; the snapshot at 10 covers both
  WriteJournal(dir.path(), {"+r1", "-r1", "+r2", "+r3", "+r4", "+r5", "+r6"});
  ASSERT_TRUE(ProvenanceOf(dir.path(), "r1").ok());
  std::string stored;
  EditRaw(dir.path(), [&](rocksdb::DB& db, const Cf& cf) {
    ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[1], SeqKey(6), &stored).ok());
  });
  Result<journal::Record> finish = journal::DecodeRecord(stored);
  ASSERT_TRUE(finish.ok());
  finish->event = RolloutFinished{"r1", RolloutOutcome::kAborted, 1, 1};
  journal::testing::OverwriteEvent(dir.path(), 6, journal::EncodeRecord(*finish));
  Result<audit::RolloutProvenance> p = ProvenanceOf(dir.path(), "r1");
  ASSERT_FALSE(p.ok()) << "showed the forged finish at seq " << p->finished_seq;
  EXPECT_EQ(p.status().code(), Code::kCorruption) << p.status().ToString();
  EXPECT_NE(p.status().message().find("hash chain broken"), std::string::npos)
      << p.status().message();
}

// Proves a trajectories file that cannot be read (a regular file whose reads fail:
// /proc/self/mem at offset 0) is an IOError and a line past the writer's bound is refused by its
// number by the strict loader, while a line of exactly the bound is read; catches the loader that
// never checked the stream (an unreadable file read as "no trajectories") and buffered a line of
// any length.
TEST(Trajectories, ReadErrorsAndOverlongLinesAreReported) {
  TempDir dir;
  if (fs::exists("/proc/self/mem")) {
    Result<std::vector<audit::Trajectory>> unreadable = audit::LoadTrajectories("/proc/self/mem");
    ASSERT_FALSE(unreadable.ok()) << unreadable->size() << " trajectories from unreadable memory";
    EXPECT_EQ(unreadable.status().code(), Code::kIOError) << unreadable.status().ToString();
  }
  const std::string head = R"({"rollout_id":"r0","admission_seq":5,"pad":")";
  std::string fits = head + std::string(audit::kTrajectoryLineBytesMax - head.size() - 2, 'x');
  fits += "\"}";
  ASSERT_EQ(fits.size(), audit::kTrajectoryLineBytesMax);
  const std::string path = dir.sub("t.jsonl");
  std::ofstream(path) << fits << "\n" << fits << "y\n";
  Result<std::vector<audit::Trajectory>> loaded = audit::LoadTrajectories(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), Code::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find(":2: a line longer than"), std::string::npos)
      << loaded.status().message().substr(0, 200);
  std::ofstream(path, std::ios::trunc) << fits << "\n";
  loaded = audit::LoadTrajectories(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message().substr(0, 200);
  EXPECT_EQ(loaded->size(), 1u);
}

// Proves a line longer than any trajectory line is read past, not refused: a run of zeros that
// long (a crash that left a large batched write's tail as zeros) after a cut document is a torn
// line, after a whole one its trajectory, anything else that long a damaged line, and the lines
// after it are audited. Catches the whole file refused
// (exit 2) at such a line, so a file its writer's crash left could never be audited again.
TEST(Trajectories, AnOverlongLineIsSkippedAsTornOrDamaged) {
  TempDir dir;
  const std::string good = R"({"rollout_id":"r0","admission_seq":5})";
  const std::string path = dir.sub("t.jsonl");
  {
    std::ofstream out(path, std::ios::binary);
    out << good << "\n";  // line 1
    out << R"({"rollout_id":"r1")" << std::string(audit::kTrajectoryLineBytesMax + 9, '\0')
        << "\n";                                                          // line 2: zeros
    out << std::string(audit::kTrajectoryLineBytesMax + 9, 'x') << "\n";  // line 3
    out << good << "\n";                                                  // line 4
    out << R"({"rollout_id":"r3")" << std::string(audit::kTrajectoryLineBytesMax, '\0')
        << "x\n";  // line 5: not only zeros after the bound
    out << good << std::string(audit::kTrajectoryLineBytesMax, '\0') << "\n";  // line 6
  }
  Result<audit::TrajectoriesFile> file = audit::ReadTrajectoriesFile(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->trajectories.size(), 3u) << "line 6: a whole line, then zeros";
  EXPECT_EQ(file->torn, 1u);
  EXPECT_EQ(file->damaged, 2u);
  ASSERT_EQ(file->torn_lines.size(), 1u);
  EXPECT_EQ(file->torn_lines[0].line_no, 2u);
  EXPECT_EQ(file->torn_lines[0].why, "cut short after over 16777216 bytes");
  ASSERT_EQ(file->damaged_lines.size(), 2u);
  EXPECT_EQ(file->damaged_lines[0].line_no, 3u);
  EXPECT_EQ(file->damaged_lines[1].line_no, 5u);
  EXPECT_NE(file->damaged_lines[0].why.find("longer than"), std::string::npos)
      << file->damaged_lines[0].why;
}

// Proves a trajectories file is read around the lines that hold no trajectory: torn ones (a
// document cut short mid-file, one whose tail is zero bytes, one at the end with no newline) are
// counted and named as a note that leaves the verdict healthy; damaged ones (complete, not a
// trajectory) are counted exactly, named up to kSkippedLinesNamedMax, and make one engine finding;
// the strict LoadTrajectories still refuses the file at its first such line. Catches the loader
// that refused the whole file over one torn line, and a report that names every bad line of a
// damaged file without bound.
TEST(Trajectories, TornAndDamagedLinesAreSkippedCountedAndNamed) {
  TempDir dir;
  const std::string good = R"({"rollout_id":"r0","admission_seq":5})";
  const std::string torn = R"({"rollout_id":"r1","admiss)";
  const std::string no_seq = R"({"rollout_id":"r2"})";
  const std::string path = dir.sub("t.jsonl");
  {
    std::ofstream out(path, std::ios::binary);
    out << good << "\n" << torn << "\n" << good << "\n";  // lines 1-3
    out << torn << std::string(4, '\0') << "\n";          // line 4: its tail zeros
    for (int i = 0; i < 7; ++i) out << "{not json}\n";    // lines 5-11
    out << no_seq << "\n" << good << "\n";                // lines 12-13
    out << torn;                                          // line 14, no newline
  }
  Result<audit::TrajectoriesFile> file = audit::ReadTrajectoriesFile(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->trajectories.size(), 3u);
  EXPECT_EQ(file->torn, 3u);
  EXPECT_EQ(file->damaged, 8u);
  std::vector<std::size_t> torn_at;
  for (const audit::SkippedLine& l : file->torn_lines) torn_at.push_back(l.line_no);
  EXPECT_EQ(torn_at, (std::vector<std::size_t>{2, 4, 14}));
  ASSERT_EQ(file->damaged_lines.size(), audit::kSkippedLinesNamedMax);
  EXPECT_EQ(file->damaged_lines.front().line_no, 5u);
  EXPECT_EQ(file->damaged_lines.front().why, "not a JSON object");

  audit::Verdict torn_only;
  audit::TrajectoriesFile crashed = *file;
  crashed.damaged = 0;
  crashed.damaged_lines.clear();
  audit::AddSkippedLines(crashed, path, torn_only);
  EXPECT_TRUE(torn_only.engine_healthy());
  EXPECT_EQ(torn_only.exit_code(), audit::kExitOk);
  ASSERT_EQ(torn_only.notes.size(), 1u);
  EXPECT_NE(torn_only.notes[0].find(": 3 torn lines skipped"), std::string::npos)
      << torn_only.notes[0];
  EXPECT_NE(torn_only.notes[0].find("line 2 (cut short after 26 bytes), line 4 (cut short after "
                                    "30 bytes), line 14 (cut short after 26 bytes)"),
            std::string::npos)
      << torn_only.notes[0];

  audit::Verdict v;
  audit::AddSkippedLines(*file, path, v);
  EXPECT_EQ(v.notes.size(), 1u);
  ASSERT_EQ(v.engine_findings.size(), 1u);
  EXPECT_EQ(v.exit_code(), audit::kExitEngineUnhealthy);
  EXPECT_NE(v.engine_findings[0].find(": 8 lines hold no trajectory"), std::string::npos)
      << v.engine_findings[0];
  EXPECT_NE(v.engine_findings[0].find("line 9 (not a JSON object), and 3 more"), std::string::npos)
      << v.engine_findings[0];

  Result<std::vector<audit::Trajectory>> strict = audit::LoadTrajectories(path);
  ASSERT_FALSE(strict.ok());
  EXPECT_EQ(strict.status().code(), Code::kInvalidArgument);
  EXPECT_NE(strict.status().message().find(":2: cut short after 26 bytes"), std::string::npos)
      << strict.status().message();
}

// Re-encodes the records from `from` to `head` of a closed journal, each chained to the one
// before, after `edit` changed record `from`; the head hash follows, the clean-close record and
// the durable mark (which name the old hashes) go: a forgery that keeps the chain whole.
// What an editor who also removes the marks removes in the journal: the record that its writer
// marked it (without it a journal with no mark file opens, as one never marked does).
void ForgetMarks(rocksdb::DB& db, const Cf& cf) {
  ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[5], "durable_mark_written").ok());
}

void RechainFrom(const std::string& path, std::uint64_t from, std::uint64_t head,
                 const std::function<void(journal::Record&)>& edit) {
  EditRaw(path, [&](rocksdb::DB& db, const Cf& cf) {
    std::string bytes;
    ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[1], SeqKey(from - 1), &bytes).ok());
    journal::Hash prev = journal::Sha256(bytes);
    for (std::uint64_t seq = from; seq <= head; ++seq) {
      ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[1], SeqKey(seq), &bytes).ok());
      Result<journal::Record> r = journal::DecodeRecord(bytes);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      if (seq == from) edit(*r);
      r->prev_hash = prev;
      bytes = journal::EncodeRecord(*r);
      prev = journal::Sha256(bytes);
      ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[1], SeqKey(seq), bytes).ok());
    }
    const std::string hash(reinterpret_cast<const char*>(prev.data()), prev.size());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_hash", hash).ok());
    ForgetMarks(db, cf);
  });
  fs::remove(path + "/CLOSED");
  fs::remove(path + "/DURABLE");
}

// Reads the trajectories file holding `text` as written (bytes, zeros included).
Result<audit::TrajectoriesFile> ReadFileOf(const TempDir& dir, const std::string& text) {
  const std::string path = dir.sub("t.jsonl");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  return audit::ReadTrajectoriesFile(path);
}

// Proves each choice of a line is read by its own index (choice 0 is the one whose tokens are
// compared with the journal, wherever it stands) and a repeated, missing or ill-typed index, or a
// malformed other choice, damages the line; catches the reader that took outputs[0] as choice 0
// (choice 1's tokens held against the journal) and never looked at the other choices.
TEST(Trajectories, EveryChoiceIsReadByItsIndex) {
  TempDir dir;
  const std::string head = R"({"rollout_id":"r0","admission_seq":5,"outputs":)";
  Result<audit::TrajectoriesFile> file =
      ReadFileOf(dir, head + R"([{"index":1,"token_ids":[9,9,9]},{"index":0,"token_ids":[4,5],)" +
                          R"("logprobs":[-0.25,null]}]})" + "\n");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_EQ(file->trajectories.size(), 1u);
  const audit::Trajectory& t = file->trajectories[0];
  EXPECT_EQ(t.output, (std::vector<std::int32_t>{4, 5}));
  ASSERT_EQ(t.logprobs.size(), 2u);
  EXPECT_EQ(t.logprobs[0], -0.25);
  EXPECT_FALSE(t.logprobs[1].has_value());
  EXPECT_EQ(t.choices, 2u);
  EXPECT_TRUE(t.has_choice0);
  EXPECT_TRUE(t.other_tokens);

  for (const std::string& outputs : {
           std::string(R"([{"index":0,"token_ids":[4]},{"index":0,"token_ids":[5]}])"),
           std::string(R"([{"token_ids":[4]}])"),
           std::string(R"([{"index":"0","token_ids":[4]}])"),
           std::string(R"([{"index":65536,"token_ids":[4]}])"),
           std::string(R"([{"index":0,"token_ids":[4]},{"index":1,"token_ids":["a"]}])"),
           std::string(R"([{"index":0,"token_ids":[4]},{"index":1,"logprobs":["x"]}])"),
       }) {
    Result<audit::TrajectoriesFile> bad = ReadFileOf(dir, head + outputs + "}\n");
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    EXPECT_EQ(bad->trajectories.size(), 0u) << outputs;
    EXPECT_EQ(bad->damaged, 1u) << outputs;
  }
}

// Proves a line with a zero byte inside it is damaged, whatever precedes it, while a line whose
// only zeros are its tail (a crash's lost data) is still read; catches the JSON parser stopping
// at the zero byte, which read `<a valid line>\0<anything>` as the valid line.
TEST(Trajectories, AZeroByteInsideALineDamagesIt) {
  TempDir dir;
  const std::string good = R"({"rollout_id":"r0","admission_seq":5})";
  Result<audit::TrajectoriesFile> inside =
      ReadFileOf(dir, good + std::string(1, '\0') + R"({"forged":true})" + "\n" + good +
                          std::string(1, '\0') + std::string(1, '\0') + "x\n");
  ASSERT_TRUE(inside.ok()) << inside.status().ToString();
  EXPECT_EQ(inside->trajectories.size(), 0u);
  EXPECT_EQ(inside->damaged, 2u);
  EXPECT_EQ(inside->torn, 0u);
  ASSERT_EQ(inside->damaged_lines.size(), 2u);
  EXPECT_NE(inside->damaged_lines[0].why.find("zero byte"), std::string::npos)
      << inside->damaged_lines[0].why;

  Result<audit::TrajectoriesFile> tail = ReadFileOf(dir, good + std::string(3, '\0') + "\n");
  ASSERT_TRUE(tail.ok()) << tail.status().ToString();
  EXPECT_EQ(tail->trajectories.size(), 1u);
  EXPECT_EQ(tail->skipped(), 0u);
}

// Proves replay keeps its first failure (a decision naming the wrong cause at seq 4) when the
// scan later stops on damage (seq 6 lost): the report names seq 4 and its reason, then the
// damage, and says the read failed; catches the report that paired seq 4 with the reason of
// seq 6.
TEST(Replay, TheFirstFailureStaysTheReportedOne) {
  TempDir dir;
  std::vector<std::string> admissions;
  for (int i = 0; i < 20; ++i) admissions.push_back("+r" + std::to_string(i));
  WriteJournal(dir.path(), admissions);  // head 24, snapshots at 10 and 20
  RechainFrom(dir.path(), 4, 24, [](journal::Record& r) { r.cause_seq = 2; });
  EditRaw(dir.path(), [](rocksdb::DB& db, const Cf& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(6)).ok());
  });
  Result<replay::ReplayReport> report = ReplayOf(dir.path());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->ok);
  EXPECT_EQ(report->first_bad_seq, 4u);
  EXPECT_EQ(report->error.rfind("derived record names cause seq 2", 0), 0u) << report->error;
  EXPECT_NE(report->error.find("then the scan stopped: "), std::string::npos) << report->error;
  EXPECT_NE(report->error.find("seq 6 is missing"), std::string::npos) << report->error;
  EXPECT_EQ(report->read_failure, Code::kCorruption);
}

// Proves replay lists a torn WAL tail an executor's start recorded after an earlier record already
// failed verification (a decision naming the wrong cause at seq 4); catches the replay that
// stopped noting recorded torn tails at its first failure, saying 0 where audit lists one.
TEST(Replay, ATornTailRecordedAfterAFailureIsStillListed) {
  TempDir dir;
  std::uint64_t head = 0;
  {
    auto j = journal::Journal::Open(dir.path(), journal::Options{});
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : journal::testing::BootstrapGroups()) {
      ASSERT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
    }
    const RecoveryStarted start{"exec-2", JournalEnding::kTornTail, 9, "torn WAL tail: 9 bytes"};
    auto s = (*j)->Submit(Event{start}, 1700000000000);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*j)->Wait(s->ticket).ok());
    head = (*j)->head_seq();
  }
  RechainFrom(dir.path(), 4, head, [](journal::Record& r) { r.cause_seq = 2; });
  Result<replay::ReplayReport> report = ReplayOf(dir.path());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->ok);
  EXPECT_EQ(report->first_bad_seq, 4u);
  EXPECT_EQ(report->torn_tails_count, 1u);
  ASSERT_EQ(report->torn_tails.size(), 1u);
  EXPECT_EQ(report->torn_tails[0].sentence, "torn WAL tail: 9 bytes");
}

// Proves replay compares its refold with the state a restart loads (the newest snapshot and the
// records after it): a snapshot whose counters were edited is damage (exit 3's Corruption),
// while the same journal with its own snapshots replays OK; catches the replay that said
// "verification: OK" of a journal serve would restart from a state its records never reached.
TEST(Replay, ASnapshotUnlikeTheRecordsIsDamage) {
  TempDir dir;
  WriteJournal(dir.path(), {"+a", "-a", "+b", "-b", "+c", "-c", "+d", "-d"});  // snapshot at 10
  auto replayed = [&] { return ReplayOf(dir.path()); };
  Result<replay::ReplayReport> healthy = replayed();
  ASSERT_TRUE(healthy.ok()) << healthy.status().ToString();
  EXPECT_TRUE(healthy->ok) << healthy->error;
  {
    journal::Options o;
    o.snapshot_every = 0;
    auto j = journal::Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    Result<FleetState> edited = (*j)->RefoldFleet();
    ASSERT_TRUE(edited.ok()) << edited.status().ToString();
    edited->engines[""].counters.rollouts_completed += 7;
    ASSERT_TRUE((*j)->WriteSnapshot((*j)->head_seq(), *edited).ok());
  }
  Result<replay::ReplayReport> report = replayed();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->ok);
  EXPECT_EQ(report->read_failure, Code::kCorruption);
  EXPECT_NE(report->error.find("the snapshot is damaged"), std::string::npos) << report->error;
  EXPECT_NE(replay::FormatReport(*report).find("verification: FAILED"), std::string::npos);
}

// Proves the whole-journal audit fails a journal whose newest snapshot is another journal's (same
// seq, another history: its chain hash is not this record's), naming the snapshot, while the
// same journal with its own snapshot audits OK; catches the audit that said OK of a journal
// serve refuses to start from, or would restart from a state its records never reached.
TEST(Audit, ASnapshotOfAnotherJournalIsDamage) {
  TempDir mine, other;
  WriteJournal(mine.path(), {"+a", "-a", "+b", "-b", "+c", "-c", "+d", "-d"});  // snapshot at 10
  WriteJournal(other.path(), {"+x", "-x", "+y", "-y", "+z", "-z", "+w", "-w"});
  auto audited = [&] {
    auto j = journal::Journal::Open(mine.path(), ReadOnly());
    EXPECT_TRUE(j.ok()) << j.status().ToString();
    return audit::AuditJournal(**j);
  };
  Result<audit::AuditReport> healthy = audited();
  ASSERT_TRUE(healthy.ok()) << healthy.status().ToString();
  EXPECT_TRUE(healthy->failures.empty()) << healthy->failures.front();
  std::string foreign;
  EditRaw(other.path(), [&](rocksdb::DB& db, const Cf& cf) {
    ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[4], SeqKey(10) + "f", &foreign).ok());
  });
  EditRaw(mine.path(), [&](rocksdb::DB& db, const Cf& cf) {
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[4], SeqKey(10) + "f", foreign).ok());
    ASSERT_TRUE(db.Flush(rocksdb::FlushOptions(), cf).ok());
  });
  Result<audit::AuditReport> report = audited();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  bool named = false;
  for (const std::string& f : report->failures) {
    named = named || (f.rfind("restart state: ", 0) == 0 &&
                      f.find("snapshot at seq 10 carries the chain hash") != std::string::npos);
  }
  EXPECT_TRUE(named) << (report->failures.empty() ? "no failure" : report->failures.front());
}

// Proves a journal whose last input lacks the decision decide() derives (a probe recorded without
// its READY transition, the chain intact) replays to "FAILED", never to an abort; catches the
// restart-state check that asserted the report was still OK after the last group's own check
// had failed it, killing replay on exactly the journals it exists to explain.
TEST(Replay, ALastGroupShortOfItsDecisionsFailsTheReport) {
  TempDir dir;
  WriteJournal(dir.path(), {});  // the bootstrap: seq 4 is the probe's StateChanged
  EditRaw(dir.path(), [](rocksdb::DB& db, const Cf& cf) {
    std::string probe;
    ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[1], SeqKey(3), &probe).ok());
    const journal::Hash hash = journal::Sha256(probe);
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(4)).ok());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_seq", SeqKey(3)).ok());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_hash",
                       std::string(reinterpret_cast<const char*>(hash.data()), hash.size()))
                    .ok());
    ForgetMarks(db, cf);
  });
  fs::remove(dir.path() + "/CLOSED");  // the marks name the lost seq 4
  fs::remove(dir.path() + "/DURABLE");
  Result<replay::ReplayReport> report = ReplayOf(dir.path());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->ok);
  EXPECT_EQ(report->read_failure, Code::kOk) << report->error;
  EXPECT_NE(replay::FormatReport(*report).find("verification: FAILED"), std::string::npos);
}

// Proves a trajectories file that is no regular file (a FIFO no process writes, a directory) is
// refused at once, before any read, as InvalidArgument naming what it is. Catches the open that
// waited for ever for the FIFO's writer (bounded here: past 20 s the test opens the FIFO's write
// end itself, so that the regression fails rather than hangs) and a directory read as a file.
TEST(Trajectories, AFileThatIsNoRegularFileIsRefusedAtOnce) {
  TempDir dir;
  const std::string fifo = dir.sub("t.jsonl");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::promise<Status> read;
  std::future<Status> done = read.get_future();
  std::thread reader([&] { read.set_value(audit::ReadTrajectoriesFile(fifo).status()); });
  const bool prompt = done.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  while (done.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // a blocked open returns
    if (writer >= 0) ::close(writer);
  }
  reader.join();
  EXPECT_TRUE(prompt) << "the read of a FIFO waited for a writer";
  const Status refused = done.get();
  EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.ToString();
  EXPECT_EQ(refused.message(), "trajectories file '" + fifo +
                                   "' is a FIFO, not a regular file: refused before reading it");
  Result<audit::TrajectoriesFile> directory = audit::ReadTrajectoriesFile(dir.path());
  ASSERT_FALSE(directory.ok());
  EXPECT_EQ(directory.status().code(), Code::kInvalidArgument) << directory.status().ToString();
  EXPECT_EQ(directory.status().message(),
            "trajectories file '" + dir.path() +
                "' is a directory, not a regular file: refused before reading it");
}

// Bootstrap (seqs 1..4), then rollout r0 admitted at seq 5 and given one trajectory part per entry
// of `outputs` (seqs 6..), each that many output tokens with their logprobs, the first after
// `prompt` prompt tokens; finished; closed cleanly.
void WriteParts(const std::string& path, const std::vector<std::size_t>& outputs,
                std::size_t prompt) {
  journal::Options o;
  o.sync = false;  // the tests read the parts, not the disk
  auto j = journal::Journal::Open(path, o);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (auto& g : journal::testing::BootstrapGroups()) {
    ASSERT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
  }
  const auto submit = [&](const Event& e) {
    auto s = (*j)->Submit(e, 1700000000000);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*j)->Wait(s->ticket).ok());
  };
  submit(make_admission((*j)->state(), "r0"));
  for (std::size_t p = 0; p < outputs.size(); ++p) {
    submit(TrajectoryRecorded{
        "r0", static_cast<std::uint32_t>(p), std::vector<std::int32_t>(p == 0 ? prompt : 0, 1),
        std::vector<std::int32_t>(outputs[p], 2), std::vector<float>(outputs[p], -0.5f)});
  }
  submit(RolloutFinished{"r0", RolloutOutcome::kCompleted, 0, 0});
  ASSERT_TRUE((*j)->Close().ok());
}

// A trajectories file of one line, r0's (admitted at seq 5): the file side of the comparison.
audit::TrajectoriesFile LineOfR0() {
  audit::Trajectory t;
  t.rollout_id = "r0";
  t.admission_seq = 5;
  t.line_no = 1;
  audit::TrajectoriesFile file;
  file.trajectories.push_back(t);
  return file;
}

// What a rollout's joined trajectory holds and how reading it ended, both where the journal's
// trajectories are sampled and where a trajectories file is held against them.
struct Joined {
  Status sampled;
  Status compared;
  std::size_t prompt = 0, output = 0, logprobs = 0;  // of r0, when sampled
};

Joined JoinR0(const std::string& path, audit::RolloutTrajectoryBounds bounds) {
  Joined out;
  auto j = journal::Journal::Open(path, ReadOnly());
  RC_CHECK(j.ok());
  Result<audit::JournalTrajectories> sampled =
      audit::SampleTrajectoriesFromJournal(**j, audit::kTrajectoriesMax, bounds);
  out.sampled = sampled.status();
  if (sampled.ok() && sampled->trajectories.size() == 1) {
    const audit::Trajectory& t = sampled->trajectories[0];
    out.prompt = t.prompt.size();
    out.output = t.output.size();
    out.logprobs = t.logprobs.size();
  }
  out.compared = audit::CompareTrajectoriesFile(**j, LineOfR0(), bounds).status();
  return out;
}

// Proves a rollout's trajectory is joined up to kTrajectoryPartsPerRolloutMax parts (its writer's
// most: 257 of one token each, every token with its logprob), and one part more is a Corruption
// naming the seq, the rollout and the bound, where the journal's trajectories are sampled and
// where a trajectories file is held against them. Catches the joins that appended parts for as
// long as the journal held any, so a journal of endless parts grew one trajectory without limit.
TEST(TrajectoryBounds, ARolloutsPartsAreJoinedUpToTheirBound) {
  const std::size_t max = audit::kTrajectoryPartsPerRolloutMax;
  TempDir at;
  WriteParts(at.path(), std::vector<std::size_t>(max, 1), 0);
  const Joined whole = JoinR0(at.path(), {});
  EXPECT_TRUE(whole.sampled.ok()) << whole.sampled.ToString();
  EXPECT_TRUE(whole.compared.ok()) << whole.compared.ToString();
  EXPECT_EQ(whole.output, max);
  EXPECT_EQ(whole.logprobs, max);

  TempDir over;
  WriteParts(over.path(), std::vector<std::size_t>(max + 1, 1), 0);
  const Joined refused = JoinR0(over.path(), {});
  const std::string why = "seq " + std::to_string(6 + max) +
                          ": the trajectory of rollout 'r0' has more than " + std::to_string(max) +
                          " parts, the most one rollout's trajectory may hold";
  for (const Status& st : {refused.sampled, refused.compared}) {
    EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
    EXPECT_EQ(st.message(), why);
  }
}

// Proves a rollout's trajectory is joined up to its token bound (prompt and output together; a
// bound of 10 here, where the real one, kTrajectoryTokensPerRolloutMax, is more than any journal
// the fold accepts can pass) and a part that would pass it is a Corruption naming the seq, the
// rollout and the bound, in both reads. Catches joins that bound the parts only, so that parts
// past the fold's size rule (a damaged journal) grew one trajectory without limit.
TEST(TrajectoryBounds, ARolloutsTokensAreJoinedUpToTheirBound) {
  audit::RolloutTrajectoryBounds bounds;
  bounds.tokens_per_rollout_max = 10;
  TempDir at;
  WriteParts(at.path(), {3, 5}, /*prompt=*/2);  // 2 + 3, then 5: 10 tokens
  const Joined whole = JoinR0(at.path(), bounds);
  EXPECT_TRUE(whole.sampled.ok()) << whole.sampled.ToString();
  EXPECT_TRUE(whole.compared.ok()) << whole.compared.ToString();
  EXPECT_EQ(whole.prompt, 2u);
  EXPECT_EQ(whole.output, 8u);
  EXPECT_EQ(whole.logprobs, 8u);

  TempDir over;
  WriteParts(over.path(), {3, 6}, /*prompt=*/2);  // 11 tokens: the part at seq 7 passes the bound
  const Joined refused = JoinR0(over.path(), bounds);
  for (const Status& st : {refused.sampled, refused.compared}) {
    EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
    EXPECT_EQ(st.message(),
              "seq 7: the trajectory of rollout 'r0' has more than 10 tokens (prompt and output), "
              "the most one rollout's trajectory may hold");
  }
}

// Proves re-verification builds no scoring request for a trajectory of more than
// kTrajectoryTokensPerRolloutMax tokens (skipped, its detail naming the bound), while one of
// exactly the bound goes on to ask the engine (unreachable here: nothing listens on port 1).
// Catches the request built for a trajectory of any length: its JSON, and the answer it asks
// for, grow with every token.
TEST(TrajectoryBounds, ReverifySendsNothingPastTheTokenBound) {
  const std::size_t max = audit::kTrajectoryTokensPerRolloutMax;
  effects::EngineClient nobody("http://127.0.0.1:1");
  audit::Trajectory t;
  t.rollout_id = "r0";
  t.version = WeightVersion{1, "rc-1"};
  t.prompt.assign(max - 1, 7);
  t.output = {8};
  t.logprobs = {-0.5};
  const audit::ReverifyResult at = audit::Reverify(nobody, t, 0.5, false);
  EXPECT_FALSE(at.checked);
  EXPECT_EQ(at.detail.rfind("engine unreachable", 0), 0u) << at.detail;
  t.output.push_back(9);
  t.logprobs.push_back(-0.5);
  const audit::ReverifyResult over = audit::Reverify(nobody, t, 0.5, false);
  EXPECT_FALSE(over.checked);
  EXPECT_EQ(over.detail, std::to_string(max + 1) + " tokens (prompt and output), more than the " +
                             std::to_string(max) +
                             " one rollout's trajectory may hold: not sent for scoring");
}

}  // namespace
}  // namespace rc
