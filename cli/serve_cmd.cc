// `rolloutcore serve`: the long-running executor beside a trainer (one per engine).
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <spdlog/spdlog.h>

#include "cli/commands.h"

#ifdef RC_CLI_HAVE_SERVICE
#include "service/config.h"
#include "service/service.h"
#endif

namespace rc::cli {

#ifdef RC_CLI_HAVE_SERVICE
Runner add_serve(CLI::App& app) {
  auto cfg = std::make_shared<service::ServeConfig>();
  auto config_file = std::make_shared<std::string>();
  // Flags override the file: each flag is applied after the file only when it was given.
  app.add_option("--config", *config_file, "JSON config file (keys = the long flag names with _)");
  auto flags = std::make_shared<service::ServeConfig>();
  auto opts = std::make_shared<std::vector<std::pair<CLI::Option*, std::function<void()>>>>();
  auto add = [&](const std::string& name, auto service::ServeConfig::*field, const std::string& help) {
    CLI::Option* o = app.add_option(name, (*flags).*field, help);
    opts->push_back({o, [cfg, flags, field] { (*cfg).*field = (*flags).*field; }});
  };
  add("--engine-url", &service::ServeConfig::engine_url, "vLLM base URL, e.g. http://127.0.0.1:8000");
  add("--journal", &service::ServeConfig::journal_path, "journal directory (RocksDB)");
  add("--trajectories", &service::ServeConfig::trajectories_path,
      "trajectories JSON-lines file (default: trajectories.jsonl beside the journal)");
  add("--host", &service::ServeConfig::listen_host, "listen address (default 127.0.0.1)");
  add("--port", &service::ServeConfig::listen_port, "listen port (0 = ephemeral; default 8100)");
  add("--auth-token", &service::ServeConfig::auth_token,
      "Bearer token required on mutating trainer routes (or RC_AUTH_TOKEN)");
  add("--executor-id", &service::ServeConfig::executor_id, "executor id recorded on recovery");
  add("--initial-label", &service::ServeConfig::initial_label, "bootstrap label (default rc-0)");
  add("--initial-manifest", &service::ServeConfig::initial_manifest_digest,
      "bootstrap identity: manifest digest");
  add("--initial-source", &service::ServeConfig::initial_source,
      "bootstrap identity: compute the manifest from this source (e.g. synthetic:4x64)");
  add("--initial-checkpoint", &service::ServeConfig::initial_checkpoint, "bootstrap checkpoint");
  add("--initial-run", &service::ServeConfig::initial_run, "bootstrap run id");
  add("--initial-step", &service::ServeConfig::initial_step, "bootstrap step");
  add("--connect-timeout-ms", &service::ServeConfig::connect_timeout_ms, "engine connect deadline");
  add("--call-timeout-ms", &service::ServeConfig::call_timeout_ms, "engine control-call deadline");
  add("--drain-timeout-ms", &service::ServeConfig::drain_timeout_ms, "drain deadline");
  add("--transfer-timeout-ms", &service::ServeConfig::transfer_timeout_ms, "transfer deadline");
  add("--request-timeout-ms", &service::ServeConfig::request_timeout_ms,
      "one proxied generation's deadline");
  add("--admit-wait-ms", &service::ServeConfig::admit_wait_ms,
      "how long a proxied request waits for READY during an update before 503");
  add("--retry-after-s", &service::ServeConfig::retry_after_s, "Retry-After on 503");
  add("--shutdown-grace-ms", &service::ServeConfig::shutdown_grace_ms,
      "SIGTERM: how long in-flight rollouts may take to finish");
  add("--watch-timeout-ms-max", &service::ServeConfig::watch_timeout_ms_max, "long-poll bound");
  add("--body-bytes-max", &service::ServeConfig::body_bytes_max, "request body bound");
  add("--http-threads", &service::ServeConfig::http_threads, "concurrent connections served");
  add("--events-page-max", &service::ServeConfig::events_page_max, "records per /v1/events page");
  add("--trajectories-bytes-max", &service::ServeConfig::trajectories_bytes_max,
      "trajectories file size before rotation");
  add("--transfer", &service::ServeConfig::transfer,
      "http (GPU-free) or nccl (needs a CUDA/NCCL build and a GPU)");
  add("--packed-buffer-size-bytes", &service::ServeConfig::packed_buffer_size_bytes,
      "packed transfer buffer size (1 MiB..64 GiB; default 1 GiB)");
  add("--packed-num-buffers", &service::ServeConfig::packed_num_buffers,
      "packed buffer count (1..64; default 2)");
  add("--rendezvous", &service::ServeConfig::rendezvous,
      "HOST:PORT the engine's workers dial for the NCCL rendezvous (PORT 0 = ephemeral); "
      "required with --transfer nccl");
  add("--cuda-device", &service::ServeConfig::cuda_device, "nccl: rank 0's CUDA device (default 0)");
  add("--nccl-world-size", &service::ServeConfig::nccl_world_size,
      "nccl: 1 + engine workers (0 = ask GET /get_world_size; default 0)");
  add("--nccl-init-timeout-ms", &service::ServeConfig::nccl_init_timeout_ms,
      "nccl: startup rendezvous deadline (default 120000)");
  add("--nccl-abort-reserve-ms", &service::ServeConfig::nccl_abort_reserve_ms,
      "nccl: time kept at the end of each deadline for ncclCommAbort (default 1000)");
  add("--journal-sync", &service::ServeConfig::journal_sync, "fsync each group commit (true)");
  add("--engine-monitor-interval-ms", &service::ServeConfig::engine_monitor_interval_ms,
      "how often the engine is probed while READY (10..60000; default 200)");
  add("--engine-startup-timeout-ms", &service::ServeConfig::engine_startup_timeout_ms,
      "how long startup waits for the engine to come up (default 300000)");
  add("--rollout-lease-ms", &service::ServeConfig::rollout_lease_ms,
      "lease of an explicit rollout, renewed by its client (1000..3600000; default 30000)");
  add("--finish-retry-ms", &service::ServeConfig::finish_retry_ms,
      "how long a finish that cannot be made durable is retried before fail-stop (default 30000)");
  add("--journal-commit-stall-timeout-ms", &service::ServeConfig::journal_commit_stall_timeout_ms,
      "a group commit not durable within this fail-stops the executor (default 10000)");
  {
    CLI::Option* o = app.add_flag("--adopt-engine", flags->adopt_engine,
                                  "accept an engine that reports another label or is paused "
                                  "(relabel/resume it; journaled)");
    opts->push_back({o, [cfg, flags] { cfg->adopt_engine = flags->adopt_engine; }});
  }

  return [cfg, flags, config_file, opts]() -> int {
    if (!config_file->empty()) {
      Status st = service::MergeConfigFile(*config_file, *cfg);
      if (!st.ok()) {
        std::fprintf(stderr, "rolloutcore serve: %s\n", st.ToString().c_str());
        return 2;
      }
    }
    for (auto& [opt, apply] : *opts) {
      if (opt->count() > 0) apply();
    }
    if (cfg->auth_token.empty()) {
      if (const char* t = std::getenv("RC_AUTH_TOKEN"); t != nullptr) cfg->auth_token = t;
    }
    Status valid = service::ValidateConfig(*cfg);
    if (!valid.ok()) {
      std::fprintf(stderr, "rolloutcore serve: %s\n", valid.ToString().c_str());
      return 2;
    }
    if (cfg->auth_token.empty()) {
      spdlog::warn("serve: no auth token: mutating trainer routes are open to anyone on {}",
                   cfg->listen_host);
    }
    // SIGTERM/SIGINT are taken by sigwait below; block them before any thread starts.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    signal(SIGPIPE, SIG_IGN);

    auto opened = service::Service::Open(*cfg);
    if (!opened.ok()) {
      std::fprintf(stderr, "rolloutcore serve: %s\n", opened.status().ToString().c_str());
      return 1;
    }
    std::unique_ptr<service::Service> svc = std::move(opened.value());
    Status started = svc->Start();
    if (!started.ok()) {
      std::fprintf(stderr, "rolloutcore serve: %s\n", started.ToString().c_str());
      return 1;
    }
    std::printf("listening on %s:%d\n", cfg->listen_host.c_str(), svc->port());
    std::fflush(stdout);
    // Waits for SIGTERM/SIGINT or a fail-stop (a journal write/fsync error, a stalled fsync,
    // the runner failing mid-update): then nothing more may be decided, so the process exits
    // non-zero without closing the journal and the next start recovers from what is durable.
    int sig = 0;
    for (;;) {
      if (svc->failed()) {
        std::fprintf(stderr, "rolloutcore serve: fail-stop: %s\n", svc->failure().c_str());
        std::fflush(stderr);
        std::_Exit(4);
      }
      timespec tick{0, 100 * 1000 * 1000};
      sig = sigtimedwait(&set, nullptr, &tick);
      if (sig > 0) break;
    }
    spdlog::info("serve: signal {}: draining (grace {} ms)", sig, cfg->shutdown_grace_ms);
    const bool clean = svc->Shutdown(cfg->shutdown_grace_ms);
    if (svc->failed()) {
      std::fprintf(stderr, "rolloutcore serve: fail-stop: %s\n", svc->failure().c_str());
      std::fflush(stderr);
      std::_Exit(4);
    }
    if (!clean) {
      // Everything acknowledged is durable; recovery on the next start classifies the rest.
      std::fflush(stderr);
      std::_Exit(3);
    }
    svc.reset();
    spdlog::info("serve: stopped cleanly");
    return 0;
  };
}
#else
Runner add_serve(CLI::App& app) {
  (void)app;
  return [] {
    std::fprintf(stderr, "rolloutcore serve: this build has no service library\n");
    return 1;
  };
}
#endif

}  // namespace rc::cli
