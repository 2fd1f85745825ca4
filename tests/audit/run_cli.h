// Runs the `rolloutcore` command as a child process (its path: RC_TEST_ROLLOUTCORE_BIN) and keeps
// what it printed and how it exited: the CLI tests' one way to run it.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

namespace rc::cli_testing {

struct CliRun {
  int exit_code = -1;  // -1: did not exit normally
  std::string out;     // stdout, and stderr too with `with_stderr`
};

// Runs `rolloutcore ARGS` (each argument single-quoted: test arguments hold no quote).
inline CliRun RunCli(const std::vector<std::string>& args, bool with_stderr) {
  std::string cmd = RC_TEST_ROLLOUTCORE_BIN;
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += with_stderr ? " 2>&1" : " 2>/dev/null";
  CliRun run;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return run;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) run.out.append(buf, n);
  const int status = ::pclose(p);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

}  // namespace rc::cli_testing
