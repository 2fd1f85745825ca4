// DurableWaits against a real journal on disk and real event loops: every waiter runs exactly once,
// on the executor it gave, after its group is durable (or with the journal's failure).

#include "service/durable_waits.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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

// An io_context run by a thread of its own until the test ends.
struct Loop {
  asio::io_context context{1};
  asio::executor_work_guard<asio::io_context::executor_type> work{context.get_executor()};
  std::thread thread{[this] { context.run(); }};
  ~Loop() {
    work.reset();
    context.stop();
    thread.join();
  }
};

struct Seen {
  std::mutex mu;
  std::vector<int> calls;  // per waiter
  std::vector<bool> on_its_thread, durable_when_run;
  explicit Seen(std::size_t n) : calls(n, 0), on_its_thread(n, false), durable_when_run(n, false) {}
};

bool WaitFor(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

// Proves waiters of many groups, spread over two loops and a strand, each run once on their own
// loop's thread with OK and their record readable; catches a batch handed to the wrong loop, a
// waiter dropped or run twice when it shares a batch with others, or "durable" before the commit.
TEST(DurableWaits, EveryWaiterRunsOnceOnItsLoopAfterItsGroupIsDurable) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  Loop a, b;
  auto strand = asio::make_strand(b.context);
  constexpr int kWaiters = 300;
  Seen seen(kWaiters);
  for (int i = 0; i < kWaiters; ++i) {
    Result<journal::Ticket> t =
        j->Enqueue(Group({make_admission(j->state(), "r" + std::to_string(i))}));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const bool on_a = i % 3 == 0;
    const asio::any_io_executor ex =
        on_a ? asio::any_io_executor(a.context.get_executor())
             : (i % 3 == 1 ? asio::any_io_executor(b.context.get_executor()) : strand);
    const std::thread::id want = on_a ? a.thread.get_id() : b.thread.get_id();
    waits.Wait(*t, ex, [&, i, want, seq = t->result.last_seq](Status st) {
      std::lock_guard<std::mutex> g(seen.mu);
      seen.calls[i]++;
      seen.on_its_thread[i] = std::this_thread::get_id() == want;
      seen.durable_when_run[i] = st.ok() && j->Read(seq).ok();
    });
  }
  ASSERT_TRUE(WaitFor([&] { return waits.pending() == 0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a second run would land now
  std::lock_guard<std::mutex> g(seen.mu);
  for (int i = 0; i < kWaiters; ++i) {
    EXPECT_EQ(seen.calls[i], 1) << "waiter " << i;
    EXPECT_TRUE(seen.on_its_thread[i]) << "waiter " << i;
    EXPECT_TRUE(seen.durable_when_run[i]) << "waiter " << i;
  }
}

// Proves a waiter whose group is durable already still runs through its executor, never inline on
// the caller; catches a handler re-entering the caller's code in the middle of its step.
TEST(DurableWaits, AWaiterOnADurableGroupRunsOnlyThroughItsExecutor) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  Result<journal::Ticket> t = j->Enqueue(Group({make_admission(j->state(), "r")}));
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(j->Wait(*t).ok());
  asio::io_context idle{1};
  int calls = 0;
  waits.Wait(*t, idle.get_executor(), [&](Status st) { calls += st.ok() ? 1 : 100; });
  EXPECT_EQ(calls, 0);
  idle.run();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(waits.pending(), 0u);
}

// Proves every waiter of a batch whose WAL sync fails runs once with the journal's failure;
// catches an admission told "durable" on a failed commit, or left waiting forever.
TEST(DurableWaits, AFailedCommitReachesEveryWaiterOfItsBatch) {
  TempDir dir;
  FaultEnv faults;
  auto j = OpenBootstrapped(dir.path(), faults);
  DurableWaits waits(*j);
  Loop loop;
  faults.Inject(FileKind::kWal, FileOp::kSync, journal::testing::Fault::kEio);
  constexpr int kWaiters = 20;
  std::atomic<int> failed{0}, ok{0};
  int waiting = 0;
  for (int i = 0; i < kWaiters; ++i) {
    Result<journal::Ticket> t =
        j->Enqueue(Group({make_admission(j->state(), "d" + std::to_string(i))}));
    if (!t.ok()) break;  // the journal failed already: later groups are refused at once
    waits.Wait(*t, loop.context.get_executor(), [&](Status st) { (st.ok() ? ok : failed)++; });
    waiting++;
  }
  ASSERT_GT(waiting, 0);
  ASSERT_TRUE(WaitFor([&] { return waits.pending() == 0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(ok.load(), 0);
  EXPECT_EQ(failed.load(), waiting);
  EXPECT_TRUE(j->failed());
}

}  // namespace
}  // namespace rc::service
