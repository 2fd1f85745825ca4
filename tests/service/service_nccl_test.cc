// `--transfer nccl` in serve, GPU-free: the configuration it needs is validated, and on a host
// that cannot run it (a build without CUDA, or CUDA compiled in but no GPU, as on CI) startup is
// refused at once with an error that says why, before the journal is opened or the engine called.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "effects/http/engine_client.h"
#include "fixtures/vllm_double.h"
#include "service/config.h"
#include "service/nccl_transfer.h"
#include "service/service.h"
#include "tests/service/serve_process.h"

#ifdef RC_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace rc::service {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Generous: the refusal is local (no network, no rendezvous); only a hang could come near it.
constexpr auto kStartupRefusalMax = std::chrono::seconds(30);

fs::path FreshDir(const std::string& tag) {
  static int n = 0;
  fs::path d = fs::temp_directory_path() / ("rc-svc-nccl-" + tag + "-" +
                                            std::to_string(::getpid()) + "-" + std::to_string(n++));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

ServeConfig NcclConfig(const std::string& engine_url, const fs::path& dir) {
  ServeConfig c;
  c.engine_url = engine_url;
  c.journal_path = (dir / "journal").string();
  c.listen_port = 0;
  c.initial_source = "synthetic:4x64";
  c.transfer = "nccl";
  c.rendezvous = "127.0.0.1:0";
  c.nccl_init_timeout_ms = 5000;
  return c;
}

int CudaDeviceCount() {
#ifdef RC_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

// Proves a valid nccl configuration passes and each bad NCCL-related value is refused with a
// message naming the key; it would catch a bad rendezvous, device or buffer count reaching the
// sender (where it would fail late, or as an out-of-memory mid-update).
TEST(ServiceNcclConfig, BadNcclValuesAreRefusedByName) {
  ServeConfig ok = NcclConfig("http://127.0.0.1:1", FreshDir("cfg"));
  ok.rendezvous = "10.0.0.7:29500";
  ASSERT_TRUE(ValidateConfig(ok).ok()) << ValidateConfig(ok).ToString();
  struct Case {
    const char* what;
    std::function<void(ServeConfig&)> tweak;
    const char* expect;  // in the message
  };
  const std::vector<Case> cases = {
      {"no rendezvous", [](ServeConfig& c) { c.rendezvous = ""; }, "rendezvous"},
      {"rendezvous without port", [](ServeConfig& c) { c.rendezvous = "10.0.0.7"; }, "HOST:PORT"},
      {"rendezvous port too big", [](ServeConfig& c) { c.rendezvous = "h:65536"; }, "port"},
      {"rendezvous port not a number", [](ServeConfig& c) { c.rendezvous = "h:29x"; }, "port"},
      {"rendezvous empty host", [](ServeConfig& c) { c.rendezvous = ":29500"; }, "host"},
      {"rendezvous bare IPv6", [](ServeConfig& c) { c.rendezvous = "::1:29500"; }, "IPv6"},
      {"negative device", [](ServeConfig& c) { c.cuda_device = -1; }, "cuda_device"},
      {"device too large", [](ServeConfig& c) { c.cuda_device = 5000; }, "cuda_device"},
      {"zero buffer", [](ServeConfig& c) { c.packed_buffer_size_bytes = 0; },
       "packed_buffer_size_bytes"},
      {"huge buffer", [](ServeConfig& c) { c.packed_buffer_size_bytes = std::uint64_t{1} << 40; },
       "packed_buffer_size_bytes"},
      {"no buffers", [](ServeConfig& c) { c.packed_num_buffers = 0; }, "packed_num_buffers"},
      {"too many buffers", [](ServeConfig& c) { c.packed_num_buffers = 65; }, "packed_num_buffers"},
      {"world size 1", [](ServeConfig& c) { c.nccl_world_size = 1; }, "nccl_world_size"},
      {"zero init deadline", [](ServeConfig& c) { c.nccl_init_timeout_ms = 0; },
       "nccl_init_timeout_ms"},
      {"reserve eats the init deadline",
       [](ServeConfig& c) { c.nccl_abort_reserve_ms = c.nccl_init_timeout_ms; },
       "nccl_abort_reserve_ms"},
      {"reserve eats the transfer deadline",
       [](ServeConfig& c) { c.transfer_timeout_ms = c.nccl_abort_reserve_ms; },
       "nccl_abort_reserve_ms"},
  };
  for (const auto& k : cases) {
    ServeConfig c = ok;
    k.tweak(c);
    Status st = ValidateConfig(c);
    EXPECT_FALSE(st.ok()) << k.what;
    EXPECT_NE(st.message().find(k.expect), std::string::npos) << k.what << ": " << st.ToString();
  }
  auto v6 = ParseHostPort("[::1]:29500");
  ASSERT_TRUE(v6.ok()) << v6.status().ToString();
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 29500);
  auto eph = ParseHostPort("trainer-0.local:0");
  ASSERT_TRUE(eph.ok());
  EXPECT_EQ(eph->port, 0);
  // The JSON config file takes the same keys.
  ServeConfig j = ok;
  const Status merged =
      MergeConfigJson(nlohmann::json::parse(R"({"cuda_device": 1, "nccl_abort_reserve_ms": 2000,
                                "nccl_init_timeout_ms": 60000, "nccl_world_size": 2})"),
                      j);
  ASSERT_TRUE(merged.ok()) << merged.ToString();
  EXPECT_EQ(j.cuda_device, 1);
  EXPECT_EQ(j.nccl_abort_reserve_ms, 2000u);
  EXPECT_FALSE(MergeConfigJson(nlohmann::json{{"cuda_device", "0"}}, j).ok());
}

// Proves the startup log's record of a ready NCCL sender stays one line of printable text
// whatever the engine's GET /version said and whatever the configuration names: outside text is
// escaped. Catches the engine's protocol line logged raw, where a /version with a newline split
// the record and could forge another.
TEST(ServiceNcclLog, TheReadyRecordEscapesTheEnginesVersion) {
  const NcclEngine engine{"e\n1", "http://127.0.0.1:1/\r\n", HostPort{"rv\nhost", 29500}};
  const ServeConfig config;
  const std::string line = NcclReadyLine(DescribeNcclEngine(engine, config),
                                         "0.30.0\n[2026-01-01 00:00:00.000] [critical] forged",
                                         "tcp_store", 29500, 1000);
  for (const char c : line) EXPECT_GE(static_cast<unsigned char>(c), 0x20) << line;
  EXPECT_NE(line.find("0.30.0"), std::string::npos) << line;
  EXPECT_NE(line.find("forged"), std::string::npos) << line;
}

// Proves Service::Open with transfer nccl on a host without a usable GPU (or a build without
// CUDA) fails promptly with an error naming the cause, and opens no journal and calls no engine
// route; it would catch a hang in device or rendezvous setup, a half-started service (journal
// bootstrapped, engine initialised) left behind by a refused start, or a vague error.
TEST(ServiceNccl, StartupWithoutUsableGpuIsRefusedBeforeAnythingStarts) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present: this test is for GPU-free hosts";
  fixtures::VllmDoubleOptions eo;
  eo.worker_extension_cls = effects::kWorkerExtensionClass;  // vLLM 0.25.1 (the default)
  fixtures::VllmDouble engine(eo);
  ASSERT_GT(engine.Start(0), 0);
  const fs::path dir = FreshDir("open");
  const ServeConfig c = NcclConfig(engine.base_url(), dir);
  const auto t0 = Clock::now();
  auto opened = Service::Open(c);
  const auto took = Clock::now() - t0;
  ASSERT_FALSE(opened.ok()) << "serve started with --transfer nccl and no GPU";
  const std::string msg = opened.status().ToString();
#ifdef RC_HAVE_CUDA
  EXPECT_NE(msg.find("CUDA device 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not usable"), std::string::npos) << msg;
#else
  EXPECT_NE(msg.find("built without"), std::string::npos) << msg;
#endif
  EXPECT_LT(took, kStartupRefusalMax);
  EXPECT_FALSE(fs::exists(c.journal_path)) << "journal opened by a refused start";
  for (const char* route : {"/version", "/init_weight_transfer_engine", "/get_world_size"}) {
    EXPECT_EQ(engine.RouteCount(route), 0u) << route;
  }
  engine.Stop();
  fs::remove_all(dir);
}

// Proves a fleet with transfer nccl (a communicator per engine) is refused on such a host as one
// engine is, before its journal is opened or any engine asked to rendezvous; catches a fleet
// that half-starts members before finding it cannot send to any of them.
TEST(ServiceNccl, AFleetIsRefusedBeforeAnythingStarts) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present: this test is for GPU-free hosts";
  fixtures::VllmDouble a, b;
  ASSERT_GT(a.Start(0), 0);
  ASSERT_GT(b.Start(0), 0);
  const fs::path dir = FreshDir("fleet");
  ServeConfig c = NcclConfig("", dir);
  c.engines = {{"a", a.base_url()}, {"b", b.base_url()}};
  ASSERT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
  auto opened = Service::Open(c);
  ASSERT_FALSE(opened.ok());
  EXPECT_FALSE(fs::exists(c.journal_path)) << "journal opened by a refused start";
  for (fixtures::VllmDouble* e : {&a, &b}) {
    EXPECT_EQ(e->RouteCount("/version"), 0u);
    EXPECT_EQ(e->RouteCount("/init_weight_transfer_engine"), 0u);
    e->Stop();
  }
  fs::remove_all(dir);
}

// Runs `rolloutcore serve` with args; stdout+stderr into one string; killed at `limit`.
using ProcessRun = stack::ServeRun;
ProcessRun RunServe(const std::vector<std::string>& args, Clock::duration limit) {
  const fs::path out = FreshDir("cli") / "out.txt";
  ProcessRun r = stack::RunServeProcess(RC_TEST_ROLLOUTCORE_BIN, args, out, limit);
  fs::remove_all(out.parent_path());
  return r;
}

// Proves the `rolloutcore serve --transfer nccl` process exits non-zero within the bound, never
// prints "listening on", and says on stderr why (no rendezvous; no CUDA build; no usable GPU);
// it would catch a CLI that ignores the flags, hangs in CUDA or NCCL setup, or half-starts.
TEST(ServiceNccl, ServeProcessRefusesNcclClearly) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present: this test is for GPU-free hosts";
  fixtures::VllmDoubleOptions eo;
  eo.worker_extension_cls = effects::kWorkerExtensionClass;  // vLLM 0.25.1 (the default)
  fixtures::VllmDouble engine(eo);
  ASSERT_GT(engine.Start(0), 0);
  const fs::path dir = FreshDir("proc");
  const std::vector<std::string> base = {"--engine-url",     engine.base_url(),
                                         "--journal",        (dir / "journal").string(),
                                         "--port",           "0",
                                         "--initial-source", "synthetic:4x64",
                                         "--transfer",       "nccl"};

  ProcessRun missing = RunServe(base, kStartupRefusalMax);
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("needs rendezvous HOST:PORT"), std::string::npos) << missing.output;

  std::vector<std::string> full = base;
  for (const char* a :
       {"--rendezvous", "127.0.0.1:0", "--cuda-device", "0", "--packed-buffer-size-bytes",
        "268435456", "--packed-num-buffers", "2", "--nccl-init-timeout-ms", "5000"}) {
    full.emplace_back(a);
  }
  ProcessRun refused = RunServe(full, kStartupRefusalMax);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_EQ(refused.output.find("listening on"), std::string::npos) << refused.output;
#ifdef RC_HAVE_CUDA
  EXPECT_NE(refused.output.find("CUDA device 0 is not usable"), std::string::npos)
      << refused.output;
#else
  EXPECT_NE(refused.output.find("built without"), std::string::npos) << refused.output;
#endif
  EXPECT_LT(refused.took, kStartupRefusalMax);
  EXPECT_FALSE(fs::exists(dir / "journal"));
  EXPECT_EQ(engine.RouteCount("/init_weight_transfer_engine"), 0u);
  engine.Stop();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rc::service
