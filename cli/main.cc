// rolloutcore: the update executor beside a trainer, and the tools around its journal.
#include <sysexits.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "audit/audit.h"
#include "cli/commands.h"
#include "statemachine/text.h"

namespace {

// Exit codes: each command's own (0 success; audit and replay: audit/audit.h, 0..4; serve: 1 its
// start failed, 2 a usage or configuration error, 3 an unclean exit, 4 a fail-stop; a command line
// CLI11 refuses: 2, or CLI11's own code, 104..114, for serve and a line naming no command
// (ParseFailed)), and this one, which none of them uses: an exception no handler took (Fatal).
inline constexpr int kExitFatal = EX_SOFTWARE;  // 70, sysexits.h's "internal software error"

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

// What a subcommand's run is. kReport: its product is its report on stdout (replay, audit),
// checked once run. kReport and kTool (demo, restore) exit 2 on a command line CLI11 refuses, as
// on their own usage errors; kServer (serve) exits with CLI11's code (ParseFailed).
enum class Kind { kReport, kTool, kServer };

struct Command {
  CLI::App* app = nullptr;
  Kind kind = Kind::kReport;
};

// What a refusal shows of the arguments CLI11 did not expect: at most this many option names, each
// cut to this many bytes.
inline constexpr std::size_t kShownNamesMax = 8;
inline constexpr std::size_t kShownNameBytesMax = 64;
// CLI11's other messages (option and command names, counts) are cut to this many bytes.
inline constexpr std::size_t kRefusalBytesMax = 1024;

// The option name an argument typed gives, without the value it may carry: `--name` of
// `--name=value`, `-x` of `-xvalue`; "" when the argument is not an option (a value).
std::string OptionName(const std::string& arg) {
  if (arg.size() < 2 || arg[0] != '-') return "";
  const std::size_t end = arg[1] == '-' ? arg.find('=') : 2;
  return rc::text::utf8_prefix(arg.substr(0, end), kShownNameBytesMax);
}

// The arguments CLI11 did not expect, by option name only: the value after a mistyped option may
// be a secret (`--auth-tokn TOKEN`), so a value is counted, never shown.
std::string NotExpected(const std::vector<std::string>& args) {
  std::string names;
  std::size_t options = 0;
  std::size_t values = 0;
  for (const std::string& arg : args) {
    const std::string name = OptionName(arg);
    if (name.empty()) {
      ++values;
    } else if (++options <= kShownNamesMax) {
      names += (options == 1 ? "" : " ") + rc::text::escape_line(name);
    }
  }
  if (options == 0 && values == 0) return "arguments not expected (not shown: one may be a secret)";
  std::string out = "arguments not expected:";
  if (options > 0) out += " " + names;
  if (options > kShownNamesMax) {
    out += " and " + std::to_string(options - kShownNamesMax) + " more options";
  }
  if (values > 0) {
    out += std::string(options > 0 ? "," : "") + " " + std::to_string(values) +
           (values == 1 ? " argument that is not an option" : " arguments that are not options") +
           ", not shown (a value may be a secret)";
  }
  return out;
}

// CLI11's refusal of a value given to an option it knows, less the value: "Could not convert:
// NAME = VALUE" names the option and the value's size. Messages that hold no value ("NAME: too
// many inputs for a flag", "NAME: Should be true/false or a number") are kept; any other form is
// replaced whole.
std::string ValueRefused(const std::string& what) {
  constexpr std::string_view kConvert = "Could not convert: ";
  const std::size_t eq = what.find(" = ", kConvert.size());
  if (what.starts_with(kConvert) && eq != std::string::npos) {
    const std::string name = what.substr(kConvert.size(), eq - kConvert.size());
    return rc::text::escape_line(rc::text::utf8_prefix(name, kShownNameBytesMax)) +
           ": the value given could not be read (its " + std::to_string(what.size() - eq - 3) +
           " bytes are not shown: a value may be a secret)";
  }
  if (what.ends_with(": too many inputs for a flag") ||
      what.ends_with(": Should be true/false or a number")) {
    return rc::text::escape_line(rc::text::utf8_prefix(what, kRefusalBytesMax));
  }
  return "a value given is not one its option takes (not shown: a value may be a secret)";
}

// What CLI11 refused, as one escaped line that never shows a value typed (docs/security.md: no
// token is ever printed, and a token typed after a misspelt option is an unexpected argument).
std::string RefusalText(const CLI::App& app, const CLI::ParseError& e) {
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) return NotExpected(app.remaining(true));
  if (dynamic_cast<const CLI::ConversionError*>(&e) != nullptr ||
      dynamic_cast<const CLI::ValidationError*>(&e) != nullptr) {
    return ValueRefused(e.what());
  }
  return rc::text::escape_line(rc::text::utf8_prefix(e.what(), kRefusalBytesMax));
}

// A command line CLI11 refuses (an unknown option, an option without its value, one given twice,
// a value it cannot convert, no journal, no --label, no command), for every command: one escaped
// line on stderr naming the command (RefusalText), nothing on stdout. replay, audit, demo and
// restore exit 2, as on their own usage errors; serve and a command line naming no command exit
// with CLI11's code. Help (exit 0) is printed by CLI11.
int ParseFailed(const CLI::App& app, const CLI::ParseError& e, const Command* command) {
  if (e.get_exit_code() == 0) return app.exit(e);
  const std::string who =
      command == nullptr ? std::string("rolloutcore") : "rolloutcore " + command->app->get_name();
  std::fprintf(stderr, "%s: %s (%s --help lists its %s)\n", who.c_str(),
               RefusalText(app, e).c_str(), who.c_str(),
               command == nullptr ? "commands" : "options");
  const bool strict = command != nullptr && command->kind != Kind::kServer;
  return strict ? rc::audit::kExitUsage : e.get_exit_code();
}

// An exception no handler takes (a bug, or memory or threads the system refused where nothing
// below turned the refusal into an error) ends the process here, from std::terminate: one escaped
// line on stderr and kExitFatal, never "terminate called after throwing" and a core. No handler
// in main catches it on purpose: catching unwinds serve's frames, whose destructors would close
// the journal cleanly (its CLOSED mark) for what is a crash, and tear the service down under
// threads still running; terminate runs before any unwinding, so the next start recovers.
[[noreturn]] void Fatal() noexcept {
  const char* what = "an exception not derived from std::exception";
  try {
    if (std::exception_ptr e = std::current_exception()) std::rethrow_exception(e);
    what = "std::terminate without an exception";
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  try {
    std::fprintf(stderr, "rolloutcore: fatal: %s\n", rc::text::escape_line(what).c_str());
  } catch (...) {  // no memory left even to escape the message: the line without it
    std::fputs("rolloutcore: fatal: an error whose message could not be printed\n", stderr);
  }
  std::fflush(stderr);
  std::_Exit(kExitFatal);
}

// Parses the command line and runs its subcommand; its exit code.
int Run(int argc, char** argv) {
  CLI::App app{"RolloutCore: safe live policy-weight updates for vLLM"};
  app.require_subcommand(1);
  std::map<CLI::App*, rc::cli::Runner> runners;
  std::vector<Command> commands;
  auto add = [&](rc::cli::Runner (*fn)(CLI::App&), const char* name, const char* help, Kind kind) {
    CLI::App* sub = app.add_subcommand(name, help);
    rc::cli::Runner run = fn(*sub);
    commands.push_back({sub, kind});
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
    // The subcommand whose options were being read when CLI11 refused them, if any.
    const auto parsing = std::find_if(commands.begin(), commands.end(),
                                      [](const Command& c) { return c.app->parsed(); });
    return ParseFailed(app, e, parsing == commands.end() ? nullptr : &*parsing);
  }
  for (auto& [sub, run] : runners) {
    if (sub->parsed()) return run();
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::set_terminate(Fatal);
  return Run(argc, argv);
}
