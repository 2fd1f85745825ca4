// Seeded fault-injection runs of many update cycles against the vLLM test double: random
// delays, HTTP errors, {"success": false}, unparseable bodies, dropped connections, and executor
// processes SIGKILLed at random points. After every cycle: the refold equals the live state,
// snapshot+tail equals the refold, the history checker finds no rollout spanning two versions
// and nothing published without validation, and replay re-derives every decision.
//
// A failure prints the seed; rerun one seed with RC_FAULT_SEED=<n>.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <random>
#include <thread>

#include "replay/replay.h"
#include "tests/integration/harness.h"

namespace rc::itest {
namespace {

std::vector<std::uint32_t> Seeds(std::uint32_t count) {
  if (const char* s = std::getenv("RC_FAULT_SEED"))
    return {static_cast<std::uint32_t>(std::atoi(s))};
  std::vector<std::uint32_t> out;
  for (std::uint32_t i = 1; i <= count; ++i) out.push_back(i * 7919u);
  return out;
}

// Draws this cycle's faults from the seed (a swarm: each seed has its own fault mix).
void InjectFaults(fixtures::VllmDouble& engine, std::mt19937& rng, double intensity) {
  engine.ClearFaults();
  std::uniform_real_distribution<double> p(0, 1);
  const char* routes[] = {"/pause",
                          "/resume",
                          "/is_paused",
                          "/weight_info",
                          "/reset_encoder_cache",
                          "/reset_mm_cache",
                          "/start_weight_update",
                          "/update_weights",
                          "/finish_weight_update",
                          "/init_weight_transfer_engine"};
  for (const char* route : routes) {
    if (p(rng) > intensity) continue;
    fixtures::RouteFault f;
    f.times = 1 + static_cast<int>(rng() % 2);
    switch (rng() % 5) {
      case 0:
        f.delay_ms = 1 + static_cast<int>(rng() % 30);
        break;
      case 1:
        f.status = (rng() % 2) ? 500 : 503;
        break;
      case 2:
        f.garbage_body = true;
        break;
      case 3:
        f.drop_connection = true;
        f.after = (rng() % 2) == 0;
        break;
      default:
        f.delay_ms = 5;
        f.status = 500;
        break;
    }
    engine.SetRouteFault(route, f);
  }
  if (p(rng) < intensity) engine.FailResetPrefixCache(static_cast<int>(rng() % 4));
}

// The checks after every cycle; returns false (with failures recorded) when one fails.
void CheckJournal(Executor& x, std::uint32_t seed, int cycle) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " cycle " + std::to_string(cycle));
  const State live = x.journal->state();
  auto refold = x.journal->Refold();
  ASSERT_TRUE(refold.ok()) << refold.status().ToString();
  EXPECT_EQ(*refold, live) << "refold differs from the live state";
  auto loaded = x.journal->LoadState();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(*loaded, live) << "snapshot + tail differs from the live state";
  HistoryReport h = x.CheckHistory();
  EXPECT_TRUE(h.ok) << "history: seq " << h.first_bad_seq << ": " << h.message;
  auto report = replay::Replay(*x.journal, {});
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok) << "replay: seq " << report->first_bad_seq << ": " << report->error;
}

// Runs concurrent rollouts through explicit admission while an update runs.
struct RolloutLoad {
  Executor& x;
  std::atomic<bool> stop{false};
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;
  RolloutLoad(Executor& exec, int workers, const std::string& tag) : x(exec) {
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([this, w, tag] {
        for (int i = 0; !stop.load() && i < 1000; ++i) {
          const std::string id = tag + "-w" + std::to_string(w) + "-" + std::to_string(i);
          auto a = x.Admit(id);
          if (!a.ok()) {  // refused during an update (or tainted): wait and retry
            std::this_thread::sleep_for(std::chrono::milliseconds(3));
            continue;
          }
          admitted++;
          auto reply =
              x.Complete("prompt " + std::to_string(i % 3) + " under test", 6, a->version.label);
          Status st =
              x.Finish(id, reply.body,
                       reply.http.ok_2xx() ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted);
          EXPECT_TRUE(st.ok()) << st.ToString();
        }
      });
    }
  }
  void Stop() {
    stop = true;
    for (auto& t : threads) t.join();
    threads.clear();
  }
  ~RolloutLoad() { Stop(); }
};

// Proves the controller's guarantees hold across many seeded update cycles with random HTTP
// faults and concurrent rollouts; would catch any fault that leads to publishing without
// validation, a rollout spanning two versions, a non-deterministic decision or a fold that
// disagrees with its journal.
TEST(FaultRun, SeededFaultsKeepTheContract) {
  int committed = 0, refused = 0, tainted = 0;
  for (std::uint32_t seed : Seeds(6)) {
    std::mt19937 rng(seed);
    const double intensity = 0.05 + (seed % 5) * 0.05;
    auto x = std::make_unique<Executor>();
    x->Bootstrap();
    for (int cycle = 0; cycle < 12; ++cycle) {
      InjectFaults(x->engine, rng, intensity);
      RolloutLoad load(*x, 3, "s" + std::to_string(seed) + "c" + std::to_string(cycle));
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
      const std::string label =
          "rc-" + std::to_string(x->journal->state().committed.generation + 1);
      auto ended = x->runner->Update(Update("u-" + std::to_string(cycle), label, cycle + 1));
      load.Stop();
      x->engine.ClearFaults();
      if (ended.ok()) {
        committed += ended->outcome == UpdateOutcome::kCommitted;
        refused += ended->outcome == UpdateOutcome::kRefused;
        tainted += ended->outcome == UpdateOutcome::kTainted;
      } else {
        // Retries exhausted in RESUMING: an executor restart resumes.
        x->Restart();
        ASSERT_TRUE(x->runner->Recover(x->journal->recovery()).ok());
      }
      CheckJournal(*x, seed, cycle);
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "rerun with RC_FAULT_SEED=" << seed;
        return;
      }
      if (x->journal->state().lifecycle == Lifecycle::kTainted) {
        x = std::make_unique<Executor>();  // a tainted engine is replaced, never reused
        x->Bootstrap();
      }
    }
  }
  std::printf("fault run: %d committed, %d refused, %d tainted\n", committed, refused, tainted);
  EXPECT_GT(committed, 10) << "the fault mix is so heavy that nothing is exercised";
  EXPECT_GT(refused + tainted, 0) << "the faults never bit: the run proves nothing";
}

// ---- executor kills: a child process runs the executor; the parent SIGKILLs it ----

int ChildMain(const std::string& dir, const std::string& url, std::uint32_t seed) {
  auto j = journal::Journal::Open(dir, journal::Options{});
  if (!j.ok()) return 3;
  effects::EngineDeadlines d;
  d.call_timeout_ms = 5000;
  d.drain_timeout_ms = 20000;
  d.update_timeout_ms = 20000;
  effects::EngineClient client(url, d);
  effects::HttpEngineControl control(client);
  effects::HttpSequenceTransfer transfer(client, effects::detect_protocol("0.30.0"));
  effects::Runner runner(**j, control, transfer, effects::system_clock(), Executor::FastRunner());
  if ((*j)->state().lifecycle == Lifecycle::kUninitialized) {
    if (!runner.Bootstrap("rc-0", Identity(0)).ok()) return 4;
  } else if (!runner.Recover((*j)->recovery()).ok()) {
    return 5;
  }
  std::mt19937 rng(seed);
  for (int cycle = 0; cycle < 1000; ++cycle) {
    const State s = (*j)->state();
    if (s.lifecycle == Lifecycle::kTainted) return 0;
    std::atomic<bool> stop{false};
    std::thread rollouts([&] {
      for (int i = 0; !stop.load() && i < 1000; ++i) {
        const std::string id =
            "k" + std::to_string(seed) + "-" + std::to_string(cycle) + "-" + std::to_string(i);
        RolloutAdmitted a = make_admission((*j)->state(), id);
        auto sub = (*j)->Submit(a, WallMs());
        if (!sub.ok() || !(*j)->Wait(sub->ticket).ok()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          continue;
        }
        nlohmann::json req = {{"prompt", "kill test"}, {"max_tokens", 4}, {"temperature", 0}};
        auto reply = client.Completions(req);
        auto fin = (*j)->Submit(RolloutFinished{id, RolloutOutcome::kCompleted, 0, 0}, WallMs());
        if (fin.ok()) (*j)->Wait(fin->ticket).IgnoreError();
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 10));
    const std::string label = "rc-" + std::to_string(s.committed.generation + 1);
    runner
        .Update(Update("k" + std::to_string(seed) + "-u" + std::to_string(cycle), label,
                       static_cast<int>(s.committed.generation + 1)))
        .status()
        .IgnoreError();
    stop = true;
    rollouts.join();
  }
  return 0;
}

// Proves that SIGKILLing the executor at random points never loses an acknowledged binding,
// never leaves a rollout spanning two versions, classifies a kill during the transfer as
// TAINTED (and one before it as a refusal), and that a restarted executor reconciles and
// carries on; would catch a crash window where the journal and the engine disagree silently.
TEST(FaultRun, ExecutorKillsAreReconciled) {
  int kills = 0, tainted = 0, recovered_updates = 0, journal_updates = 0;
  for (std::uint32_t seed : Seeds(3)) {
    std::mt19937 rng(seed);
    auto x = std::make_unique<Executor>();
    // Each kill after which no further update had committed doubles the next child's life (up to
    // 16x): on a starved machine the children must still get far enough to show they carry on.
    int stalled_kills = 0;
    for (int k = 0; k < 12; ++k) {
      // The parent holds no journal while the child runs (one writer per journal).
      x->runner.reset();
      x->journal.reset();
      // Everything the child needs is prepared before fork: only exec runs in the child.
      const std::string seed_text = std::to_string(seed * 100 + k);
      const std::string url = x->url();
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        execl("/proc/self/exe", "fault_run_child", x->dir.c_str(), url.c_str(), seed_text.c_str(),
              static_cast<char*>(nullptr));
        _exit(127);
      }
      const int life_ms = static_cast<int>(40 + rng() % 250) << std::min(stalled_kills, 4);
      std::this_thread::sleep_for(std::chrono::milliseconds(life_ms));
      kill(pid, SIGKILL);
      int status = 0;
      waitpid(pid, &status, 0);
      kills++;
      x->OpenJournal();
      x->runner = std::make_unique<effects::Runner>(*x->journal, *x->control, *x->transfer,
                                                    effects::system_clock(), x->runner_options);
      if (x->journal->state().lifecycle == Lifecycle::kUninitialized) {
        ++stalled_kills;
        continue;
      }
      ASSERT_TRUE(x->runner->Recover(x->journal->recovery()).ok());
      const State s = x->journal->state();
      EXPECT_TRUE(s.active.empty()) << "bindings of the dead executor were not abandoned";
      EXPECT_TRUE(s.lifecycle == Lifecycle::kReady || s.lifecycle == Lifecycle::kTainted)
          << lifecycle_name(s.lifecycle);
      const int committed = static_cast<int>(s.counters.updates_committed);
      stalled_kills = committed > journal_updates ? 0 : stalled_kills + 1;
      journal_updates = committed;
      CheckJournal(*x, seed, k);
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "rerun with RC_FAULT_SEED=" << seed;
        return;
      }
      if (s.lifecycle == Lifecycle::kTainted) {
        tainted++;
        recovered_updates += journal_updates;
        journal_updates = 0;
        x = std::make_unique<Executor>();
      }
    }
    recovered_updates += journal_updates;
    journal_updates = 0;
  }
  std::printf("executor kills: %d kills, %d tainted, %d updates committed across restarts\n", kills,
              tainted, recovered_updates);
  EXPECT_GT(recovered_updates, 0);
}

}  // namespace
}  // namespace rc::itest

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[0]) == "fault_run_child") {
    return rc::itest::ChildMain(argv[1], argv[2], static_cast<std::uint32_t>(std::atoi(argv[3])));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
