// DurableWaits against a real journal on disk and real event loops: every waiter runs exactly once,
// on the executor it gave, after its group is durable (or with the journal's failure), and the
// waiters of one batch on one loop share one journal notice.

#include "service/durable_waits.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>

#include "journal/journal.h"
#include "journal/testing/fault_env.h"
#include "statemachine/state.h"
#include "tests/journal/test_util.h"

namespace rc::service {
namespace {

namespace asio = boost::asio;
using journal::testing::FaultEnv;
using journal::testing::FileKind;
using journal::testing::FileOp;
using journal::testing::Group;
using journal::testing::TempDir;

std::unique_ptr<journal::Journal> OpenBootstrapped(const std::string& path, FaultEnv& faults) {
  journal::Options o;
  o.env = faults.env();
  Result<std::unique_ptr<journal::Journal>> j = journal::Journal::Open(path, o);
  RC_CHECK(j.ok());
  for (auto& g : journal::testing::BootstrapGroups()) RC_CHECK((*j)->Append(Group(g)).ok());
  return std::move(j.value());
}

journal::Ticket Admit(journal::Journal& j, const std::string& id) {
  Result<journal::Ticket> t = j.Enqueue(Group({make_admission(j.state(), id)}));
  RC_CHECK(t.ok());
  return *t;
}

// An io_context run by a thread of its own until Stop (or the end of the test).
struct Loop {
  asio::io_context context{1};
  asio::executor_work_guard<asio::io_context::executor_type> work{context.get_executor()};
  std::thread thread{[this] { context.run(); }};
  void Stop() {
    if (!thread.joinable()) return;
    work.reset();
    context.stop();
    thread.join();
  }
  ~Loop() { Stop(); }
};

bool WaitFor(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

struct Seen {
  std::mutex mu;
  std::vector<int> calls;  // per waiter
  std::vector<bool> where_asked, durable_when_run;
  int total = 0;
  explicit Seen(std::size_t n) : calls(n, 0), where_asked(n, false), durable_when_run(n, false) {}
};

// Proves waiters of many groups, spread over two loops and a strand, each run once where they
// asked (on their loop, inside the strand) with OK and their record readable; catches a batch
// handed to the wrong loop, a strand skipped, a waiter dropped or run twice when it shares a
// batch with others, or "durable" before the commit.
TEST(DurableWaits, EveryWaiterRunsOnceWhereItAskedAfterItsGroupIsDurable) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  constexpr int kWaiters = 300;
  Seen seen(kWaiters);
  Loop a, b;
  auto strand = asio::make_strand(b.context);
  for (int i = 0; i < kWaiters; ++i) {
    const journal::Ticket t = Admit(*j, "r" + std::to_string(i));
    const int kind = i % 3;  // 0: loop a, 1: loop b, 2: the strand on loop b
    const asio::any_io_executor ex = kind == 0   ? asio::any_io_executor(a.context.get_executor())
                                     : kind == 1 ? asio::any_io_executor(b.context.get_executor())
                                                 : asio::any_io_executor(strand);
    waits.Wait(t, ex, [&, i, kind, seq = t.result.last_seq](Status st) {
      const bool where = kind == 0   ? a.context.get_executor().running_in_this_thread()
                         : kind == 1 ? b.context.get_executor().running_in_this_thread()
                                     : strand.running_in_this_thread();
      const bool durable = st.ok() && j->Read(seq).ok();
      std::lock_guard<std::mutex> g(seen.mu);
      seen.calls[i]++;
      seen.where_asked[i] = where;
      seen.durable_when_run[i] = durable;
      seen.total++;
    });
  }
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> g(seen.mu);
    return seen.total >= kWaiters;
  }));
  a.Stop();
  b.Stop();  // nothing runs after this: a second call would have landed by now or never
  EXPECT_EQ(waits.waiting(), 0u);
  for (int i = 0; i < kWaiters; ++i) {
    EXPECT_EQ(seen.calls[i], 1) << "waiter " << i;
    EXPECT_TRUE(seen.where_asked[i]) << "waiter " << i;
    EXPECT_TRUE(seen.durable_when_run[i]) << "waiter " << i;
  }
}

// Proves the waiters of one batch on one loop cost one journal notice: with the WAL sync held
// back while they register, the notices registered equal the distinct (loop, batch) pairs, far
// fewer than the waiters; catches a return to one notice (and one post) per waiter.
TEST(DurableWaits, WaitersOfOneBatchOnOneLoopShareOneNotice) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  Loop a, b;
  faults.StallSync(FileKind::kWal, 300);  // nothing is durable while the waiters register
  constexpr int kWaiters = 200;
  std::set<std::pair<int, std::uint64_t>> keys;
  std::atomic<int> ok{0};
  for (int i = 0; i < kWaiters; ++i) {
    const journal::Ticket t = Admit(*j, "s" + std::to_string(i));
    asio::io_context& loop = i % 2 == 0 ? a.context : b.context;
    keys.emplace(i % 2, t.batch_id);
    waits.Wait(t, loop.get_executor(), [&](Status st) { ok += st.ok() ? 1 : 0; });
  }
  EXPECT_EQ(waits.registrations(), keys.size());
  EXPECT_LE(keys.size(), 2u * 3u) << "the groups should have shared a few batches";
  faults.StallSync(FileKind::kWal, 0);
  ASSERT_TRUE(WaitFor([&] { return ok.load() == kWaiters; }));
}

// Proves a waiter whose group is durable already still runs through its executor, never inline on
// the caller; catches a handler re-entering the caller's code in the middle of its step.
TEST(DurableWaits, AWaiterOnADurableGroupRunsOnlyThroughItsExecutor) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  const journal::Ticket t = Admit(*j, "r");
  ASSERT_TRUE(j->Wait(t).ok());
  asio::io_context idle{1};
  int calls = 0;
  waits.Wait(t, idle.get_executor(), [&](Status st) { calls += st.ok() ? 1 : 100; });
  EXPECT_EQ(calls, 0);
  idle.run();
  EXPECT_EQ(calls, 1);
}

// Proves every waiter of a batch whose WAL sync fails runs once with the journal's failure;
// catches an admission told "durable" on a failed commit, or left waiting forever.
TEST(DurableWaits, AFailedCommitReachesEveryWaiterOfItsBatch) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  Loop loop;
  faults.StallSync(FileKind::kWal, 300);  // the first batch syncs late; the rest gather behind it
  faults.Inject(FileKind::kWal, FileOp::kSync, journal::testing::Fault::kEio);
  constexpr int kWaiters = 20;
  std::atomic<int> failed{0}, ok{0};
  for (int i = 0; i < kWaiters; ++i) {
    waits.Wait(Admit(*j, "d" + std::to_string(i)), loop.context.get_executor(),
               [&](Status st) { (st.ok() ? ok : failed)++; });
  }
  ASSERT_TRUE(WaitFor([&] { return failed.load() + ok.load() == kWaiters; }));
  EXPECT_EQ(ok.load(), 0);
  EXPECT_EQ(failed.load(), kWaiters);
  EXPECT_TRUE(j->failed());
}

// Proves that once the journal is gone, waiters of a stopped loop belong to that loop's queue
// (freed with its io_context, while the timers and sockets they hold can still be closed), not to
// DurableWaits; catches waiters outliving their io_context when a service is torn down.
TEST(DurableWaits, AStoppedLoopsQueueOwnsItsWaitersOnceTheJournalIsGone) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  auto loop = std::make_unique<Loop>();
  loop->Stop();
  auto held = std::make_shared<int>(0);  // what a waiter holds (an exchange, its timers)
  faults.StallSync(FileKind::kWal, 200);
  for (int i = 0; i < 10; ++i) {
    waits.Wait(Admit(*j, "k" + std::to_string(i)), loop->context.get_executor(),
               [held](Status) { ++*held; });
  }
  j.reset();  // fails or commits what is open, and gives every notice
  EXPECT_EQ(waits.waiting(), 0u);
  EXPECT_GT(held.use_count(), 1);  // in the stopped loop's queue
  loop.reset();
  EXPECT_EQ(held.use_count(), 1);
  EXPECT_EQ(*held, 0);  // never run
}

// Proves a waiter that throws does not take the rest of its batch with it: the others still run
// once (the loop sees the exception, as it would a handler's); catches a batch dropped whole.
TEST(DurableWaits, AThrowingWaiterLeavesTheRestOfItsBatchToRun) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  asio::io_context loop{1};
  faults.StallSync(FileKind::kWal, 200);
  constexpr int kWaiters = 6;
  int ran = 0;
  for (int i = 0; i < kWaiters; ++i) {
    waits.Wait(Admit(*j, "t" + std::to_string(i)), loop.get_executor(), [&ran, i](Status) {
      ++ran;
      if (i == 1) throw std::runtime_error("handler failed");
    });
  }
  int thrown = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ran < kWaiters && std::chrono::steady_clock::now() < until) {
    try {
      loop.run_for(std::chrono::milliseconds(10));
    } catch (const std::runtime_error&) {
      ++thrown;
    }
    loop.restart();
  }
  EXPECT_EQ(ran, kWaiters);
  EXPECT_GE(thrown, 1);
}

}  // namespace
}  // namespace rc::service
