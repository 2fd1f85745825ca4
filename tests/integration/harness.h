// A RolloutCore executor wired to the vLLM test double over real loopback HTTP and a real
// RocksDB journal in a temporary directory. Shared by the experiment and fault tests.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "effects/clock.h"
#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/http/sequence_transfer.h"
#include "effects/runner.h"
#include "fixtures/vllm_double.h"
#include "journal/journal.h"
#include "statemachine/history.h"
#include "tests/support/engine_calls.h"

namespace rc::itest {

inline std::string TempDir(const std::string& tag) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() /
             ("rc-it-" + tag + "-" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline std::int64_t WallMs() { return effects::wall_now_ms(); }

// The manifest every test checkpoint shares ("synthetic:8x64"): same architecture.
inline std::string SharedDigest() {
  auto m = effects::synthetic_manifest("synthetic:8x64");
  RC_CHECK(m.ok());
  return m->digest();
}

inline WeightIdentity Identity(int step) {
  return WeightIdentity{SharedDigest(), "", "ckpt/step-" + std::to_string(step), "it-run", step};
}

inline UpdateRequested Update(const std::string& id, const std::string& label, int step) {
  return UpdateRequested{id, label, Identity(step), "synthetic:8x64:" + std::to_string(step)};
}

struct Executor {
  explicit Executor(fixtures::VllmDoubleOptions dopts = Defaults(),
                    effects::RunnerOptions ropts = FastRunner())
      : engine(dopts) {
    port = engine.Start(0);
    RC_CHECK(port > 0);
    dir = TempDir("exec");
    OpenJournal();
    effects::EngineDeadlines d;
    d.connect_timeout_ms = 1000;
    d.call_timeout_ms = 5000;
    d.drain_timeout_ms = 20000;
    d.update_timeout_ms = 20000;
    client = std::make_unique<effects::EngineClient>(url(), d);
    control = std::make_unique<effects::HttpEngineControl>(*client);
    transfer = std::make_unique<effects::HttpSequenceTransfer>(
        *client, effects::detect_protocol(dopts.version));
    runner_options = ropts;
    runner = std::make_unique<effects::Runner>(*journal, *control, *transfer,
                                               effects::system_clock(), ropts);
  }
  ~Executor() {
    runner.reset();
    journal.reset();
    engine.Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }

  static fixtures::VllmDoubleOptions Defaults() {
    fixtures::VllmDoubleOptions o;
    o.version = "0.30.0";
    o.token_delay_ms = 2;
    return o;
  }
  static effects::RunnerOptions FastRunner() {
    effects::RunnerOptions o;
    o.executor_id = "itest";
    o.drain_timeout_ms = 20000;
    o.await_rollouts_timeout_ms = 300;
    o.transfer_timeout_ms = 10000;
    o.call_timeout_ms = 5000;
    o.backoff_ms_min = 5;
    o.backoff_ms_max = 40;
    return o;
  }

  void OpenJournal() {
    auto j = journal::Journal::Open(dir, journal::Options{});
    RC_CHECK(j.ok());
    journal = std::move(j.value());
  }
  // Closes and reopens everything the executor process owns (a restart without a crash).
  void Restart() {
    runner.reset();
    journal.reset();
    OpenJournal();
    runner = std::make_unique<effects::Runner>(*journal, *control, *transfer,
                                               effects::system_clock(), runner_options);
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port); }

  void Bootstrap(const std::string& label = "rc-0") {
    Status st = runner->Bootstrap(label, Identity(0));
    ASSERT_TRUE(st.ok()) << st.ToString();
  }

  // Durable admission under the committed version (what the proxy does before forwarding).
  Result<RolloutAdmitted> Admit(const std::string& id) {
    RolloutAdmitted a = make_admission(journal->state(), id);
    auto s = journal->Submit(a, WallMs());
    if (!s.ok()) return s.status();
    RC_RETURN_IF_ERROR(journal->Wait(s->ticket));
    return a;
  }
  Status Finish(const std::string& id, const nlohmann::json& reply_body,
                RolloutOutcome outcome = RolloutOutcome::kCompleted) {
    RolloutFinished f{id, outcome, 0, 0};
    if (reply_body.contains("usage")) {
      f.prompt_tokens = reply_body["usage"].value("prompt_tokens", 0u);
      f.completion_tokens = reply_body["usage"].value("completion_tokens", 0u);
    }
    auto s = journal->Submit(f, WallMs());
    if (!s.ok()) return s.status();
    return journal->Wait(s->ticket);
  }
  // Greedy completion on the engine.
  effects::HttpReply Complete(const std::string& prompt, int max_tokens,
                              const std::string& cache_salt = "") {
    nlohmann::json req = {{"model", "rc-double-model"},
                          {"prompt", prompt},
                          {"max_tokens", max_tokens},
                          {"temperature", 0},
                          {"return_token_ids", true}};
    if (!cache_salt.empty()) req["cache_salt"] = cache_salt;
    return client->Completions(req);
  }

  // Every record of the journal, for history checks and ordering assertions.
  std::vector<journal::Record> Records() {
    std::vector<journal::Record> out;
    Status st = journal->Scan(1, 0, [&](const journal::Record& r) {
      out.push_back(r);
      return Status::OK();
    });
    EXPECT_TRUE(st.ok()) << st.ToString();
    return out;
  }
  HistoryReport CheckHistory() {
    std::vector<HistoryEntry> h;
    for (const journal::Record& r : Records()) h.push_back({r.seq, r.cause_seq, r.event});
    return check_history(h);
  }

  fixtures::VllmDouble engine;
  int port = 0;
  std::string dir;
  std::unique_ptr<journal::Journal> journal;
  std::unique_ptr<effects::EngineClient> client;
  std::unique_ptr<effects::HttpEngineControl> control;
  std::unique_ptr<effects::HttpSequenceTransfer> transfer;
  effects::RunnerOptions runner_options;
  std::unique_ptr<effects::Runner> runner;
};

// Seq of the first record matching pred, 0 if none.
template <class Pred>
std::uint64_t FirstSeq(const std::vector<journal::Record>& records, Pred pred) {
  for (const journal::Record& r : records) {
    if (pred(r)) return r.seq;
  }
  return 0;
}

// Every record of a journal in seq order (a scan error is recorded as a test failure).
inline std::vector<journal::Record> ScanRecords(journal::Journal& j) {
  std::vector<journal::Record> out;
  Status st = j.Scan(1, 0, [&](const journal::Record& r) {
    out.push_back(r);
    return Status::OK();
  });
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// The history checker over records as the journal holds them.
inline HistoryReport CheckRecords(const std::vector<journal::Record>& records) {
  std::vector<HistoryEntry> h;
  h.reserve(records.size());
  for (const journal::Record& r : records) h.push_back({r.seq, r.cause_seq, r.event});
  return check_history(h);
}

inline double MetricOr0(effects::EngineClient& c, const std::string& name) {
  auto m = rc::testing::Metrics(c);
  if (!m.ok()) return -1;
  return rc::testing::metric_sum(*m, name);
}

}  // namespace rc::itest
