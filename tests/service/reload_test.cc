// `serve` with transfer "reload" against the vLLM double, which loads checkpoints from its own
// disk as vLLM's reload_weights does: updates commit end to end with the engine's digest of the
// reloaded weights, an earlier checkpoint restores an earlier digest, and a reload that fails
// half-way taints. Real journal, loopback HTTP.
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

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

constexpr const char* kToken = "reload-token";

struct Stack : stack::ServiceStack {
  explicit Stack(const std::string& initial_file) : ServiceStack(Options(initial_file)) {}
  static stack::StackOptions Options(const std::string& initial_file) {
    stack::StackOptions o;
    o.token = kToken;
    o.dir_prefix = "rc-reload";
    o.tweak = [initial_file](ServeConfig& c) {
      c.transfer = "reload";
      c.initial_source = "safetensors:" + initial_file;
    };
    return o;
  }
  json Update(const std::string& id, const std::string& label, const std::string& file, int step,
              const std::string& expected = "") {
    Result<std::string> manifest = effects::nccl::SourceManifestDigest("safetensors:" + file);
    RC_CHECK(manifest.ok());
    json body = {
        {"update_id", id},
        {"target_label", label},
        {"identity",
         {{"manifest_digest", *manifest}, {"checkpoint", file}, {"run", "run-a"}, {"step", step}}},
        {"source", "safetensors:" + file}};
    if (!expected.empty()) body["expected_digest"] = expected;
    httplib::Client c = client();
    auto r = c.Post("/v1/updates", stack::Bearer(kToken), body.dump(), "application/json");
    if (!r) return json{{"http", -1}};
    json out = json::parse(r->body, nullptr, false);
    if (!out.is_object()) out = json::object();
    out["http"] = r->status;
    return out;
  }
  std::string EngineDigest() {
    effects::EngineClient c(engine->base_url());
    return effects::ReadWeightDigest(c).combined;
  }
};

// Proves `serve --transfer reload` commits an update end to end (the engine reloads the
// checkpoint from its own disk, once), journals the engine's digest of the reloaded weights, and
// that reloading an earlier checkpoint restores that checkpoint's digest, checked by the
// trainer's expected_digest; would catch the reload transfer not being built for "reload", a
// commit on weights the engine never loaded, and a restore that cannot be verified.
TEST(ServiceReload, CommitsWithTheReloadedWeightsDigestAndRestores) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  const std::string boot = s.svc->journal().state().committed_digest.combined;
  ASSERT_FALSE(boot.empty());

  const json r1 = s.Update("u1", "rc-1", ckpt.v1, 1);
  ASSERT_EQ(r1["http"], 200) << r1.dump();
  EXPECT_EQ(r1.value("outcome", ""), "committed");
  EXPECT_EQ(s.engine->RpcCount("reload_weights"), 1u);
  EXPECT_EQ(s.engine->weight_label(), "rc-1");
  const State after = s.svc->journal().state();
  EXPECT_EQ(after.committed.label, "rc-1");
  EXPECT_EQ(after.committed_digest.combined, s.EngineDigest());
  EXPECT_NE(after.committed_digest.combined, boot);
  const std::string at_v1 = after.committed_digest.combined;

  ASSERT_EQ(s.Update("u2", "rc-2", ckpt.v2, 2)["http"], 200);
  EXPECT_NE(s.svc->journal().state().committed_digest.combined, at_v1);
  const json back = s.Update("u3", "rc-3", ckpt.v1, 3, at_v1);
  ASSERT_EQ(back["http"], 200) << back.dump();
  EXPECT_EQ(s.svc->journal().state().committed_digest.combined, at_v1);
  EXPECT_EQ(s.engine->RpcCount("reload_weights"), 3u);
}

// Proves a reload that fails after replacing half the checkpoint's tensors taints the update
// and publishes nothing; would catch a vLLM 500 from reload_weights read as "nothing changed",
// which would resume serving an engine holding half of the new checkpoint under the old label.
TEST(ServiceReload, AReloadFailingHalfWayTaints) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  s.engine->SetReloadFault(fixtures::ReloadFault::kFailMid);
  const json r = s.Update("u1", "rc-1", ckpt.v1, 1);
  EXPECT_EQ(r["http"], 500) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "tainted");
  EXPECT_NE(r.value("reason", "").find("reload_weights"), std::string::npos) << r.dump();
  EXPECT_EQ(s.svc->journal().state().committed.label, "rc-0");
}

// Proves a checkpoint the engine would not load as declared (its directory holds another
// checkpoint file, which vLLM's loader would read too) is refused at preflight and the engine
// resumes without any call to reload_weights; would catch an update that drains the engine and
// loads more than the trainer declared.
TEST(ServiceReload, ACheckpointTheEngineWouldLoadDifferentlyIsRefused) {
  Checkpoints ckpt;
  Stack s(ckpt.v0);
  std::filesystem::copy_file(ckpt.v2, ckpt.dir / "v1" / "extra.safetensors");
  const json r = s.Update("u1", "rc-1", ckpt.v1, 1);
  EXPECT_EQ(r["http"], 422) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "refused");
  EXPECT_NE(r.value("reason", "").find("loads a directory"), std::string::npos) << r.dump();
  EXPECT_EQ(s.engine->RpcCount("reload_weights"), 0u);
  EXPECT_EQ(s.svc->journal().state().committed.label, "rc-0");
}

}  // namespace
}  // namespace rc::service
