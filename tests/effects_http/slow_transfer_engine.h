// A loopback engine for transfer deadline tests: every transfer route answers at once except the
// ones a test slows, so only a transfer's one deadline can end a call in time.
#pragma once

#include <atomic>
#include <string>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "tests/effects_http/test_servers.h"

namespace rc::testing {

inline constexpr int kStallMs = 30000;  // outlasts every deadline of these tests
inline constexpr char kSlowEngineGpu[] = "53e453ed-62c9-48db-8fed-1e8c25d98d47";

// The world size, the device report (the worker extension's rc_device_info over collective_rpc,
// one worker on kSlowEngineGpu), the init and the label read answer after the delays set; the
// label read names the process the engine runs as ("proc-<generation>").
struct SlowTransferEngine {
  ScriptedServer s;
  std::atomic<int> world_delay_ms{0}, device_delay_ms{0}, init_delay_ms{0}, label_delay_ms{0};
  std::atomic<int> generation{1};

  SlowTransferEngine() {
    Slowed("/get_world_size", world_delay_ms, R"({"world_size":1})");
    Slowed("/init_weight_transfer_engine", init_delay_ms, R"({"message":"ok"})");
    s.server().Post("/collective_rpc", [this](const httplib::Request&, httplib::Response& res) {
      s.SlowSleep(device_delay_ms.load());
      const nlohmann::json worker = {
          {"gpu_uuid", kSlowEngineGpu}, {"free_bytes", 1}, {"total_bytes", 2}};
      Answer(res, nlohmann::json{{"results", {worker}}}.dump());
    });
    s.server().Get("/weight_info", [this](const httplib::Request&, httplib::Response& res) {
      s.SlowSleep(label_delay_ms.load());
      const std::string instance = "proc-" + std::to_string(generation.load());
      Answer(res, nlohmann::json{{"weight_version", "rc-0"}, {"instance", instance}}.dump());
    });
    for (const char* path : {"/start_weight_update", "/update_weights", "/finish_weight_update"}) {
      s.server().Post(path, [](const httplib::Request&, httplib::Response& res) {
        Answer(res, R"({"message":"ok"})");
      });
    }
    s.Start();
  }

 private:
  static void Answer(httplib::Response& res, const std::string& body) {
    res.status = 200;
    res.set_content(body, "application/json");
  }
  // GET for the world size, POST for the init: as vLLM serves them.
  void Slowed(const char* path, std::atomic<int>& delay_ms, const char* body) {
    auto handler = [this, &delay_ms, body](const httplib::Request&, httplib::Response& res) {
      s.SlowSleep(delay_ms.load());
      Answer(res, body);
    };
    if (std::string(path) == "/get_world_size") {
      s.server().Get(path, handler);
    } else {
      s.server().Post(path, handler);
    }
  }
};

// Each call's own timeout is longer than the transfers' deadlines in these tests.
inline effects::EngineDeadlines SlowDeadlines() {
  effects::EngineDeadlines d;
  d.connect_timeout_ms = 500;
  d.call_timeout_ms = 5000;
  d.update_timeout_ms = 60000;
  d.drain_timeout_ms = 5000;
  return d;
}

}  // namespace rc::testing
