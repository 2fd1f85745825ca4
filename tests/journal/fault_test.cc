// Journal under injected faults (journal/testing/fault_env.h over the real file system): write
// and sync errors and stalls fail the journal for good, torn writes after a crash recover exactly
// the acknowledged prefix, a torn WAL tail is reported, rollout ids are never reused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <rocksdb/env.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "journal/journal.h"
#include "journal/testing/fault_env.h"
#include "statemachine/text.h"
#include "tests/journal/test_util.h"

namespace rc::journal {
namespace {

namespace fs = std::filesystem;
using testing::BootstrapGroups;
using testing::FaultEnv;
using testing::FileKind;
using testing::FileOp;
using testing::Group;
using testing::TempDir;

std::unique_ptr<Journal> OpenOk(const std::string& path, const Options& o) {
  Result<std::unique_ptr<Journal>> j = Journal::Open(path, o);
  RC_CHECK(j.ok() || (std::fprintf(stderr, "%s\n", j.status().ToString().c_str()), false));
  return std::move(j.value());
}

void Bootstrap(Journal& j) {
  for (auto& g : BootstrapGroups()) ASSERT_TRUE(j.Append(Group(g)).ok());
}

Result<AppendResult> Admit(Journal& j, const std::string& id) {
  return j.Append(Group({make_admission(j.state(), id)}));
}

// Proves an EIO or ENOSPC on the WAL's append or sync fails that Append and every later call
// with an error naming the journal and the fault, and that reopening yields at least every
// acknowledged record and at most the failed group; catches a journal that acknowledges an
// unsynced group, keeps accepting appends after a failed commit, or hides which journal failed.
TEST(FailStop, WalWriteAndSyncErrorsFailTheJournalForGood) {
  for (FileOp op : {FileOp::kAppend, FileOp::kSync}) {
    for (testing::Fault fault : {testing::Fault::kEio, testing::Fault::kEnospc}) {
      SCOPED_TRACE(std::string(op == FileOp::kAppend ? "append " : "sync ") +
                   (fault == testing::Fault::kEio ? "EIO" : "ENOSPC"));
      TempDir dir;
      FaultEnv faults;
      Options o;
      o.env = faults.env();
      std::uint64_t acked = 0;
      {
        auto j = OpenOk(dir.path(), o);
        Bootstrap(*j);
        ASSERT_TRUE(Admit(*j, "r1").ok());
        acked = j->head_seq();
        EXPECT_FALSE(j->failed());
        faults.Inject(FileKind::kWal, op, fault);
        Result<AppendResult> failed = Admit(*j, "r2");
        ASSERT_FALSE(failed.ok());
        const std::string msg = failed.status().message();
        EXPECT_NE(msg.find(dir.path()), std::string::npos) << msg;
        EXPECT_NE(msg.find("fault injected"), std::string::npos) << msg;
        if (fault == testing::Fault::kEnospc) {
          EXPECT_NE(msg.find("space"), std::string::npos) << msg;
        }
        EXPECT_TRUE(j->failed());
        EXPECT_EQ(j->failure().ToString(), failed.status().ToString());
        faults.Clear();  // the disk recovered: the journal must stay failed anyway
        Result<AppendResult> later = Admit(*j, "r3");
        ASSERT_FALSE(later.ok());
        EXPECT_EQ(later.status().ToString(), failed.status().ToString());
        EXPECT_FALSE(j->WriteSnapshot(acked, j->fleet_state()).ok());
      }
      auto reopened = OpenOk(dir.path(), o);
      EXPECT_FALSE(reopened->recovery().clean_close) << "a failed journal recorded a clean close";
      EXPECT_GE(reopened->head_seq(), acked) << "an acknowledged record was lost";
      EXPECT_LE(reopened->head_seq(), acked + 1) << "records appeared that were never enqueued";
      EXPECT_TRUE(reopened->Scan(1, 0, [](const Record&) { return Status::OK(); }).ok());
    }
  }
}

// Proves a durable mark that cannot be written (its file's sync fails) fails the journal: the
// group already durable stays acknowledged, every later call fails naming the mark, and a reopen
// holds every acknowledged record; catches a mark failure ignored (the open's check would then
// rest on a stale mark) or one that takes back an acknowledged group.
TEST(FailStop, ADurableMarkThatCannotBeWrittenFailsTheJournal) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.durable_mark_interval_ms = 0;
  std::uint64_t acked = 0;
  {
    auto j = OpenOk(dir.path(), o);
    faults.Inject(FileKind::kOther, FileOp::kSync, testing::Fault::kEio);
    Result<AppendResult> durable = j->Append(Group(BootstrapGroups().at(0)));
    ASSERT_TRUE(durable.ok()) << durable.status().ToString();
    acked = durable->last_seq;
    // The mark follows the group's commit; the journal fails once its write did.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!j->failed() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Result<AppendResult> later = j->Append(Group(BootstrapGroups().at(1)));
    ASSERT_FALSE(later.ok());
    EXPECT_NE(later.status().message().find("durable mark"), std::string::npos)
        << later.status().ToString();
    EXPECT_TRUE(j->failed());
    faults.Clear();
  }
  auto reopened = OpenOk(dir.path(), o);
  EXPECT_GE(reopened->head_seq(), acked);
}

// Proves the durable mark's rename is synced into the journal's directory (through the journal's
// Env) and that a failure of that sync fails the journal as a mark that cannot be written does:
// the close that marks the last commit fails naming the mark, and a reopen holds every
// acknowledged record; catches a mark renamed into place without the directory sync, which a
// power loss can take back (an older mark, or none, guarding the journal).
TEST(FailStop, ADurableMarkWhoseRenameCannotBeSyncedFailsTheJournal) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.durable_mark_interval_ms = UINT32_MAX;  // after the open's, the close writes the only mark
  std::uint64_t acked = 0;
  {
    auto j = OpenOk(dir.path(), o);
    // The first commit syncs the new WAL's directory entry (RocksDB's own directory sync): the
    // close's mark is the next to sync the directory.
    Bootstrap(*j);
    faults.Inject(FileKind::kDirectory, FileOp::kSync, testing::Fault::kEio);
    Result<AppendResult> durable = Admit(*j, "r1");
    ASSERT_TRUE(durable.ok()) << durable.status().ToString();
    acked = durable->last_seq;
    const Status closed = j->Close();
    ASSERT_FALSE(closed.ok()) << "the mark's directory sync failed unnoticed, or never ran";
    EXPECT_NE(closed.message().find("durable mark"), std::string::npos) << closed.ToString();
    EXPECT_NE(closed.message().find("fault injected"), std::string::npos) << closed.ToString();
    faults.Clear();
  }
  EXPECT_FALSE(fs::exists(dir.path() + "/CLOSED")) << "a failed journal recorded a clean close";
  auto reopened = OpenOk(dir.path(), o);
  EXPECT_GE(reopened->head_seq(), acked);
}

// Proves a full disk under a flush fails the journal with RocksDB's own log kept out of the
// journal's directory (no LOG file) and no recovery inside the process; catches the reproduced
// abort where RocksDB's no-space recovery wrote to the failed LOG file of a full journal disk.
TEST(FailStop, AFullDiskAtAFlushFailsTheJournalWithoutALogFile) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  ASSERT_TRUE(Admit(*j, "r1").ok());
  faults.Inject(FileKind::kSst, FileOp::kAppend, testing::Fault::kEnospc);
  EXPECT_FALSE(j->Flush().ok());
  faults.Clear();
  // RocksDB would try to resume every bgerror_resume_retry_interval (1 s by default): past two of
  // them, an automatic resume would have happened.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  Result<AppendResult> after = Admit(*j, "r2");
  EXPECT_FALSE(after.ok()) << "RocksDB resumed writes after a background error";
  EXPECT_TRUE(j->failed());
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_NE(e.path().filename().string().rfind("LOG", 0), 0u) << e.path();
  }
}

// Captures what this process writes to stderr (fd 2) in `file`, readable while the capture goes on
// (gtest's capture can be read only once it ended), until End().
class StderrCapture {
 public:
  explicit StderrCapture(std::string file) : file_(std::move(file)) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    RC_CHECK(saved_ >= 0 && fd >= 0 && ::dup2(fd, 2) == 2);
    ::close(fd);
  }
  ~StderrCapture() { End(); }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  void End() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  // The whole lines written so far.
  std::string Lines() const {
    std::ifstream in(file_, std::ios::binary);
    const std::string all{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const std::size_t end = all.rfind('\n');
    return end == std::string::npos ? "" : all.substr(0, end + 1);
  }

 private:
  const std::string file_;
  int saved_ = -1;
};

// Proves RocksDB's own log lines reach stderr escaped as every line from outside is, and cut
// between UTF-8 sequences: a failed flush of a journal whose path holds a line separator (U+2028)
// and runs past the line bound in two-byte characters; catches bytes >= 0x80 passed raw (the
// separator breaks the line in two for a reader that honours it) and a cut inside a character
// (ill-formed UTF-8 on stderr).
TEST(FailStop, RocksDbLogLinesAreEscapedAndCutBetweenCharacters) {
  TempDir dir;
  std::string path = dir.path() + "/line\u2028sep";
  for (int i = 0; i < 5; ++i) {
    std::string name;
    for (int c = 0; c < 120; ++c) name += "\u00e9";  // U+00E9, two bytes
    path += "/" + name;
  }
  fs::create_directories(fs::path(path).parent_path());
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  auto j = OpenOk(path, o);
  Bootstrap(*j);
  faults.Inject(FileKind::kSst, FileOp::kAppend, testing::Fault::kEio);
  TempDir captured;
  StderrCapture capture(captured.sub("stderr"));
  EXPECT_FALSE(j->Flush().ok());
  // RocksDB logs the failed flush on its own thread, as it wakes the caller: waited for (at most
  // 10 s) until a line of it names the journal's directory, escaped or not.
  std::string err;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    err = capture.Lines();
    const std::size_t named = err.find("rolloutcore: journal: rocksdb: ");
    if (named != std::string::npos && err.find("/line", named) != std::string::npos) break;
    if (std::chrono::steady_clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  capture.End();
  faults.Clear();
  std::size_t named = 0;
  std::size_t from = 0;
  while (from < err.size()) {
    std::size_t end = err.find('\n', from);
    if (end == std::string::npos) end = err.size();
    const std::string line = err.substr(from, end - from);
    from = end + 1;
    if (line.rfind("rolloutcore: journal: rocksdb: ", 0) != 0) continue;
    EXPECT_TRUE(text::valid_utf8(line)) << text::escape_line(line);
    EXPECT_EQ(line.find("\u2028"), std::string::npos) << "a raw line separator";
    EXPECT_EQ(line.find("\\xc3"), std::string::npos) << "a character cut in two";
    named += line.find("line\\u2028sep") != std::string::npos ? 1 : 0;
  }
  EXPECT_GT(named, 0u) << "no RocksDB line named the journal's path: " << text::escape_line(err);
}

// Proves a WAL sync stalled past commit_stall_timeout_ms makes Wait return Timeout naming the
// journal well before the stall ends, fails every later call, and never acknowledges the stalled
// group; catches an unbounded wait on a hung disk and a journal that goes on after it.
TEST(FailStop, StalledSyncPastTheDeadlineTimesOut) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.commit_stall_timeout_ms = 200;
  std::uint64_t acked = 0;
  {
    auto j = OpenOk(dir.path(), o);
    Bootstrap(*j);
    acked = j->head_seq();
    faults.StallSync(FileKind::kWal, 2000);
    const auto t0 = std::chrono::steady_clock::now();
    Result<AppendResult> stalled = Admit(*j, "r1");
    const auto waited = std::chrono::steady_clock::now() - t0;
    ASSERT_FALSE(stalled.ok()) << "acknowledged while its sync was still stalled";
    EXPECT_EQ(stalled.status().code(), Code::kTimeout) << stalled.status().ToString();
    EXPECT_NE(stalled.status().message().find(dir.path()), std::string::npos);
    EXPECT_LT(waited, std::chrono::milliseconds(1500));
    EXPECT_GE(waited, std::chrono::milliseconds(150));
    EXPECT_TRUE(j->failed());
    EXPECT_EQ(j->failure().code(), Code::kTimeout);
    faults.Clear();
    EXPECT_EQ(Admit(*j, "r2").status().code(), Code::kTimeout);
  }  // the close waits for the stalled sync, then writes nothing more
  auto reopened = OpenOk(dir.path(), o);
  EXPECT_GE(reopened->head_seq(), acked);
  EXPECT_LE(reopened->head_seq(), acked + 1);
}

// Opens `path` once no open-time write left running past its deadline holds it (Busy), trying for
// at most 10 s.
Result<std::unique_ptr<Journal>> OpenOnceReleased(const std::string& path, const Options& o) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(path, o);
    if (j.ok() || j.status().code() != Code::kBusy || std::chrono::steady_clock::now() > until) {
      return j;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Proves a write of the writer's open stalled past commit_stall_timeout_ms (a new journal's schema
// and head keys: a WAL sync; RocksDB's own open of an existing journal: a MANIFEST sync) makes
// Open return Timeout naming the journal and the write well before the stall ends, and that once
// the stalled call returns, its database is closed and the journal opens as it was; catches an
// open that waits forever on a hung disk, and a timed-out open that keeps the journal locked or
// changes it (the clean close it found lost).
TEST(FailStop, AWriteAtOpenStalledPastTheDeadlineTimesOut) {
  // Never destroyed: the stalled call runs on inside it after Open returned.
  static FaultEnv* const faults = new FaultEnv();
  struct Case {
    bool existing;
    FileKind stalled;
    const char* write;
    std::chrono::milliseconds deadline;  // RocksDB's open, replaying the WAL, gets 6x the 200 ms
  };
  for (const Case& c :
       {Case{false, FileKind::kWal, "schema_version", std::chrono::milliseconds(200)},
        Case{true, FileKind::kManifest, "RocksDB's open", std::chrono::milliseconds(1200)}}) {
    SCOPED_TRACE(c.write);
    TempDir dir;
    Options o;
    o.env = faults->env();
    o.commit_stall_timeout_ms = 200;
    std::uint64_t head = 0;
    if (c.existing) {
      auto j = OpenOk(dir.path(), o);
      Bootstrap(*j);
      head = j->head_seq();
    }
    faults->StallSync(c.stalled, 3000);
    const auto t0 = std::chrono::steady_clock::now();
    Result<std::unique_ptr<Journal>> stalled = Journal::Open(dir.path(), o);
    const auto waited = std::chrono::steady_clock::now() - t0;
    faults->Clear();  // the stalled sync still sleeps out its 3 s
    ASSERT_FALSE(stalled.ok()) << "opened while a write of its open was stalled";
    EXPECT_EQ(stalled.status().code(), Code::kTimeout) << stalled.status().ToString();
    EXPECT_NE(stalled.status().message().find(dir.path()), std::string::npos);
    EXPECT_NE(stalled.status().message().find(c.write), std::string::npos)
        << stalled.status().message();
    EXPECT_LT(waited, c.deadline + std::chrono::milliseconds(1300));
    EXPECT_GE(waited, c.deadline - std::chrono::milliseconds(50));
    Result<std::unique_ptr<Journal>> again = OpenOnceReleased(dir.path(), o);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ((*again)->head_seq(), head);
    EXPECT_EQ((*again)->recovery().clean_close, c.existing);
  }
}

// Proves the durable mark the writer's open writes last, stalled past commit_stall_timeout_ms,
// keeps the journal locked until its write returns: Open is Timeout naming the mark, a reopen
// meanwhile is Busy, and once the write ended the journal opens (its DURABLE well-formed) with the
// head it had; catches the mark's write run without holding the database, whose close on the
// caller's thread let a new writer rewrite DURABLE.tmp while the stalled write could still rename
// it, half written, over DURABLE (every later open then refused a healthy journal as malformed).
TEST(FailStop, AStalledMarkAtOpenKeepsTheJournalLockedUntilItsWriteEnds) {
  // Never destroyed: the stalled write runs on inside it after Open returned.
  static FaultEnv* const faults = new FaultEnv();
  TempDir dir;
  Options o;
  o.env = faults->env();
  o.commit_stall_timeout_ms = 200;
  std::uint64_t head = 0;
  {
    auto j = OpenOk(dir.path(), o);
    Bootstrap(*j);
    head = j->head_seq();
  }
  // RocksDB's open syncs files of the same kind (CURRENT, OPTIONS): the stall starts once it
  // returned, when the writer reads its marks again (its second read of DURABLE).
  faults->BeforeNextRead("DURABLE", [] {
    faults->BeforeNextRead("DURABLE", [] { faults->StallSync(FileKind::kOther, 3000); });
  });
  Result<std::unique_ptr<Journal>> stalled = Journal::Open(dir.path(), o);
  faults->Clear();  // the stalled sync still sleeps out its 3 s
  ASSERT_FALSE(stalled.ok()) << "opened while its durable mark's write was stalled";
  EXPECT_EQ(stalled.status().code(), Code::kTimeout) << stalled.status().ToString();
  EXPECT_NE(stalled.status().message().find("durable mark"), std::string::npos)
      << stalled.status().ToString();
  Result<std::unique_ptr<Journal>> meanwhile = Journal::Open(dir.path(), o);
  ASSERT_FALSE(meanwhile.ok()) << "a writer opened while the stalled mark's write ran on";
  EXPECT_EQ(meanwhile.status().code(), Code::kBusy) << meanwhile.status().ToString();
  Result<std::unique_ptr<Journal>> again = OpenOnceReleased(dir.path(), o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->head_seq(), head);
  again->reset();
  std::ifstream mark(dir.path() + "/DURABLE");
  std::string title;
  std::getline(mark, title);
  EXPECT_EQ(title, "rolloutcore journal durable through");
}

// Proves WaitAsync calls back exactly once with OK only after the group is durable (every
// callback of one group commit sees the record readable), and with the failure when the WAL sync
// fails; catches an event loop told "durable" before the fsync or never told at all.
TEST(WaitAsync, CallsBackOnceAfterTheCommitOrWithTheFailure) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  constexpr int kGroups = 64;
  std::atomic<int> ok{0}, calls{0};
  std::vector<Ticket> tickets;
  for (int i = 0; i < kGroups; ++i) {
    Result<Ticket> t = j->Enqueue(Group({make_admission(j->state(), "a" + std::to_string(i))}));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tickets.push_back(*t);
  }
  for (const Ticket& t : tickets) {
    j->WaitAsync(t, [&, seq = t.result.last_seq](Status st) {
      calls++;
      if (st.ok() && j->Read(seq).ok()) ok++;
    });
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (calls.load() < kGroups && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(calls.load(), kGroups);
  EXPECT_EQ(ok.load(), kGroups);
  faults.Inject(FileKind::kWal, FileOp::kSync, testing::Fault::kEio);
  Result<Ticket> doomed = j->Enqueue(Group({make_admission(j->state(), "doomed")}));
  ASSERT_TRUE(doomed.ok());
  std::atomic<int> failed_calls{0};
  Status seen;
  std::mutex seen_mu;
  j->WaitAsync(*doomed, [&](Status st) {
    std::lock_guard<std::mutex> g(seen_mu);
    seen = st;
    failed_calls++;
  });
  while (failed_calls.load() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(failed_calls.load(), 1);
  std::lock_guard<std::mutex> g(seen_mu);
  EXPECT_FALSE(seen.ok());
  EXPECT_NE(seen.message().find(dir.path()), std::string::npos) << seen.ToString();
  // Already decided: called back at once, on the caller's thread.
  bool inline_call = false;
  j->WaitAsync(*doomed, [&](Status st) { inline_call = !st.ok(); });
  EXPECT_TRUE(inline_call);
}

// Proves a stalled sync reaches async waiters too: failed() past the deadline calls them back
// with Timeout while the sync still hangs; catches admissions parked forever on a hung disk.
TEST(WaitAsync, StalledSyncCallsBackWithTimeout) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.commit_stall_timeout_ms = 200;
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  faults.StallSync(FileKind::kWal, 2000);
  Result<Ticket> t = j->Enqueue(Group({make_admission(j->state(), "r1")}));
  ASSERT_TRUE(t.ok());
  std::atomic<int> code{-1};
  j->WaitAsync(*t, [&](Status st) { code = static_cast<int>(st.code()); });
  const auto t0 = std::chrono::steady_clock::now();
  while (code.load() < 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    (void)j->failed();  // what serve's watchdog does
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(code.load(), static_cast<int>(Code::kTimeout));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1500));
  faults.Clear();
}

// Proves a commit window makes a group submitted while the committer waits share the batch (and
// the fsync) of a group already wanted durable, and that both are then durable; catches a window
// that is ignored (each wanted group written alone) or one that strands the late group.
TEST(CommitWindow, GroupsSubmittedWithinTheWindowShareOneCommit) {
  TempDir dir;
  Options o;
  o.commit_window_us = kCommitWindowUsMax;  // 10 ms
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  int judged = 0;
  for (int round = 0; round < 5 && judged == 0; ++round) {
    const std::string id = "w" + std::to_string(round);
    Result<Ticket> first = j->Enqueue(Group({make_admission(j->state(), id + "a")}));
    ASSERT_TRUE(first.ok());
    // Shared: a callback that comes after a round gave up must not write to a dead frame.
    auto durable = std::make_shared<std::atomic<int>>(0);
    j->WaitAsync(*first, [durable](Status st) { *durable += st.ok() ? 1 : 100; });
    const auto wanted_at = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // the committer is awake by now
    Result<Ticket> late = j->Enqueue(Group({make_admission(j->state(), id + "b")}));
    ASSERT_TRUE(late.ok());
    const auto late_after = std::chrono::steady_clock::now() - wanted_at;
    j->WaitAsync(*late, [durable](Status st) { *durable += st.ok() ? 1 : 100; });
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (durable->load() < 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(durable->load(), 2) << "round " << round;
    if (late_after >= std::chrono::milliseconds(8)) continue;  // a descheduled test thread
    ++judged;
    EXPECT_EQ(late->batch_id, first->batch_id) << "round " << round;
  }
  EXPECT_EQ(judged, 1) << "every round was descheduled past the window";
}

// Proves Stop() while the committer waits out its commit window fails the waiting group with the
// owner's reason, writes nothing more and refuses every later submit, without tripping the
// committer's invariants; catches a committer that asserted the journal could not fail during
// the window (a fail-stop of serve crashed the process instead of answering 503).
TEST(CommitWindow, StopDuringTheWindowFailsTheWaitersAndWritesNothing) {
  TempDir dir;
  Options o;
  o.commit_window_us = kCommitWindowUsMax;  // 10 ms
  auto j = OpenOk(dir.path(), o);
  Bootstrap(*j);
  const std::uint64_t durable_head = j->head_seq();
  Result<Ticket> t = j->Enqueue(Group({make_admission(j->state(), "in-window")}));
  ASSERT_TRUE(t.ok());
  auto told = std::make_shared<std::atomic<int>>(-1);
  j->WaitAsync(*t, [told](Status st) { *told = static_cast<int>(st.code()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the committer is in its window
  j->Stop(Status::Unavailable("the owner fail-stopped"));
  EXPECT_EQ(j->Wait(*t).code(), Code::kUnavailable);
  EXPECT_EQ(told->load(), static_cast<int>(Code::kUnavailable));
  EXPECT_EQ(j->failure().message(), "the owner fail-stopped");
  EXPECT_FALSE(j->Enqueue(Group({make_admission(j->state(), "after")})).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the window
  j.reset();
  auto reopened = OpenOk(dir.path(), Options{});
  EXPECT_EQ(reopened->head_seq(), durable_head) << "the stopped group was written";
}

// Appends admissions from several threads until the WAL's sync fails, then crashes and drops
// the unsynced bytes (whole or a torn prefix). Returns the acknowledged (seq -> hash).
struct CrashRun {
  std::map<std::uint64_t, Hash> acked;
  std::uint64_t enqueued_head = 0;
  std::uint64_t kept_unsynced_bytes = 0;
};

CrashRun AppendThenCrash(const std::string& path, FaultEnv& faults, testing::Torn torn,
                         std::uint64_t seed) {
  CrashRun run;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 16;
  std::mutex mu;
  {
    auto j = OpenOk(path, o);
    for (auto& g : BootstrapGroups()) {
      Result<AppendResult> r = j->Append(Group(g));
      RC_CHECK(r.ok());
      run.acked[r->last_seq] = r->last_hash;
    }
    // The sync of some batch after the first ~40 fails: its bytes reach the WAL, unsynced.
    faults.Inject(FileKind::kWal, FileOp::kSync, testing::Fault::kEio,
                  static_cast<std::uint32_t>(40 + seed % 40));
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 1000; ++i) {
          const std::string id =
              "s" + std::to_string(seed) + "-t" + std::to_string(t) + "-" + std::to_string(i);
          Result<Journal::Submitted> s = j->Submit(make_admission(j->state(), id), i);
          if (!s.ok()) return;
          if (!j->Wait(s->ticket).ok()) return;
          std::lock_guard<std::mutex> l(mu);
          run.acked[s->ticket.result.last_seq] = s->ticket.result.last_hash;
        }
      });
    }
    for (auto& th : threads) th.join();
    RC_CHECK(j->failed());
    run.enqueued_head = j->head_seq();
    faults.Crash();
  }
  RC_CHECK(faults.DropUnsyncedData(torn, seed, &run.kept_unsynced_bytes).ok());
  faults.Restart();
  return run;
}

// Proves that after a crash with torn writes (unsynced WAL bytes dropped whole or cut at a
// seeded point) recovery yields every acknowledged record with its acknowledged hash, nothing
// beyond the enqueued head, and reports exactly the torn bytes when the tail was cut mid-batch;
// catches acknowledging before the sync, losing a synced group, and a torn tail passed off as a
// healthy shorter journal.
TEST(FailStop, TornWritesRecoverTheAcknowledgedPrefix) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    TempDir dir;
    FaultEnv faults;
    const testing::Torn torn = seed % 2 == 0 ? testing::Torn::kNone : testing::Torn::kRandomPrefix;
    CrashRun run = AppendThenCrash(dir.path(), faults, torn, seed);
    ASSERT_FALSE(run.acked.empty());
    const std::uint64_t max_acked = run.acked.rbegin()->first;
    for (bool read_only : {true, false}) {
      Options o;
      o.env = faults.env();
      o.read_only = read_only;
      o.create_if_missing = false;
      auto j = OpenOk(dir.path(), o);
      const std::uint64_t head = j->head_seq();
      EXPECT_GE(head, max_acked) << "an acknowledged record was lost";
      EXPECT_LE(head, run.enqueued_head);
      for (const auto& [seq, hash] : run.acked) {
        Result<Record> r = j->Read(seq);
        ASSERT_TRUE(r.ok()) << "acknowledged seq " << seq << ": " << r.status().ToString();
        EXPECT_EQ(r->hash, hash) << "acknowledged seq " << seq << " changed";
      }
      ASSERT_TRUE(j->Scan(1, 0, [](const Record&) { return Status::OK(); }).ok());
      const Recovery rec = j->recovery();
      EXPECT_FALSE(rec.clean_close);
      if (head == max_acked) {
        // The unacknowledged batch was dropped: what was kept of it is exactly the torn tail.
        EXPECT_EQ(rec.wal_bytes_unread, run.kept_unsynced_bytes) << rec.torn_tail;
        EXPECT_EQ(rec.torn_tail.empty(), run.kept_unsynced_bytes == 0) << rec.torn_tail;
      } else {
        EXPECT_EQ(rec.wal_bytes_unread, 0u) << rec.torn_tail;
      }
      if (!rec.torn_tail.empty()) {
        EXPECT_NE(rec.torn_tail.find(".log"), std::string::npos) << rec.torn_tail;
        EXPECT_NE(rec.torn_tail.find("seq " + std::to_string(head + 1)), std::string::npos)
            << rec.torn_tail;
      }
      if (read_only) continue;
      // The writer recovered and kept what it found; an executor's start records it, then
      // forgets it.
      ASSERT_TRUE(j->ForgetRecordedTornTail().ok());
    }
    Options o;
    o.env = faults.env();
    auto again = OpenOk(dir.path(), o);
    // The WAL was flushed away, and the finding forgotten.
    EXPECT_TRUE(again->recovery().torn_tail.empty()) << again->recovery().torn_tail;
    EXPECT_TRUE(again->recovery().clean_close);
  }
}

// Proves a crash whose WAL is intact (every batch synced) reports no torn tail across a WAL of
// many 32 KiB blocks; catches a tail check that miscounts the WAL's framing and would call every
// healthy crash recovery torn.
TEST(Recovery, IntactWalAfterACrashIsNotTorn) {
  TempDir dir;
  FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  std::uint64_t head = 0;
  {
    auto j = OpenOk(dir.path(), o);
    Bootstrap(*j);
    for (int i = 0; i < 700; ++i) {
      // Ids of varying length move the records across block boundaries at varying offsets.
      ASSERT_TRUE(
          Admit(*j, "r" + std::string(static_cast<std::size_t>(i % 97), 'x') + std::to_string(i))
              .ok());
    }
    head = j->head_seq();
    faults.Crash();
  }
  ASSERT_TRUE(faults.DropUnsyncedData(testing::Torn::kNone, 0).ok());
  faults.Restart();
  std::uintmax_t wal_bytes = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    if (e.path().extension() == ".log") wal_bytes += e.file_size();
  }
  ASSERT_GT(wal_bytes, 4 * 32768u) << "the WAL must span several blocks";
  Options ro = o;
  ro.read_only = true;
  auto j = OpenOk(dir.path(), ro);
  EXPECT_EQ(j->head_seq(), head);
  EXPECT_FALSE(j->recovery().clean_close);
  EXPECT_EQ(j->recovery().wal_bytes_unread, 0u) << j->recovery().torn_tail;
  EXPECT_TRUE(j->recovery().torn_tail.empty()) << j->recovery().torn_tail;
}

// Proves a journal runs over an in-memory Env through Options::env (open, append, clean close,
// reopen); catches an Env that is not passed to RocksDB or to the journal's own files.
TEST(Recovery, RunsOverAnInMemoryEnv) {
  std::unique_ptr<rocksdb::Env> mem(rocksdb::NewMemEnv(rocksdb::Env::Default()));
  Options o;
  o.env = mem.get();
  const std::string path = "/rc-mem-journal";
  Hash head_hash{};
  {
    auto j = OpenOk(path, o);
    Bootstrap(*j);
    ASSERT_TRUE(Admit(*j, "r1").ok());
    head_hash = j->head_hash();
  }
  EXPECT_FALSE(fs::exists(path)) << "the in-memory journal reached the real file system";
  auto j = OpenOk(path, o);
  EXPECT_EQ(j->head_seq(), 5u);
  EXPECT_EQ(j->head_hash(), head_hash);
  EXPECT_TRUE(j->recovery().clean_close);
}

// Proves a rollout id is refused (Conflict naming the id and the seq of its first use, nothing
// written) once it has any record: finished, durable, reopened, or still pending in the same
// group commit; catches an id bound to two versions over the journal's life (rc-2, then rc-3).
TEST(RolloutIds, AreNeverReused) {
  TempDir dir;
  {
    auto j = OpenOk(dir.path(), Options{});
    Bootstrap(*j);
    ASSERT_TRUE(Admit(*j, "r1").ok());  // seq 5
    ASSERT_TRUE(j->Append(Group({RolloutFinished{"r1", RolloutOutcome::kCompleted, 1, 1}})).ok());
    const std::uint64_t head = j->head_seq();
    Result<AppendResult> again = Admit(*j, "r1");
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), Code::kConflict);
    EXPECT_EQ(again.status().message(), "rollout id 'r1' was already used at seq 5");
    Result<Journal::Submitted> submitted = j->Submit(make_admission(j->state(), "r1"), 9);
    EXPECT_EQ(submitted.status().code(), Code::kConflict);
    EXPECT_EQ(j->head_seq(), head);
    // Pending: admitted and finished in groups not yet known durable, then admitted again.
    Result<Ticket> a = j->Enqueue(Group({make_admission(j->state(), "r2")}));
    ASSERT_TRUE(a.ok());
    Result<Ticket> f = j->Enqueue(Group({RolloutFinished{"r2", RolloutOutcome::kAborted, 0, 0}}));
    ASSERT_TRUE(f.ok());
    Result<Ticket> reuse = j->Enqueue(Group({make_admission(j->state(), "r2")}));
    EXPECT_EQ(reuse.status().code(), Code::kConflict);
    EXPECT_EQ(reuse.status().message(),
              "rollout id 'r2' was already used at seq " + std::to_string(a->result.first_seq));
    ASSERT_TRUE(j->Wait(*f).ok());
    EXPECT_EQ(*j->RolloutSeqs("r1"), (std::vector<std::uint64_t>{5, 6}));
  }
  auto j = OpenOk(dir.path(), Options{});
  EXPECT_EQ(Admit(*j, "r1").status().code(), Code::kConflict);
  EXPECT_EQ(Admit(*j, "r2").status().code(), Code::kConflict);
  EXPECT_TRUE(Admit(*j, "r3").ok());
}

// Proves AppendResult.last_hash is the hash of record last_seq, also for an idempotent duplicate;
// catches a witness head a client could not check against the journal.
TEST(RolloutIds, AppendResultCarriesTheLastHash) {
  TempDir dir;
  auto j = OpenOk(dir.path(), Options{});
  Bootstrap(*j);
  const AppendRequest request = Group({make_admission(j->state(), "r1")}, "key-1");
  Result<AppendResult> r = j->Append(request);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->last_hash, j->Read(r->last_seq)->hash);
  EXPECT_EQ(r->last_hash, j->head_hash());
  Result<AppendResult> dup = j->Append(request);
  ASSERT_TRUE(dup.ok()) << dup.status().ToString();
  EXPECT_TRUE(dup->duplicate);
  EXPECT_EQ(dup->last_hash, r->last_hash);
}

}  // namespace
}  // namespace rc::journal
