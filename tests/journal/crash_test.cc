// Crash test: a child process appends through group commit (several threads, sync on) and
// reports every acknowledged seq on a pipe; the parent SIGKILLs it at seeded random times, at
// least 200 times, and after each kill reopens and checks that every acknowledged seq is present,
// seqs are contiguous, the hash chain verifies and the fold equals LoadState and a full Refold.
// It catches acknowledged-but-lost events, torn groups and chains broken by a crash.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "journal/journal.h"
#include "tests/journal/test_util.h"

namespace rc::journal {
namespace {

constexpr int kKills = 200;
constexpr int kChildThreads = 4;

Options CrashOptions() {
  Options o;
  o.sync = true;
  o.snapshot_every = 64;
  return o;
}

void WriteSeq(int fd, std::uint64_t seq) {
  const ssize_t n = write(fd, &seq, sizeof(seq));
  RC_CHECK(n == sizeof(seq));
}

// Submits `input` and waits for durability; returns the group's last seq.
std::uint64_t SubmitDurable(Journal& j, const Event& input) {
  Result<Journal::Submitted> s = j.Submit(input, 1);
  if (!s.ok()) std::fprintf(stderr, "crash child: %s\n", s.status().ToString().c_str());
  RC_CHECK(s.ok());
  RC_CHECK(j.Wait(s->ticket).ok());
  return s->ticket.result.last_seq;
}

// The child: bring the journal to READY (resuming a bootstrap a previous kill interrupted), then
// append admissions and finishes from several threads until killed.
[[noreturn]] void ChildMain(const std::string& dir, int fd) {
  Result<std::unique_ptr<Journal>> opened = Journal::Open(dir, CrashOptions());
  if (!opened.ok()) {
    std::fprintf(stderr, "crash child: %s\n", opened.status().ToString().c_str());
    _exit(3);
  }
  Journal& j = **opened;
  while (j.state().lifecycle != Lifecycle::kReady) {
    const State s = j.state();
    if (!s.bootstrap) {
      WriteSeq(fd, SubmitDurable(j, BootstrapRequested{"rc-0", testing::SampleIdentity()}));
    } else if (!s.in_flight) {
      WriteSeq(fd,
               SubmitDurable(j, EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000}));
    } else {
      WriteSeq(fd, SubmitDurable(j, EngineProbed{HttpEvidence{Transport::kOk, 200, true, 1, ""},
                                                 "0.25.1", "rc-0", false, false, "i-0"}));
    }
  }
  WriteSeq(fd, 0);  // ready marker: appending starts now
  std::vector<std::thread> threads;
  for (int t = 0; t < kChildThreads; ++t) {
    threads.emplace_back([&, t] {
      for (std::uint64_t i = 0;; ++i) {
        const std::string id =
            "p" + std::to_string(getpid()) + "-t" + std::to_string(t) + "-" + std::to_string(i);
        WriteSeq(fd, SubmitDurable(j, make_admission(j.state(), id)));
        WriteSeq(fd, SubmitDurable(j, RolloutFinished{id, RolloutOutcome::kCompleted, 1, 1}));
      }
    });
  }
  for (auto& th : threads) th.join();
  _exit(0);
}

// Reads 8-byte seqs until EOF or timeout; returns the max and whether the ready marker arrived.
struct Acks {
  std::uint64_t max_seq = 0;
  bool ready = false;
  bool eof = false;
};

void ReadAcks(int fd, Acks& acks, int timeout_ms, bool until_ready) {
  std::uint64_t seq = 0;
  while (!(until_ready && acks.ready)) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return;
    const ssize_t n = read(fd, &seq, sizeof(seq));
    if (n <= 0) {
      acks.eof = true;
      return;
    }
    RC_CHECK(n == sizeof(seq));
    if (seq == 0) acks.ready = true;
    acks.max_seq = std::max(acks.max_seq, seq);
  }
}

// Proves no acknowledged event is lost or torn across 200 SIGKILLs (see the file comment).
TEST(Crash, SigkillDuringGroupCommitLosesNoAcknowledgedEvent) {
  testing::TempDir dir;
  const std::string path = dir.sub("journal");
  std::mt19937_64 rng(20261130);
  std::uint64_t max_acked_ever = 0;
  int ready_kills = 0;
  int torn_tails = 0;  // a SIGKILL can cut a multi-page write(): reported, never acknowledged
  for (int kill_no = 0; kill_no < kKills; ++kill_no) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      const std::string fd = std::to_string(fds[1]);
      execl("/proc/self/exe", "journal_crash_test", "--crash-child", path.c_str(), fd.c_str(),
            static_cast<char*>(nullptr));
      _exit(4);
    }
    close(fds[1]);
    Acks acks;
    ReadAcks(fds[0], acks, 20000, /*until_ready=*/true);
    if (acks.ready) ++ready_kills;
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 36));
    kill(pid, SIGKILL);
    int wstatus = 0;
    waitpid(pid, &wstatus, 0);
    ReadAcks(fds[0], acks, 1000, /*until_ready=*/false);
    close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(wstatus)) << "child exited on its own with " << WEXITSTATUS(wstatus);
    max_acked_ever = std::max(max_acked_ever, acks.max_seq);

    {
      // The read-only tools see the crashed journal first: every acknowledged seq, and a torn
      // tail only as unacknowledged bytes beyond them.
      Options ro = CrashOptions();
      ro.read_only = true;
      Result<std::unique_ptr<Journal>> r = Journal::Open(path, ro);
      ASSERT_TRUE(r.ok()) << "read-only after kill " << kill_no << ": " << r.status().ToString();
      ASSERT_GE((*r)->head_seq(), max_acked_ever) << "acknowledged seq lost after kill " << kill_no;
      ASSERT_FALSE((*r)->recovery().clean_close);
      if ((*r)->recovery().wal_bytes_unread > 0) ++torn_tails;
    }
    Result<std::unique_ptr<Journal>> j = Journal::Open(path, CrashOptions());
    ASSERT_TRUE(j.ok()) << "after kill " << kill_no << ": " << j.status().ToString();
    const std::uint64_t head = (*j)->head_seq();
    ASSERT_GE(head, max_acked_ever) << "acknowledged seq lost after kill " << kill_no;
    std::uint64_t expect = 1;
    Status scanned = (*j)->Scan(1, 0, [&](const Record& r) {
      EXPECT_EQ(r.seq, expect++);
      return Status::OK();
    });
    ASSERT_TRUE(scanned.ok()) << scanned.ToString();
    ASSERT_EQ(expect, head + 1);
    Result<State> loaded = (*j)->LoadState();
    Result<State> refold = (*j)->Refold();
    ASSERT_TRUE(loaded.ok() && refold.ok());
    ASSERT_EQ(*loaded, *refold) << "snapshot + tail differs from the full fold after kill "
                                << kill_no;
    ASSERT_EQ((*j)->state(), *refold);
  }
  EXPECT_GE(ready_kills, kKills * 9 / 10);
  std::printf("%d kills (%d while appending), %llu events acknowledged in total, %d torn tails\n",
              kKills, ready_kills, static_cast<unsigned long long>(max_acked_ever), torn_tails);
}

}  // namespace
}  // namespace rc::journal

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--crash-child") {
    rc::journal::ChildMain(argv[2], std::atoi(argv[3]));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
