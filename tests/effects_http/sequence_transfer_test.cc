// HttpSequenceTransfer against scripted engines: the start/update/finish order and bodies, and
// the mutation class of every way the sequence can fail.
#include "effects/http/sequence_transfer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>

#include "effects/clock.h"
#include "tests/effects_http/slow_transfer_engine.h"
#include "tests/effects_http/test_servers.h"

namespace rc::effects {
namespace {

using nlohmann::json;
using rc::testing::ClosedPort;
using rc::testing::ScriptedServer;

void Json(httplib::Response& res, const std::string& body, int status = 200) {
  res.status = status;
  res.set_content(body, "application/json");
}

TransferTarget Target(const std::string& uri = "synthetic:3x16:7") {
  TransferTarget t;
  t.update_id = "u1";
  t.target = WeightVersion{1, "rc-1"};
  t.source_uri = uri;
  return t;
}

// An engine whose three routes answer per the given statuses (0 = slow past any deadline), and
// whose label read names its process `instance` ("": it names none).
struct Engine {
  ScriptedServer s;
  json update_body, finish_body, init_body;
  std::string instance = "proc-1";
  int restarts_in_init = 0;  // inits during which the engine restarts (a new instance)
  Engine(int start, int update, int finish, int init = 200) {
    s.server().Get("/get_world_size", [](const httplib::Request&, httplib::Response& res) {
      Json(res, R"({"world_size":1})");
    });
    s.server().Get("/weight_info", [this](const httplib::Request&, httplib::Response& res) {
      json label = {{"weight_version", "rc-0"}};
      if (!instance.empty()) label["instance"] = instance;
      Json(res, label.dump());
    });
    auto route = [this](const char* path, int status, json* seen) {
      s.server().Post(path, [this, status, seen](const httplib::Request& req, auto& res) {
        if (seen != nullptr) *seen = json::parse(req.body, nullptr, false);
        if (seen == &init_body && restarts_in_init > 0) {
          --restarts_in_init;
          instance += "'";
        }
        if (status == 0) {
          s.SlowSleep(5000);
          status_or_ok(res, 200);
          return;
        }
        status_or_ok(res, status);
      });
    };
    route("/init_weight_transfer_engine", init, &init_body);
    route("/start_weight_update", start, nullptr);
    route("/update_weights", update, &update_body);
    route("/finish_weight_update", finish, &finish_body);
    s.Start();
  }
  static void status_or_ok(httplib::Response& res, int status) {
    if (status == 299) {  // 2xx with a body that is not JSON
      Json(res, "not json", 200);
    } else {
      Json(res, status == 200 ? R"({"message":"ok"})" : R"({"error":"x"})", status);
    }
  }
};

using rc::testing::kStallMs;
using rc::testing::SlowDeadlines;
using rc::testing::SlowTransferEngine;

EngineDeadlines Fast() {
  EngineDeadlines d;
  d.connect_timeout_ms = 500;
  d.call_timeout_ms = 2000;
  d.update_timeout_ms = 2000;
  d.drain_timeout_ms = 2000;
  return d;
}

// Proves a manifest whose tensor names hold a tab or a newline is refused: the digest's canonical
// text separates fields and tensors by those, so one tensor "x<TAB>bfloat16<TAB>2<LF>y" of [3]
// float32 would give the digest of two tensors x and y, and a checkpoint could pass for another.
TEST(Manifest, NamesThatCouldForgeTheCanonicalTextAreRefused) {
  Manifest two;
  two.tensors = {{"x", DType::kBFloat16, {2}}, {"y", DType::kFloat32, {3}}};
  Manifest one;
  one.tensors = {{"x\tbfloat16\t2\ny", DType::kFloat32, {3}}};
  ASSERT_TRUE(two.Validate().ok());
  EXPECT_EQ(one.digest(), two.digest()) << "the forgery this test guards against is gone";
  EXPECT_FALSE(one.Validate().ok());
}

// Proves the synthetic manifest is deterministic, seed-independent and well-formed; would catch
// a preflight digest that differs between runner and trainer for the same source.
TEST(SyntheticSource, ManifestIsDeterministic) {
  Result<Manifest> a = synthetic_manifest("synthetic:3x16:7");
  Result<Manifest> b = synthetic_manifest("synthetic:3x16");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->digest(), b->digest());
  ASSERT_EQ(a->tensors.size(), 3u);
  EXPECT_EQ(a->tensors[2].name, "model.layers.2.weight");
  EXPECT_EQ(a->tensors[2].dtype, DType::kBFloat16);
  EXPECT_EQ(a->tensors[2].shape, (std::vector<std::uint64_t>{16, 16}));
  EXPECT_EQ(a->total_bytes(), 3u * 16 * 16 * 2);
  EXPECT_NE(a->digest(), synthetic_manifest("synthetic:3x17")->digest());
  for (const char* bad : {"synthetic:", "synthetic:3", "synthetic:0x4", "synthetic:3x0",
                          "synthetic:3x4:", "synthetic:3x4:z", "safetensors:/x",
                          "synthetic:99999999999x4", "synthetic:-1x4"}) {
    EXPECT_FALSE(synthetic_manifest(bad).ok()) << bad;
  }
}

// Proves Preflight reports the source digest with device/memory ok and sends nothing; would
// catch a preflight that touches the engine (it must not mutate) or a wrong digest.
TEST(HttpSequenceTransfer, PreflightComputesDigestOffline) {
  EngineClient c("http://127.0.0.1:" + std::to_string(ClosedPort()), Fast());
  HttpSequenceTransfer t(c);
  PreflightObserved p = t.Preflight(Target());
  EXPECT_EQ(p.source_manifest_digest, synthetic_manifest("synthetic:3x16")->digest());
  EXPECT_TRUE(p.device_ok);
  EXPECT_TRUE(p.memory_ok);
  PreflightObserved bad = t.Preflight(Target("safetensors:/nope"));
  EXPECT_TRUE(bad.source_manifest_digest.empty());
  EXPECT_FALSE(bad.detail.empty());
}

// Proves the happy path is init -> the initialized process's label read -> start -> (the source
// named to a content-modelling engine) -> update(update_info of the manifest) -> finish(label)
// and yields kComplete with byte and tensor counts; would catch a missing step, a wrong order or a
// finish without the target label. The loopback engine answers 404 to the data-plane stand-in, as a
// real one does: no effect.
TEST(HttpSequenceTransfer, CompleteSequence) {
  Engine e(200, 200, 200);
  EngineClient c(e.s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
  HttpSequenceTransfer t(c);
  TransferObserved o = t.Transfer(Target(), 5000);
  EXPECT_TRUE(o.acknowledged) << o.error;
  EXPECT_EQ(o.mutation, MutationClass::kComplete);
  EXPECT_EQ(o.bytes_sent, 3u * 16 * 16 * 2);
  EXPECT_EQ(o.tensors_sent, 3u);
  EXPECT_EQ(o.finish_label, "rc-1");
  EXPECT_GT(o.duration_us, 0u);
  EXPECT_TRUE(o.error.empty());
  // Label reads before and after the init name the process it initialized (a restart
  // re-initializes).
  EXPECT_EQ(e.s.paths(8),
            (std::vector<std::string>{"GET /weight_info", "GET /get_world_size",
                                      "POST /init_weight_transfer_engine", "GET /weight_info",
                                      "POST /start_weight_update", "POST /_double/data_plane",
                                      "POST /update_weights", "POST /finish_weight_update"}));
  EXPECT_EQ(e.finish_body, json({{"weight_version", "rc-1"}}));
  const json& info = e.update_body["update_info"];
  EXPECT_EQ(info["names"].size(), 3u);
  EXPECT_EQ(info["dtype_names"][0], "bfloat16");
  EXPECT_EQ(info["shapes"][1], json({16, 16}));
  EXPECT_FALSE(info.contains("packed"));  // default line is >= 0.28
}

// Proves the 0.25 line's update_info carries packed*; would catch the protocol line ignored.
TEST(HttpSequenceTransfer, V025UpdateInfoCarriesPacking) {
  Engine e(200, 200, 200);
  EngineClient c(e.s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
  HttpSequenceTransfer t(c, detect_protocol("0.25.1"));
  EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
  EXPECT_EQ(e.update_body["update_info"]["packed"], true);
}

// Proves a refused connection on /start_weight_update is kNone (refusal without taint); would
// catch an unreachable engine tainting the controller.
TEST(HttpSequenceTransfer, ConnectRefusedIsNoMutation) {
  EngineClient c("http://127.0.0.1:" + std::to_string(ClosedPort()), Fast());
  HttpSequenceTransfer t(c);
  TransferObserved o = t.Transfer(Target(), 5000);
  EXPECT_FALSE(o.acknowledged);
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  EXPECT_EQ(o.bytes_sent, 0u);
  EXPECT_NE(o.error.find("/get_world_size"), std::string::npos) << o.error;
}

// Proves the weight-transfer engine is initialised once per engine process (world size = 1 + the
// engine's), again at the next transfer when the engine names no process or restarted during the
// init, and that a failed initialisation is a refusal (kNone) since it mutates no weight; would
// catch a re-init before every update of a known process, an unknown process trusted (a restart
// then goes unseen), or an init failure tainting the controller.
TEST(HttpSequenceTransfer, InitialisesOnceAndInitFailureIsNoMutation) {
  {
    Engine e(200, 200, 200);
    EngineClient c(e.s.url(), Fast());
    c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
    HttpSequenceTransfer t(c, detect_protocol("0.30.0"));
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    EXPECT_EQ(e.init_body["init_info"]["world_size"], 2);
    EXPECT_EQ(e.init_body["init_info"]["nccl_unique_id_b64"].get<std::string>().size(), 172u);
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    int inits = 0;
    for (const std::string& p : e.s.paths()) inits += p == "POST /init_weight_transfer_engine";
    EXPECT_EQ(inits, 1);
  }
  {
    // An engine that names no process may have restarted unseen: it is initialized every time.
    Engine e(200, 200, 200);
    e.instance.clear();
    EngineClient c(e.s.url(), Fast());
    c.set_label_route(LabelRoute::kWeightInfoRoute);
    HttpSequenceTransfer t(c);
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    int inits = 0;
    for (const std::string& p : e.s.paths()) inits += p == "POST /init_weight_transfer_engine";
    EXPECT_EQ(inits, 2);
  }
  {
    // A restart during the init: the process read after it is not the one initialized.
    Engine e(200, 200, 200);
    e.restarts_in_init = 1;
    EngineClient c(e.s.url(), Fast());
    c.set_label_route(LabelRoute::kWeightInfoRoute);
    HttpSequenceTransfer t(c);
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    EXPECT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
    int inits = 0;
    for (const std::string& p : e.s.paths()) inits += p == "POST /init_weight_transfer_engine";
    EXPECT_EQ(inits, 2);
  }
  Engine e(200, 200, 200, /*init=*/500);
  EngineClient c(e.s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
  HttpSequenceTransfer t(c);
  TransferObserved o = t.Transfer(Target(), 5000);
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  EXPECT_NE(o.error.find("/init_weight_transfer_engine"), std::string::npos) << o.error;
  for (const std::string& p : e.s.paths()) EXPECT_NE(p, "POST /start_weight_update");
}

// Proves a bad source is kNone before any request; would catch a request sent for an unknown
// source.
TEST(HttpSequenceTransfer, BadSourceIsNoMutation) {
  Engine e(200, 200, 200);
  EngineClient c(e.s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
  HttpSequenceTransfer t(c);
  EXPECT_EQ(t.Transfer(Target("synthetic:nope"), 5000).mutation, MutationClass::kNone);
  EXPECT_TRUE(e.s.paths().empty());
}

// Proves every failure once the engine may have seen /start_weight_update is kPossible; would
// catch a failed update or finish reported as "no mutation" (a half-loaded model published).
TEST(HttpSequenceTransfer, FailuresAfterStartArePossible) {
  struct Case {
    int start, update, finish;
  };
  for (const Case& k : {Case{500, 200, 200}, Case{299, 200, 200}, Case{200, 500, 200},
                        Case{200, 299, 200}, Case{200, 200, 500}, Case{200, 200, 299}}) {
    Engine e(k.start, k.update, k.finish);
    EngineClient c(e.s.url(), Fast());
    c.set_label_route(LabelRoute::kWeightInfoRoute);  // probed: an engine with /weight_info
    HttpSequenceTransfer t(c);
    TransferObserved o = t.Transfer(Target(), 5000);
    EXPECT_FALSE(o.acknowledged) << k.start << k.update << k.finish;
    EXPECT_EQ(o.mutation, MutationClass::kPossible) << k.start << k.update << k.finish;
    EXPECT_FALSE(o.error.empty());
  }
}

// Proves Transfer honours its deadline when /update_weights hangs and calls it kPossible; would
// catch a transfer that waits for the engine's own timeout (the article's >120 s stall).
TEST(HttpSequenceTransfer, HonoursDeadline) {
  Engine e(200, 0, 200);
  EngineDeadlines d = Fast();
  d.update_timeout_ms = 60000;
  EngineClient c(e.s.url(), d);
  HttpSequenceTransfer t(c);
  const auto t0 = std::chrono::steady_clock::now();
  TransferObserved o = t.Transfer(Target(), 400);
  EXPECT_LT(elapsed_ms(t0), 800u);
  EXPECT_EQ(o.mutation, MutationClass::kPossible);
  EXPECT_FALSE(o.acknowledged);
}

// Proves a transfer whose deadline is already spent is a refusal (kNone) with nothing sent, and
// that a zero deadline reaches no engine call; catches the abort (RC_CHECK(timeout_ms > 0) in the
// client) that crashed the executor and recovered as TAINTED although nothing was ever sent.
TEST(HttpSequenceTransfer, SpentDeadlineIsARefusalNotACrash) {
  Engine e(200, 200, 200);
  EngineClient c(e.s.url(), Fast());
  c.set_label_route(LabelRoute::kWeightInfoRoute);
  HttpSequenceTransfer t(c);
  TransferObserved o = t.Transfer(Target(), 0);
  EXPECT_FALSE(o.acknowledged);
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  EXPECT_NE(o.error.find("deadline"), std::string::npos) << o.error;
  EXPECT_TRUE(e.s.paths().empty());
  // A call with a spent deadline is evidence that nothing was sent, for every route.
  HttpReply r = c.StartWeightUpdate(StaleSession::kRefuse, CallOptions{0, std::nullopt});
  EXPECT_TRUE(r.http.never_sent()) << r.http.error;
  EXPECT_TRUE(e.s.paths().empty());
}

// Proves /get_world_size and /init_weight_transfer_engine share the transfer's one deadline: a
// world size answered at 1.6 s of a 2 s deadline leaves the stalled init only what is left, so
// the transfer ends near 2 s; catches the init handed the same `left` as the world size (the
// transfer then ran to ~3.6 s, almost twice its journaled deadline).
TEST(HttpSequenceTransfer, InitializationEndsByTheTransferDeadline) {
  SlowTransferEngine e;
  e.world_delay_ms = 1600;
  e.init_delay_ms = kStallMs;
  EngineClient c(e.s.url(), SlowDeadlines());
  c.set_label_route(LabelRoute::kWeightInfoRoute);
  HttpSequenceTransfer t(c);
  const auto t0 = std::chrono::steady_clock::now();
  TransferObserved o = t.Transfer(Target(), 2000);
  EXPECT_LT(elapsed_ms(t0), 3000u);  // deadline 2000 ms; the stale timeout took >= 3600 ms
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  EXPECT_NE(o.error.find("/init_weight_transfer_engine"), std::string::npos) << o.error;
}

// Proves the check that the engine is still the initialized process and the re-initialization
// after a restart end by one deadline: a label read answered at 1.6 s of 2 s (naming a new
// process) leaves the stalled init only the rest; catches SameEngineAs and the init each given
// the same `left` (the transfer then ran to ~3.6 s).
TEST(HttpSequenceTransfer, RestartCheckAndReinitEndByOneDeadline) {
  SlowTransferEngine e;
  EngineClient c(e.s.url(), SlowDeadlines());
  c.set_label_route(LabelRoute::kWeightInfoRoute);
  HttpSequenceTransfer t(c);
  ASSERT_EQ(t.Transfer(Target(), 5000).mutation, MutationClass::kComplete);
  e.generation = 2;  // restarted: the transfer engine must be initialized again
  e.label_delay_ms = 1600;
  e.init_delay_ms = kStallMs;
  const auto t0 = std::chrono::steady_clock::now();
  TransferObserved o = t.Transfer(Target(), 2000);
  EXPECT_LT(elapsed_ms(t0), 3000u);  // deadline 2000 ms; the stale timeout took >= 3600 ms
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  EXPECT_NE(o.error.find("/init_weight_transfer_engine"), std::string::npos) << o.error;
}

}  // namespace
}  // namespace rc::effects
