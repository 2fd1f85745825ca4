// EngineClient and HttpSequenceTransfer against the vLLM double (fixtures/): the whole update
// sequence per protocol line, injected faults, cancellation, metrics and streaming; and the
// runners (Runner, FleetRunner) driving it through a journal where a race or a refused thread
// must be made deterministic.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <system_error>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "effects/fleet_runner.h"
#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/http/ipc_transfer.h"
#include "effects/http/protocol.h"
#include "effects/http/sequence_transfer.h"
#include "effects/runner.h"
#include "encoding/base64.h"
#include "fixtures/vllm_double.h"
#include "journal/journal.h"
#include "tests/support/engine_calls.h"

namespace rc::effects {
namespace {

using nlohmann::json;
using rc::fixtures::RouteFault;
using rc::fixtures::VllmDouble;
using rc::fixtures::VllmDoubleOptions;
using rc::testing::metric_present;
using rc::testing::Metrics;
using rc::testing::MetricsMap;
using rc::testing::read_engine_load;
using Clock = std::chrono::steady_clock;

EngineDeadlines Fast() {
  EngineDeadlines d;
  d.connect_timeout_ms = 500;
  d.call_timeout_ms = 3000;
  d.drain_timeout_ms = 5000;
  d.update_timeout_ms = 5000;
  return d;
}

std::unique_ptr<VllmDouble> StartDouble(const std::string& version) {
  VllmDoubleOptions o;
  o.version = version;
  o.token_delay_ms = 1;
  o.worker_extension_cls = kWorkerExtensionClass;  // needed below 0.26 (no /weight_info)
  auto d = std::make_unique<VllmDouble>(o);
  EXPECT_GT(d->Start(0), 0);
  return d;
}

TransferTarget Target() {
  TransferTarget t;
  t.update_id = "u1";
  t.target = WeightVersion{1, "rc-1"};
  t.source_uri = "synthetic:4x32:1";
  return t;
}

// Initialises the transfer engine the way the NCCL sender will: world size from the engine,
// init_info for the detected line.
void InitTransfer(EngineClient& c, const EngineProtocol& p, bool unique_id) {
  HttpReply ws = c.GetWorldSize(true);
  ASSERT_TRUE(ws.http.ok_2xx()) << ws.http.error;
  NcclInitParams init;
  if (unique_id) {
    init.nccl_unique_id_b64 = std::string(171, 'A') + "=";
  } else {
    init.master_address = "127.0.0.1";
    init.master_port = 29555;
  }
  init.world_size = 1 + ws.body["world_size"].get<std::uint32_t>();
  Result<json> info = build_init_info(p, init, PackingParams{});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  HttpReply r = c.InitWeightTransferEngine(*info);
  ASSERT_TRUE(r.http.ok_2xx()) << r.http.error;
}

class FullSequence : public ::testing::TestWithParam<const char*> {};

// Proves the full probe -> pause(wait) -> start/update/finish -> resets -> label -> resume
// sequence yields the evidence the fold needs on each protocol line (0.25.1: label through the
// worker extension, prefix reset unreported); would catch any route, body or layout the double
// (faithful to vLLM) refuses, e.g. packed* in the wrong info or /weight_info on 0.25.1.
TEST_P(FullSequence, ProbeDrainTransferResetValidateResume) {
  auto d = StartDouble(GetParam());
  EngineClient c(d->base_url(), Fast());
  EngineProbed probe = c.Probe();
  ASSERT_TRUE(probe.http.ok_2xx()) << probe.http.error;
  EXPECT_EQ(probe.engine_version, GetParam());
  EXPECT_EQ(probe.reported_label, "default");
  const EngineProtocol p = detect_protocol(probe.engine_version);
  ASSERT_NE(p.line, ProtocolLine::kUnknown);
  const bool legacy = std::string(GetParam()) == "0.25.1";  // no /weight_info: worker extension
  EXPECT_EQ(c.label_route(), legacy ? LabelRoute::kWorkerRpc : LabelRoute::kWeightInfoRoute);

  DrainObserved drain = c.PauseWait();
  EXPECT_TRUE(drain.http.ok_2xx()) << drain.http.error;
  EXPECT_TRUE(drain.paused);
  InitTransfer(c, p, p.unique_id_rendezvous);

  const std::uint64_t gen_before = d->weights_generation();
  HttpSequenceTransfer t(c, p);
  TransferObserved o = t.Transfer(Target(), 10000);
  EXPECT_TRUE(o.acknowledged) << o.error;
  EXPECT_EQ(o.mutation, MutationClass::kComplete);
  EXPECT_EQ(o.tensors_sent, 4u);
  EXPECT_EQ(o.bytes_sent, 4u * 32 * 32 * 2);
  EXPECT_GT(d->weights_generation(), gen_before);

  for (CacheKind k : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
    CacheResetObserved r = c.ResetCache(k);
    EXPECT_TRUE(r.http.ok_2xx()) << cache_name(k) << " " << r.http.error;
    EXPECT_TRUE(r.reported_success) << cache_name(k);
    if (k == CacheKind::kPrefix) {
      EXPECT_EQ(r.success_unreported, legacy);
    }
  }
  ValidationObserved v = c.WeightInfo();
  EXPECT_TRUE(v.http.ok_2xx());
  EXPECT_EQ(v.reported_label, "rc-1");
  ResumeObserved res = c.Resume();
  EXPECT_TRUE(res.http.ok_2xx()) << res.http.error;
  EXPECT_TRUE(res.is_paused_known);
  EXPECT_FALSE(res.is_paused);
}

INSTANTIATE_TEST_SUITE_P(Lines, FullSequence, ::testing::Values("0.25.1", "0.28.0", "0.30.0"));

// Proves a layout mismatch is caught by the engine and reported as a possible mutation; would
// catch the 0.25 layout silently accepted by a >= 0.28 engine in our classification.
TEST(VllmDoubleIntegration, WrongLineIsRefusedAsPossible) {
  auto d = StartDouble("0.28.0");
  EngineClient c(d->base_url(), Fast());
  InitTransfer(c, detect_protocol("0.28.0"), false);
  HttpSequenceTransfer t(c, detect_protocol("0.25.1"));  // packed* in update_info: ValueError
  TransferObserved o = t.Transfer(Target(), 10000);
  EXPECT_FALSE(o.acknowledged);
  EXPECT_EQ(o.mutation, MutationClass::kPossible);
  EXPECT_NE(o.error.find("update_weights"), std::string::npos);
}

// Proves {"success": false} from the double's /reset_prefix_cache is reported as a failed reset
// and the next one succeeds; would catch a reset trusted on its 200.
TEST(VllmDoubleIntegration, PrefixResetFailureReported) {
  auto d = StartDouble("0.30.0");
  d->FailResetPrefixCache(1);
  EngineClient c(d->base_url(), Fast());
  CacheResetObserved bad = c.ResetCache(CacheKind::kPrefix);
  EXPECT_TRUE(bad.http.ok_2xx());
  EXPECT_FALSE(bad.reported_success);
  EXPECT_TRUE(c.ResetCache(CacheKind::kPrefix).reported_success);
}

// Proves the resume reads /is_sleeping once the engine answers unpaused: an engine someone slept
// while it was held paused (as a drain holds it) reports sleeping after /resume, an awake one
// does not. Catches a resume that returned a sleeper's scheduler to service unseen: vLLM reports a
// sleeping engine as paused, so the monitor cannot tell it from the drain's own pause.
TEST(VllmDoubleIntegration, AResumeReadsWhetherTheEngineSleeps) {
  VllmDoubleOptions o;
  o.worker_extension_cls = kWorkerExtensionClass;
  o.enable_sleep_mode = true;
  VllmDouble d(o);
  ASSERT_GT(d.Start(0), 0);
  EngineClient c(d.base_url(), Fast());
  ASSERT_TRUE(c.Pause(PauseMode::kWait, false).http.ok_2xx());
  ResumeObserved awake = c.Resume();
  EXPECT_TRUE(awake.is_sleeping_known);
  EXPECT_FALSE(awake.is_sleeping);
  ASSERT_TRUE(c.Pause(PauseMode::kWait, false).http.ok_2xx());
  httplib::Client outside(d.base_url());
  auto slept = outside.Post("/sleep?level=1&mode=wait", "", "application/json");
  ASSERT_TRUE(slept && slept->status == 200);
  ResumeObserved r = c.Resume();
  ASSERT_TRUE(r.http.ok_2xx()) << r.http.error;
  EXPECT_FALSE(r.is_paused) << "vLLM's /resume unpauses a sleeper's scheduler";
  EXPECT_TRUE(r.is_sleeping_known);
  EXPECT_TRUE(r.is_sleeping);
}

// Proves injected faults map to the right mutation class: refused before start -> kNone,
// dropped or garbage after start -> kPossible; would catch ambiguity hidden as "no mutation".
TEST(VllmDoubleIntegration, FaultsClassifyMutation) {
  {
    auto d = StartDouble("0.30.0");
    const std::string url = d->base_url();
    d->Stop();
    EngineClient c(url, Fast());
    HttpSequenceTransfer t(c, detect_protocol("0.30.0"));
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kNone);
  }
  for (const char* route : {"/start_weight_update", "/update_weights", "/finish_weight_update"}) {
    for (int kind = 0; kind < 2; ++kind) {
      auto d = StartDouble("0.30.0");
      EngineClient c(d->base_url(), Fast());
      InitTransfer(c, detect_protocol("0.30.0"), false);
      RouteFault f;
      if (kind == 0)
        f.drop_connection = true;
      else
        f.garbage_body = true;
      f.times = 1;
      d->SetRouteFault(route, f);
      HttpSequenceTransfer t(c, detect_protocol("0.30.0"));
      TransferObserved o = t.Transfer(Target(), 5000);
      EXPECT_EQ(o.mutation, MutationClass::kPossible) << route << " kind " << kind;
      EXPECT_FALSE(o.acknowledged) << route;
    }
  }
}

// Proves Cancel() interrupts a call hung inside the engine within a bounded time; would catch a
// runner stuck for the whole update deadline on a stuck /update_weights.
TEST(VllmDoubleIntegration, CancelInterruptsHungUpdate) {
  auto d = StartDouble("0.30.0");
  EngineDeadlines dl = Fast();
  dl.update_timeout_ms = 60000;
  EngineClient c(d->base_url(), dl);
  RouteFault hang;
  hang.hang = true;
  d->SetRouteFault("/update_weights", hang);
  HttpReply r;
  std::thread caller([&] { r = c.UpdateWeights(json{{"names", json::array()}}); });
  while (d->RouteCount("/update_weights") == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto t0 = Clock::now();
  c.Cancel();
  caller.join();
  EXPECT_LT(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count(), 500);
  EXPECT_EQ(r.http.transport, Transport::kTimeout);
  d->ReleaseHangs();
}

// Proves several threads can drive one client against the double at once; would catch shared
// curl state across threads.
TEST(VllmDoubleIntegration, ConcurrentClients) {
  auto d = StartDouble("0.30.0");
  EngineClient c(d->base_url(), Fast());
  std::atomic<int> good{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 6; ++i) {
    ts.emplace_back([&] {
      for (int k = 0; k < 10; ++k) {
        if (c.GetWeightInfo().http.ok_2xx() && c.IsPaused().http.ok_2xx()) ++good;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(good.load(), 60);
}

// Proves the double's /metrics parses and exposes the series the runner reads, and generation
// works streamed and not; would catch a metric-name or SSE framing mismatch with vLLM.
TEST(VllmDoubleIntegration, MetricsAndGeneration) {
  auto d = StartDouble("0.30.0");
  EngineClient c(d->base_url(), Fast());
  HttpReply done = c.Completions(json{{"prompt", "hello world"}, {"max_tokens", 4}});
  ASSERT_TRUE(done.http.ok_2xx()) << done.http.error;
  EXPECT_TRUE(done.body.contains("choices"));
  int chunks = 0;
  HttpReply streamed =
      c.CompletionsStream(json{{"prompt", "hello"}, {"max_tokens", 4}}, [&](const json&) {
        ++chunks;
        return true;
      });
  EXPECT_TRUE(streamed.http.ok_2xx()) << streamed.http.error;
  EXPECT_GE(chunks, 1);
  Result<MetricsMap> m = Metrics(c);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(metric_present(*m, "vllm:num_requests_running"));
  EXPECT_TRUE(metric_present(*m, "vllm:prefix_cache_queries_total"));
  EXPECT_GT(read_engine_load(*m).prefix_cache_queries_total, 0.0);
}

VllmDoubleOptions LineOptions(const std::string& version, bool extension) {
  VllmDoubleOptions o;
  o.version = version;
  o.token_delay_ms = 1;
  if (extension) o.worker_extension_cls = kWorkerExtensionClass;
  return o;
}

// The engine restarts on the same port as `options` says: another process, maybe another line.
std::unique_ptr<VllmDouble> RestartAs(std::unique_ptr<VllmDouble> d, const VllmDoubleOptions& o) {
  const int port = d->port();
  d->Stop();
  d.reset();
  for (int i = 0; i < 200; ++i) {  // the port may take a moment to be free again
    auto next = std::make_unique<VllmDouble>(o);
    if (next->Start(port) == port) return next;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return nullptr;
}

struct LineChange {
  const char* from;
  bool from_extension;
  const char* to;
  bool to_extension;
  LabelRoute before, after;
};

void PrintTo(const LineChange& k, std::ostream* os) {
  *os << k.from << (k.from_extension ? "+extension" : "") << " -> " << k.to
      << (k.to_extension ? "+extension" : "");
}

class LabelRouteAfterRestart : public ::testing::TestWithParam<LineChange> {};

// Proves a client whose label route was cached reads and writes the label after the engine
// restarts on the same port onto a line with another route set, with one probe, not a loop;
// would catch the cached route kept once it answered 404 (/weight_info on 0.25.x) or "Method
// 'rc_weight_info' is not implemented" (a 0.30 engine without the extension): every label read
// then failed and no update could validate until the executor restarted.
TEST_P(LabelRouteAfterRestart, TheRouteIsFoundAgainOnce) {
  const LineChange& k = GetParam();
  auto d = std::make_unique<VllmDouble>(LineOptions(k.from, k.from_extension));
  ASSERT_GT(d->Start(0), 0);
  EngineClient c(d->base_url(), Fast());
  ASSERT_TRUE(c.ReadLabel().http.ok_2xx());
  ASSERT_EQ(c.label_route(), k.before);

  d = RestartAs(std::move(d), LineOptions(k.to, k.to_extension));
  ASSERT_NE(d, nullptr);
  HttpReply read = c.ReadLabel();
  ASSERT_TRUE(read.http.ok_2xx()) << read.http.error;
  EXPECT_EQ(read.body["weight_version"], "default");
  EXPECT_EQ(c.label_route(), k.after);
  EXPECT_EQ(d->RpcCount("rc_weight_info"), 1u);
  EXPECT_EQ(d->RouteCount("/weight_info"), k.after == LabelRoute::kWorkerRpc ? 2u : 1u);

  d = RestartAs(std::move(d), LineOptions(k.from, k.from_extension));
  ASSERT_NE(d, nullptr);
  HttpReply wrote = c.WriteLabel("rc-2");  // through the route cached on the other line
  ASSERT_TRUE(wrote.http.ok_2xx()) << wrote.http.error;
  EXPECT_EQ(c.label_route(), k.before);
  EXPECT_EQ(d->weight_label(), "rc-2");
  ValidationObserved v = c.WeightInfo();
  EXPECT_EQ(v.reported_label, "rc-2") << v.http.error;
}

INSTANTIATE_TEST_SUITE_P(
    Lines, LabelRouteAfterRestart,
    ::testing::Values(LineChange{"0.30.0", false, "0.25.1", true, LabelRoute::kWeightInfoRoute,
                                 LabelRoute::kWorkerRpc},
                      LineChange{"0.25.1", true, "0.30.0", false, LabelRoute::kWorkerRpc,
                                 LabelRoute::kWeightInfoRoute}));

// Proves an engine restarted onto a line where neither route answers (0.25.x without the worker
// extension) fails the read after one probe, naming the route that went and the missing flag,
// and leaves the route unknown; would catch a re-probe that loops, or an error that hides why
// the label the engine had a moment ago is gone.
TEST(VllmDoubleIntegration, ARestartOntoNoLabelRouteIsProbedOnce) {
  auto d = std::make_unique<VllmDouble>(LineOptions("0.30.0", false));
  ASSERT_GT(d->Start(0), 0);
  EngineClient c(d->base_url(), Fast());
  ASSERT_TRUE(c.ReadLabel().http.ok_2xx());
  d = RestartAs(std::move(d), LineOptions("0.25.1", false));
  ASSERT_NE(d, nullptr);
  HttpReply r = c.ReadLabel();
  EXPECT_FALSE(r.http.ok_2xx());
  EXPECT_NE(r.http.error.find("the /weight_info route is gone"), std::string::npos) << r.http.error;
  EXPECT_NE(r.http.error.find("--worker-extension-cls"), std::string::npos) << r.http.error;
  EXPECT_EQ(c.label_route(), LabelRoute::kUnknown);
  EXPECT_EQ(d->RouteCount("/weight_info"), 2u);
  EXPECT_EQ(d->RpcCount("rc_weight_info"), 1u);
}

// ---- the runners (Runner, FleetRunner) over a journal, driving the double ----

// A journal in a fresh temporary directory, removed with it.
struct TempJournal {
  TempJournal() {
    std::random_device rd;
    dir = std::filesystem::temp_directory_path() /
          ("rc-effects-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(dir);
    auto j = journal::Journal::Open(dir.string(), journal::Options{});
    RC_CHECK(j.ok());
    journal = std::move(j.value());
  }
  ~TempJournal() {
    journal.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::filesystem::path dir;
  std::unique_ptr<journal::Journal> journal;
};

// The double behind the HTTP adapter a runner drives.
struct DrivenDouble {
  DrivenDouble() : engine(StartDouble("0.30.0")) {
    client = std::make_unique<EngineClient>(engine->base_url(), Fast());
    control = std::make_unique<HttpEngineControl>(*client);
    transfer = std::make_unique<HttpSequenceTransfer>(*client, detect_protocol("0.30.0"));
  }
  ~DrivenDouble() {
    transfer.reset();
    control.reset();
    client.reset();  // closes its keep-alive connections before the double stops
    engine->Stop();
  }
  std::unique_ptr<VllmDouble> engine;
  std::unique_ptr<EngineClient> client;
  std::unique_ptr<HttpEngineControl> control;
  std::unique_ptr<HttpSequenceTransfer> transfer;
};

WeightIdentity SyntheticIdentity(int step) {
  Result<Manifest> m = synthetic_manifest("synthetic:8x64");
  RC_CHECK(m.ok());
  return WeightIdentity{m->digest(), "", "ckpt/step-" + std::to_string(step), "run", step};
}

bool AwaitsRollouts(journal::Journal& j) {
  return next_effect(j.state()).kind == EffectKind::kAwaitRollouts;
}

// Time that moves only when the runner sleeps. While the fold awaits rollouts, the first reading
// `await_ms` after the first such reading runs `race` once, before it answers: that reading is
// the one at which the runner, having just seen the fold await, times the wait out.
class AwaitRaceClock final : public ::rc::effects::Clock {
 public:
  AwaitRaceClock(journal::Journal& j, std::int64_t await_ms, std::function<void()> race)
      : journal_(j), await_ms_(await_ms), race_(std::move(race)) {}
  std::int64_t now_ms() override {
    if (race_ && AwaitsRollouts(journal_)) {
      if (awaiting_since_ms_ < 0) awaiting_since_ms_ = now_ms_;
      if (now_ms_ - awaiting_since_ms_ >= await_ms_) std::exchange(race_, nullptr)();
    }
    return now_ms_;
  }
  std::int64_t wall_ms() override { return wall_now_ms(); }
  void sleep_ms(std::uint32_t ms) override { now_ms_ += ms; }
  bool raced() const { return !race_; }

 private:
  journal::Journal& journal_;
  const std::int64_t await_ms_;
  std::function<void()> race_;
  std::int64_t now_ms_ = 0;
  std::int64_t awaiting_since_ms_ = -1;
};

// Proves an update whose last bound rollout finishes between the runner's look at the fold
// (awaiting rollouts) and its DrainTimedOut goes on to commit once the wait is timed out. Catches
// the refused timeout ("drain timeout while not awaiting rollouts") returned from Drive(), which
// fail-stopped the service with the engine left paused.
TEST(RunnerAwait, TheLastRolloutEndingAsTheWaitTimesOutLetsTheUpdateCommit) {
  TempJournal tj;
  journal::Journal& j = *tj.journal;
  DrivenDouble d;
  AwaitRaceClock clock(j, 100, [&j] {
    auto finished =
        j.Submit(RolloutFinished{"r-1", RolloutOutcome::kCompleted, 0, 0}, wall_now_ms());
    ASSERT_TRUE(finished.ok()) << finished.status().ToString();
    ASSERT_TRUE(j.Wait(finished->ticket).ok());
  });
  RunnerOptions o;
  o.drain_timeout_ms = 20000;  // the local drain waits out 15 s of the clock's time, then pauses
  o.call_timeout_ms = 5000;
  o.await_rollouts_timeout_ms = 100;
  o.await_poll_ms = 10;
  Runner runner(j, *d.control, *d.transfer, clock, o);
  ASSERT_TRUE(runner.Bootstrap("rc-0", SyntheticIdentity(0)).ok());
  auto admitted = j.Submit(make_admission(j.state(), "r-1"), wall_now_ms());
  ASSERT_TRUE(admitted.ok()) << admitted.status().ToString();
  ASSERT_TRUE(j.Wait(admitted->ticket).ok());

  auto ended =
      runner.Update(UpdateRequested{"u-1", "rc-1", SyntheticIdentity(1), "synthetic:8x64:1"});
  ASSERT_TRUE(clock.raced()) << "the rollout did not finish inside the window";
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  EXPECT_EQ(ended->outcome, UpdateOutcome::kCommitted) << ended->reason;
  const State s = j.state();
  EXPECT_EQ(s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(s.committed.label, "rc-1");
  EXPECT_EQ(d.engine->weight_label(), "rc-1");
  Status scanned = j.Scan(1, 0, [](const journal::Record& r) {
    EXPECT_FALSE(std::holds_alternative<DrainTimedOut>(r.event)) << "seq " << r.seq;
    return Status::OK();
  });
  EXPECT_TRUE(scanned.ok()) << scanned.ToString();
}

// The names of the events journaled after `after_seq`, in order.
std::vector<std::string> EventsAfter(journal::Journal& j, std::uint64_t after_seq) {
  std::vector<std::string> names;
  Status scanned = j.Scan(after_seq + 1, 0, [&names](const journal::Record& r) {
    names.emplace_back(event_name(r.event));
    return Status::OK();
  });
  EXPECT_TRUE(scanned.ok()) << scanned.ToString();
  return names;
}

// A runner bootstrapped on `d` ("rc-0"), and a client of someone else's on the same engine.
struct ChangedBehindTheRunner {
  TempJournal tj;
  DrivenDouble d;
  Runner runner{*tj.journal, *d.control, *d.transfer, system_clock(), RunnerOptions{}};
  EngineClient outsider{d.engine->base_url(), Fast()};
  ChangedBehindTheRunner() {
    const Status booted = runner.Bootstrap("rc-0", SyntheticIdentity(0));
    EXPECT_TRUE(booted.ok()) << booted.ToString();
  }
};

// Proves an update asked of an engine someone else paused (mode=abort) and relabelled between two
// monitor looks is refused before anything is sent: the runner's look before the plan is journaled
// as the monitor's observation and the engine goes TAINTED from READY with the monitor's cause
// (so the audit opens its window of suspect rollouts). Catches the update that paused the engine
// again, overwrote the outside label, committed, and journaled DrainObserved straight to publish.
TEST(RunnerLook, AnEngineChangedBehindTheRunnerIsTaintedBeforeAnyDrain) {
  struct Case {
    const char* name;
    bool relabel;
    Cause cause;
  };
  for (const Case& c : {Case{"paused", false, Cause::kEnginePausedExternally},
                        Case{"paused and relabelled", true, Cause::kEngineRelabelled}}) {
    SCOPED_TRACE(c.name);
    ChangedBehindTheRunner w;
    journal::Journal& j = *w.tj.journal;
    const std::uint64_t weights = w.d.engine->weights_generation();
    ASSERT_TRUE(w.outsider.Pause(PauseMode::kAbort, /*clear_cache=*/false).http.ok_2xx());
    if (c.relabel) {
      ASSERT_TRUE(w.outsider.UpdateWeightVersion("outsider").http.ok_2xx());
    }
    const std::uint64_t head = j.head_seq();

    auto ended =
        w.runner.Update(UpdateRequested{"u-1", "rc-1", SyntheticIdentity(1), "synthetic:8x64:1"});
    ASSERT_FALSE(ended.ok()) << "committed over an outside change: " << ended->reason;
    EXPECT_EQ(ended.status().code(), Code::kRejected) << ended.status().ToString();
    const State s = j.state();
    ASSERT_EQ(s.lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(s.taint->from, Lifecycle::kReady);
    EXPECT_EQ(s.taint->cause, c.cause) << s.taint->detail;
    EXPECT_EQ(s.counters.updates_requested, 0u);
    EXPECT_EQ(EventsAfter(j, head), (std::vector<std::string>{"EngineMonitored", "StateChanged"}));
    EXPECT_EQ(w.d.engine->RouteCount("/pause"), 1u) << "paused again by the runner";
    EXPECT_EQ(w.d.engine->weights_generation(), weights);
    EXPECT_EQ(w.d.engine->weight_label(), c.relabel ? "outsider" : "rc-0");
  }
}

// Proves an update asked of an engine whose weights someone else changed under the committed
// label (a transfer of its own) is refused, the engine TAINTED with weights_changed naming the
// tensors, because the runner's look before the plan digests the weights; catches an update that
// starts from weights nobody committed and publishes them as the trainer's.
TEST(RunnerLook, WeightsChangedUnderTheCommittedLabelAreTaintedBeforeAnyDrain) {
  ChangedBehindTheRunner w;
  journal::Journal& j = *w.tj.journal;
  ASSERT_TRUE(j.state().committed_digest.present()) << "the double computes no digest";
  HttpSequenceTransfer intruder(w.outsider, detect_protocol("0.30.0"));
  TransferTarget same_label;
  same_label.update_id = "outsider";
  same_label.target = WeightVersion{1, "rc-0"};
  same_label.source_uri = "synthetic:8x64:7";
  ASSERT_TRUE(intruder.Transfer(same_label, 5000).acknowledged);
  ASSERT_EQ(w.d.engine->weight_label(), "rc-0");

  auto ended =
      w.runner.Update(UpdateRequested{"u-1", "rc-1", SyntheticIdentity(1), "synthetic:8x64:1"});
  ASSERT_FALSE(ended.ok()) << "committed over an outside change: " << ended->reason;
  EXPECT_EQ(ended.status().code(), Code::kRejected) << ended.status().ToString();
  const State s = j.state();
  ASSERT_EQ(s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.taint->from, Lifecycle::kReady);
  EXPECT_EQ(s.taint->cause, Cause::kWeightsChanged) << s.taint->detail;
  EXPECT_NE(s.taint->detail.find("tensors differ"), std::string::npos) << s.taint->detail;
  EXPECT_EQ(w.d.engine->RouteCount("/pause"), 0u);
}

// Proves an engine the runner's look finds as committed is updated as before, with nothing more
// journaled than the plan; catches a look that refuses a healthy engine or grows the journal by
// a record per update.
TEST(RunnerLook, AnUnchangedEngineIsUpdatedAsBefore) {
  ChangedBehindTheRunner w;
  journal::Journal& j = *w.tj.journal;
  const std::uint64_t head = j.head_seq();
  auto ended =
      w.runner.Update(UpdateRequested{"u-1", "rc-1", SyntheticIdentity(1), "synthetic:8x64:1"});
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  EXPECT_EQ(ended->outcome, UpdateOutcome::kCommitted) << ended->reason;
  const std::vector<std::string> names = EventsAfter(j, head);
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.front(), "UpdateRequested");
  EXPECT_EQ(std::count(names.begin(), names.end(), "EngineMonitored"), 0);
  EXPECT_EQ(w.d.engine->weight_label(), "rc-1");
}

// ---- a weight session found open: only a restore may finish it ----

// Someone else's client opens a weight session on `d` and loads `source` into it (init, start, the
// data plane, /update_weights), leaving it unfinished: whoever sends the next
// /finish_weight_update commits that load.
void OpenOutsiderSession(VllmDouble& d, const std::string& version, const std::string& source) {
  EngineClient outsider(d.base_url(), Fast());
  const EngineProtocol p = detect_protocol(version);
  ASSERT_NO_FATAL_FAILURE(InitTransfer(outsider, p, p.unique_id_rendezvous));
  HttpReply start = outsider.StartWeightUpdate(StaleSession::kRefuse);
  ASSERT_TRUE(start.http.ok_2xx()) << start.http.error;
  ASSERT_TRUE(outsider.PostJson(kDataPlaneRoute, json{{"content", source}}).http.ok_2xx());
  Result<Manifest> manifest = synthetic_manifest(source);
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  Result<json> info = build_update_info(p, *manifest, PackingParams{});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  HttpReply update = outsider.UpdateWeights(*info);
  ASSERT_TRUE(update.http.ok_2xx()) << update.http.error;
  ASSERT_TRUE(d.StateJson()["update_active"].get<bool>());
}

// Proves an update (not a restore) that finds a weight session someone else opened fails as a
// possible mutation naming that session, sends no /finish_weight_update, and leaves the session
// open and its load uncommitted; catches the update that finished the session (committing the
// outsider's load), started again and completed over it, so the change was never seen.
TEST(OpenWeightSession, AnUpdateLeavesSomeoneElsesSessionOpenAndFailsPossible) {
  for (const char* version : {"0.25.1", "0.30.0"}) {
    SCOPED_TRACE(version);
    auto d = StartDouble(version);
    ASSERT_NO_FATAL_FAILURE(OpenOutsiderSession(*d, version, "synthetic:4x32:7"));
    const std::uint64_t weights = d->weights_generation();
    EngineClient c(d->base_url(), Fast());
    HttpSequenceTransfer t(c, detect_protocol(version));
    const TransferObserved o = t.Transfer(Target(), 10000);
    EXPECT_FALSE(o.acknowledged);
    EXPECT_EQ(o.mutation, MutationClass::kPossible) << o.error;
    EXPECT_NE(o.error.find(kForeignWeightSession), std::string::npos) << o.error;
    EXPECT_EQ(d->RouteCount("/finish_weight_update"), 0u) << "the outsider's session was finished";
    EXPECT_EQ(d->RouteCount("/start_weight_update"), 2u);  // the outsider's, the refused one
    EXPECT_EQ(d->RouteCount("/update_weights"), 1u);       // the outsider's
    EXPECT_TRUE(d->StateJson()["update_active"].get<bool>());
    EXPECT_EQ(d->weights_generation(), weights);
    EXPECT_EQ(d->weight_label(), "default");
  }
}

// Proves a restore that finds a weight session open finishes it once, starts again and completes;
// catches a restore refused for good by the session it must clear (the engine then stays TAINTED
// until restarted) or a transfer that drops its target's restore flag.
TEST(OpenWeightSession, ARestoreFinishesTheStaleSessionAndCompletes) {
  for (const char* version : {"0.25.1", "0.30.0"}) {
    SCOPED_TRACE(version);
    auto d = StartDouble(version);
    ASSERT_NO_FATAL_FAILURE(OpenOutsiderSession(*d, version, "synthetic:4x32:7"));
    EngineClient c(d->base_url(), Fast());
    HttpSequenceTransfer t(c, detect_protocol(version));
    TransferTarget restore = Target();
    restore.restore = true;
    const TransferObserved o = t.Transfer(restore, 10000);
    EXPECT_TRUE(o.acknowledged) << o.error;
    EXPECT_EQ(o.mutation, MutationClass::kComplete) << o.error;
    EXPECT_EQ(d->RouteCount("/finish_weight_update"), 2u);  // the stale session's, the restore's
    EXPECT_EQ(d->RouteCount("/start_weight_update"), 3u);   // the outsider's, refused, again
    EXPECT_FALSE(d->StateJson()["update_active"].get<bool>());
    EXPECT_EQ(d->weight_label(), "rc-1");
  }
}

// A protocol-2 pickle string opcode (BINUNICODE, little-endian length): all the ipc double reads
// of a handle pickle is the GPU UUID text inside it and the STOP byte at its end.
std::string PickleString(const std::string& s) {
  std::string out = "X";
  for (int i = 0; i < 4; ++i) out += static_cast<char>((s.size() >> (8 * i)) & 0xff);
  return out + s;
}

// A trainer's vllm-ipc: export in a fresh temporary directory (removed with it): four [32, 32]
// bf16 tensors, handles under `uuid`; `target` names it and declares its manifest.
struct IpcExport {
  explicit IpcExport(const std::string& uuid) {
    std::random_device rd;
    dir = std::filesystem::temp_directory_path() /
          ("rc-ipc-open-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(dir);
    json f = {{"format", kVllmIpcFormat}, {"version", 1}, {"gpu_uuids", {uuid}}};
    for (int i = 0; i < 4; ++i) {
      f["names"].push_back("model.layers." + std::to_string(i) + ".weight");
      f["dtype_names"].push_back("bfloat16");
      f["shapes"].push_back({32, 32});
    }
    const std::string pickle = "\x80\x02}" + PickleString(uuid) + PickleString("handles") + "s.";
    f["ipc_handles_pickled"] = encoding::Base64Encode(pickle);
    const std::string path = (dir / "step.json").string();
    std::ofstream(path) << f.dump();
    target = Target();
    target.source_uri = kVllmIpcScheme + path;
    Result<VllmIpcFile> parsed = ParseVllmIpcFile(f.dump());
    RC_CHECK(parsed.ok());
    target.identity.manifest_digest = parsed->manifest.digest();
  }
  ~IpcExport() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::filesystem::path dir;
  TransferTarget target;
};

// Proves the colocated transfer (IpcTransfer, vLLM's ipc backend) passes its target's restore
// flag to the start: an update that finds someone else's session open fails kPossible with no
// /finish_weight_update sent, and a restore finishes it and completes; catches an ipc start that
// finishes every stale session (hiding the outsider's load) or none (a restore stuck TAINTED).
TEST(OpenWeightSession, TheIpcTransferFinishesAStaleSessionOnlyForARestore) {
  VllmDoubleOptions options;
  options.version = "0.30.0";
  options.worker_extension_cls = kWorkerExtensionClass;  // rc_device_info
  options.weight_transfer_backend = "ipc";
  options.allow_insecure_serialization = true;
  VllmDouble d(options);
  ASSERT_GT(d.Start(0), 0);
  IpcExport source(d.GpuUuids().at(0));
  EngineClient outsider(d.base_url(), Fast());
  ASSERT_TRUE(outsider.StartWeightUpdate(StaleSession::kRefuse).http.ok_2xx());
  EngineClient c(d.base_url(), Fast());
  IpcTransfer t(c);

  const TransferObserved update = t.Transfer(source.target, 10000);
  EXPECT_EQ(update.mutation, MutationClass::kPossible) << update.error;
  EXPECT_NE(update.error.find(kForeignWeightSession), std::string::npos) << update.error;
  EXPECT_EQ(d.RouteCount("/finish_weight_update"), 0u) << "the outsider's session was finished";
  EXPECT_TRUE(d.StateJson()["update_active"].get<bool>());

  TransferTarget restore = source.target;
  restore.restore = true;
  const TransferObserved restored = t.Transfer(restore, 10000);
  EXPECT_EQ(restored.mutation, MutationClass::kComplete) << restored.error;
  EXPECT_EQ(d.RouteCount("/finish_weight_update"), 2u);  // the stale session's, the restore's
  EXPECT_FALSE(d.StateJson()["update_active"].get<bool>());
  EXPECT_EQ(d.weight_label(), "rc-1");
}

// Proves a whole update (Runner, journal, HTTP, the double) that meets a weight session someone
// else opened on its READY engine taints it durably (kTransferAmbiguous, the foreign session named
// in the journaled taint) without sending /finish_weight_update, and that the restore which
// follows finishes the session and commits the version back, its digest proven; catches the update
// that finished the outsider's session, loaded over it and committed (the outside change hidden),
// and a runner that does not tell the transfer it runs a restore (the engine then stays TAINTED).
TEST(RunnerOpenSession, AnOutsidersSessionTaintsTheUpdateAndTheRestoreClearsIt) {
  ChangedBehindTheRunner w;
  journal::Journal& j = *w.tj.journal;
  VllmDouble& engine = *w.d.engine;
  auto first =
      w.runner.Update(UpdateRequested{"u-1", "rc-1", SyntheticIdentity(1), "synthetic:8x64:1"});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->outcome, UpdateOutcome::kCommitted) << first->reason;
  ASSERT_NO_FATAL_FAILURE(OpenOutsiderSession(engine, "0.30.0", "synthetic:8x64:7"));
  const std::uint64_t finishes = engine.RouteCount("/finish_weight_update");

  auto ended =
      w.runner.Update(UpdateRequested{"u-2", "rc-2", SyntheticIdentity(2), "synthetic:8x64:2"});
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  EXPECT_EQ(ended->outcome, UpdateOutcome::kTainted) << ended->reason;
  State s = j.state();
  ASSERT_EQ(s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.taint->cause, Cause::kTransferAmbiguous) << s.taint->detail;
  EXPECT_NE(s.taint->detail.find(kForeignWeightSession), std::string::npos) << s.taint->detail;
  EXPECT_EQ(engine.RouteCount("/finish_weight_update"), finishes);
  EXPECT_TRUE(engine.StateJson()["update_active"].get<bool>());
  std::vector<bool> foreign;  // each transfer's record: only u-2's met someone else's session
  ASSERT_TRUE(j.Scan(1, 0, [&](const journal::Record& r) {
                 if (const auto* t = std::get_if<TransferObserved>(&r.event)) {
                   foreign.push_back(t->foreign_session);
                 }
                 return Status::OK();
               }).ok());
  EXPECT_EQ(foreign, (std::vector<bool>{false, true}));

  auto restored = w.runner.Restore(RestoreRequested{"r-1", "rc-1", "synthetic:8x64:1"});
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->outcome, UpdateOutcome::kCommitted) << restored->reason;
  s = j.state();
  EXPECT_EQ(s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(s.committed.label, "rc-1");
  EXPECT_EQ(engine.RouteCount("/finish_weight_update"), finishes + 2);
  EXPECT_FALSE(engine.StateJson()["update_active"].get<bool>());
  EXPECT_EQ(engine.weight_label(), "rc-1");
}

// Proves an adopting restore ends a weight session left open on its TAINTED engine (here one that
// loaded nothing, as a start whose answer was lost leaves it), so the next update commits; catches
// the adopt that only relabelled, leaving the session for every later update to meet and blame on
// someone else (TAINTED again, foreign_session recorded).
TEST(RunnerOpenSession, AnAdoptingRestoreEndsTheSessionLeftOpen) {
  ChangedBehindTheRunner w;
  journal::Journal& j = *w.tj.journal;
  VllmDouble& engine = *w.d.engine;
  auto first =
      w.runner.Update(UpdateRequested{"u-1", "rc-1", SyntheticIdentity(1), "synthetic:8x64:1"});
  ASSERT_TRUE(first.ok() && first->outcome == UpdateOutcome::kCommitted);
  const EngineProtocol p = detect_protocol("0.30.0");
  ASSERT_NO_FATAL_FAILURE(InitTransfer(w.outsider, p, p.unique_id_rendezvous));
  ASSERT_TRUE(w.outsider.StartWeightUpdate(StaleSession::kRefuse).http.ok_2xx());
  auto tainted =
      w.runner.Update(UpdateRequested{"u-2", "rc-2", SyntheticIdentity(2), "synthetic:8x64:2"});
  ASSERT_TRUE(tainted.ok() && tainted->outcome == UpdateOutcome::kTainted);

  auto adopted = w.runner.Restore(RestoreRequested{"r-1", "rc-1", "", true});
  ASSERT_TRUE(adopted.ok()) << adopted.status().ToString();
  EXPECT_EQ(adopted->outcome, UpdateOutcome::kCommitted) << adopted->reason;
  EXPECT_FALSE(engine.StateJson()["update_active"].get<bool>());
  auto next =
      w.runner.Update(UpdateRequested{"u-3", "rc-3", SyntheticIdentity(3), "synthetic:8x64:3"});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->outcome, UpdateOutcome::kCommitted) << next->reason;
  EXPECT_EQ(j.state().committed.label, "rc-3");
}

// Proves a fleet recovery whose second thread is refused returns that refusal, naming its engine,
// after joining the recovery that started. Catches the exception leaving Recover() with that
// thread still running against the results it wrote into (gone with Recover's frame), and the
// thread set then dying on the thread never joined.
TEST(FleetRecover, ASecondThreadRefusedJoinsTheFirstAndIsAnError) {
  TempJournal tj;
  DrivenDouble d;  // never called: the engines are not bootstrapped, so recovery only journals
  std::atomic<int> starts{0};
  std::unique_ptr<MemberThreads> threads =
      OsMemberThreads([&starts](std::function<void()> drive) -> std::thread {
        if (++starts == 2) {
          throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                                  "the test refuses the second thread");
        }
        return std::thread(std::move(drive));
      });
  FleetRunnerOptions o;
  o.threads = threads.get();
  auto fleet = std::make_unique<FleetRunner>(*tj.journal, system_clock(), o);
  ASSERT_TRUE(fleet->Configure(FleetConfigured{}).ok());
  ASSERT_TRUE(fleet->Join("e0", *d.control, *d.transfer).ok());
  ASSERT_TRUE(fleet->Join("e1", *d.control, *d.transfer).ok());

  const Status recovered = fleet->Recover(tj.journal->recovery());
  EXPECT_EQ(starts.load(), 2);
  EXPECT_EQ(recovered.code(), Code::kUnavailable) << recovered.ToString();
  EXPECT_NE(recovered.message().find("engine 'e1'"), std::string::npos) << recovered.ToString();
  EXPECT_NE(recovered.message().find("refuses the second thread"), std::string::npos)
      << recovered.ToString();
  const FleetState f = tj.journal->fleet_state();
  EXPECT_EQ(f.engines.at("e0").counters.recoveries, 1u) << "e0's recovery did not run to its end";
  EXPECT_EQ(f.engines.at("e1").counters.recoveries, 0u);
  fleet.reset();  // before the threads it runs on; these must hold no thread by now
}

// A TCP forwarder standing for a virtual address in front of engine processes: each accepted
// connection is relayed to the port `target` names when it is accepted, so connections made
// before a switch keep reaching the old process, as through a load balancer.
class SwitchingForwarder {
 public:
  explicit SwitchingForwarder(int target) : target_(target) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(listen_fd_, 64), 0);
    socklen_t len = sizeof(a);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~SwitchingForwarder() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    acceptor_.join();
    std::lock_guard<std::mutex> g(mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    for (std::thread& t : pumps_) t.join();
    for (int fd : fds_) ::close(fd);
  }
  int port() const { return port_; }
  void SwitchTo(int target) { target_.store(target); }

 private:
  void AcceptLoop() {
    while (true) {
      const int client = ::accept(listen_fd_, nullptr, nullptr);
      if (client < 0) return;
      const int engine = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<std::uint16_t>(target_.load()));
      if (::connect(engine, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        ::close(engine);
        ::close(client);
        continue;
      }
      std::lock_guard<std::mutex> g(mu_);
      fds_.push_back(client);
      fds_.push_back(engine);
      pumps_.emplace_back([client, engine] { Pump(client, engine); });
      pumps_.emplace_back([client, engine] { Pump(engine, client); });
    }
  }
  static void Pump(int from, int to) {
    char buf[16384];
    while (true) {
      const ssize_t n = ::recv(from, buf, sizeof(buf), 0);
      if (n <= 0 || ::send(to, buf, static_cast<std::size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  std::atomic<int> target_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
};

// Proves that each monitor look, probe and look before a plan reads the process the engine's
// address reaches now: after a second engine process takes over the address (a restart behind a
// virtual address), the next look names the new process, not the old one still reachable over a
// kept-alive connection; would catch a monitor whose reads all reuse a pooled connection, which
// kept vouching for the old process while the proxy's new connections reached the new one.
TEST(EngineMonitor, EachLookReadsTheProcessTheAddressReachesNow) {
  VllmDoubleOptions o;
  o.version = "0.28.0";  // every read of a look is a GET: nothing forces a new connection
  VllmDouble first(o);
  ASSERT_GT(first.Start(0), 0);
  VllmDouble second(o);
  ASSERT_GT(second.Start(0), 0);
  SwitchingForwarder address(first.port());
  EngineClient c("http://127.0.0.1:" + std::to_string(address.port()), Fast());
  const EngineMonitored before = c.Monitor();
  ASSERT_TRUE(before.http.ok_2xx()) << before.http.error;
  ASSERT_FALSE(before.engine_instance.empty());
  EXPECT_EQ(c.Monitor().engine_instance, before.engine_instance);  // same process, same name

  address.SwitchTo(second.port());
  const EngineMonitored after = c.Monitor();
  ASSERT_TRUE(after.http.ok_2xx()) << after.http.error;
  EXPECT_NE(after.engine_instance, before.engine_instance);
  const EngineProbed probe = c.Probe();
  ASSERT_TRUE(probe.http.ok_2xx()) << probe.http.error;
  EXPECT_EQ(probe.engine_instance, after.engine_instance);

  // The look before a plan (and a validation's reads) too: back to the first process.
  address.SwitchTo(first.port());
  HttpEngineControl control(c);
  const EngineMonitored look = control.Observe(/*with_digest=*/false, 3000);
  ASSERT_TRUE(look.http.ok_2xx()) << look.http.error;
  EXPECT_EQ(look.engine_instance, before.engine_instance);
}

}  // namespace
}  // namespace rc::effects
