// EngineClient against scripted loopback servers: every HttpEvidence field in every way an
// exchange can end, deadlines, cancellation, concurrency and connection reuse.
#include "effects/http/engine_client.h"

#include <gtest/gtest.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "effects/clock.h"
#include "effects/http/engine_control.h"
#include "statemachine/state.h"
#include "tests/effects_http/test_servers.h"
#include "tests/support/engine_calls.h"

namespace rc::effects {
namespace {

using nlohmann::json;
using rc::testing::AbortRequests;
using rc::testing::ClosedPort;
using rc::testing::Metrics;
using rc::testing::MetricsMap;
using rc::testing::RawServer;
using rc::testing::read_engine_load;
using rc::testing::ScriptedServer;
using Clock = std::chrono::steady_clock;

void Json(httplib::Response& res, const std::string& body, int status = 200) {
  res.status = status;
  res.set_content(body, "application/json");
}

EngineDeadlines Fast() {
  EngineDeadlines d;
  d.connect_timeout_ms = 500;
  d.call_timeout_ms = 2000;
  d.drain_timeout_ms = 2000;
  d.update_timeout_ms = 2000;
  return d;
}

// Proves Probe() reads /health, /version, /weight_info, /is_paused and the process start time
// into EngineProbed; would catch a swapped field, a probe that reports ok without asking
// /weight_info, or one blind to a paused or restarted engine.
TEST(EngineClient, ProbeReadsVersionAndLabel) {
  ScriptedServer s;
  s.server().Get("/health", [](const auto&, auto& res) { res.status = 200; });
  s.server().Get("/version", [](const auto&, auto& res) { Json(res, R"({"version":"0.30.1"})"); });
  s.server().Get("/weight_info",
                 [](const auto&, auto& res) { Json(res, R"({"weight_version":"rc-0"})"); });
  s.server().Get("/is_paused", [](const auto&, auto& res) { Json(res, R"({"is_paused":true})"); });
  s.server().Get("/metrics", [](const auto&, auto& res) {
    res.set_content(
        "# TYPE process_start_time_seconds gauge\n"
        "process_start_time_seconds 1.7649e+09\n",
        "text/plain");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  EngineProbed p = c.Probe();
  EXPECT_TRUE(p.http.ok_2xx()) << p.http.error;
  EXPECT_EQ(p.http.http_status, 200);
  EXPECT_GT(p.http.latency_us, 0u);
  EXPECT_EQ(p.engine_version, "0.30.1");
  EXPECT_EQ(p.reported_label, "rc-0");
  EXPECT_TRUE(p.is_paused_known);
  EXPECT_TRUE(p.is_paused);
  EXPECT_EQ(p.engine_instance, "start:1.7649e+09");
  EXPECT_EQ(s.paths(5), (std::vector<std::string>{"GET /health", "GET /version", "GET /weight_info",
                                                  "GET /is_paused", "GET /metrics"}));
}

// Proves a 503 from /health ends the probe with that evidence; would catch a probe that
// reports a label from an engine that said it is dead.
TEST(EngineClient, ProbeStopsAtUnhealthyEngine) {
  ScriptedServer s;
  s.server().Get("/health", [](const auto&, auto& res) { res.status = 503; });
  s.Start();
  EngineClient c(s.url(), Fast());
  EngineProbed p = c.Probe();
  EXPECT_FALSE(p.http.ok_2xx());
  EXPECT_EQ(p.http.transport, Transport::kOk);
  EXPECT_EQ(p.http.http_status, 503);
  EXPECT_TRUE(p.reported_label.empty());
  EXPECT_EQ(s.paths(1).size(), 1u);
}

// Proves PauseWait sends mode=wait and clear_cache=false and reads {"status":"paused"}; would
// catch the vLLM default clear_cache=true, which hides whether the post-update reset worked.
TEST(EngineClient, PauseWaitNeverClearsCache) {
  ScriptedServer s;
  std::string mode, clear;
  s.server().Post("/pause", [&](const httplib::Request& req, auto& res) {
    mode = req.get_param_value("mode");
    clear = req.get_param_value("clear_cache");
    Json(res, R"({"status":"paused"})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  DrainObserved d = c.PauseWait();
  EXPECT_TRUE(d.http.ok_2xx()) << d.http.error;
  EXPECT_TRUE(d.paused);
  EXPECT_EQ(mode, "wait");
  EXPECT_EQ(clear, "false");
}

// Proves a 400 {"error":...} from /pause is evidence, not a drain; would catch paused=true on a
// refused pause.
TEST(EngineClient, PauseRefusedIsNotPaused) {
  ScriptedServer s;
  s.server().Post("/pause",
                  [](const auto&, auto& res) { Json(res, R"({"error":"bad mode"})", 400); });
  s.Start();
  EngineClient c(s.url(), Fast());
  DrainObserved d = c.PauseWait();
  EXPECT_FALSE(d.paused);
  EXPECT_EQ(d.http.http_status, 400);
  EXPECT_EQ(d.http.transport, Transport::kOk);
  EXPECT_NE(d.http.error.find("bad mode"), std::string::npos);
}

// Proves /reset_prefix_cache's HTTP 200 {"success": false} is reported as not successful with a
// parsed body; would catch trusting the status code alone (vLLM answers 200 while blocks are held).
TEST(EngineClient, PrefixResetSuccessFalseIsFailure) {
  ScriptedServer s;
  s.server().Post("/reset_prefix_cache",
                  [](const auto&, auto& res) { Json(res, R"({"success":false})"); });
  s.Start();
  EngineClient c(s.url(), Fast());
  CacheResetObserved r = c.ResetCache(CacheKind::kPrefix);
  EXPECT_EQ(r.cache, CacheKind::kPrefix);
  EXPECT_TRUE(r.http.ok_2xx());
  EXPECT_EQ(r.http.http_status, 200);
  EXPECT_FALSE(r.reported_success);
}

// Proves "success" must be a JSON bool; would catch treating "true" (a string) or a missing key
// as success.
TEST(EngineClient, PrefixResetSuccessMustBeBool) {
  for (const char* body : {R"({"success":"true"})", R"({"ok":true})", R"([true])", "true"}) {
    ScriptedServer s;
    s.server().Post("/reset_prefix_cache", [&](const auto&, auto& res) { Json(res, body); });
    s.Start();
    EngineClient c(s.url(), Fast());
    CacheResetObserved r = c.ResetCache(CacheKind::kPrefix);
    EXPECT_FALSE(r.http.body_parsed) << body;
    EXPECT_FALSE(r.http.ok_2xx()) << body;
    EXPECT_FALSE(r.reported_success) << body;
  }
  ScriptedServer s;
  s.server().Post("/reset_prefix_cache",
                  [](const auto&, auto& res) { Json(res, R"({"success":true})"); });
  s.Start();
  EngineClient c(s.url(), Fast());
  EXPECT_TRUE(c.ResetCache(CacheKind::kPrefix).reported_success);
}

// Proves the encoder and mm resets accept vLLM's empty 200 as success and hit the right routes;
// would catch requiring a JSON body there (every update would fail) or a wrong path.
TEST(EngineClient, EncoderAndMmResetAcceptEmpty200) {
  ScriptedServer s;
  s.server().Post("/reset_encoder_cache", [](const auto&, auto& res) { res.status = 200; });
  s.server().Post("/reset_mm_cache", [](const auto&, auto& res) { res.status = 200; });
  s.Start();
  EngineClient c(s.url(), Fast());
  for (CacheKind k : {CacheKind::kEncoder, CacheKind::kMultimodal}) {
    CacheResetObserved r = c.ResetCache(k);
    EXPECT_EQ(r.cache, k);
    EXPECT_TRUE(r.http.body_parsed);
    EXPECT_TRUE(r.http.ok_2xx());
    EXPECT_TRUE(r.reported_success);
    EXPECT_TRUE(r.success_unreported);
  }
  EXPECT_EQ(s.paths(2),
            (std::vector<std::string>{"POST /reset_encoder_cache", "POST /reset_mm_cache"}));
}

// Proves vLLM 0.25.x's empty 200 from /reset_prefix_cache is recorded as "not reported" rather
// than as a reported success, and a reported {"success": true} is not; would catch an adapter
// that TAINTs every update on 0.25.x (empty body refused) or one that hides that the engine said
// nothing.
TEST(EngineClient, PrefixResetEmpty200IsUnreported) {
  ScriptedServer s;
  s.server().Post("/reset_prefix_cache", [](const auto&, auto& res) { res.status = 200; });
  s.Start();
  EngineClient c(s.url(), Fast());
  CacheResetObserved r = c.ResetCache(CacheKind::kPrefix);
  EXPECT_TRUE(r.http.ok_2xx()) << r.http.error;
  EXPECT_TRUE(r.reported_success);
  EXPECT_TRUE(r.success_unreported);
  ScriptedServer s2;
  s2.server().Post("/reset_prefix_cache",
                   [](const auto&, auto& res) { Json(res, R"({"success":true})"); });
  s2.Start();
  EngineClient c2(s2.url(), Fast());
  CacheResetObserved r2 = c2.ResetCache(CacheKind::kPrefix);
  EXPECT_TRUE(r2.reported_success);
  EXPECT_FALSE(r2.success_unreported);
}

// A server shaped like vLLM 0.25.1 with RolloutCore's worker extension: no /weight_info (404),
// labels through /collective_rpc, /finish_weight_update ignoring its body.
struct RpcLabelServer {
  ScriptedServer s;
  std::mutex mu;
  std::string label = "default";
  std::vector<std::string> finish_bodies;
  int workers = 2;
  bool extension = true;
  int delay_ms = 0;  // before every finish and RPC answer
  RpcLabelServer() {
    s.server().Get("/health", [](const auto&, auto& res) { res.status = 200; });
    s.server().Get("/version",
                   [](const auto&, auto& res) { Json(res, R"({"version":"0.25.1"})"); });
    s.server().Get("/weight_info",
                   [](const auto&, auto& res) { Json(res, R"({"detail":"Not Found"})", 404); });
    s.server().Get("/is_paused",
                   [](const auto&, auto& res) { Json(res, R"({"is_paused":false})"); });
    s.server().Post("/finish_weight_update", [this](const auto& req, auto& res) {
      s.SlowSleep(delay_ms);
      std::lock_guard lk(mu);
      finish_bodies.push_back(req.body);
      Json(res, R"({"message":"Weight update finished"})");
    });
    s.server().Post("/collective_rpc", [this](const auto& req, auto& res) {
      s.SlowSleep(delay_ms);
      std::lock_guard lk(mu);
      json body = json::parse(req.body);
      if (!extension) {
        res.status = 500;
        res.set_content("Internal Server Error", "text/plain");
        return;
      }
      if (body["method"] == "rc_set_weight_version") label = body["args"][0];
      json results = json::array();
      for (int i = 0; i < workers; ++i) {
        results.push_back(
            {{"weight_version", label}, {"rank", i}, {"instance", "n" + std::to_string(i)}});
      }
      Json(res, json{{"results", results}}.dump());
    });
    s.Start();
  }
};

// Proves the label falls back to the worker extension when /weight_info answers 404 (vLLM 0.25.x),
// remembers the route (no second 404), and that writing and finishing set the label on every
// worker; would catch a bootstrap that fails on every 0.25.x engine or a finish whose label is
// silently dropped (0.25.x ignores the finish body).
TEST(EngineClient, LabelThroughWorkerRpcOn025) {
  RpcLabelServer srv;
  EngineClient c(srv.s.url(), Fast());
  EngineProbed p = c.Probe();
  ASSERT_TRUE(p.http.ok_2xx()) << p.http.error;
  EXPECT_EQ(p.engine_version, "0.25.1");
  EXPECT_EQ(p.reported_label, "default");
  EXPECT_EQ(c.label_route(), LabelRoute::kWorkerRpc);
  EXPECT_EQ(p.engine_instance, "n0,n1") << "the extension's nonces name the engine's processes";
  EXPECT_EQ(srv.s.paths(5),
            (std::vector<std::string>{"GET /health", "GET /version", "GET /weight_info",
                                      "POST /collective_rpc", "GET /is_paused"}));
  ASSERT_TRUE(c.WriteLabel("rc-0").http.ok_2xx());
  HttpReply fin = c.FinishWeightUpdate(std::string("rc-1"));
  ASSERT_TRUE(fin.http.ok_2xx()) << fin.http.error;
  EXPECT_EQ(fin.body["weight_version"], "rc-1");
  ValidationObserved v = c.WeightInfo();
  EXPECT_TRUE(v.http.ok_2xx());
  EXPECT_EQ(v.reported_label, "rc-1");
  EXPECT_NE(v.detail.find("2 worker"), std::string::npos) << v.detail;
  std::lock_guard lk(srv.mu);
  EXPECT_EQ(srv.finish_bodies, (std::vector<std::string>{""}));  // the label is not sent there
  EXPECT_EQ(srv.label, "rc-1");
  const auto paths = srv.s.paths(8);
  EXPECT_EQ(std::count(paths.begin(), paths.end(), "GET /weight_info"), 1);
}

// Proves a finish that must also read and write the label (vLLM 0.25.x) ends by the one deadline
// it was given: the label write is never sent once the time is spent; would catch each call of
// the chain getting the whole timeout again (three calls, three times the bound), which let a
// transfer step outlive its deadline and be taken as success.
TEST(EngineClient, AFinishAndItsLabelWritesEndByOneDeadline) {
  RpcLabelServer srv;
  srv.delay_ms = 300;
  EngineClient c(srv.s.url(), Fast());
  CallOptions o;
  o.timeout_ms = 500;  // the finish fits; the label read after it does not
  HttpReply fin = c.FinishWeightUpdate(std::string("rc-1"), o);
  EXPECT_FALSE(fin.http.ok_2xx()) << "three 300 ms calls cannot end within 500 ms";
  std::lock_guard lk(srv.mu);
  EXPECT_EQ(srv.finish_bodies.size(), 1u);
  EXPECT_EQ(srv.label, "default") << "the label write was sent after the deadline";
}

// Proves device memory the workers report is recorded only as figures the fold accepts: sums that
// wrap, or totals beyond kDeviceBytesMax, read as unknown. Catches a sleep observation the fold
// refuses ("free memory above its total" after a wrapped sum), which stopped the executor, and
// stopped it again at every recovery that re-ran the sleep.
TEST(EngineClient, DeviceMemoryTheFoldWouldRefuseIsUnknown) {
  for (const char* workers : {
           R"([{"gpu_uuid": "GPU-a", "free_bytes": 18446744073709551615,
                "total_bytes": 18446744073709551615},
               {"gpu_uuid": "GPU-b", "free_bytes": 0, "total_bytes": 1}])",
           R"([{"gpu_uuid": "GPU-a", "free_bytes": 1, "total_bytes": 4611686018427387904}])",
           R"([{"gpu_uuid": "GPU-a", "free_bytes": 1000, "total_bytes": 4000}])",
       }) {
    ScriptedServer s;
    const std::string body = std::string(R"({"results": )") + workers + "}";
    s.server().Post("/collective_rpc", [&](const auto&, auto& res) { Json(res, body); });
    s.server().Post("/sleep", [](const auto&, auto& res) { res.status = 200; });
    s.server().Get("/is_sleeping",
                   [](const auto&, auto& res) { Json(res, R"({"is_sleeping": true})"); });
    s.Start();
    EngineClient c(s.url(), Fast());
    HttpEngineControl control(c);
    const SleepObserved slept = control.Sleep(1, 2000);
    ASSERT_TRUE(slept.http.ok_2xx()) << slept.http.error;
    EXPECT_TRUE(check_device_memory(slept.memory).ok()) << workers;
    EXPECT_EQ(slept.memory.known, std::string(workers).find("4000") != std::string::npos)
        << workers;
  }
}

// Proves a start refused for a stale weight session, whose finish then went through, is never
// reported "not sent" when the second start cannot be sent; would catch an ambiguous transfer
// (that finish may have committed a half-loaded reload) classed as provably nothing done, so the
// update ends refused and the engine READY on weights nobody checked.
TEST(EngineClient, AStartAfterFinishingAStaleSessionIsNeverNotSent) {
  ScriptedServer s;
  s.server().Post("/start_weight_update", [](const auto&, auto& res) {
    Json(res,
         R"({"detail": "A weight update is already active. Call finish_weight_update first."})",
         500);
  });
  s.server().Post("/finish_weight_update", [&s](const auto&, auto& res) {
    s.server().stop();  // the second start finds nothing listening: never sent
    res.set_header("Connection", "close");
    Json(res, R"({"message": "Weight update finished"})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  HttpReply r = c.StartWeightUpdate(StaleSession::kFinish);
  EXPECT_FALSE(r.http.ok_2xx());
  EXPECT_FALSE(r.http.never_sent()) << r.http.error;
  EXPECT_NE(r.http.error.find("stale weight session was finished"), std::string::npos)
      << r.http.error;
}

// Proves a start that must first finish a stale session ends by the one deadline it was given:
// with 300 ms per call and 500 ms in all, the second start is cut off, not answered late; would
// catch the finish and the second start each getting the whole timeout again.
TEST(EngineClient, AStaleSessionRestartEndsByOneDeadline) {
  ScriptedServer s;
  std::atomic<int> starts{0};
  s.server().Post("/start_weight_update", [&](const auto&, auto& res) {
    if (starts.fetch_add(1) == 0) {
      return Json(res, R"({"detail": "already active. Call finish_weight_update first."})", 500);
    }
    s.SlowSleep(300);
    Json(res, R"({"message": "Weight update started"})");
  });
  s.server().Post("/finish_weight_update", [&](const auto&, auto& res) {
    s.SlowSleep(300);
    Json(res, R"({"message": "Weight update finished"})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  CallOptions o;
  o.timeout_ms = 500;
  HttpReply r = c.StartWeightUpdate(StaleSession::kFinish, o);
  EXPECT_EQ(starts.load(), 2);
  EXPECT_FALSE(r.http.ok_2xx()) << "the second start outlived the deadline";
}

// Proves a start refused for an open weight session, under StaleSession::kRefuse, sends nothing
// more and returns the sent refusal led by the foreign session's cause; would catch an update
// that sends /finish_weight_update for a session someone else opened (committing and hiding
// what they loaded), or a refusal reported "not sent" (refused, never tainted).
TEST(EngineClient, AStaleSessionRefusedIsLeftOpenAndNamed) {
  ScriptedServer s;
  s.server().Post("/start_weight_update", [](const auto&, auto& res) {
    Json(res,
         R"({"detail": "A weight update is already active. Call finish_weight_update first."})",
         500);
  });
  s.server().Post("/finish_weight_update", [](const auto&, auto& res) {
    Json(res, R"({"message": "Weight update finished"})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  HttpReply r = c.StartWeightUpdate(StaleSession::kRefuse);
  EXPECT_FALSE(r.http.ok_2xx());
  EXPECT_FALSE(r.http.never_sent()) << r.http.error;
  EXPECT_EQ(r.http.http_status, 500);
  EXPECT_EQ(r.http.error.rfind(kForeignWeightSession, 0), 0u) << r.http.error;
  EXPECT_NE(r.http.error.find("finish_weight_update first"), std::string::npos) << r.http.error;
  EXPECT_EQ(s.paths(), (std::vector<std::string>{"POST /start_weight_update"}));
}

// Proves an engine without /weight_info and without the worker extension fails the probe and the
// finish with an error that names the missing --worker-extension-cls, after sending the finish;
// would catch a bootstrap that proceeds with an empty label, an error that leaves the operator
// guessing, or a finish skipped because the label could not be set.
TEST(EngineClient, LabelWithoutExtensionNamesTheFlag) {
  RpcLabelServer srv;
  srv.extension = false;
  EngineClient c(srv.s.url(), Fast());
  EngineProbed p = c.Probe();
  EXPECT_FALSE(p.http.ok_2xx());
  EXPECT_EQ(p.http.http_status, 500);
  EXPECT_NE(p.http.error.find("--worker-extension-cls"), std::string::npos) << p.http.error;
  EXPECT_NE(p.http.error.find("404"), std::string::npos) << p.http.error;
  EXPECT_EQ(c.label_route(), LabelRoute::kUnknown);
  HttpReply fin = c.FinishWeightUpdate(std::string("rc-1"));
  EXPECT_FALSE(fin.http.ok_2xx());
  EXPECT_NE(fin.http.error.find("--worker-extension-cls"), std::string::npos) << fin.http.error;
  std::lock_guard lk(srv.mu);
  // The update is finished even though it cannot be labelled (an unfinished 0.25.x update keeps
  // layers mid-reload and refuses the next start); the transfer still fails.
  EXPECT_EQ(srv.finish_bodies, (std::vector<std::string>{R"({"weight_version":"rc-1"})"}));
}

// Proves workers that disagree on the label, or a write the workers do not echo, are not
// evidence; would catch validating TP>1 engines by worker 0 alone.
TEST(EngineClient, RpcLabelWorkersMustAgree) {
  ScriptedServer s;
  s.server().Get("/weight_info",
                 [](const auto&, auto& res) { Json(res, R"({"detail":"Not Found"})", 404); });
  s.server().Post("/collective_rpc", [](const auto&, auto& res) {
    Json(res,
         R"({"results":[{"weight_version":"rc-1","rank":0},{"weight_version":"rc-0","rank":1}]})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  HttpReply r = c.ReadLabel();
  EXPECT_FALSE(r.http.ok_2xx());
  EXPECT_NE(r.http.error.find("every worker"), std::string::npos) << r.http.error;
  c.set_label_route(LabelRoute::kWorkerRpc);
  EXPECT_FALSE(c.WriteLabel("rc-2").http.ok_2xx());
}

// Proves a timeout, a 503, a 500 other than vLLM's unknown-method answer and a refused
// connection keep the cached label route and send no probe, while that unknown-method answer
// alone makes the call probe again; would catch a transient failure taken for a restart onto
// another line (the route forgotten, and a 0.25.x engine's label looked for at /weight_info),
// or the RPC's "not implemented" not recognised (a stale route kept forever).
TEST(EngineClient, OnlyAnAbsentRouteIsForgotten) {
  ScriptedServer s;
  std::atomic<int> info_mode{0};  // 0: too slow, 1: 503, 2: the label
  std::atomic<bool> rpc_unknown{false};
  s.server().Get("/weight_info", [&](const auto&, auto& res) {
    if (info_mode == 0) s.SlowSleep(1000);
    if (info_mode == 2) return Json(res, R"({"weight_version":"rc-4"})");
    Json(res, R"({"error": {"message": "busy", "code": 503}})", 503);
  });
  s.server().Post("/collective_rpc", [&](const auto&, auto& res) {
    const std::string why =
        rpc_unknown ? "Method 'rc_weight_info' is not implemented." : "CUDA error: out of memory";
    Json(res,
         json{{"error",
               {{"message", "Call to collective_rpc method failed: " + why},
                {"type", "InternalServerError"},
                {"code", 500}}}}
             .dump(),
         500);
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);
  EXPECT_EQ(c.ReadLabel(CallOptions{200, std::nullopt}).http.transport, Transport::kTimeout);
  EXPECT_EQ(c.label_route(), LabelRoute::kWeightInfoRoute);
  info_mode = 1;
  EXPECT_EQ(c.ReadLabel().http.http_status, 503);
  EXPECT_EQ(c.label_route(), LabelRoute::kWeightInfoRoute);
  c.set_label_route(LabelRoute::kWorkerRpc);
  EXPECT_EQ(c.ReadLabel().http.http_status, 500);
  EXPECT_EQ(c.label_route(), LabelRoute::kWorkerRpc);
  EXPECT_EQ(s.paths(3), (std::vector<std::string>{"GET /weight_info", "GET /weight_info",
                                                  "POST /collective_rpc"}))
      << "a transient failure sent a probe";
  info_mode = 2;
  rpc_unknown = true;
  HttpReply found = c.ReadLabel();
  ASSERT_TRUE(found.http.ok_2xx()) << found.http.error;
  EXPECT_EQ(found.body["weight_version"], "rc-4");
  EXPECT_EQ(c.label_route(), LabelRoute::kWeightInfoRoute);

  EngineClient refused("http://127.0.0.1:" + std::to_string(ClosedPort()), Fast());
  refused.set_label_route(LabelRoute::kWorkerRpc);
  EXPECT_EQ(refused.ReadLabel().http.transport, Transport::kConnectFailed);
  EXPECT_EQ(refused.label_route(), LabelRoute::kWorkerRpc);
}

// Proves a 200 with an unparseable body is evidence (body_parsed=false), not success, with
// bounded error text; would catch a client that trusts 2xx alone.
TEST(EngineClient, Unparseable200IsNotSuccess) {
  ScriptedServer s;
  const std::string garbage = "<html>" + std::string(5000, 'x');
  s.server().Get("/weight_info", [&](const auto&, auto& res) { Json(res, garbage); });
  s.Start();
  EngineClient c(s.url(), Fast());
  ValidationObserved v = c.WeightInfo();
  EXPECT_EQ(v.http.transport, Transport::kOk);
  EXPECT_EQ(v.http.http_status, 200);
  EXPECT_FALSE(v.http.body_parsed);
  EXPECT_FALSE(v.http.ok_2xx());
  EXPECT_TRUE(v.reported_label.empty());
  EXPECT_LE(v.http.error.size(), kHttpErrorBytesMax);
  EXPECT_FALSE(v.http.error.empty());
}

// Proves a relabel the engine answers 200 {"success": false} is a failure that says so, both for
// /update_weight_version and for the label write the runner makes through it, while
// {"success": true} still succeeds; catches a label the engine refused counted as set.
TEST(EngineClient, ASuccessFalseRelabelIsAFailureThatSaysSo) {
  ScriptedServer s;
  std::atomic<bool> succeed{false};
  s.server().Get("/weight_info",
                 [](const auto&, auto& res) { Json(res, R"({"weight_version":"rc-0"})"); });
  s.server().Post("/update_weight_version", [&](const auto&, auto& res) {
    Json(res, succeed.load() ? R"({"success":true})" : R"({"success":false})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  const HttpReply refused = c.UpdateWeightVersion("rc-1");
  EXPECT_EQ(refused.http.http_status, 200);
  EXPECT_FALSE(refused.http.ok_2xx());
  EXPECT_NE(refused.http.error.find(R"({"success": false})"), std::string::npos)
      << refused.http.error;
  HttpEngineControl control(c);
  EXPECT_FALSE(control.SetLabel("rc-1").ok_2xx());
  succeed.store(true);
  EXPECT_TRUE(c.UpdateWeightVersion("rc-1").http.ok_2xx());
  EXPECT_TRUE(control.SetLabel("rc-1").ok_2xx());
}

// Proves a refused connection is kConnectFailed with status 0 and quickly; would catch a refused
// connect being classified as a possible mutation (kTimeout/kBroken).
TEST(EngineClient, ConnectionRefusedIsNeverSent) {
  EngineClient c("http://127.0.0.1:" + std::to_string(ClosedPort()), Fast());
  const auto t0 = Clock::now();
  HttpReply r = c.StartWeightUpdate(StaleSession::kRefuse);
  EXPECT_EQ(r.http.transport, Transport::kConnectFailed);
  EXPECT_TRUE(r.http.never_sent());
  EXPECT_EQ(r.http.http_status, 0);
  EXPECT_FALSE(r.http.body_parsed);
  EXPECT_FALSE(r.http.error.empty());
  EXPECT_LT(elapsed_ms(t0), 1000u);
}

// Proves a response slower than the call deadline ends as kTimeout within 2x the deadline; would
// catch a missing CURLOPT_TIMEOUT_MS (the call would hang for the server's 5 s) or calling a
// sent request "never sent".
TEST(EngineClient, SlowResponseTimesOutWithinTwiceTheDeadline) {
  ScriptedServer s;
  s.server().Post("/update_weights", [&](const auto&, auto& res) {
    s.SlowSleep(5000);
    Json(res, R"({"message":"Weights updated"})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  const auto t0 = Clock::now();
  HttpReply r = c.UpdateWeights(json::object(), CallOptions{300, std::nullopt});
  const auto ms = elapsed_ms(t0);
  EXPECT_EQ(r.http.transport, Transport::kTimeout);
  EXPECT_FALSE(r.http.never_sent());
  EXPECT_EQ(r.http.http_status, 0);
  EXPECT_GE(ms, 250u);
  EXPECT_LT(ms, 600u);
}

// Proves the drain deadline (not the short call deadline) governs PauseWait; would catch a drain
// cut off by call_timeout_ms while running requests finish.
TEST(EngineClient, PauseWaitUsesDrainDeadline) {
  ScriptedServer s;
  s.server().Post("/pause", [&](const auto&, auto& res) {
    s.SlowSleep(600);
    Json(res, R"({"status":"paused"})");
  });
  s.Start();
  EngineDeadlines d = Fast();
  d.call_timeout_ms = 200;
  d.drain_timeout_ms = 5000;
  EngineClient c(s.url(), d);
  DrainObserved o = c.PauseWait();
  EXPECT_TRUE(o.http.ok_2xx()) << o.http.error;
  EXPECT_TRUE(o.paused);
}

// Proves a connection closed before any response byte is kBroken; would catch it being called
// kConnectFailed (the request was sent and may have acted).
TEST(EngineClient, ClosedWithoutResponseIsBroken) {
  RawServer raw([](int fd) { RawServer::ReadHead(fd); });
  EngineClient c(raw.url(), Fast());
  HttpReply r = c.StartWeightUpdate(StaleSession::kRefuse);
  EXPECT_EQ(r.http.transport, Transport::kBroken) << r.http.error;
  EXPECT_EQ(r.http.http_status, 0);
  EXPECT_FALSE(r.http.never_sent());
}

// Proves a connection dropped in the middle of a response body is kBroken; would catch a
// partial body being parsed or reported as a complete 200.
TEST(EngineClient, DroppedMidResponseIsBroken) {
  RawServer raw([](int fd) {
    RawServer::ReadHead(fd);
    RawServer::Send(fd,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    "Content-Length: 100\r\n\r\n{\"message\":");
  });
  EngineClient c(raw.url(), Fast());
  HttpReply r = c.FinishWeightUpdate(std::string("rc-1"));
  EXPECT_EQ(r.http.transport, Transport::kBroken) << r.http.error;
  EXPECT_FALSE(r.http.body_parsed);
  EXPECT_FALSE(r.http.ok_2xx());
}

// Proves Cancel() makes an in-flight call return promptly and later calls fail at once without
// sending, until ClearCancel(); would catch a cancel that waits for the 10 s server or curl's
// own 1 s poll.
TEST(EngineClient, CancelInterruptsInFlightCall) {
  ScriptedServer s;
  std::atomic<int> hits{0};
  s.server().Post("/update_weights", [&](const auto&, auto& res) {
    ++hits;
    s.SlowSleep(10000);
    Json(res, R"({"message":"Weights updated"})");
  });
  s.server().Get("/health", [](const auto&, auto& res) { res.status = 200; });
  s.Start();
  EngineDeadlines d = Fast();
  d.update_timeout_ms = 20000;
  EngineClient c(s.url(), d);
  HttpReply r;
  Clock::time_point cancelled_at;
  std::thread caller([&] { r = c.UpdateWeights(json::object()); });
  while (hits.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  cancelled_at = Clock::now();
  c.Cancel();
  caller.join();
  EXPECT_LT(elapsed_ms(cancelled_at), 500u);
  EXPECT_EQ(r.http.transport, Transport::kTimeout);  // the request was sent: may have acted
  EXPECT_NE(r.http.error.find("cancel"), std::string::npos);

  HttpReply after = c.Health();
  EXPECT_EQ(after.http.transport, Transport::kConnectFailed);
  // Only the cancelled call reached the server; the health check after Cancel() never did.
  EXPECT_EQ(s.paths(), (std::vector<std::string>{"POST /update_weights"}));
  c.ClearCancel();
  EXPECT_TRUE(c.Health().http.ok_2xx());
}

// Proves a per-call CancelToken stops only that call; would catch a token that cancels the whole
// client (the NCCL sender aborts /update_weights while other calls continue).
TEST(EngineClient, CancelTokenIsPerCall) {
  ScriptedServer s;
  std::atomic<int> hits{0};
  s.server().Post("/update_weights", [&](const auto&, auto& res) {
    ++hits;
    s.SlowSleep(10000);
    Json(res, R"({"message":"ok"})");
  });
  s.server().Get("/health", [](const auto&, auto& res) { res.status = 200; });
  s.Start();
  EngineClient c(s.url(), Fast());
  CancelToken token;
  HttpReply r;
  std::thread caller([&] {
    r = c.UpdateWeights(json::object(), CallOptions{std::uint64_t{20000}, token});
  });
  while (hits.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t0 = Clock::now();
  token.Cancel();
  caller.join();
  EXPECT_LT(elapsed_ms(t0), 500u);
  EXPECT_EQ(r.http.transport, Transport::kTimeout);
  EXPECT_FALSE(c.cancelled());
  EXPECT_TRUE(c.Health().http.ok_2xx());
}

// Proves concurrent calls from several threads all get their own correct answers and reuse
// connections; would catch a shared curl handle (crashes, crossed bodies) or a new connection
// per call.
TEST(EngineClient, ConcurrentCallsAndConnectionReuse) {
  ScriptedServer s;
  s.server().Get("/get_world_size", [](const httplib::Request& req, auto& res) {
    const bool dp = req.get_param_value("include_dp") == "true";
    Json(res, dp ? R"({"world_size":4})" : R"({"world_size":2})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  constexpr int kThreads = 6;
  constexpr int kCalls = 25;
  std::atomic<int> good{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const bool dp = (t + i) % 2 == 0;
        HttpReply r = c.GetWorldSize(dp);
        if (r.http.ok_2xx() && r.body["world_size"] == (dp ? 4 : 2)) ++good;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), kThreads * kCalls);
  EXPECT_LE(s.distinct_client_ports(), static_cast<std::size_t>(kThreads * 2));
}

// Proves /finish_weight_update carries {"weight_version": label} or no body at all; would catch
// a missing label (the engine would keep reporting the old version) or "null" sent as a body.
TEST(EngineClient, FinishBodyWithAndWithoutLabel) {
  ScriptedServer s;
  std::vector<std::string> bodies;
  s.server().Post("/finish_weight_update", [&](const httplib::Request& req, auto& res) {
    bodies.push_back(req.body);
    Json(res, R"({"message":"Weight update finished"})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
  EXPECT_TRUE(c.FinishWeightUpdate(std::string("rc-7")).http.ok_2xx());
  EXPECT_TRUE(c.FinishWeightUpdate(std::nullopt).http.ok_2xx());
  ASSERT_EQ(bodies.size(), 2u);
  EXPECT_EQ(json::parse(bodies[0]), json({{"weight_version", "rc-7"}}));
  EXPECT_EQ(bodies[1], "");
}

// Proves request bodies of the weight-transfer routes are wrapped as vLLM expects; would catch
// sending update_info unwrapped (vLLM answers 400 "update_info missing").
TEST(EngineClient, InitAndUpdateBodiesAreWrapped) {
  ScriptedServer s;
  json init_seen, update_seen, version_seen, abort_seen;
  s.server().Post("/init_weight_transfer_engine", [&](const httplib::Request& req, auto& res) {
    init_seen = json::parse(req.body);
    Json(res, R"({"message":"Weight transfer initialized"})");
  });
  s.server().Post("/update_weights", [&](const httplib::Request& req, auto& res) {
    update_seen = json::parse(req.body);
    Json(res, R"({"message":"Weights updated"})");
  });
  s.server().Post("/update_weight_version", [&](const httplib::Request& req, auto& res) {
    version_seen = json::parse(req.body);
    Json(res, R"({"success":true,"new_version":"x"})");
  });
  s.server().Post("/abort_requests", [&](const httplib::Request& req, auto& res) {
    abort_seen = json::parse(req.body);
    Json(res, R"({"status":"aborted","aborted":2})");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  EXPECT_TRUE(c.InitWeightTransferEngine(json{{"world_size", 2}}).http.ok_2xx());
  EXPECT_TRUE(c.UpdateWeights(json{{"names", json::array()}}).http.ok_2xx());
  EXPECT_TRUE(c.UpdateWeightVersion("x").http.ok_2xx());
  EXPECT_TRUE(AbortRequests(c, {"a", "b"}).http.ok_2xx());
  EXPECT_EQ(init_seen, json({{"init_info", {{"world_size", 2}}}}));
  EXPECT_EQ(update_seen, json({{"update_info", {{"names", json::array()}}}}));
  EXPECT_EQ(version_seen, json({{"new_version", "x"}}));
  EXPECT_EQ(abort_seen, json({{"request_ids", {"a", "b"}}}));
}

// Proves Resume() reports is_paused from GET /is_paused after a 2xx /resume, then which process
// answers (the label route, then /metrics), reports that instance unknown when the label read
// fails, and stops at a failed /resume; would catch a resume reported done while the engine
// still says paused, and a failed label read mistaken for another process.
TEST(EngineClient, ResumeReadsIsPaused) {
  ScriptedServer s;
  std::atomic<bool> fail{false};
  std::atomic<bool> label_fails{false};
  s.server().Get("/weight_info", [&](const auto&, auto& res) {
    if (label_fails)
      Json(res, R"({"error":"busy"})", 503);
    else
      Json(res, R"({"weight_version":"rc-0"})");
  });
  s.server().Get("/metrics", [](const auto&, auto& res) {
    res.set_content("process_start_time_seconds 1.7649e+09\n", "text/plain");
  });
  s.server().Post("/resume", [&](const auto&, auto& res) {
    if (fail)
      Json(res, R"({"error":"boom"})", 500);
    else
      Json(res, R"({"status":"resumed"})");
  });
  s.server().Get("/is_paused", [](const auto&, auto& res) { Json(res, R"({"is_paused":false})"); });
  s.Start();
  EngineClient c(s.url(), Fast());
  ResumeObserved ok = c.Resume();
  EXPECT_TRUE(ok.http.ok_2xx());
  EXPECT_TRUE(ok.is_paused_known);
  EXPECT_FALSE(ok.is_paused);
  EXPECT_EQ(ok.engine_instance, "start:1.7649e+09");
  label_fails = true;
  ResumeObserved unread = c.Resume();
  EXPECT_TRUE(unread.http.ok_2xx());
  EXPECT_EQ(unread.engine_instance, "") << "a failed label read proves no other process";
  fail = true;
  ResumeObserved bad = c.Resume();
  EXPECT_EQ(bad.http.http_status, 500);
  EXPECT_FALSE(bad.is_paused_known);
  EXPECT_TRUE(bad.is_paused);
}

// Proves a body over kResponseBytesMax is cut off and reported unparsed, not buffered without
// bound; would catch an unbounded response buffer.
TEST(EngineClient, OversizedBodyIsBounded) {
  ScriptedServer s;
  s.server().Get("/weight_info", [](const auto&, auto& res) {
    res.set_chunked_content_provider("application/json", [](size_t, httplib::DataSink& sink) {
      const std::string chunk(1 << 20, ' ');
      for (int i = 0; i < 20; ++i) {
        if (!sink.write(chunk.data(), chunk.size())) return false;
      }
      sink.done();
      return true;
    });
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  HttpReply r = c.GetWeightInfo();
  EXPECT_EQ(r.http.transport, Transport::kOk);
  EXPECT_EQ(r.http.http_status, 200);
  EXPECT_FALSE(r.http.body_parsed);
  EXPECT_LE(r.raw.size(), kResponseBytesMax);
  EXPECT_NE(r.http.error.find("exceeds"), std::string::npos);
}

// Proves SSE streaming hands each data event to the callback, ends at [DONE], and can be stopped
// by the callback; would catch events merged, lost at a chunk boundary, or a stop ignored.
TEST(EngineClient, StreamingDeliversEachChunk) {
  ScriptedServer s;
  std::string seen_body;
  s.server().Post("/v1/completions", [&](const httplib::Request& req, auto& res) {
    seen_body = req.body;
    res.set_chunked_content_provider("text/event-stream", [](size_t, httplib::DataSink& sink) {
      const std::string parts[] = {"data: {\"i\":0}\n\n", "data: {\"i\"", ":1}\n\ndata: {\"i\":2}",
                                   "\n\n", "data: [DONE]\n\n"};
      for (const auto& p : parts) {
        if (!sink.write(p.data(), p.size())) return false;
      }
      sink.done();
      return true;
    });
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  std::vector<int> got;
  HttpReply r = c.CompletionsStream(json{{"prompt", "hi"}}, [&](const json& j) {
    got.push_back(j["i"].get<int>());
    return true;
  });
  EXPECT_TRUE(r.http.ok_2xx()) << r.http.error;
  EXPECT_EQ(got, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(json::parse(seen_body)["stream"], true);

  got.clear();
  HttpReply stopped = c.CompletionsStream(json{{"prompt", "hi"}}, [&](const json& j) {
    got.push_back(j["i"].get<int>());
    return false;
  });
  EXPECT_EQ(got, (std::vector<int>{0}));
  EXPECT_EQ(stopped.http.transport, Transport::kOk);
  EXPECT_NE(stopped.http.error.find("stopped"), std::string::npos);
}

// Proves non-streaming completions pass JSON through both ways; would catch a wrong route or a
// dropped body.
TEST(EngineClient, CompletionsRoundTrip) {
  ScriptedServer s;
  s.server().Post("/v1/chat/completions", [](const httplib::Request& req, auto& res) {
    json in = json::parse(req.body);
    Json(res, json{{"echo", in["messages"][0]["content"]}}.dump());
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  HttpReply r = c.ChatCompletions(json{{"messages", {{{"role", "user"}, {"content", "hey"}}}}});
  EXPECT_TRUE(r.http.ok_2xx());
  EXPECT_EQ(r.body["echo"], "hey");
}

// Proves /metrics is fetched as text and parsed; would catch requiring JSON on /metrics.
TEST(EngineClient, MetricsOverHttp) {
  ScriptedServer s;
  s.server().Get("/metrics", [](const auto&, auto& res) {
    res.set_content(
        "# TYPE vllm:num_requests_running gauge\n"
        "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n"
        "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n",
        "text/plain; version=0.0.4");
  });
  s.Start();
  EngineClient c(s.url(), Fast());
  Result<MetricsMap> m = Metrics(c);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_DOUBLE_EQ(read_engine_load(*m).num_requests_running, 5.0);
}

}  // namespace
}  // namespace rc::effects
