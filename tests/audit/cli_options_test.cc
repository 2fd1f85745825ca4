// `rolloutcore demo` and `rolloutcore restore` as child processes: the numbers on their command
// lines (demo --token-delay-ms and --fleet, restore --timeout-s) are read strictly, their text
// options given empty (or holding no value of their kind) are refused rather than read as left
// out, and a command line CLI11 refuses is a usage error as replay's and audit's are: exit 2,
// nothing on stdout, one escaped line on stderr quoting what was typed. Every refusal comes before
// anything runs: no double started, no journal created, nothing sent to an executor. serve's
// command lines CLI11 refuses, and one naming no command, are one escaped line too, and no refusal
// shows a value typed. The commands `demo` prints name its journal when pasted back, and `serve`
// refuses a FIFO for its config file or in its journal at once.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "statemachine/text.h"
#include "tests/audit/cli_journals.h"
#include "tests/audit/cli_usage.h"
#include "tests/audit/run_cli.h"
#include "tests/journal/test_util.h"

namespace rc {
namespace {

using cli_testing::CliRun;
using cli_testing::ExpectUsageError;
using cli_testing::kNotWholeNumbers;
using cli_testing::Lines;
using cli_testing::RunCli;
using cli_testing::RunCliIn;
using journal::testing::TempDir;

// No executor listens here: a restore sent there is answered by the transport, never by serve.
constexpr const char* kNoExecutor = "http://127.0.0.1:1";

// `demo ARGS` with its journal in `dir` (which holds a file, so that a demo whose options passed
// stops at once, refusing to append to it).
std::vector<std::string> Demo(const TempDir& dir, std::vector<std::string> args) {
  args.insert(args.begin(), {"demo", "--journal", dir.path()});
  return args;
}

// `restore ARGS` of an adoption of rc-0 at kNoExecutor.
std::vector<std::string> Restore(std::vector<std::string> args) {
  args.insert(args.begin(), {"restore", "--url", kNoExecutor, "--label", "rc-0", "--adopt"});
  return args;
}

// A whole-number option's refusal of `typed`: "rolloutcore COMMAND: OPTION: 'TYPED' is not a
// whole number from MIN to MAX (digits only)".
std::string NotANumber(const std::string& command, const std::string& option,
                       const std::string& typed, const std::string& range) {
  return "rolloutcore " + command + ": " + option + ": '" + text::escape_line(typed) +
         "' is not a whole number from " + range + " (digits only)";
}

// Proves demo --token-delay-ms (1 to 1000), demo --fleet (2 to 16) and restore --timeout-s (1 to
// 86400) refuse every text that is not a whole number in range, as a usage error quoting it (exit
// 2, nothing on stdout, one escaped line), while leading zeros are digits. Catches CLI11's
// conversion, which took "1e3", " 5" or "0x10", wrapped or clamped values out of range, and
// refused the rest with its own exit codes (105, 106) and unescaped text; and a --timeout-s
// whose milliseconds wrapped past 2^64 into a short deadline.
TEST(CliOptions, DemoAndRestoreNumbersAreReadStrictly) {
  TempDir dir;
  std::ofstream(dir.sub("taken")) << "a file: the demo never appends to a directory holding one\n";
  std::vector<std::string> not_numbers = kNotWholeNumbers;
  for (const char* more : {"1e3", "0x10", " 5", "0"}) not_numbers.push_back(more);
  for (const std::string& typed : not_numbers) {
    ExpectUsageError(Demo(dir, {"--token-delay-ms", typed}),
                     NotANumber("demo", "--token-delay-ms", typed, "1 to 1000"));
    ExpectUsageError(Restore({"--timeout-s", typed}),
                     NotANumber("restore", "--timeout-s", typed, "1 to 86400"));
#ifdef RC_TEST_CLI_HAS_FLEET
    ExpectUsageError(Demo(dir, {"--fleet", typed}),
                     NotANumber("demo", "--fleet", typed, "2 to 16"));
#endif
  }
  ExpectUsageError(Demo(dir, {"--token-delay-ms", "1001"}),
                   NotANumber("demo", "--token-delay-ms", "1001", "1 to 1000"));
  for (const char* typed : {"86401", "9223372036854775808", "18446744073709551615"}) {
    ExpectUsageError(Restore({"--timeout-s", typed}),
                     NotANumber("restore", "--timeout-s", typed, "1 to 86400"));
  }
#ifdef RC_TEST_CLI_HAS_FLEET
  for (const char* typed : {"1", "17", "256"}) {
    ExpectUsageError(Demo(dir, {"--fleet", typed}),
                     NotANumber("demo", "--fleet", typed, "2 to 16"));
  }
#endif
  // Options that pass: the demo stops at its journal, the restore at the transport.
  const CliRun demo = RunCli(Demo(dir, {"--token-delay-ms", "0010"}), /*with_stderr=*/true);
  EXPECT_EQ(demo.exit_code, 2) << demo.out;
  EXPECT_NE(demo.out.find("already holds a journal"), std::string::npos) << demo.out;
  const CliRun restore = RunCli(Restore({"--timeout-s", "0002"}), /*with_stderr=*/false);
  EXPECT_EQ(restore.exit_code, 2) << restore.out;
  EXPECT_EQ(restore.out.rfind("restore: no answer from the executor (nothing was sent): ", 0), 0u)
      << restore.out;
}

// Proves demo's and restore's text options given empty (or with no value of their kind: a URL
// without http:// or a host, a label with a line break) are usage errors quoting the text, never
// the option left out, and that a restore with both or neither of --source and --adopt is one
// too. Catches `restore --url ''` aborting on the HTTP client's check, `--restore-id ''` sent as
// the default restore-<label>, `--adopt --source ''` sent as an adoption, and `demo --journal ''`
// starting the double before its journal failed to open.
TEST(CliOptions, DemoAndRestoreTextOptionsAreNeverReadAsLeftOut) {
  const std::string id = "' is not an id: 1 to 128 bytes of printable UTF-8";
  const std::string url =
      "' is not an http:// or https:// URL naming a host (printable ASCII, no spaces)";
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"demo", "--journal", ""}, "demo: --journal: '' is not a path (an empty one names nothing)"},
      {{"restore", "--label", "", "--adopt"}, "restore: --label: '" + id},
      {{"restore", "--label", "rc\n0", "--adopt"}, "restore: --label: 'rc\n0" + id},
      {{"restore", "--url", "", "--label", "rc-0", "--adopt"}, "restore: --url: '" + url},
      {{"restore", "--url", "/", "--label", "rc-0", "--adopt"}, "restore: --url: '/" + url},
      {{"restore", "--url", "127.0.0.1:8080", "--label", "rc-0", "--adopt"},
       "restore: --url: '127.0.0.1:8080" + url},
      {Restore({"--restore-id", ""}), "restore: --restore-id: '" + id},
      {Restore({"--source", ""}),
       "restore: --source: '' is not 1 to 4096 bytes of printable UTF-8"},
      {Restore({"--source", "safetensors:/ckpt"}),
       "restore: give --source URI, or --adopt (not both)"},
      {{"restore", "--url", kNoExecutor, "--label", "rc-0"},
       "restore: give --source URI, or --adopt (not both)"}};
  for (const auto& [args, why] : refused) {
    ExpectUsageError(args, "rolloutcore " + text::escape_line(why));
  }
}

// Proves a command line CLI11 itself refuses for demo or restore (no --label, an option without
// its value or given twice, an unknown option holding a line break) exits 2 with nothing on
// stdout and one escaped line on stderr naming the command, as for replay and audit, while
// --help still exits 0. Catches CLI11's own exit codes (106, 109, 114) and its raw message, which
// restore's documented "2: bad arguments" did not hold to.
TEST(CliOptions, CommandLinesCli11RefusesExitAsUsageErrors) {
  const std::vector<std::vector<std::string>> refused = {
      {"restore", "--adopt"},
      {"restore", "--label", "rc-0", "--adopt", "--timeout-s"},
      {"restore", "--label", "rc-0", "--label", "rc-1", "--adopt"},
      {"demo", "--token-delay-ms", "1", "--token-delay-ms", "2"},
      {"demo", "--bogus\ntimeline: OK"}};
  cli_testing::ExpectCli11Refusals(refused,
                                   {{"demo", "--token-delay-ms"}, {"restore", "--timeout-s"}});
}

// Proves a command line CLI11 refuses, for serve, restore or naming no command, is one line on
// stderr naming the command, nothing on stdout and the exit code (CLI11's for serve and no
// command, 2 for restore), and shows no value typed: a misspelt `--auth-tokn SECRET` names the
// option only, a `--port` value holding a line break is not echoed; catches CLI11's own message
// for serve, which printed the secret and let the line break forge a second stderr line.
TEST(CliOptions, RefusedCommandLinesNeverShowAValueTyped) {
  const std::string secret = "s3cr3t-token-7f3a";
  struct Refused {
    std::vector<std::string> args;
    int exit_code;
    std::string command;  // how the line names it
    std::string option;   // the option name it must show ("": none)
  };
  const std::vector<Refused> refused = {
      {{"serve", "--auth-tokn", secret}, 109, "rolloutcore serve", "--auth-tokn"},
      {{"serve", "--auth-tokn=" + secret}, 109, "rolloutcore serve", "--auth-tokn"},
      {{"serve", "-a" + secret}, 109, "rolloutcore serve", "-a"},
      {{"restore", "--label", "rc-0", "--adopt", "--auth-tokn", secret},
       2,
       "rolloutcore restore",
       "--auth-tokn"},
      {{"--auth-tokn", secret}, 106, "rolloutcore", ""},
#ifdef RC_TEST_CLI_HAS_SERVE
      {{"serve", "--port", "1\nrolloutcore serve: listening, token " + secret},
       104,
       "rolloutcore serve",
       "--port"},
#endif
  };
  for (const Refused& r : refused) {
    const std::string typed = text::escape_line(r.args.back());
    const CliRun out = RunCli(r.args, /*with_stderr=*/false);
    EXPECT_EQ(out.exit_code, r.exit_code) << typed << ": " << text::escape_line(out.out);
    EXPECT_EQ(out.out, "") << typed;
    const CliRun all = RunCli(r.args, /*with_stderr=*/true);
    const std::vector<std::string> lines = Lines(all.out);
    ASSERT_EQ(lines.size(), 1u) << typed << ": " << text::escape_line(all.out);
    EXPECT_EQ(lines[0].rfind(r.command + ": ", 0), 0u) << lines[0];
    EXPECT_NE(lines[0].find("(" + r.command + " --help lists its "), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find(r.option), std::string::npos) << lines[0];
    EXPECT_EQ(all.out.find(secret), std::string::npos) << lines[0];
  }
}

// Proves each command `demo` prints for inspecting its journal (and `demo --fleet`'s) names that
// journal when its path begins with `-`: pasted back through /bin/sh and the CLI's own parser,
// replay verifies the demo's journal and audit finds it intact. Catches `replay -j --events` and
// `rolloutcore audit -j`, which CLI11 reads as an option it does not know (exit 2, nothing read).
TEST(CliOptions, TheCommandsADemoPrintsNameAJournalBeginningWithADash) {
  std::vector<std::vector<std::string>> demos = {{"demo", "--journal=-j", "--token-delay-ms=1"}};
#ifdef RC_TEST_CLI_HAS_FLEET
  demos.push_back({"demo", "--journal=--fleet", "--fleet=2", "--token-delay-ms=1"});
#endif
  for (const std::vector<std::string>& demo : demos) {
    TempDir dir;
    const CliRun ran = RunCliIn(dir.path(), demo);
    const std::vector<std::string> lines = Lines(ran.out);
    const auto intro = std::find_if(lines.begin(), lines.end(), [](const std::string& l) {
      return l.find(" — inspect it with:") != std::string::npos;
    });
    ASSERT_NE(intro, lines.end()) << ran.out;
    ASSERT_GE(lines.end() - intro, 3) << ran.out;
    for (const std::string& line : {intro[1], intro[2]}) {
      ASSERT_EQ(line.rfind("  ", 0), 0u) << line;
      const std::string printed = line.substr(2);
      const CliRun inspected = cli_testing::RunPrinted(dir.path(), printed);
      if (printed.find(" replay ") != std::string::npos) {
        EXPECT_EQ(inspected.exit_code, 0) << printed << ": " << inspected.out;
        EXPECT_NE(inspected.out.find("verification: OK"), std::string::npos) << inspected.out;
      } else {  // audit: 1 when the fleet demo's tainted engine is its finding
        EXPECT_TRUE(inspected.exit_code == 0 || inspected.exit_code == 1)
            << printed << ": " << inspected.out;
        EXPECT_NE(inspected.out.find("journal: INTACT\n"), std::string::npos) << inspected.out;
      }
    }
  }
}

#ifdef RC_TEST_CLI_HAS_SERVE
// Proves `serve` refuses at once, before anything is read or started, a FIFO given as its config
// file and a journal whose directory holds a FIFO (CURRENT): exit 2 and one line naming it.
// Catches the opens that waited for ever for a writer: each command runs under a 20 s limit, so
// that regression exits 124 or 137 here rather than hanging the test.
TEST(CliOptions, ServeRefusesAFifoWhereItReadsAFile) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.sub("config.json").c_str(), 0600), 0) << std::strerror(errno);
  const CliRun config = RunCliIn(dir.path(), {"serve", "--config", "config.json"}, 20);
  EXPECT_EQ(config.exit_code, 2) << config.out;
  EXPECT_EQ(config.out,
            "rolloutcore serve: InvalidArgument: config file 'config.json' is a FIFO, not a "
            "regular file: refused before reading it\n");
  ASSERT_EQ(::mkdir(dir.sub("j").c_str(), 0700), 0) << std::strerror(errno);
  ASSERT_EQ(::mkfifo(dir.sub("j/CURRENT").c_str(), 0600), 0) << std::strerror(errno);
  const CliRun journal = RunCliIn(
      dir.path(), {"serve", "--journal", "j", "--port", "0", "--engine-url", kNoExecutor}, 20);
  EXPECT_EQ(journal.exit_code, 2) << journal.out;
  EXPECT_EQ(journal.out,
            "rolloutcore serve: InvalidArgument: journal 'j' holds 'CURRENT', a FIFO: refused "
            "before opening the journal (its open would wait on it)\n");
}
#endif

}  // namespace
}  // namespace rc
