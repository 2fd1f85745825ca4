// POST /v1/restores end to end: `serve` with the reload transfer against the vLLM double, a real
// journal and loopback HTTP. A TAINTED engine serves again only when a restore's reload (or an
// adoption) brings back the weight digest recorded for the version; every other restore leaves
// it TAINTED, and bad requests journal nothing.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "audit/audit.h"
#include "effects/http/engine_client.h"
#include "effects/http/weight_digest.h"
#include "effects/nccl/weight_source.h"
#include "fixtures/vllm_double.h"
#include "service/service.h"
#include "tests/service/checkpoint_dirs.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;
using test::Checkpoints;

constexpr const char* kToken = "restore-token";

json Answer(const httplib::Result& r) {
  if (!r) return json{{"http", -1}};
  json out = json::parse(r->body, nullptr, false);
  if (!out.is_object()) out = json::object();
  out["http"] = r->status;
  return out;
}

struct Stack : stack::ServiceStack {
  explicit Stack(const std::string& initial_file) : ServiceStack(Options(initial_file)) {}
  static stack::StackOptions Options(const std::string& initial_file) {
    stack::StackOptions o;
    o.token = kToken;
    o.dir_prefix = "rc-restore";
    o.tweak = [initial_file](ServeConfig& c) {
      c.transfer = "reload";
      c.initial_source = "safetensors:" + initial_file;
      c.engine_monitor_interval_ms = 50;
    };
    return o;
  }
  json Update(const std::string& id, const std::string& label, const std::string& file) {
    Result<std::string> manifest = effects::nccl::SourceManifestDigest("safetensors:" + file);
    RC_CHECK(manifest.ok());
    const json body = {{"update_id", id},
                       {"target_label", label},
                       {"identity", {{"manifest_digest", *manifest}, {"checkpoint", file}}},
                       {"source", "safetensors:" + file}};
    httplib::Client c = client();
    return Answer(c.Post("/v1/updates", stack::Bearer(kToken), body.dump(), "application/json"));
  }
  json Restore(const json& body, bool auth = true) {
    httplib::Client c = client();
    const httplib::Headers h = auth ? stack::Bearer(kToken) : httplib::Headers{};
    return Answer(c.Post("/v1/restores", h, body.dump(), "application/json"));
  }
  std::string EngineDigest() {
    effects::EngineClient c(engine->base_url());
    return effects::ReadWeightDigest(c).combined;
  }
  // rc-1 (v1) committed, then an update to v2 whose reload fails half-way: TAINTED.
  std::string CommitThenTaint(const Checkpoints& ckpt) {
    EXPECT_EQ(Update("u1", "rc-1", ckpt.v1)["http"], 200);
    const std::string d1 = svc->journal().state().committed_digest.combined;
    engine->SetReloadFault(fixtures::ReloadFault::kFailMid);
    EXPECT_EQ(Update("u2", "rc-2", ckpt.v2)["http"], 500);
    engine->SetReloadFault(fixtures::ReloadFault::kNone);
    EXPECT_EQ(svc->journal().state().lifecycle, Lifecycle::kTainted);
    return d1;
  }
  bool WaitForTaint(int timeout_ms) {
    for (int waited = 0; waited < timeout_ms; waited += 10) {
      if (svc->journal().state().lifecycle == Lifecycle::kTainted) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
};

// Proves the whole route: after a half-applied reload TAINTED the engine, a restore to rc-1 from
// its checkpoint answers 200 committed, the engine serves rc-1 again at a new generation with the
// digest recorded for rc-1 (the engine's own digest equals it), the taint is gone, the metric
// counts it, and a re-POST answers the recorded outcome while the same id with another body is
// refused. Would catch a restore published without the digest proof or an unidempotent route.
TEST(RestoreApi, ProvenRestoreAfterAHalfAppliedReload) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  const std::string d1 = s.CommitThenTaint(ckpt);
  const json body = {{"restore_id", "r1"}, {"label", "rc-1"}, {"source", "safetensors:" + ckpt.v1}};
  const json r = s.Restore(body);
  ASSERT_EQ(r["http"], 200) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "committed");
  EXPECT_FALSE(r.value("replayed", true));
  EXPECT_EQ(r["state"]["lifecycle"], "READY");
  EXPECT_TRUE(r["state"]["taint"].is_null());
  const State st = s.svc->journal().state();
  EXPECT_EQ(st.committed, (WeightVersion{2, "rc-1"}));
  EXPECT_EQ(st.committed_digest.combined, d1);
  EXPECT_EQ(s.EngineDigest(), d1);
  EXPECT_EQ(s.engine->weight_label(), "rc-1");

  const json again = s.Restore(body);
  EXPECT_EQ(again["http"], 200) << again.dump();
  EXPECT_TRUE(again.value("replayed", false));
  json other = body;
  other["source"] = "safetensors:" + ckpt.v2;
  EXPECT_EQ(s.Restore(other)["http"], 409);

  httplib::Client c = s.client();
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("rolloutcore_restores_total{outcome=\"committed\"} 1"), std::string::npos);

  // The audit of the same journal: the taint is ended by the restore, nothing else is found.
  Result<audit::AuditReport> report = audit::AuditJournal(s.svc->journal());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const audit::Verdict v = audit::MakeVerdict(*report);
  EXPECT_TRUE(v.engine_healthy()) << audit::RenderAudit(*report, v, "j").text;
  EXPECT_EQ(report->engine.restored_count, 1u);
  EXPECT_TRUE(report->engine.unexplained_taints.empty());
}

// Proves a restore from the wrong checkpoint (same manifest, other weights) stays TAINTED with
// the differing tensors named and the proxy still refusing; would catch publishing a restore on
// its label alone.
TEST(RestoreApi, WrongSourceStaysTaintedNamingTensors) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  s.CommitThenTaint(ckpt);
  const json r = s.Restore(
      {{"restore_id", "r-wrong"}, {"label", "rc-1"}, {"source", "safetensors:" + ckpt.v2}});
  EXPECT_EQ(r["http"], 500) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "tainted");
  EXPECT_NE(r.value("reason", "").find("tensors differ"), std::string::npos) << r.dump();
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kTainted);
  httplib::Client c = s.client();
  auto p =
      c.Post("/v1/completions", R"({"model":"m","prompt":"x","max_tokens":2})", "application/json");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->status, 503);
}

// Proves the failures a restore can meet before anything changes leave the engine TAINTED and
// are answered 422 refused: a source the engine cannot read (the preflight through the engine
// fails, nothing is reloaded) and an engine that is down (the drain fails); afterwards a good
// restore still succeeds. Would catch a refused restore that resumes the suspect engine.
TEST(RestoreApi, MissingSourceAndDeadEngineAreRefusedAndStayTainted) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  s.CommitThenTaint(ckpt);
  const std::uint64_t reloads = s.engine->RpcCount("reload_weights");
  const json missing = s.Restore({{"restore_id", "r-missing"},
                                  {"label", "rc-1"},
                                  {"source", "safetensors:" + (ckpt.dir / "nowhere").string()}});
  EXPECT_EQ(missing["http"], 422) << missing.dump();
  EXPECT_EQ(missing.value("outcome", ""), "refused");
  EXPECT_EQ(s.engine->RpcCount("reload_weights"), reloads) << "a missing source was reloaded";
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kTainted);

  s.engine->SetEngineDead(true);
  const json dead = s.Restore(
      {{"restore_id", "r-dead"}, {"label", "rc-1"}, {"source", "safetensors:" + ckpt.v1}});
  EXPECT_EQ(dead["http"], 422) << dead.dump();
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kTainted);
  s.engine->SetEngineDead(false);

  const json good = s.Restore(
      {{"restore_id", "r-good"}, {"label", "rc-1"}, {"source", "safetensors:" + ckpt.v1}});
  EXPECT_EQ(good["http"], 200) << good.dump();
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kReady);
}

// Proves bad restore requests are refused with a clear status and journal nothing: unauthorised,
// not TAINTED, a label never committed, both or neither of source and adopt, malformed JSON; and
// that /metrics counts them by why. Catches an invalid request shown as a conflict.
TEST(RestoreApi, BadRequestsJournalNothing) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  const json good = {{"restore_id", "r"}, {"label", "rc-0"}, {"source", "safetensors:" + ckpt.v0}};
  std::uint64_t head = s.svc->journal().head_seq();
  EXPECT_EQ(s.Restore(good, /*auth=*/false)["http"], 401);
  EXPECT_EQ(s.Restore(good)["http"], 409);  // READY: nothing to restore
  EXPECT_EQ(s.svc->journal().head_seq(), head);

  s.CommitThenTaint(ckpt);
  head = s.svc->journal().head_seq();
  EXPECT_EQ(s.Restore({{"restore_id", "r"}, {"label", "rc-9"}, {"adopt", true}})["http"], 400);
  EXPECT_EQ(s.Restore({{"restore_id", "r"},
                       {"label", "rc-1"},
                       {"adopt", true},
                       {"source", "safetensors:" + ckpt.v1}})["http"],
            400);
  EXPECT_EQ(s.Restore({{"restore_id", "r"}, {"label", "rc-1"}})["http"], 400);
  EXPECT_EQ(s.Restore({{"restore_id", "r"}, {"label", "rc-1"}, {"adopt", "yes"}})["http"], 400);
  EXPECT_EQ(s.Restore({{"restore_id", "r\n"}, {"label", "rc-1"}, {"adopt", true}})["http"], 400);
  EXPECT_EQ(s.Restore({{"label", "rc-1"}, {"adopt", true}})["http"], 400);
  httplib::Client c = s.client();
  auto bad = c.Post("/v1/restores", stack::Bearer(kToken), "{not json", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(s.svc->journal().head_seq(), head);
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kTainted);

  // Counted by why: the lifecycle's refusal (READY), the fold's verdict on a label it never
  // committed; none of them is a conflict.
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  for (const char* sample : {"rolloutcore_restores_total{outcome=\"refused\"} 1\n",
                             "rolloutcore_restores_total{outcome=\"invalid\"} 1\n",
                             "rolloutcore_restores_total{outcome=\"conflict\"} 0\n"}) {
    EXPECT_NE(m->body.find(sample), std::string::npos) << sample << m->body;
  }
}

// Proves re-adoption, and that the monitor still watches after restores: the engine restarts
// outside RolloutCore (the monitor taints: another process answers); adopting it as a version whose
// digest it does not have stays TAINTED, and adopting it as the version it does hold (the
// bootstrap's rc-0: a fresh engine holds the same initial weights) is committed without any reload.
// Would catch adopt skipping the digest proof, or an adoption refused only because the process
// changed.
TEST(RestoreApi, AdoptsARestartedEngineOnlyAsTheVersionItHolds) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  ASSERT_EQ(s.Update("u1", "rc-1", ckpt.v1)["http"], 200);
  ASSERT_TRUE(s.RestartEngine());
  ASSERT_TRUE(s.WaitForTaint(5000));
  EXPECT_EQ(s.svc->journal().state().taint->cause, Cause::kEngineReplaced);
  const std::uint64_t reloads = s.engine->RpcCount("reload_weights");

  const json wrong = s.Restore({{"restore_id", "a1"}, {"label", "rc-1"}, {"adopt", true}});
  EXPECT_EQ(wrong["http"], 500) << wrong.dump();
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kTainted);

  const json right = s.Restore({{"restore_id", "a2"}, {"label", "rc-0"}, {"adopt", true}});
  ASSERT_EQ(right["http"], 200) << right.dump();
  const State st = s.svc->journal().state();
  EXPECT_EQ(st.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(st.committed.label, "rc-0");
  EXPECT_EQ(s.engine->weight_label(), "rc-0");
  EXPECT_EQ(s.engine->RpcCount("reload_weights"), reloads) << "adopt reloaded weights";
  // The monitor watches the adopted process from now on: no second taint, until that process
  // is replaced too (a monitor whose observations the fold refuses as stale after a restore
  // would never see it).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kReady);
  ASSERT_TRUE(s.RestartEngine());
  ASSERT_TRUE(s.WaitForTaint(5000)) << "the monitor missed a restart after a restore";
  EXPECT_EQ(s.svc->journal().state().taint->cause, Cause::kEngineReplaced);
}

}  // namespace
}  // namespace rc::service
