// What the CLI tests expect of a usage error (exit 2, nothing on stdout, exactly one escaped line
// on stderr), and the texts no whole-number option takes.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "statemachine/text.h"
#include "tests/audit/cli_journals.h"
#include "tests/audit/run_cli.h"

namespace rc::cli_testing {

// Texts no whole-number option takes: a sign, spaces, another base, a fraction, an exponent, no
// digits at all, a value past 2^64-1, and a line break (which the message must escape).
inline const std::vector<std::string> kNotWholeNumbers = {"-1",
                                                          "18446744073709551616",
                                                          "99999999999999999999999",
                                                          "+3",
                                                          " 3",
                                                          "3 ",
                                                          "0x3",
                                                          "3e0",
                                                          "3.0",
                                                          "three",
                                                          "",
                                                          "3\n4"};

// `args` refused as a usage error: exit 2, nothing on stdout, and exactly `line` on stderr.
inline void ExpectUsageError(const std::vector<std::string>& args, const std::string& line) {
  const CliRun out = RunCli(args, /*with_stderr=*/false);
  EXPECT_EQ(out.exit_code, 2) << text::escape_line(line) << ": " << text::escape_line(out.out);
  EXPECT_EQ(out.out, "") << text::escape_line(line);
  const CliRun all = RunCli(args, /*with_stderr=*/true);
  EXPECT_EQ(all.out, line + "\n") << text::escape_line(all.out);
}

// Each of `refused` (a command line CLI11 itself refuses: its first word the command) a usage
// error: exit 2, nothing on stdout, one stderr line naming the command and pointing at its --help;
// and `--help` of each command in `helped` exits 0 listing its option.
inline void ExpectCli11Refusals(const std::vector<std::vector<std::string>>& refused,
                                const std::vector<std::pair<std::string, std::string>>& helped) {
  for (const std::vector<std::string>& args : refused) {
    const CliRun out = RunCli(args, /*with_stderr=*/false);
    EXPECT_EQ(out.exit_code, 2) << text::escape_line(args.back()) << ": " << out.out;
    EXPECT_EQ(out.out, "") << text::escape_line(args.back());
    const CliRun all = RunCli(args, /*with_stderr=*/true);
    const std::vector<std::string> lines = Lines(all.out);
    ASSERT_EQ(lines.size(), 1u) << text::escape_line(all.out);
    EXPECT_EQ(lines[0].rfind("rolloutcore " + args[0] + ": ", 0), 0u) << lines[0];
    EXPECT_NE(lines[0].find("(rolloutcore " + args[0] + " --help lists its options)"),
              std::string::npos)
        << lines[0];
  }
  for (const auto& [command, option] : helped) {
    const CliRun help = RunCli({command, "--help"}, /*with_stderr=*/false);
    EXPECT_EQ(help.exit_code, 0) << help.out;
    EXPECT_NE(help.out.find(option), std::string::npos) << help.out;
  }
}

}  // namespace rc::cli_testing
