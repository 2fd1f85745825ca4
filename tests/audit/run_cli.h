// Runs the `rolloutcore` command as a child process (its path: RC_TEST_ROLLOUTCORE_BIN) and keeps
// what it printed and how it exited: the CLI tests' one way to run it.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/audit/quoting.h"

namespace rc::cli_testing {

struct CliRun {
  int exit_code = -1;  // -1: did not exit normally
  std::string out;     // what the shell command sent to its stdout (see each runner)
};

// Runs the shell command `cmd`; `out` is what it sent to its stdout.
inline CliRun RunCommand(const std::string& cmd) {
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

// `rolloutcore ARGS` as a shell command line (each argument one exact shell word, quotes in it
// included).
inline std::string CliCommand(const std::vector<std::string>& args) {
  std::string cmd = RC_TEST_ROLLOUTCORE_BIN;
  for (const std::string& a : args) cmd += " " + quoting_testing::ExactShellWord(a);
  return cmd;
}

// `rolloutcore ARGS` followed by `redirections`.
inline CliRun RunShell(const std::vector<std::string>& args, const std::string& redirections) {
  return RunCommand(CliCommand(args) + redirections);
}

// Runs `rolloutcore ARGS`; `out` is its stdout, and its stderr too with `with_stderr`.
inline CliRun RunCli(const std::vector<std::string>& args, bool with_stderr) {
  return RunShell(args, with_stderr ? " 2>&1" : " 2>/dev/null");
}

// Runs `rolloutcore ARGS` from directory `cwd` (so that a relative path, one beginning with `-`
// included, names a file there), its stderr with its stdout, killed after `limit_s` seconds: a
// command that blocks exits 124 (timeout's code) and the test fails rather than hangs.
inline CliRun RunCliIn(const std::string& cwd, const std::vector<std::string>& args,
                       int limit_s = 60) {
  return RunCommand("cd " + quoting_testing::ExactShellWord(cwd) + " && timeout -k 5 " +
                    std::to_string(limit_s) + " " + CliCommand(args) + " 2>&1");
}

// Runs, from directory `cwd`, a command line a tool printed for an operator to paste, split into
// arguments as /bin/sh splits it (quoting_testing::ShellWords), its first word `rolloutcore` read
// as the binary under test; `out` is its stdout and stderr. Nothing the line holds but its words
// reaches the command: it is run exactly as the shell would hand it to the binary.
inline CliRun RunPrinted(const std::string& cwd, const std::string& printed) {
  std::vector<std::string> words = quoting_testing::ShellWords(printed);
  if (words.empty()) return CliRun{};
  if (words[0] == "rolloutcore") words[0] = RC_TEST_ROLLOUTCORE_BIN;
  std::string cmd = "cd " + quoting_testing::ExactShellWord(cwd) + " && timeout -k 5 60";
  for (const std::string& w : words) cmd += " " + quoting_testing::ExactShellWord(w);
  return RunCommand(cmd + " 2>&1");
}

// Runs `rolloutcore ARGS` with its stdout sent to `stdout_path` (e.g. /dev/full); `out` is its
// stderr.
inline CliRun RunCliStdoutTo(const std::vector<std::string>& args, const std::string& stdout_path) {
  return RunShell(args, " 2>&1 >'" + stdout_path + "'");  // stderr to the pipe, then stdout away
}

// Runs `rolloutcore ARGS` with its stdout into a pipe whose reader exits at once; `out` is its
// stderr, then "exit N" with its exit status as the shell saw it (128 + a signal's number).
inline CliRun RunCliStdoutToClosedPipe(const std::vector<std::string>& args) {
  return RunCommand("exec 3>&1; { " + CliCommand(args) +
                    " 2>&3; echo \"exit $?\" >&3; } | exec true");
}

}  // namespace rc::cli_testing
