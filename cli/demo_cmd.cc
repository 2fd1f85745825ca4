// `rolloutcore demo`: the update executor against the vLLM test double (loopback, no GPU).
//
// Scenario: bootstrap rc-0; four concurrent rollouts; update to rc-1 requested while a long
// rollout is still generating (the drain waits for it); two rollouts under rc-1; update to rc-2
// with nothing in flight. Every journaled event is printed as a timeline; the journal stays on
// disk for `rolloutcore replay`.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/fleet_demo.h"
#include "cli/number_args.h"
#include "effects/clock.h"
#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/http/sequence_transfer.h"
#include "effects/runner.h"
#include "fixtures/vllm_double.h"
#include "journal/journal.h"
#include "statemachine/describe.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Prints journaled events in one timeline, from the runner and the rollout threads alike. Every
// string is escaped: event fields carry engine and client text, and one event is one line.
class Timeline {
 public:
  Timeline() : start_(Clock::now()) {}
  void event(std::uint64_t seq, const Event& e) {
    std::lock_guard lock(mu_);
    std::printf("[%8.1f ms] seq %-4llu %s%s\n", ms(), static_cast<unsigned long long>(seq),
                family_of(e) == Family::kDecision ? "  => " : "",
                text::escape_line(describe(e)).c_str());
    std::fflush(stdout);
  }
  void note(const std::string& what) {
    std::lock_guard lock(mu_);
    std::printf("[%8.1f ms] ---- %s\n", ms(), text::escape_line(what).c_str());
    std::fflush(stdout);
  }

 private:
  double ms() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
  }
  std::mutex mu_;
  Clock::time_point start_;
};

struct Demo {
  journal::Journal& journal;
  effects::EngineClient& client;
  Timeline& timeline;

  // Submits an input outside the runner (rollout bindings) and prints what was journaled.
  Result<std::vector<Event>> submit(const Event& input) {
    auto s = journal.Submit(input, effects::wall_now_ms());
    if (!s.ok()) return s.status();
    RC_RETURN_IF_ERROR(journal.Wait(s->ticket));
    std::uint64_t seq = s->ticket.result.first_seq;
    timeline.event(seq, input);
    for (const Event& d : s->decisions) timeline.event(++seq, d);
    return std::move(s->decisions);
  }

  // One rollout: admit durably under the committed version, generate, record the finish.
  Status rollout(const std::string& id, const std::string& prompt, int max_tokens) {
    const State state = journal.state();
    RolloutAdmitted admission = make_admission(state, id);
    auto admitted = submit(admission);
    if (!admitted.ok()) return admitted.status();
    nlohmann::json req = {{"model", "rc-double-model"},
                          {"prompt", prompt},
                          {"max_tokens", max_tokens},
                          {"temperature", 0},
                          {"cache_salt", admission.version.label},
                          {"return_token_ids", true}};
    effects::HttpReply reply = client.Completions(req);
    RolloutFinished finished{id, RolloutOutcome::kCompleted, 0, 0};
    static const nlohmann::json kNoUsage = nlohmann::json::object();
    const nlohmann::json* usage = &kNoUsage;
    const bool counted = reply.http.ok_2xx() && reply.body.contains("usage") &&
                         ReadObject(reply.body, "usage", usage) &&
                         ReadUint32(*usage, "prompt_tokens", finished.prompt_tokens) &&
                         ReadUint32(*usage, "completion_tokens", finished.completion_tokens);
    if (!counted) finished.outcome = RolloutOutcome::kAborted;
    auto done = submit(finished);
    return done.status();
  }
};

// The engine's version string; "" when its answer has none (or not as a string).
std::string VersionOf(const nlohmann::json& body) {
  std::string version;
  if (!ReadString(body, "version", version)) version.clear();
  return version;
}

int run_demo(const std::string& journal_path, int token_delay_ms) {
  const std::string shown_path = text::escape_line(journal_path);
  if (HoldsFiles(journal_path)) {
    std::fprintf(stderr,
                 "rolloutcore demo: %s already holds a journal; remove it or pass another "
                 "--journal (the demo never appends to an existing journal)\n",
                 shown_path.c_str());
    return 2;
  }
  fixtures::VllmDoubleOptions dopts;
  dopts.token_delay_ms = token_delay_ms;
  dopts.version = "0.30.0";
  // With the worker extension the engine digests its weights: the journal shows the digest
  // each validation saw and each version published.
  dopts.worker_extension_cls = effects::kWorkerExtensionClass;
  fixtures::VllmDouble engine(dopts);
  const int port = engine.Start(0);
  if (port <= 0) {
    std::fprintf(stderr, "rolloutcore demo: could not start the vLLM test double\n");
    return 2;
  }
  std::printf("vLLM TEST DOUBLE (not vLLM) listening on 127.0.0.1:%d; journal: %s\n\n", port,
              shown_path.c_str());

  auto opened = journal::Journal::Open(journal_path, journal::Options{});
  if (!opened.ok()) {
    std::fprintf(stderr, "rolloutcore demo: %s\n",
                 text::escape_line(opened.status().ToString()).c_str());
    return 2;
  }
  journal::Journal& j = **opened;
  effects::EngineDeadlines deadlines;
  deadlines.drain_timeout_ms = 60000;
  effects::EngineClient client("http://127.0.0.1:" + std::to_string(port), deadlines);
  effects::HttpEngineControl control(client);
  effects::HttpReply version = client.Version();
  effects::HttpSequenceTransfer transfer(client, effects::detect_protocol(VersionOf(version.body)));
  effects::RunnerOptions ropts;
  ropts.executor_id = "demo";
  ropts.drain_timeout_ms = 60000;
  effects::Runner runner(j, control, transfer, effects::system_clock(), ropts);
  Timeline timeline;
  runner.set_observer([&](std::uint64_t seq, const Event& e) { timeline.event(seq, e); });
  Demo demo{j, client, timeline};

  auto manifest = effects::synthetic_manifest("synthetic:8x64");
  RC_CHECK(manifest.ok());
  const std::string digest = manifest->digest();
  auto identity = [&](int step) {
    return WeightIdentity{digest, "", "ckpt/step-" + std::to_string(step), "demo-run", step};
  };

  timeline.note("bootstrap: the engine must report rc-0");
  if (Status st = runner.Bootstrap("rc-0", identity(0)); !st.ok()) {
    std::fprintf(stderr, "bootstrap failed: %s\n", text::escape_line(st.ToString()).c_str());
    return 1;
  }

  timeline.note("four concurrent rollouts under rc-0");
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      Status st = demo.rollout("r0-" + std::to_string(i),
                               "the quick brown fox " + std::to_string(i), 12 + 4 * i);
      if (!st.ok()) failures++;
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();

  timeline.note("a long rollout starts under rc-0; update to rc-1 is requested while it runs");
  std::thread long_rollout([&] {
    if (!demo.rollout("r0-long", "a long reasoning trace about prime numbers", 64).ok()) failures++;
  });
  engine.engine_snapshot();  // let it start generating
  std::this_thread::sleep_for(std::chrono::milliseconds(20 * token_delay_ms));
  auto first = runner.Update(UpdateRequested{"u-1", "rc-1", identity(100), "synthetic:8x64:100"});
  long_rollout.join();
  if (!first.ok()) {
    std::fprintf(stderr, "update u-1 failed: %s\n",
                 text::escape_line(first.status().ToString()).c_str());
    return 1;
  }
  const auto& t1 = runner.last_timings();
  timeline.note("u-1 " + std::string(update_outcome_name(first->outcome)) + ": total " +
                std::to_string(t1.total_us / 1000) + " ms, of which drain " +
                std::to_string(t1.drain_us / 1000) + " ms (waiting for r0-long), journal " +
                std::to_string(t1.journal_us / 1000) + " ms");

  timeline.note("two rollouts under rc-1");
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      if (!demo.rollout("r1-" + std::to_string(i), "the quick brown fox 0", 16).ok()) failures++;
    });
  }
  for (auto& t : threads) t.join();

  timeline.note("update to rc-2 with nothing in flight");
  auto second = runner.Update(UpdateRequested{"u-2", "rc-2", identity(200), "synthetic:8x64:200"});
  if (!second.ok()) {
    std::fprintf(stderr, "update u-2 failed: %s\n",
                 text::escape_line(second.status().ToString()).c_str());
    return 1;
  }
  timeline.note("u-2 " + std::string(update_outcome_name(second->outcome)) + " in " +
                std::to_string(runner.last_timings().total_us / 1000) + " ms");

  const State final_state = j.state();
  std::printf("\nfinal state: %s\n", text::escape_line(describe(final_state)).c_str());
  std::printf("rollout failures: %d\n", failures.load());
  // Commands to copy: the binary and the path are each one shell word (shell_quote's result is
  // one printable line), the path after `--`, so that one beginning with `-` is read as the
  // journal, never as an option.
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  const std::string exe = text::shell_quote(ec ? std::string("rolloutcore") : self);
  const std::string word = text::shell_quote(journal_path);
  std::printf(
      "journal left at %s — inspect it with:\n  %s replay --events -- %s\n  %s audit -- %s\n",
      shown_path.c_str(), exe.c_str(), word.c_str(), exe.c_str(), word.c_str());
  engine.Stop();
  const bool ok = failures.load() == 0 && first->outcome == UpdateOutcome::kCommitted &&
                  second->outcome == UpdateOutcome::kCommitted &&
                  final_state.committed.label == "rc-2";
  return ok ? 0 : 1;
}

// demo's options as typed: each read strictly once given (ReadDemoOptions).
struct DemoOpts {
  std::string journal_path = "demo-journal";
  CLI::Option* journal = nullptr;
  std::string token_delay_typed;
  CLI::Option* token_delay = nullptr;
  std::string fleet_typed;
  CLI::Option* fleet = nullptr;  // absent without the service (no fleet scenario)
};

// The numbers the scenario runs with.
struct DemoArgs {
  int token_delay_ms = 10;
  int fleet = 0;  // engines behind serve; 0: the one-engine scenario
};

constexpr std::uint64_t kTokenDelayMsMax = 1000;
// Each engine of the fleet scenario is a double in this process, with its own threads.
constexpr std::uint64_t kFleetDemoEnginesMax = 16;

// A usage error on stderr, one escaped line (it quotes the command line); exit 2, nothing run.
int Usage(const std::string& why) {
  std::fprintf(stderr, "rolloutcore demo: %s\n", text::escape_line(why).c_str());
  return 2;
}

// The options given, read strictly (cli/number_args.h, cli/cli_util.h): a usage error quoting the
// text typed otherwise; an option left out keeps its default.
Status ReadDemoOptions(const DemoOpts& o, DemoArgs& args) {
  RC_RETURN_IF_ERROR(
      CheckTextOptions({{"--journal", o.journal, &o.journal_path, TextKind::kPath}}));
  if (o.token_delay->count() > 0) {
    const Result<std::uint64_t> ms =
        ParseWholeNumberOption("--token-delay-ms", o.token_delay_typed, 1, kTokenDelayMsMax);
    if (!ms.ok()) return ms.status();
    args.token_delay_ms = static_cast<int>(*ms);
  }
  if (o.fleet != nullptr && o.fleet->count() > 0) {
    const Result<std::uint64_t> engines =
        ParseWholeNumberOption("--fleet", o.fleet_typed, 2, kFleetDemoEnginesMax);
    if (!engines.ok()) return engines.status();
    args.fleet = static_cast<int>(*engines);
  }
  return Status::OK();
}

}  // namespace

Runner add_demo(CLI::App& app) {
  auto o = std::make_shared<DemoOpts>();
  o->journal = app.add_option("--journal", o->journal_path,
                              "Directory for the demo's journal (must be new; default "
                              "demo-journal)");
  o->token_delay = app.add_option("--token-delay-ms", o->token_delay_typed,
                                  "The double's time per generated token, 1 to 1000 ms "
                                  "(default 10)");
#ifdef RC_CLI_HAVE_SERVICE
  o->fleet = app.add_option("--fleet", o->fleet_typed,
                            "N engines behind one serve: a rolling update under traffic, then an "
                            "all update in which one engine is lost (2..16)");
#endif
  return [o]() {
    DemoArgs args;
    if (Status read = ReadDemoOptions(*o, args); !read.ok()) return Usage(read.message());
#ifdef RC_CLI_HAVE_SERVICE
    if (args.fleet > 0) return run_fleet_demo(o->journal_path, args.fleet, args.token_delay_ms);
#endif
    return run_demo(o->journal_path, args.token_delay_ms);
  };
}

}  // namespace rc::cli
