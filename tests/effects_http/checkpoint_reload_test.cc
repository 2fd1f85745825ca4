// CheckpointReload against the vLLM double (which reads the checkpoint from disk as vLLM 0.25.1's
// reload_weights does) and against scripted engines for the exact failure shapes: the manifest
// digest the engine reports for the same files as the C++, every fault's mutation class, the
// refusals that send nothing to reload_weights, and the deadline.
#include "effects/http/checkpoint_reload.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>

#include "effects/http/weight_digest.h"
#include "effects/nccl/weight_source.h"
#include "fixtures/vllm_double.h"
#include "tests/effects_http/test_servers.h"

namespace rc::effects {
namespace {

using nlohmann::json;
using rc::testing::RawServer;
using rc::testing::ScriptedServer;
using SteadyClock = std::chrono::steady_clock;

struct Tensor {
  std::string name;
  std::string dtype;  // safetensors name
  std::vector<std::uint64_t> shape;
};

std::uint64_t ItemSize(const std::string& dtype) {
  return dtype == "F32" ? 4 : dtype == "I64" ? 8 : dtype == "U8" ? 1 : 2;
}

// A safetensors file holding `tensors` in this data order, every byte of tensor i = fill + i.
void WriteSafetensors(const std::filesystem::path& path, const std::vector<Tensor>& tensors,
                      int fill) {
  json header = json::object();
  std::string data;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    std::uint64_t n = ItemSize(tensors[i].dtype);
    for (std::uint64_t d : tensors[i].shape) n *= d;
    header[tensors[i].name] = {{"dtype", tensors[i].dtype},
                               {"shape", tensors[i].shape},
                               {"data_offsets", {data.size(), data.size() + n}}};
    data.append(n, static_cast<char>(fill + static_cast<int>(i)));
  }
  const std::string h = header.dump();
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((h.size() >> (8 * i)) & 0xFF);
  std::ofstream(path, std::ios::binary) << len << h << data;
}

const std::vector<Tensor> kLayers = {{"model.layers.0.weight", "BF16", {4, 4}},
                                     {"model.layers.1.weight", "BF16", {4, 4}},
                                     {"model.layers.2.weight", "BF16", {4, 4}},
                                     {"model.layers.3.weight", "BF16", {4, 4}}};

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/rc_reload_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  // A checkpoint directory `name` holding one model.safetensors of the four layers.
  std::filesystem::path Checkpoint(const std::string& name, int fill) const {
    const std::filesystem::path dir = path / name;
    std::filesystem::create_directories(dir);
    WriteSafetensors(dir / "model.safetensors", kLayers, fill);
    return dir;
  }
};

EngineDeadlines Fast() {
  EngineDeadlines d;
  d.connect_timeout_ms = 500;
  d.call_timeout_ms = 3000;
  d.update_timeout_ms = 3000;
  d.drain_timeout_ms = 3000;
  return d;
}

TransferTarget Target(const std::string& uri, const std::string& manifest_digest = "") {
  TransferTarget t;
  t.update_id = "u1";
  t.target = WeightVersion{1, "rc-1"};
  t.identity.manifest_digest = manifest_digest;
  t.source_uri = uri;
  return t;
}

// The vLLM double (0.25.1, the worker extension on) and a client of it.
struct Double {
  fixtures::VllmDouble engine;
  EngineClient client;
  CheckpointReload reload;
  explicit Double(const std::string& load_format = "auto", const std::string& version = "0.25.1")
      : engine(Options(load_format, version)), client(Url(engine), Fast()), reload(client) {}
  static fixtures::VllmDoubleOptions Options(const std::string& load_format,
                                             const std::string& version) {
    fixtures::VllmDoubleOptions o;
    o.worker_extension_cls = kWorkerExtensionClass;
    o.load_format = load_format;
    o.version = version;
    return o;
  }
  static std::string Url(fixtures::VllmDouble& d) {
    RC_CHECK(d.Start(0) > 0);
    return d.base_url();
  }
  std::string Digest() { return ReadWeightDigest(client).combined; }
  std::map<std::string, std::string> TensorDigests() {
    std::map<std::string, std::string> out;
    for (const TensorDigest& t : ReadWeightDigest(client).tensors) out[t.name] = t.digest;
    return out;
  }
};

std::string Uri(const std::filesystem::path& p) { return "safetensors:" + p.string(); }

// Proves the engine's preflight digest is the C++ manifest digest of the same files (one file,
// the directory holding it, and a sharded directory as the concatenation of its shards in name
// order), with nothing sent to reload_weights; would catch a preflight that refuses every real
// update because the engine digests another layout than the trainer declares.
TEST(CheckpointReload, PreflightDigestIsTheCppDigestOfTheSameFiles) {
  TempDir tmp;
  Double d;
  const std::filesystem::path dir = tmp.Checkpoint("v1", 1);
  const std::string file = (dir / "model.safetensors").string();
  Result<std::string> cpp = nccl::SourceManifestDigest("safetensors:" + file);
  ASSERT_TRUE(cpp.ok()) << cpp.status().ToString();
  const PreflightObserved by_file = d.reload.Preflight(Target("safetensors:" + file));
  EXPECT_EQ(by_file.source_manifest_digest, *cpp) << by_file.detail;
  EXPECT_EQ(d.reload.Preflight(Target(Uri(dir))).source_manifest_digest, *cpp);
  EXPECT_TRUE(by_file.device_ok && by_file.memory_ok);
  EXPECT_NE(by_file.detail.find("4 tensors, 128 bytes in 1 files"), std::string::npos)
      << by_file.detail;

  const std::filesystem::path sharded = tmp.path / "sharded";
  std::filesystem::create_directories(sharded);
  WriteSafetensors(sharded / "b.safetensors", {{"x.1", "F32", {3}}}, 0);
  WriteSafetensors(sharded / "a.safetensors", {{"x.0", "U8", {5}}, {"x.2", "I64", {}}}, 0);
  Manifest joined;
  for (const char* f : {"a.safetensors", "b.safetensors"}) {
    Result<nccl::SafetensorsIndex> index = nccl::ReadSafetensorsIndex((sharded / f).string());
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    for (const TensorSpec& t : index->manifest.tensors) joined.tensors.push_back(t);
  }
  EXPECT_EQ(d.reload.Preflight(Target(Uri(sharded))).source_manifest_digest, joined.digest());
  EXPECT_EQ(d.engine.RpcCount("reload_weights"), 0u);
}

// Proves a transfer reloads the checkpoint (the engine's weights and digest change), labels the
// engine, reports the checkpoint's bytes and tensors, and that reloading an earlier checkpoint
// gives its digest back; would catch a reload that acknowledges without loading, and a restore
// to an earlier version that cannot be verified against the digest that version had.
TEST(CheckpointReload, ReloadLoadsLabelsAndRestores) {
  TempDir tmp;
  Double d;
  const std::string v1 = Uri(tmp.Checkpoint("v1", 1));
  const std::string v2 = Uri(tmp.Checkpoint("v2", 2));
  const std::string before = d.Digest();
  const PreflightObserved p = d.reload.Preflight(Target(v1));
  const TransferObserved t = d.reload.Transfer(Target(v1, p.source_manifest_digest), 5000);
  EXPECT_EQ(t.mutation, MutationClass::kComplete) << t.error;
  EXPECT_TRUE(t.acknowledged);
  EXPECT_EQ(t.bytes_sent, 128u);
  EXPECT_EQ(t.tensors_sent, 4u);
  EXPECT_EQ(t.finish_label, "rc-1");
  EXPECT_EQ(d.engine.weight_label(), "rc-1");
  EXPECT_EQ(d.engine.RpcCount("reload_weights"), 1u);
  const std::string at_v1 = d.Digest();
  EXPECT_NE(at_v1, before);
  ASSERT_EQ(d.reload.Transfer(Target(v2), 5000).mutation, MutationClass::kComplete);
  EXPECT_NE(d.Digest(), at_v1);
  ASSERT_EQ(d.reload.Transfer(Target(v1), 5000).mutation, MutationClass::kComplete);
  EXPECT_EQ(d.Digest(), at_v1) << "the same checkpoint gives the same weights again";
}

// Proves that on a line with label routes (>= 0.26 in the double) the label is set through
// POST /update_weight_version, since reload_weights has no update to finish; would catch a
// reload that calls /finish_weight_update there, which fails with no update in progress.
TEST(CheckpointReload, LaterLinesSetTheLabelThroughTheirRoute) {
  TempDir tmp;
  Double d("auto", "0.30.0");
  const TransferObserved t = d.reload.Transfer(Target(Uri(tmp.Checkpoint("v1", 1))), 5000);
  EXPECT_EQ(t.mutation, MutationClass::kComplete) << t.error;
  EXPECT_EQ(d.engine.weight_label(), "rc-1");
  EXPECT_EQ(d.engine.RouteCount("/update_weight_version"), 1u);
  EXPECT_EQ(d.engine.RouteCount("/finish_weight_update"), 0u);
}

// Proves an engine on --load-format dummy, a missing path, a file beside other checkpoint files
// and a non-safetensors URI are refused at preflight with the reason, and that a transfer of
// them sends nothing to reload_weights (kNone); would catch a transfer that starts vLLM's
// layerwise reload on a checkpoint it cannot load, leaving the model taken apart.
TEST(CheckpointReload, RefusalsSendNothingToReloadWeights) {
  TempDir tmp;
  const std::string v1 = Uri(tmp.Checkpoint("v1", 1));
  WriteSafetensors(tmp.path / "v1" / "other.safetensors", {{"y", "U8", {1}}}, 0);
  Double dummy("dummy");
  Double d;
  struct Case {
    Double* engine;
    std::string uri;
    std::string why;
  };
  for (const Case& c : {Case{&dummy, Uri(tmp.path / "v2"), "dummy"},
                        Case{&d, Uri(tmp.path / "missing"), "no such file"},
                        Case{&d, v1 + "/model.safetensors", "loads a directory"},
                        Case{&d, "synthetic:4x64", "safetensors:/path"}}) {
    const PreflightObserved p = c.engine->reload.Preflight(Target(c.uri));
    EXPECT_TRUE(p.source_manifest_digest.empty()) << c.uri;
    EXPECT_NE(p.detail.find(c.why), std::string::npos) << c.uri << ": " << p.detail;
    const TransferObserved t = c.engine->reload.Transfer(Target(c.uri), 5000);
    EXPECT_EQ(t.mutation, MutationClass::kNone) << c.uri << ": " << t.error;
    EXPECT_FALSE(t.acknowledged);
    EXPECT_NE(t.error.find(c.why), std::string::npos) << c.uri << ": " << t.error;
  }
  EXPECT_EQ(dummy.engine.RpcCount("reload_weights"), 0u);
  EXPECT_EQ(d.engine.RpcCount("reload_weights"), 0u);
}

// Proves a checkpoint whose manifest is no longer the declared one at transfer time is refused
// without calling reload_weights; would catch a checkpoint rewritten between preflight and
// transfer being loaded under the identity of the one that was checked.
TEST(CheckpointReload, ACheckpointChangedSincePreflightIsNotLoaded) {
  TempDir tmp;
  Double d;
  const std::filesystem::path dir = tmp.Checkpoint("v1", 1);
  const std::string declared = d.reload.Preflight(Target(Uri(dir))).source_manifest_digest;
  WriteSafetensors(dir / "model.safetensors", {{"model.layers.0.weight", "F32", {4}}}, 1);
  const TransferObserved t = d.reload.Transfer(Target(Uri(dir), declared), 5000);
  EXPECT_EQ(t.mutation, MutationClass::kNone) << t.error;
  EXPECT_NE(t.error.find("not the declared"), std::string::npos) << t.error;
  EXPECT_EQ(d.engine.RpcCount("reload_weights"), 0u);
}

// Proves each reload fault of the double is classified as the engine may have changed:
// fail_before (nothing changed) and fail_mid (half changed) are kPossible, because vLLM's 500
// looks the same either way; would catch a 500 read as "nothing happened" (kNone), which would
// resume serving on an engine that holds half of a checkpoint.
TEST(CheckpointReload, EveryReloadFailureIsPossible) {
  TempDir tmp;
  const std::string v1 = Uri(tmp.Checkpoint("v1", 1));
  for (auto fault : {fixtures::ReloadFault::kFailBefore, fixtures::ReloadFault::kFailMid}) {
    Double d;
    const std::map<std::string, std::string> before = d.TensorDigests();
    d.engine.SetReloadFault(fault);
    const TransferObserved t = d.reload.Transfer(Target(v1), 5000);
    EXPECT_EQ(t.mutation, MutationClass::kPossible) << t.error;
    EXPECT_FALSE(t.acknowledged);
    EXPECT_NE(t.error.find("reload_weights: transport=ok status=500"), std::string::npos)
        << t.error;
    EXPECT_EQ(d.engine.weight_label(), "default") << "no label after a failed reload";
    const std::map<std::string, std::string> after = d.TensorDigests();
    int changed = 0;
    for (const auto& [name, digest] : after) changed += before.at(name) != digest;
    EXPECT_EQ(changed, fault == fixtures::ReloadFault::kFailMid ? 2 : 0);
  }
}

// Proves a reload that hangs returns by the transfer deadline as kPossible, and that the engine
// may finish the reload after the caller gave up; would catch a transfer that blocks past its
// deadline, or one that calls a timed-out reload "no mutation".
TEST(CheckpointReload, HangHonoursTheDeadline) {
  TempDir tmp;
  Double d;
  const std::string v1 = Uri(tmp.Checkpoint("v1", 1));
  const std::string before = d.Digest();
  d.engine.SetReloadFault(fixtures::ReloadFault::kHang);
  const auto t0 = SteadyClock::now();
  const TransferObserved t = d.reload.Transfer(Target(v1), 400);
  const auto took_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - t0).count();
  EXPECT_EQ(t.mutation, MutationClass::kPossible) << t.error;
  EXPECT_NE(t.error.find("transport=timeout"), std::string::npos) << t.error;
  EXPECT_LT(took_ms, 1400);
  d.engine.SetReloadFault(fixtures::ReloadFault::kNone);
  d.engine.ReleaseHangs();  // the engine goes on with the reload nobody waits for
  for (int i = 0; i < 200 && d.Digest() == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_NE(d.Digest(), before);
}

// Reads one whole request (head and Content-Length body), so that closing the socket afterwards
// cannot reset a response the client has yet to read.
void ReadRequest(int fd) {
  std::string got;
  char buf[4096];
  std::size_t want = std::string::npos;
  while (want == std::string::npos || got.size() < want) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    got.append(buf, static_cast<std::size_t>(n));
    const std::size_t head = got.find("\r\n\r\n");
    const std::size_t cl = got.find("Content-Length: ");
    if (head != std::string::npos && cl != std::string::npos && cl < head) {
      want = head + 4 + std::stoul(got.substr(cl + 16));
    }
  }
}

// A scripted engine: rc_checkpoint_manifest answers a valid manifest; `reload` and `label`
// answer reload_weights and rc_set_weight_version.
struct Scripted {
  ScriptedServer s;
  std::atomic<int> reloads{0};
  std::function<void(httplib::Response&)> reload, label;
  Scripted() {
    s.server().Post("/collective_rpc", [this](const httplib::Request& req, auto& res) {
      const json body = json::parse(req.body, nullptr, false);
      const std::string method = body.value("method", "");
      if (method == kCheckpointManifestMethod) return Manifest(res);
      if (method == kReloadWeightsMethod) {
        ++reloads;
        return reload(res);
      }
      label(res);
    });
  }
  static void Manifest(httplib::Response& res) {
    res.set_content(json{{"results",
                          {{{"manifest_digest", std::string(64, 'a')},
                            {"tensors", 2},
                            {"bytes", 64},
                            {"files", 1},
                            {"weights_path", "/ckpt/v1"},
                            {"load_format", "auto"},
                            {"error", ""}}}}}
                        .dump(),
                    "application/json");
  }
};

// Proves the classification at the edges the double cannot script: reload_weights refused at
// connect (the engine went away after the manifest) is kNone, a broken connection, vLLM's 500
// body (control bytes escaped, length bounded) and an unexpected 2xx body are kPossible, and a
// label that cannot be set after a good reload is kPossible; would catch any "maybe" that is
// reported as "nothing happened", and engine bytes reaching the journal unescaped.
TEST(CheckpointReload, ClassificationAtTheEdges) {
  const TransferTarget target = Target("safetensors:/ckpt/v1");
  {  // the listener closes while the manifest is answered: reload_weights never connects
    ScriptedServer s;
    s.server().Post("/collective_rpc", [&s](const httplib::Request&, auto& res) {
      s.server().stop();
      Scripted::Manifest(res);
    });
    s.Start();
    EngineClient client(s.url(), Fast());
    const TransferObserved t = CheckpointReload(client).Transfer(target, 3000);
    EXPECT_EQ(t.mutation, MutationClass::kNone) << t.error;
    EXPECT_NE(t.error.find("transport=connect_failed"), std::string::npos) << t.error;
  }
  std::atomic<int> connections{0};
  RawServer broken([&connections](int fd) {
    ReadRequest(fd);
    if (connections++ > 0) return;  // reload_weights: dropped unanswered
    const std::string body = json{
        {"results",
         {{{"manifest_digest", std::string(64, 'b')},
           {"tensors", 1},
           {"bytes", 2},
           {"files", 1},
           {"weights_path", "/ckpt"},
           {"load_format", "auto"},
           {"error", ""}}}}}.dump();
    RawServer::Send(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
                            std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
  });
  {
    EngineClient client(broken.url(), Fast());
    const TransferObserved t = CheckpointReload(client).Transfer(target, 3000);
    EXPECT_EQ(t.mutation, MutationClass::kPossible) << t.error;
    EXPECT_NE(t.error.find("transport=broken"), std::string::npos) << t.error;
  }
  const std::string vllm_500 = json{
      {"error",
       {{"message", "Call to collective_rpc method failed: Worker failed with error '\x1b[31m" +
                        std::string(6000, 'x') + "'"},
        {"type", "InternalServerError"},
        {"param", nullptr},
        {"code", 500}}}}.dump();
  struct Case {
    std::function<void(httplib::Response&)> reload, label;
    const char* expected;
  };
  const auto ok = [](httplib::Response& res) {
    res.set_content(R"({"results": [null]})", "application/json");
  };
  const auto fail = [&vllm_500](httplib::Response& res) {
    res.status = 500;
    res.set_content(vllm_500, "application/json");
  };
  const auto odd = [](httplib::Response& res) {
    res.set_content(R"({"results": [{"loaded": 2}]})", "application/json");
  };
  for (const Case& c : {Case{fail, ok, "status=500"}, Case{odd, ok, "not vLLM's"},
                        Case{ok, fail, "weights reloaded, label not set"}}) {
    Scripted e;
    e.reload = c.reload;
    e.label = c.label;
    e.s.Start();
    EngineClient client(e.s.url(), Fast());
    client.set_label_route(LabelRoute::kWorkerRpc);
    const TransferObserved t = CheckpointReload(client).Transfer(target, 3000);
    EXPECT_EQ(t.mutation, MutationClass::kPossible) << t.error;
    EXPECT_NE(t.error.find(c.expected), std::string::npos) << t.error;
    EXPECT_EQ(t.error.find('\x1b'), std::string::npos) << "engine bytes are escaped";
    EXPECT_LE(t.error.size(), 2 * kEngineErrorBytesMax);
    EXPECT_EQ(e.reloads.load(), 1) << "reload_weights is sent once";
  }
}

// Proves the manifest reply is read defensively: workers that disagree, a worker's error (escaped
// and bounded), a malformed digest, an empty checkpoint and load_format dummy are refusals, and
// reload_weights' success is exactly one null per worker; would catch a preflight that trusts
// whatever the first worker says about a checkpoint the others see differently.
TEST(CheckpointReload, RepliesAreReadDefensively) {
  const json good = {{"manifest_digest", std::string(64, 'c')},
                     {"tensors", 3},
                     {"bytes", 9},
                     {"files", 1},
                     {"weights_path", "/c"},
                     {"load_format", "safetensors"},
                     {"error", ""}};
  Result<CheckpointManifest> m = ParseCheckpointManifestReply(json{{"results", {good, good}}});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tensors, 3u);
  EXPECT_EQ(m->weights_path, "/c");
  json other = good;
  other["manifest_digest"] = std::string(64, 'd');
  json failing = good;
  failing["error"] = "bad\n" + std::string(5000, 'e');
  json bad_digest = good;
  bad_digest["manifest_digest"] = "ABC";
  json empty = good;
  empty["tensors"] = 0;
  json dummy = good;
  dummy["load_format"] = "dummy";
  for (const json& body :
       {json{{"results", {good, other}}}, json{{"results", {failing}}},
        json{{"results", {bad_digest}}}, json{{"results", {empty}}}, json{{"results", {dummy}}},
        json{{"results", json::array()}}, json{{"results", "x"}}, json::array()}) {
    Result<CheckpointManifest> r = ParseCheckpointManifestReply(body);
    EXPECT_FALSE(r.ok()) << body.dump().substr(0, 200);
    if (!r.ok()) {
      EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
      EXPECT_LE(r.status().message().size(), kEngineErrorBytesMax + 200);
    }
  }
  EXPECT_TRUE(ReloadAnswered(json{{"results", {nullptr, nullptr}}}));
  EXPECT_FALSE(ReloadAnswered(json{{"results", json::array()}}));
  EXPECT_FALSE(ReloadAnswered(json{{"results", {nullptr, 1}}}));
  EXPECT_FALSE(ReloadAnswered(json::object()));
}

}  // namespace
}  // namespace rc::effects
