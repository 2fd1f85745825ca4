// The trajectories file's writer (service/trajectories.h): every line in order, Append never
// waiting on a stalled file, the queue's bounds in lines and bytes, Close's deadline, and failed
// writes that never merge two records into one line.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "service/trajectories.h"

namespace rc::service {
namespace {

namespace fs = std::filesystem;

// A generous bound on waits for the writer thread: reaching it is a hang, never a slow run.
constexpr std::uint64_t kHangMs = 30000;
// What Close waits for a writer the test keeps stuck.
constexpr std::uint64_t kStuckDrainMs = 50;

fs::path FreshDir() {
  char tmpl[] = "/tmp/rc_trajectories_test_XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  EXPECT_NE(made, nullptr);
  return fs::path(made == nullptr ? "/tmp" : made);
}

// One JSON record, `pad_bytes` of padding in it.
std::string Record(int i, std::size_t pad_bytes) {
  return "{\"i\":" + std::to_string(i) + ",\"pad\":\"" + std::string(pad_bytes, 'x') + "\"}";
}

// The file's lines without their newlines; a last line without one counts.
std::vector<std::string> ReadLines(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A FIFO that nobody reads: held open O_RDWR here, so the log's open does not block, and its
// writer blocks once the pipe is full. Closing `fd` ends that write with EPIPE.
struct StalledFifo {
  fs::path path;
  int fd = -1;
};

StalledFifo MakeStalledFifo(const fs::path& dir) {
  ::signal(SIGPIPE, SIG_IGN);  // the stuck write ends with EPIPE, not the process
  StalledFifo f{dir / "stalled.fifo"};
  EXPECT_EQ(::mkfifo(f.path.c_str(), 0600), 0);
  f.fd = ::open(f.path.c_str(), O_RDWR | O_CLOEXEC);
  EXPECT_GE(f.fd, 0);
  return f;
}

// Queues a line larger than any pipe holds (64 KiB by default, 1 MiB at most unless raised) and
// waits until the writer has taken it: from then on it is stuck inside that write.
void StickTheWriter(TrajectoryLog& log) {
  ASSERT_TRUE(log.Append(Record(0, std::size_t{2} << 20)));
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kHangMs);
  while (!(log.stats().in_flight && log.stats().queued_lines == 0)) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "the writer never took the line";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Proves a normal run writes every appended line once, whole and in order, and counts each as
// written; it would catch a writer thread that reorders, loses or duplicates lines, or a Close
// that returns before the queue is written.
TEST(TrajectoryLog, WritesEveryLineInOrder) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(path.string(), 0).ok());
  std::vector<std::string> expected;
  for (int i = 0; i < 1000; ++i) {
    expected.push_back(Record(i, static_cast<std::size_t>(i % 97)));
    ASSERT_TRUE(log.Append(expected.back())) << i;
  }
  EXPECT_EQ(log.Close(), 0u);
  EXPECT_EQ(ReadLines(path), expected);
  EXPECT_EQ(log.stats().written, 1000u);
  EXPECT_EQ(log.stats().dropped, 0u);
  EXPECT_FALSE(log.Append(Record(1000, 0))) << "a closed log took a line";
  fs::remove_all(dir);
}

// Proves lines written together still rotate the file at a line boundary and by its bound: the
// file and its predecessor hold the newest lines in order, each file at most bytes_max; it would
// catch one write carrying many lines across the bound (a file past it, or a line split between
// the two files).
TEST(TrajectoryLog, LinesWrittenTogetherRotateAtALineBoundary) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  constexpr std::uint64_t kBytesMax = 1000;
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(path.string(), kBytesMax).ok());
  std::vector<std::string> appended;
  for (int i = 0; i < 200; ++i) {
    appended.push_back(Record(i, 30));
    ASSERT_TRUE(log.Append(appended.back()));
  }
  EXPECT_EQ(log.Close(), 0u);
  EXPECT_EQ(log.stats().written, 200u);
  EXPECT_LE(fs::file_size(path), kBytesMax);
  EXPECT_LE(fs::file_size(path.string() + ".1"), kBytesMax);
  std::vector<std::string> kept = ReadLines(path.string() + ".1");
  for (const std::string& line : ReadLines(path)) kept.push_back(line);
  ASSERT_FALSE(kept.empty());
  const std::vector<std::string> newest(appended.end() - static_cast<long>(kept.size()),
                                        appended.end());
  EXPECT_EQ(kept, newest);
  fs::remove_all(dir);
}

// Proves a file truncated from outside (logrotate's copytruncate) is taken at its new size: the
// next lines go into it and nothing rotates early; it would catch a size kept from before the
// truncation (an early rotation here; a failed write's cut-back would extend the file with zeros).
TEST(TrajectoryLog, AFileTruncatedFromOutsideIsTakenAtItsNewSize) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(path.string(), 1000).ok());
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(log.Append(Record(i, 60)));
  ASSERT_TRUE(log.Drain(kHangMs));
  ASSERT_GT(fs::file_size(path), 700u);
  fs::resize_file(path, 0);
  std::vector<std::string> after;
  for (int i = 10; i < 14; ++i) {
    after.push_back(Record(i, 60));
    ASSERT_TRUE(log.Append(after.back()));
  }
  EXPECT_EQ(log.Close(), 0u);
  EXPECT_FALSE(fs::exists(path.string() + ".1")) << "rotated on the size from before";
  EXPECT_EQ(ReadLines(path), after);
  fs::remove_all(dir);
}

// Proves a file moved away from outside (rotation by rename) is followed by a new file at the
// path; it would catch lines written on into the moved file, where nobody looks for them.
TEST(TrajectoryLog, AFileMovedAwayIsReplacedAtItsPath) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  const fs::path moved = dir / "t.jsonl.old";
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(path.string(), 0).ok());
  ASSERT_TRUE(log.Append(Record(1, 3)));
  ASSERT_TRUE(log.Drain(kHangMs));
  fs::rename(path, moved);
  ASSERT_TRUE(log.Append(Record(2, 3)));
  EXPECT_EQ(log.Close(), 0u);
  EXPECT_EQ(ReadLines(moved), std::vector<std::string>{Record(1, 3)});
  EXPECT_EQ(ReadLines(path), std::vector<std::string>{Record(2, 3)});
  fs::remove_all(dir);
}

// Proves a line too large for the file is dropped and counted, never cut into invalid JSON; it
// would catch a bound lost in the move to the writer thread.
TEST(TrajectoryLog, ALineAboveTheBoundIsDroppedWhole) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(path.string(), 0).ok());
  EXPECT_FALSE(log.Append(std::string(kTrajectoryLineBytesMax, 'x')));
  ASSERT_TRUE(log.Append(Record(1, 3)));
  EXPECT_EQ(log.Close(), 0u);
  EXPECT_EQ(ReadLines(path), std::vector<std::string>{Record(1, 3)});
  EXPECT_EQ(log.stats().dropped, 1u);
  EXPECT_EQ(log.stats().written, 1u);
  fs::remove_all(dir);
}

// Proves that with the writer stuck on a file that takes nothing (an NFS stall), Append still
// returns, takes exactly the queue's line bound and drops and counts the rest, and Close gives up
// at its deadline, counting what was not written; it would catch Append waiting on the file (the
// event loops blocked: this test would hang), an unbounded queue, or a Close that never returns.
TEST(TrajectoryLog, AStalledFileBlocksNoAppendAndTheQueueHoldsItsLineBound) {
  const fs::path dir = FreshDir();
  StalledFifo fifo = MakeStalledFifo(dir);
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(fifo.path.string(), 0, {4, std::uint64_t{64} << 20}).ok());
  StickTheWriter(log);
  int accepted = 0;
  for (int i = 1; i <= 20; ++i) accepted += log.Append(Record(i, 10)) ? 1 : 0;
  EXPECT_EQ(accepted, 4);
  EXPECT_EQ(log.stats().queued_lines, 4u);
  EXPECT_EQ(log.stats().dropped, 16u);
  EXPECT_EQ(log.Close(kStuckDrainMs), 5u) << "4 queued and 1 in flight are not written";
  EXPECT_EQ(log.stats().dropped, 21u);
  EXPECT_EQ(log.stats().written, 0u);
  EXPECT_FALSE(log.Append(Record(21, 10)));
  ::close(fifo.fd);  // the stuck write ends (EPIPE), and with it the writer thread
  fs::remove_all(dir);
}

// Proves a trajectories path that is a FIFO nobody reads is refused at Open with a clear error
// instead of blocking the opening thread (serve's start, holding the journal) for ever; it would
// catch an open without O_NONBLOCK (this test would then hang until its timeout).
TEST(TrajectoryLog, AFifoWithoutAReaderIsRefusedAtOpen) {
  const fs::path dir = FreshDir();
  const fs::path fifo = dir / "unread.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  TrajectoryLog log;
  const Status st = log.Open(fifo.string(), 0, {4, std::uint64_t{64} << 20});
  EXPECT_EQ(st.code(), Code::kIOError) << st.ToString();
  EXPECT_NE(st.message().find("cannot open trajectories file"), std::string::npos);
  fs::remove_all(dir);
}

// Proves the queue is bounded in bytes as well as in lines: with the writer stuck, lines are
// taken until their bytes reach the bound and the next is dropped and counted; it would catch a
// queue that a few large trajectories grow past its memory bound.
TEST(TrajectoryLog, AStalledFileAndTheQueueHoldsItsByteBound) {
  const fs::path dir = FreshDir();
  StalledFifo fifo = MakeStalledFifo(dir);
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(fifo.path.string(), 0, {1000, std::uint64_t{4} << 20}).ok());
  StickTheWriter(log);
  const std::string line((std::size_t{1} << 20) - 1, 'x');  // with its newline, 1 MiB
  int accepted = 0;
  for (int i = 0; i < 6; ++i) accepted += log.Append(line) ? 1 : 0;
  EXPECT_EQ(accepted, 4);
  EXPECT_EQ(log.stats().queued_lines, 4u);
  EXPECT_EQ(log.stats().queued_bytes, std::uint64_t{4} << 20);
  EXPECT_EQ(log.stats().dropped, 2u);
  EXPECT_EQ(log.Close(kStuckDrainMs), 5u);
  ::close(fifo.fd);
  fs::remove_all(dir);
}

// Whether `c` is queued after `a` and `b` were written and the limit lifted, or with them (one
// batch, `c` short enough to fit once `b` is cut back).
enum class ThirdLine { kAfterTheLimitIsLifted, kInTheSameBatch };

// In a child process (the limit is per process): a file-size limit that cuts `b` part-way. 0 when
// each step went as planned, else the number of the step that did not.
int WriteAcrossAFileSizeLimit(const fs::path& path, const std::string& a, const std::string& b,
                              const std::string& c, ThirdLine third) {
  ::signal(SIGXFSZ, SIG_IGN);  // the write past the limit fails with EFBIG instead
  rlimit lifted{};
  if (::getrlimit(RLIMIT_FSIZE, &lifted) != 0) return 1;
  const rlimit cut{a.size() + 1 + b.size() / 2, lifted.rlim_max};
  if (::setrlimit(RLIMIT_FSIZE, &cut) != 0) return 2;
  TrajectoryLog log;
  if (!log.Open(path.string(), 0).ok()) return 3;
  if (!log.Append(a) || !log.Append(b)) return 4;
  if (third == ThirdLine::kAfterTheLimitIsLifted) {
    if (!log.Drain(kHangMs)) return 5;
    if (::setrlimit(RLIMIT_FSIZE, &lifted) != 0) return 6;
  }
  if (!log.Append(c)) return 7;
  if (log.Close(kHangMs) != 0) return 8;
  if (log.stats().written != 2 || log.stats().dropped != 1) return 9;
  return 0;
}

// The file after a, b (cut part-way by the limit) and c were written in a child process: a and c
// whole, b dropped and counted.
void ExpectTheCutLineAloneDropped(ThirdLine third) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  const std::string a = Record(1, 10), b = Record(2, 4096), c = Record(3, 10);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) ::_exit(WriteAcrossAFileSizeLimit(path, a, b, c, third));
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died, status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "step that failed (WriteAcrossAFileSizeLimit)";
  EXPECT_EQ(ReadLines(path), (std::vector<std::string>{a, c}));
  fs::remove_all(dir);
}

// Proves a write that fails part-way (disk full, EIO; here a file-size limit) leaves no fragment
// for the next line to continue: the file holds the lines before and after it, each whole, and
// the failed one is counted dropped; it would catch two records merged into one line, which makes
// audit refuse the whole file.
TEST(TrajectoryLog, AWriteFailingPartWayNeverMergesTwoRecords) {
  ExpectTheCutLineAloneDropped(ThirdLine::kAfterTheLimitIsLifted);
}

// Proves a write that fails inside a batch keeps the lines before the cut, drops only the line it
// failed in, and still writes the lines after it; it would catch a batch dropped whole after one
// failure, or the later lines appended to the failed one's fragment.
TEST(TrajectoryLog, AWriteFailingInsideABatchKeepsTheLinesAroundIt) {
  ExpectTheCutLineAloneDropped(ThirdLine::kInTheSameBatch);
}

// Proves a file an earlier process left ending inside a line gets the next record on a fresh
// line, the fragment a line of its own (what the writer also does when a failed write cannot be
// cut back); it would catch the first record after a crash merged with the fragment.
TEST(TrajectoryLog, AFragmentLeftInTheFileStaysALineOfItsOwn) {
  const fs::path dir = FreshDir();
  const fs::path path = dir / "t.jsonl";
  const std::string fragment = Record(2, 30).substr(0, 12);
  std::ofstream(path, std::ios::binary) << Record(1, 3) << "\n" << fragment;
  TrajectoryLog log;
  ASSERT_TRUE(log.Open(path.string(), 0).ok());
  ASSERT_TRUE(log.Append(Record(3, 3)));
  EXPECT_EQ(log.Close(), 0u);
  EXPECT_EQ(ReadLines(path), (std::vector<std::string>{Record(1, 3), fragment, Record(3, 3)}));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rc::service
