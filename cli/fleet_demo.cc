// `rolloutcore demo --fleet N`: `serve` in front of N vLLM test doubles (loopback, no GPU).
//
// Scenario: bootstrap the fleet at rc-0; clients keep sending completions through the proxy
// while the trainer asks for a rolling update to rc-1 (one engine at a time, the others serving);
// then an `all` update to rc-2 during which one engine loses its weight transfer ambiguously: it
// goes TAINTED alone, the update ends partial, and the proxy stops routing to it. Each answer
// prints the engine and version it was bound to; the journal stays on disk for replay and audit.
#ifdef RC_CLI_HAVE_SERVICE
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli/cli_util.h"
#include "cli/fleet_demo.h"
#include "effects/http/sequence_transfer.h"
#include "fixtures/vllm_double.h"
#include "service/http_util.h"
#include "service/service.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

using nlohmann::json;
constexpr const char* kSource = "synthetic:8x64";

// A value from serve's answers as one printable line: DumpSafe keeps non-ASCII as is, and with it
// U+2028, NEL, DEL and bidirectional controls, which would split or reorder the printed line.
std::string JsonLine(const json& j) { return text::escape_line(service::DumpSafe(j)); }

// Counts each client's answers by engine and version, printing the first of each pair.
class Answers {
 public:
  void Note(int status, const std::string& engine, const std::string& label) {
    std::lock_guard<std::mutex> g(mu_);
    if (status != 200) {
      failed_++;
      return;
    }
    if (seen_[engine + " " + label]++ == 0) {
      std::printf("  first answer from engine %s under %s\n", text::escape_line(engine).c_str(),
                  text::escape_line(label).c_str());
    }
  }
  void Print() const {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& [key, n] : seen_) {
      std::printf("  %-16s %d answer(s)\n", text::escape_line(key).c_str(), n);
    }
    std::printf("  failed: %d\n", failed_);
  }
  int failed() const {
    std::lock_guard<std::mutex> g(mu_);
    return failed_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, int> seen_;
  int failed_ = 0;
};

// Client threads sending completions through the proxy until stopped.
class Traffic {
 public:
  Traffic(int port, Answers& answers) : port_(port), answers_(answers) {}
  void Start(int clients) {
    for (int i = 0; i < clients; ++i) threads_.emplace_back([this, i] { Run(i); });
  }
  void Stop() {
    stop_ = true;
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_ = false;
  }

 private:
  void Run(int client) {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    for (int n = 0; !stop_.load(); ++n) {
      const json body = {
          {"prompt", "client " + std::to_string(client) + " asks " + std::to_string(n)},
          {"max_tokens", 8}};
      auto r = c.Post("/v1/completions", service::DumpSafe(body), "application/json");
      answers_.Note(r ? r->status : 0, r ? r->get_header_value("X-RolloutCore-Engine") : "",
                    r ? r->get_header_value("X-RolloutCore-Version") : "");
    }
  }
  const int port_;
  Answers& answers_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

json UpdateBody(const std::string& id, const std::string& mode, int step) {
  auto manifest = effects::synthetic_manifest(kSource);
  RC_CHECK(manifest.ok());
  return {{"update_id", id},
          {"mode", mode},
          {"target_label", "rc-" + std::to_string(step)},
          {"identity",
           {{"manifest_digest", manifest->digest()},
            {"checkpoint", "ckpt/step-" + std::to_string(step)},
            {"run", "demo-run"},
            {"step", step}}},
          {"source", std::string(kSource) + ":" + std::to_string(step)}};
}

// One engine's line of /v1/state, its fields read with their types (a field of another type
// reads as "?").
void PrintEngine(const std::string& name, const json& e) {
  static const json kNone = json::object();
  std::string lifecycle = "?";
  std::string label = "?";
  bool admitting = false;
  const json* committed = &kNone;
  if (!ReadString(e, "lifecycle", lifecycle)) lifecycle = "?";
  if (!ReadObject(e, "committed", committed) || !ReadString(*committed, "label", label)) {
    label = "?";
  }
  if (!ReadBool(e, "admitting", admitting)) admitting = false;
  const auto generation = e.is_object() ? e.find("generation") : e.end();
  std::printf("  engine %-4s %-9s %-5s generation %s%s\n", text::escape_line(name).c_str(),
              text::escape_line(lifecycle).c_str(), text::escape_line(label).c_str(),
              generation == e.end() ? "?" : JsonLine(*generation).c_str(),
              admitting ? ", admitting" : "");
}

void PrintEngines(httplib::Client& c) {
  auto r = c.Get("/v1/state");
  if (!r || r->status != 200) return;
  const json s = json::parse(r->body, nullptr, false);
  if (!s.is_object()) return;
  const auto engines = s.find("engines");
  if (engines == s.end() || !engines->is_object()) return;
  for (const auto& [name, e] : engines->items()) PrintEngine(name, e);
}

// Posts a fleet update and prints its end; the HTTP status, or 0 when no answer came.
int FleetUpdate(httplib::Client& c, const json& body) {
  auto r = c.Post("/v1/fleet/updates", service::DumpSafe(body), "application/json");
  if (!r) return 0;
  const json end = json::parse(r->body, nullptr, false);
  std::string outcome = r->body;
  if (!ReadString(end, "outcome", outcome)) outcome = r->body;
  const bool object = end.is_object();
  std::printf("  HTTP %d: %s (committed %s, tainted %s)\n", r->status,
              text::escape_line(outcome).c_str(),
              object && end.contains("committed") ? JsonLine(end["committed"]).c_str() : "?",
              object && end.contains("tainted") ? JsonLine(end["tainted"]).c_str() : "?");
  return r->status;
}

std::vector<std::unique_ptr<fixtures::VllmDouble>> StartEngines(int n, int token_delay_ms) {
  std::vector<std::unique_ptr<fixtures::VllmDouble>> engines;
  for (int i = 0; i < n; ++i) {
    fixtures::VllmDoubleOptions o;
    o.token_delay_ms = token_delay_ms;
    o.worker_extension_cls = effects::kWorkerExtensionClass;
    engines.push_back(std::make_unique<fixtures::VllmDouble>(o));
    if (engines.back()->Start(0) <= 0) return {};
  }
  return engines;
}

service::ServeConfig FleetConfig(const std::string& journal_path,
                                 const std::vector<std::unique_ptr<fixtures::VllmDouble>>& e) {
  service::ServeConfig c;
  for (std::size_t i = 0; i < e.size(); ++i) {
    c.engines.push_back({"e" + std::to_string(i), e[i]->base_url()});
  }
  c.journal_path = journal_path;
  c.listen_port = 0;
  c.initial_source = kSource;
  c.initial_checkpoint = "ckpt/step-0";
  c.initial_run = "demo-run";
  c.initial_step = 0;
  c.fleet_min_serving = static_cast<std::uint32_t>(e.size() > 1 ? e.size() - 1 : 0);
  return c;
}

}  // namespace

int run_fleet_demo(const std::string& journal_path, int engines_n, int token_delay_ms) {
  const std::string shown = text::escape_line(journal_path);
  if (HoldsFiles(journal_path)) {
    std::fprintf(stderr, "rolloutcore demo: %s already holds a journal\n", shown.c_str());
    return 2;
  }
  auto engines = StartEngines(engines_n, token_delay_ms);
  if (engines.empty()) {
    std::fprintf(stderr, "rolloutcore demo: could not start the vLLM test doubles\n");
    return 2;
  }
  spdlog::set_level(spdlog::level::warn);  // the demo prints its own story
  auto opened = service::Service::Open(FleetConfig(journal_path, engines));
  if (!opened.ok() || !(*opened)->Start().ok()) {
    // The status quotes the journal path and RocksDB's text: escaped, one line.
    const std::string why =
        opened.ok() ? "listen failed" : text::escape_line(opened.status().ToString());
    std::fprintf(stderr, "rolloutcore demo: serve did not start: %s\n", why.c_str());
    return 1;
  }
  std::unique_ptr<service::Service> svc = std::move(opened.value());
  std::printf("serve in front of %d vLLM TEST DOUBLES (not vLLM) on %s; journal: %s\n\n", engines_n,
              svc->url().c_str(), shown.c_str());
  httplib::Client trainer("127.0.0.1", svc->port());
  trainer.set_read_timeout(120, 0);
  PrintEngines(trainer);

  Answers answers;
  Traffic traffic(svc->port(), answers);
  std::printf("\n---- 4 clients send completions; the trainer asks for a ROLLING update to rc-1\n");
  traffic.Start(4);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int rolled = FleetUpdate(trainer, UpdateBody("fleet-u1", "rolling", 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));

  std::printf("\n---- an ALL update to rc-2; engine e%d loses its weight transfer ambiguously\n",
              engines_n - 1);
  fixtures::RouteFault lost;
  lost.drop_connection = true;
  lost.after = true;  // the engine took the weights; the executor cannot tell
  engines.back()->SetRouteFault("/update_weights", lost);
  const int partial = FleetUpdate(trainer, UpdateBody("fleet-u2", "all", 2));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  traffic.Stop();

  std::printf("\n---- the fleet now\n");
  PrintEngines(trainer);
  std::printf("\n---- answers, by engine and version\n");
  answers.Print();
  (void)svc->Shutdown(5000);
  svc.reset();
  for (auto& e : engines) e->Stop();
  // Commands to copy: the path is one shell word (shell_quote's result is one printable line),
  // after `--`, so that a path beginning with `-` is read as the journal, never as an option.
  const std::string word = text::shell_quote(journal_path);
  std::printf(
      "\njournal left at %s — inspect it with:\n  rolloutcore replay -- %s\n"
      "  rolloutcore audit -- %s\n",
      shown.c_str(), word.c_str(), word.c_str());
  const bool ok = rolled == 200 && (engines_n == 1 || partial == 207) && answers.failed() == 0;
  return ok ? 0 : 1;
}

}  // namespace rc::cli

#endif  // RC_CLI_HAVE_SERVICE
