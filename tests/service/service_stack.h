// The service tests' world: a real Service (RocksDB journal in a private temporary directory,
// optionally over a fault-injecting Env) in front of an in-process vLLM double, over loopback.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "effects/http/sequence_transfer.h"
#include "fixtures/vllm_double.h"
#include "journal/testing/fault_env.h"
#include "service/service.h"

namespace rc::service::stack {

inline constexpr const char* kStackSource = "synthetic:4x64";

inline std::string SyntheticDigest(const std::string& uri) {
  auto m = effects::synthetic_manifest(uri);
  RC_CHECK(m.ok());
  return m->digest();
}

inline httplib::Headers Bearer(const std::string& token) {
  return {{"Authorization", "Bearer " + token}};
}

// The body of POST /v1/updates for `label` at `step`, from kStackSource seeded with the step:
// each step's checkpoint holds other bytes (one manifest), as a trainer's steps do, so the
// engine's weight digest changes with every update.
inline nlohmann::json UpdateBody(const std::string& id, const std::string& label, int step,
                                 const std::string& run) {
  return {{"update_id", id},
          {"target_label", label},
          {"identity",
           {{"manifest_digest", SyntheticDigest(kStackSource)},
            {"checkpoint", "ckpt-" + std::to_string(step)},
            {"run", run},
            {"step", step}}},
          {"source", std::string(kStackSource) + ":" + std::to_string(step)}};
}

struct StackOptions {
  std::string token;          // "" = the trainer routes need no token
  std::string run = "run-a";  // the initial identity's run
  std::string dir_prefix = "rc-svc";
  int token_delay_ms = 1;
  int engine_http_threads = 64;  // the double's concurrent requests
  int engine_max_model_len = 4096;
  bool fault_env = false;  // the journal over a journal::testing::FaultEnv
  // Applied last: a test's own settings (http_threads, deadlines, ...).
  std::function<void(ServeConfig&)> tweak;
  // Applied last to the engine double's options (colocated mode: the ipc backend, sleep mode).
  std::function<void(fixtures::VllmDoubleOptions&)> engine_tweak;
};

class ServiceStack {
 public:
  std::filesystem::path dir;
  std::unique_ptr<journal::testing::FaultEnv> faults;
  std::unique_ptr<fixtures::VllmDouble> engine;
  std::unique_ptr<Service> svc;

  explicit ServiceStack(StackOptions options) : options_(std::move(options)) {
    static int n = 0;
    dir = std::filesystem::temp_directory_path() /
          (options_.dir_prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    if (options_.fault_env) faults = std::make_unique<journal::testing::FaultEnv>();
    engine = std::make_unique<fixtures::VllmDouble>(EngineOptions());
    RC_CHECK(engine->Start(0) > 0);
    Open();
  }

  fixtures::VllmDoubleOptions EngineOptions() const {
    fixtures::VllmDoubleOptions eo;
    eo.worker_extension_cls = effects::kWorkerExtensionClass;  // vLLM 0.25.1 (the default)
    eo.token_delay_ms = options_.token_delay_ms;
    eo.http_threads = options_.engine_http_threads;
    eo.max_num_seqs = std::max(eo.max_num_seqs, options_.engine_http_threads);
    eo.max_model_len = options_.engine_max_model_len;
    if (options_.engine_tweak) options_.engine_tweak(eo);
    return eo;
  }

  // The engine process restarts on the same port: initial label, a new instance. Returns false
  // when the port could not be bound again.
  bool RestartEngine() {
    const int port = engine->port();
    engine->Stop();
    engine = std::make_unique<fixtures::VllmDouble>(EngineOptions());
    return engine->Start(port) == port;
  }
  ServiceStack(const ServiceStack&) = delete;
  ServiceStack& operator=(const ServiceStack&) = delete;

  ~ServiceStack() {
    if (svc && !svc->failed()) (void)svc->Shutdown(5000);
    svc.reset();
    if (engine) engine->Stop();
    std::filesystem::remove_all(dir);
  }

  ServeConfig Config() const {
    ServeConfig c;
    c.engine_url = engine->base_url();
    c.journal_path = (dir / "journal").string();
    c.listen_port = 0;
    c.auth_token = options_.token;
    c.initial_source = kStackSource;
    c.initial_checkpoint = "ckpt-0";
    c.initial_run = options_.run;
    c.initial_step = 0;
    c.engine_startup_timeout_ms = 10000;
    if (options_.tweak) options_.tweak(c);
    return c;
  }

  // Opens and starts the service; `extra` applies after the stack's own tweak (this open only).
  void Open(const std::function<void(ServeConfig&)>& extra = nullptr) {
    OpenWithoutStarting(extra);
    RC_CHECK(svc->Start().ok());
  }

  // Opens (recovers, bootstraps) without listening: the caller calls svc->Start(), which also
  // drives an update the last process left interrupted.
  void OpenWithoutStarting(const std::function<void(ServeConfig&)>& extra = nullptr) {
    ServeConfig c = Config();
    if (extra) extra(c);
    auto opened = Service::Open(c, faults ? faults->env() : nullptr);
    if (!opened.ok()) ADD_FAILURE() << opened.status().ToString();
    RC_CHECK(opened.ok());
    svc = std::move(opened.value());
  }

  // Like a crash: no Shutdown; the journal is closed by the destructor.
  void Kill() { svc.reset(); }

  httplib::Client client(int read_timeout_s = 120) const {
    httplib::Client c("127.0.0.1", svc->port());
    c.set_read_timeout(read_timeout_s, 0);
    c.set_write_timeout(30, 0);
    return c;
  }

 private:
  StackOptions options_;
};

// Installs (before Start) a step probe that, once `armed`, holds the first plan to take the slot
// there until `released` (10 s at most: never a hang); `holding` is set when it does.
inline void HoldNextPlanSlot(Service& svc, std::atomic<bool>& armed, std::atomic<bool>& holding,
                             std::atomic<bool>& released) {
  svc.set_step_probe([&armed, &holding, &released](const char* step) {
    if (!armed.load() || std::string(step) != "plan slot taken" || holding.exchange(true)) return;
    for (int i = 0; i < 1000 && !released.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
}

// The body budget's bytes held now (rolloutcore_http_body_memory_bytes).
inline std::uint64_t BodyMemoryUsed(const Service& svc) {
  const std::string metrics = svc.RenderMetrics();
  const std::string series = "\nrolloutcore_http_body_memory_bytes ";
  const std::size_t at = metrics.find(series);
  RC_CHECK(at != std::string::npos);
  return std::strtoull(metrics.c_str() + at + series.size(), nullptr, 10);
}

// Runs `fn` as it is destroyed: held by a handler posted to a stopped loop, it runs as that loop
// is destroyed.
class AtDestruction {
 public:
  explicit AtDestruction(std::function<void()> fn) : fn_(std::move(fn)) {}
  ~AtDestruction() { fn_(); }
  AtDestruction(const AtDestruction&) = delete;
  AtDestruction& operator=(const AtDestruction&) = delete;

 private:
  std::function<void()> fn_;
};

}  // namespace rc::service::stack
