// rolloutcore: the update executor beside a trainer, and the tools around its journal.
#include <cstdio>
#include <map>
#include <string>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"RolloutCore: safe live policy-weight updates for vLLM"};
  app.require_subcommand(1);
  std::map<CLI::App*, rc::cli::Runner> runners;
  auto add = [&](rc::cli::Runner (*fn)(CLI::App&), const char* name, const char* help) {
    CLI::App* sub = app.add_subcommand(name, help);
    runners[sub] = fn(*sub);
  };
  add(&rc::cli::add_replay, "replay",
      "Refold a journal, re-verify every decision and the hash chain, explain TAINTED incidents");
  add(&rc::cli::add_demo, "demo",
      "Run an update scenario against the vLLM test double and print its timeline");
  add(&rc::cli::add_serve, "serve",
      "Run the update executor: trainer API, enforcing admission proxy and /metrics");
  add(&rc::cli::add_audit, "audit",
      "Audit a journal offline: integrity, lifecycle history, provenance, trajectories");
#ifdef RC_CLI_HAVE_EFFECTS
  add(&rc::cli::add_restore, "restore",
      "Ask a running executor to restore its TAINTED engine to an earlier version, with proof");
#endif
  CLI11_PARSE(app, argc, argv);
  for (auto& [sub, run] : runners) {
    if (sub->parsed()) return run();
  }
  return 2;
}
