// rolloutcore: the update executor beside a trainer, and the tools around its journal.
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "cli/commands.h"
#include "statemachine/text.h"

namespace {

// A verdict is worth only the report that carries it: a report that did not reach stdout whole
// (a full disk, a closed pipe's reader gone with SIGPIPE ignored) exits kExitOutputFailed, so a
// script never takes an exit 0 for a report nobody can read. stdout is flushed here, while the
// error can still be told; the flush at exit would fail silently.
int CheckedOutput(const std::string& command, int verdict) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int flush_errno = errno;
  if (flushed && std::ferror(stdout) == 0) return verdict;
  std::fprintf(stderr,
               "rolloutcore %s: the report could not be written to stdout (%s): exit %d in place "
               "of its verdict's %d\n",
               command.c_str(), flushed ? "an earlier write failed" : std::strerror(flush_errno),
               rc::audit::kExitOutputFailed, verdict);
  return rc::audit::kExitOutputFailed;
}

// A command line CLI11 refuses (an unknown option, an option without its value, one given twice,
// no journal, no --label) for replay, audit, demo or restore is a usage error as their own are:
// exit 2, one escaped line on stderr (CLI11's message may quote the command line), nothing on
// stdout. serve, and help (exit 0), keep CLI11's own handling.
int ParseFailed(const CLI::App& app, const CLI::ParseError& e, const CLI::App* strict) {
  if (strict == nullptr || e.get_exit_code() == 0) return app.exit(e);
  std::fprintf(stderr, "rolloutcore %s: %s (rolloutcore %s --help lists its options)\n",
               strict->get_name().c_str(), rc::text::escape_line(e.what()).c_str(),
               strict->get_name().c_str());
  return rc::audit::kExitUsage;
}

// What a subcommand's run is. kReport: its product is its report on stdout (replay, audit),
// checked once run. kReport and kTool (demo, restore) refuse a command line as a usage error
// (ParseFailed); kServer (serve) keeps CLI11's handling.
enum class Kind { kReport, kTool, kServer };

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"RolloutCore: safe live policy-weight updates for vLLM"};
  app.require_subcommand(1);
  std::map<CLI::App*, rc::cli::Runner> runners;
  std::vector<CLI::App*> strict;  // the subcommands whose refused command lines are usage errors
  auto add = [&](rc::cli::Runner (*fn)(CLI::App&), const char* name, const char* help, Kind kind) {
    CLI::App* sub = app.add_subcommand(name, help);
    rc::cli::Runner run = fn(*sub);
    if (kind != Kind::kServer) strict.push_back(sub);
    if (kind != Kind::kReport) {
      runners[sub] = std::move(run);
      return;
    }
    runners[sub] = [command = std::string(name), run = std::move(run)]() {
      // A reader that went away (a closed pipe) is a failed write (EPIPE), told as one, not a
      // signal that ends the process with no word on stderr.
      std::signal(SIGPIPE, SIG_IGN);
      return CheckedOutput(command, run());
    };
  };
  add(&rc::cli::add_replay, "replay",
      "Refold a journal, re-verify every decision and the hash chain, explain TAINTED incidents",
      Kind::kReport);
  add(&rc::cli::add_demo, "demo",
      "Run an update scenario against the vLLM test double and print its timeline", Kind::kTool);
  add(&rc::cli::add_serve, "serve",
      "Run the update executor: trainer API, enforcing admission proxy and /metrics",
      Kind::kServer);
  add(&rc::cli::add_audit, "audit",
      "Audit a journal offline: integrity, lifecycle history, provenance, trajectories",
      Kind::kReport);
#ifdef RC_CLI_HAVE_EFFECTS
  add(&rc::cli::add_restore, "restore",
      "Ask a running executor to restore its TAINTED engine to an earlier version, with proof",
      Kind::kTool);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // The subcommand whose options were being read when CLI11 refused them, if it is strict.
    const auto parsing = std::find_if(strict.begin(), strict.end(),
                                      [](const CLI::App* sub) { return sub->parsed(); });
    return ParseFailed(app, e, parsing == strict.end() ? nullptr : *parsing);
  }
  for (auto& [sub, run] : runners) {
    if (sub->parsed()) return run();
  }
  return 2;
}
