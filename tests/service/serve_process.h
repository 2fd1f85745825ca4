// `rolloutcore serve` as a child process, for the tests that check what the real command does.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace rc::service::stack {

struct ServeRun {
  int exit_code = -1;  // -1: killed at the limit
  std::string output;  // stdout and stderr together
  std::chrono::steady_clock::duration took{};
};

// Starts `binary serve ARGS...` with stdout and stderr in `out`; its pid. With `open_files`, the
// child's RLIMIT_NOFILE (soft and hard, so serve cannot raise it) is set to it before the exec.
inline pid_t SpawnServe(const std::string& binary, const std::vector<std::string>& args,
                        const std::filesystem::path& out,
                        std::optional<rlim_t> open_files = std::nullopt) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (open_files) {
      const rlimit lim{*open_files, *open_files};
      if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) ::_exit(126);
    }
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<std::string> all = {binary, "serve"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Runs `binary serve ARGS...` with its output in `out`, and kills it at `limit`.
inline ServeRun RunServeProcess(const std::string& binary, const std::vector<std::string>& args,
                                const std::filesystem::path& out,
                                std::chrono::steady_clock::duration limit) {
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = SpawnServe(binary, args, out);
  ServeRun r;
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (std::chrono::steady_clock::now() - t0 > limit) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.took = std::chrono::steady_clock::now() - t0;
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  return r;
}

// `binary serve ARGS...` running beside the test, its output in `out`: the test talks to it,
// signals it and waits for its exit. Killed (SIGKILL) by the destructor if it still runs.
class ServeChild {
 public:
  ServeChild(const std::string& binary, const std::vector<std::string>& args,
             std::filesystem::path out, std::optional<rlim_t> open_files = std::nullopt)
      : out_(std::move(out)) {
    pid_ = SpawnServe(binary, args, out_, open_files);
  }
  ~ServeChild() {
    if (exit_code_ != kRunning || pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  ServeChild(const ServeChild&) = delete;
  ServeChild& operator=(const ServeChild&) = delete;

  // The port serve printed ("listening on HOST:PORT"), or 0 when it exited or `limit` passed first.
  int WaitListening(std::chrono::steady_clock::duration limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until && !Exited()) {
      std::istringstream lines(Output());
      for (std::string line; std::getline(lines, line);) {
        if (line.rfind("listening on ", 0) != 0) continue;
        const std::size_t colon = line.rfind(':');
        if (colon != std::string::npos) return std::atoi(line.c_str() + colon + 1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return 0;
  }

  void Signal(int sig) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }

  // Its exit code (128 + N after signal N), or -1 when it still ran at `limit` (then killed).
  int Wait(std::chrono::steady_clock::duration limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!Exited() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (Exited()) return exit_code_;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    exit_code_ = -1;
    return exit_code_;
  }

  std::string Output() const {
    std::ifstream in(out_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  static constexpr int kRunning = -2;
  bool Exited() {
    if (exit_code_ != kRunning) return true;
    int status = 0;
    if (pid_ <= 0 || ::waitpid(pid_, &status, WNOHANG) != pid_) return pid_ <= 0;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }

  std::filesystem::path out_;
  pid_t pid_ = -1;
  int exit_code_ = kRunning;
};

}  // namespace rc::service::stack
