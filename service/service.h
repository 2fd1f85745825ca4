// Service: the long-running executor behind `rolloutcore serve` — one per engine.
//
// It owns the journal, the runner (the only writer of lifecycle inputs) and the weight transfer,
// and serves over HTTP (cpp-httplib):
//   trainer API   /v1/state, /v1/version, /v1/updates, /v1/rollouts[/<id>], /v1/watch,
//                 /v1/events, /v1/manifest, /healthz           (docs/api.md)
//   proxy         /v1/completions, /v1/chat/completions, /inference/v1/generate: each request is
//                 admitted durably under the committed version before it reaches the engine,
//                 salted per version, and finished (or recorded aborted) when its response ends.
//   metrics       /metrics (Prometheus text)
//
// Thread model: every request runs on an httplib worker (bounded pool of http_threads). Runner
// calls (Recover, Bootstrap, Update) are serialised by update_mu_; admissions and finishes go
// straight to Journal::Submit + Wait (group commit), which decides them against the folded state
// under the journal's lock, so an admission can never slip past the start of a drain.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "effects/engine.h"
#include "effects/http/engine_client.h"
#include "effects/http/protocol.h"
#include "effects/http_engine.h"
#include "effects/runner.h"
#include "effects/transfer.h"
#include "journal/journal.h"
#include "service/config.h"
#include "service/connection_gate.h"  // proxy owner
#include "service/inflight_calls.h"   // proxy owner
#include "service/disconnect.h"
#include "service/metrics.h"
#include "service/trajectories.h"
#include "statemachine/state.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace rc::service {

// The binding a rollout was admitted under (what the response headers carry).
struct Admission {
  RolloutAdmitted binding;
  std::uint64_t seq = 0;  // journal seq of the RolloutAdmitted record
};

// Why an admission was refused, with the HTTP status a client sees.
struct AdmitRefusal {
  int http_status = 503;
  std::string type;     // "tainted", "unavailable", "shutting_down", "conflict", "invalid"
  std::string message;
  std::uint32_t retry_after_s = 0;  // 0: no Retry-After
};

class Service {
 public:
  // Opens the journal, recovers (abandons rollouts of dead clients, reconciles the engine) and
  // bootstraps if the journal is UNINITIALIZED. Does not listen yet.
  [[nodiscard]] static Result<std::unique_ptr<Service>> Open(const ServeConfig& config);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Binds listen_host:listen_port (0 = ephemeral) and serves on a background thread.
  [[nodiscard]] Status Start();
  int port() const { return port_; }
  std::string url() const;

  // Graceful stop: refuse new admissions (503), let in-flight proxied rollouts finish for up to
  // grace_ms, wait for a running update for what is left of it, stop serving, close the journal.
  // Returns false when something was still running at the deadline (the journal is then left
  // open for the caller to exit without closing: everything acknowledged is already durable).
  bool Shutdown(std::uint64_t grace_ms);

  // In-process access for tests.
  journal::Journal& journal() { return *journal_; }
  const ServeConfig& config() const { return config_; }
  ServiceMetrics& metrics() { return metrics_; }

  // Admission and finish, as the proxy and the explicit rollout routes use them.
  struct AdmitResult {
    std::optional<Admission> admitted;
    AdmitRefusal refusal;
  };
  AdmitResult Admit(const std::string& rollout_id, std::uint64_t wait_ms);
  [[nodiscard]] Status Finish(const std::string& rollout_id, RolloutOutcome outcome,
                              std::uint32_t prompt_tokens, std::uint32_t completion_tokens);

  nlohmann::json StateSummary() const;
  std::string RenderMetrics() const;

 private:
  explicit Service(ServeConfig config);
  [[nodiscard]] Status Init();
  void RegisterRoutes();
  void NotifyLifecycle(std::uint64_t seq);
  void InitWeightTransfer(const effects::EngineProtocol& protocol);
  std::string NextRolloutId();
  // The folded state as admissions read it: a copy refreshed only when the runner has journaled
  // a decision since (or when `fresh`), instead of one O(active rollouts) copy per admission.
  // A stale view is harmless: the journal decides every admission against its own state and
  // refuses one bound to an outdated version (Admit then refreshes and looks again).
  std::shared_ptr<const State> AdmitView(bool fresh);

  // Route handlers (service.cc, proxy.cc).
  void HandleState(const httplib::Request& req, httplib::Response& res);
  void HandleVersion(const httplib::Request& req, httplib::Response& res);
  void HandleUpdate(const httplib::Request& req, httplib::Response& res);
  void HandleAdmit(const httplib::Request& req, httplib::Response& res);
  void HandleFinish(const httplib::Request& req, httplib::Response& res);
  void HandleWatch(const httplib::Request& req, httplib::Response& res);
  void HandleEvents(const httplib::Request& req, httplib::Response& res);
  void HandleManifest(const httplib::Request& req, httplib::Response& res);
  void HandleMetrics(const httplib::Request& req, httplib::Response& res);
  enum class Route : std::uint8_t { kCompletions, kChat, kGenerate };
  void HandleProxy(Route route, const httplib::Request& req, httplib::Response& res);
  bool Authorized(const httplib::Request& req, httplib::Response& res);

  ServeConfig config_;
  std::unique_ptr<journal::Journal> journal_;
  std::unique_ptr<effects::EngineClient> control_client_;  // runner + transfer
  std::unique_ptr<effects::EngineClient> proxy_client_;    // rollouts
  std::unique_ptr<effects::HttpEngineControl> http_control_;
  std::unique_ptr<effects::WeightTransfer> transfer_;
  std::unique_ptr<effects::Runner> runner_;
  std::unique_ptr<httplib::Server> server_;
  std::unique_ptr<DisconnectWatcher> watcher_;
  TrajectoryLog trajectories_;
  mutable ServiceMetrics metrics_;
  std::thread server_thread_;
  int port_ = 0;

  std::timed_mutex update_mu_;            // held by the one runner call in progress
  std::mutex update_id_mu_;
  std::string running_update_id_;
  effects::PhaseTimings last_timings_;    // copied under update_id_mu_ after each update

  mutable std::mutex lifecycle_mu_;
  std::condition_variable lifecycle_cv_;
  std::uint64_t lifecycle_seq_ = 0;       // seq of the last decision the runner journaled
  std::atomic<std::uint64_t> lifecycle_epoch_{0};  // bumped on every NotifyLifecycle

  std::mutex view_mu_;
  std::shared_ptr<const State> view_;     // AdmitView's copy
  std::uint64_t view_epoch_ = 0;          // lifecycle_epoch_ when view_ was taken
  std::atomic<bool> shutting_down_{false};

  std::string rollout_prefix_;
  std::atomic<std::uint64_t> rollout_counter_{0};

  // ---- proxy owner: the gated HTTP front and the proxied calls in flight (connection_gate.h,
  // inflight_calls.h). Declared last so they are destroyed first, while what handlers use lives.
  InFlightCalls in_flight_calls_;
  std::unique_ptr<GatedHttpServer> http_;
};

// The cache_salt a proxied request is sent with: a digest of the committed version and identity
// (and the client's own salt, when given), so KV computed under one generation is never reused
// under another while requests of one generation share their prefixes.
std::string DeriveCacheSalt(const RolloutAdmitted& binding, const std::string& client_salt);

}  // namespace rc::service
