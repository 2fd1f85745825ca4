// `rolloutcore serve`: the long-running executor beside a trainer (one per engine).
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <spdlog/spdlog.h>

#include "cli/commands.h"

#ifdef RC_CLI_HAVE_SERVICE
#include "cli/cli_util.h"
#include "effects/thread_start.h"
#include "service/config.h"
#include "service/service.h"
#include "service/trajectories.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"
#endif

namespace rc::cli {

#ifdef RC_CLI_HAVE_SERVICE
namespace {

using FlagAppliers = std::vector<std::pair<CLI::Option*, std::function<void()>>>;

// Every message serve prints may quote outside text (a config path or value, a journal path, a
// recorded field, a client's path segment): escaped, so that one message is one line.
void PrintError(const std::string& what) {
  std::fprintf(stderr, "rolloutcore serve: %s\n", text::escape_line(what).c_str());
}

// `j` as one line of printable ASCII: config strings may hold line and paragraph separators,
// NEL and other C1 controls, bidirectional controls, DEL or ill-formed UTF-8, and a log line must
// stay one line that reads as written. Every control is escaped, every non-ASCII character and DEL
// is a \uXXXX escape (ill-formed bytes \ufffd); nothing here throws past bad_alloc.
std::string AsciiLine(const nlohmann::json& j) {
  return j.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

// One flag for one row of the configuration table, with its default and bounds in the help.
void AddConfigFlag(CLI::App& app, const service::ConfigKey& k,
                   const std::shared_ptr<service::ServeConfig>& cfg,
                   const std::shared_ptr<service::ServeConfig>& flags, FlagAppliers& out) {
  const std::string name = "--" + std::string(k.flag);
  const std::string help = std::string(k.help) + " [config key " + std::string(k.key) +
                           ", default " + service::ConfigDefault(k).dump() + "]";
  std::visit(
      [&](auto member) {
        CLI::Option* o = nullptr;
        using T = std::decay_t<decltype((*flags).*member)>;
        if constexpr (std::is_same_v<T, bool>) {
          o = k.is_switch ? app.add_flag(name, (*flags).*member, help)
                          : app.add_option(name, (*flags).*member, help);
        } else {
          o = app.add_option(name, (*flags).*member, help);
        }
        out.push_back({o, [cfg, flags, member] { (*cfg).*member = (*flags).*member; }});
      },
      k.field);
}

// RocksDB creates the journal directory but not its parents: create them, saying so.
bool EnsureJournalParent(const std::string& journal_path) {
  const std::filesystem::path parent = std::filesystem::path(journal_path).parent_path();
  if (parent.empty()) return true;
  std::error_code ec;
  if (std::filesystem::is_directory(parent, ec)) return true;
  if (!std::filesystem::create_directories(parent, ec) || ec) {
    PrintError("cannot create the journal's parent directory " + text::quoted(parent.string()) +
               ": " + (ec ? ec.message() : std::string("not created")));
    return false;
  }
  spdlog::info("serve: created the journal's parent directory {}",
               text::escape_line(parent.string()));
  return true;
}

// From the signal on, the process ends within the shutdown grace (or, while a plan's mutation of
// the engine is in flight, that mutation's own deadline and the steps after it: Service::Shutdown
// says how long), then a bound for the rest: its settle, the journal's close and the trajectory
// file's drain. The close writes up to four times, each within the commit stall bound: a durable
// mark already in flight, the mark of the commits it did not cover, the flush, the clean-close
// record. A stalled disk or a stuck worker past that exits unclean (3), and the next start
// recovers from what is durable.
std::uint64_t AfterPlansBoundMs(const service::ServeConfig& c) {
  constexpr std::uint64_t kSettleMs = 10000;  // cancelled rollouts' finishes, the loops' join
  constexpr std::uint64_t kJournalCloseWritesMax = 4;
  return kSettleMs + kJournalCloseWritesMax * std::uint64_t{c.journal_commit_stall_timeout_ms} +
         service::kTrajectoryDrainTimeoutMsDefault;
}

using SteadyClock = std::chrono::steady_clock;

std::int64_t SteadyMs(SteadyClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

// When the process exits unclean, once a signal armed it (steady-clock ms): moved later, never
// earlier. Shared with the thread that watches it, which outlives a clean return from main.
struct ExitDeadline {
  std::mutex mu;
  std::condition_variable armed_cv;
  bool armed = false;  // under mu
  SteadyClock::time_point signalled;
  std::atomic<std::int64_t> at_ms{0};
};

void MoveLater(ExitDeadline& deadline, std::int64_t at_ms) {
  std::int64_t current = deadline.at_ms.load();
  while (at_ms > current && !deadline.at_ms.compare_exchange_weak(current, at_ms)) {
  }
}

// The watch's thread: idle until a signal arms the deadline, then exits the process unclean (3)
// once it passes.
void WatchExitDeadline(const std::shared_ptr<ExitDeadline>& deadline) {
  SteadyClock::time_point signalled;
  {
    std::unique_lock<std::mutex> l(deadline->mu);
    deadline->armed_cv.wait(l, [&] { return deadline->armed; });
    signalled = deadline->signalled;
  }
  constexpr std::int64_t kLookMs = 100;  // how often the deadline is read again
  for (std::int64_t now = SteadyMs(SteadyClock::now()); now < deadline->at_ms.load();
       now = SteadyMs(SteadyClock::now())) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(kLookMs, deadline->at_ms.load() - now)));
  }
  std::fprintf(stderr,
               "rolloutcore serve: shutdown did not end within %lld ms of the signal (a stalled "
               "disk?); exiting without the journal's clean-close record: the next start "
               "recovers\n",
               static_cast<long long>(SteadyMs(SteadyClock::now()) - SteadyMs(signalled)));
  std::fflush(stderr);
  std::_Exit(3);
}

// Started with serve, before the journal opens, so that a shutdown never needs a thread the
// system may refuse by then: a refusal here is a start failure, with nothing opened.
Status StartExitDeadlineWatch(const std::shared_ptr<ExitDeadline>& deadline) {
  Result<std::thread> watch = effects::StartThread("the shutdown's exit deadline watch",
                                                   [deadline] { WatchExitDeadline(deadline); });
  if (!watch.ok()) return watch.status();
  watch->detach();  // a clean shutdown returns from main first
  return Status::OK();
}

void ArmExitDeadline(ExitDeadline& deadline, std::int64_t at_ms) {
  {
    std::lock_guard<std::mutex> l(deadline.mu);
    deadline.signalled = SteadyClock::now();
    deadline.at_ms.store(at_ms);
    deadline.armed = true;
  }
  deadline.armed_cv.notify_all();
}

}  // namespace

namespace {
// Secrets left out of the command line and the file come from the environment (kept out of
// `ps` and of configuration files).
void TokensFromEnvironment(service::ServeConfig& cfg) {
  const auto take = [](std::string& value, const char* name) {
    if (!value.empty()) return;
    if (const char* t = std::getenv(name); t != nullptr) value = t;
  };
  take(cfg.auth_token, "RC_AUTH_TOKEN");
  take(cfg.proxy_token, "RC_PROXY_TOKEN");
  take(cfg.engine_api_key, "RC_ENGINE_API_KEY");
}
}  // namespace

Runner add_serve(CLI::App& app) {
  auto cfg = std::make_shared<service::ServeConfig>();
  auto config_file = std::make_shared<std::string>();
  auto reference = std::make_shared<bool>(false);
  app.add_option("--config", *config_file,
                 "JSON config file: one object of the keys in docs/config.md; flags override it");
  app.add_flag("--config-reference", *reference,
               "print the configuration reference (Markdown) and exit");
  // Every other flag comes from the one configuration table (service/config.cc). A flag is
  // parsed into `flags` and applied over the file only when it was given.
  auto flags = std::make_shared<service::ServeConfig>();
  auto opts = std::make_shared<std::vector<std::pair<CLI::Option*, std::function<void()>>>>();
  auto fleet_engines = std::make_shared<std::vector<std::string>>();
  app.add_option("--fleet-engine", *fleet_engines,
                 "NAME=URL: one engine of a fleet, once per engine (replaces the config file's "
                 "`engines`; docs/fleet.md)");
  auto retiring = std::make_shared<std::vector<std::string>>();
  app.add_option("--fleet-retire", *retiring,
                 "NAME: a configured engine that leaves the fleet at start without having to "
                 "answer (one that died); once per engine");
  for (const service::ConfigKey& k : service::ConfigKeys()) {
    AddConfigFlag(app, k, cfg, flags, *opts);
  }

  return [cfg, flags, config_file, opts, reference, fleet_engines, retiring]() -> int {
    if (*reference) {
      std::fputs(service::ConfigReferenceMarkdown().c_str(), stdout);
      return 0;
    }
    if (!config_file->empty()) {
      Status st = CheckRegularFile("config file", *config_file);
      if (st.ok()) st = service::MergeConfigFile(*config_file, *cfg);
      if (!st.ok()) {
        PrintError(st.ToString());
        return 2;
      }
    }
    for (auto& [opt, apply] : *opts) {
      if (opt->count() > 0) apply();
    }
    if (!fleet_engines->empty()) {
      cfg->engines.clear();
      for (const std::string& flag : *fleet_engines) {
        auto engine = service::ParseFleetEngineFlag(flag);
        if (!engine.ok()) {
          PrintError(engine.status().ToString());
          return 2;
        }
        cfg->engines.push_back(std::move(engine.value()));
      }
    }
    if (Status marked = service::MarkRetiring(*retiring, *cfg); !marked.ok()) {
      PrintError(marked.ToString());
      return 2;
    }
    if (!cfg->journal_sync) {
      spdlog::warn(
          "serve: journal_sync is off: admissions and outcomes are acknowledged before they are "
          "on disk, and a power loss can lose them (use only for benchmarks)");
    }
    TokensFromEnvironment(*cfg);
    Status valid = service::ValidateConfig(*cfg);
    if (!valid.ok()) {
      PrintError(valid.ToString());
      return 2;
    }
    if (Status files = CheckJournalFiles(cfg->journal_path); !files.ok()) {
      PrintError(files.ToString());
      return 2;
    }
    if (!EnsureJournalParent(cfg->journal_path)) return 1;
    if (cfg->auth_token.empty()) {
      spdlog::warn("serve: no auth token: mutating trainer routes are open to anyone on {}",
                   text::escape_line(cfg->listen_host));
    }
    // SIGTERM/SIGINT are taken by sigwait below; block them before any thread starts.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    signal(SIGPIPE, SIG_IGN);
    auto exit_deadline = std::make_shared<ExitDeadline>();
    if (Status watching = StartExitDeadlineWatch(exit_deadline); !watching.ok()) {
      PrintError(watching.ToString());
      return 1;
    }

    // The effective configuration, one line, its tokens redacted: what this process runs with.
    spdlog::info("serve: configuration {}", AsciiLine(service::ConfigToJson(*cfg)));
    auto opened = service::Service::Open(*cfg);
    if (!opened.ok()) {
      PrintError(opened.status().ToString());
      // A journal write of the open past its deadline still runs on a detached thread, inside
      // the database: no destructor may run under it.
      if (opened.status().code() == Code::kTimeout) {
        spdlog::default_logger()->flush();
        std::fflush(nullptr);
        std::_Exit(1);
      }
      return 1;
    }
    std::unique_ptr<service::Service> svc = std::move(opened.value());
    Status started = svc->Start();
    if (!started.ok()) {
      PrintError(started.ToString());
      return 1;
    }
    std::printf("listening on %s:%d\n", text::escape_line(cfg->listen_host).c_str(), svc->port());
    std::fflush(stdout);
    // Waits for SIGTERM/SIGINT or a fail-stop (a journal write/fsync error, a stalled fsync,
    // the runner failing mid-update): then nothing more may be decided, so the process exits
    // non-zero without closing the journal and the next start recovers from what is durable.
    int sig = 0;
    for (;;) {
      if (svc->failed()) {
        PrintError("fail-stop: " + svc->failure());
        std::fflush(stderr);
        std::_Exit(4);
      }
      timespec tick{0, 100 * 1000 * 1000};
      sig = sigtimedwait(&set, nullptr, &tick);
      if (sig > 0) break;
    }
    spdlog::info("serve: signal {}: draining (grace {} ms)", sig, cfg->shutdown_grace_ms);
    const std::int64_t after_plans_ms = static_cast<std::int64_t>(AfterPlansBoundMs(*cfg));
    ArmExitDeadline(*exit_deadline, SteadyMs(SteadyClock::now()) +
                                        static_cast<std::int64_t>(cfg->shutdown_grace_ms) +
                                        after_plans_ms);
    // A plan's mutation in flight is waited for past the grace: the exit waits as long.
    const bool clean = svc->Shutdown(
        cfg->shutdown_grace_ms, [exit_deadline, after_plans_ms](SteadyClock::time_point until) {
          MoveLater(*exit_deadline, SteadyMs(until) + after_plans_ms);
        });
    if (svc->failed()) {
      PrintError("fail-stop: " + svc->failure());
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
