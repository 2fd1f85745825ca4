// What the CLI tests expect of a usage error (exit 2, nothing on stdout, exactly one escaped line
// on stderr), and the texts no whole-number option takes.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "statemachine/text.h"
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

}  // namespace rc::cli_testing
