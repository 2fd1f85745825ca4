// TrajectoryLog: a bounded JSON-lines file of what each proxied rollout saw (prompt and output
// token ids, logprobs), keyed by rollout id and the seq of its admission. The journal's
// TrajectoryRecorded parts hold choice 0; this file holds every choice as the engine reported
// it, for `audit`. Lines are appended and flushed at rollout end; when the file reaches
// bytes_max it is renamed to <path>.1 (replacing an older one) and a new file begins, so at most
// 2 * bytes_max bytes are kept. A line larger than kTrajectoryLineBytesMax is dropped (counted),
// never truncated into invalid JSON.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include "statemachine/status.h"

namespace rc::service {

inline constexpr std::size_t kTrajectoryLineBytesMax = std::size_t{16} << 20;

class TrajectoryLog {
 public:
  TrajectoryLog() = default;
  ~TrajectoryLog();
  TrajectoryLog(const TrajectoryLog&) = delete;
  TrajectoryLog& operator=(const TrajectoryLog&) = delete;

  [[nodiscard]] Status Open(const std::string& path, std::uint64_t bytes_max);
  // Appends one line (one JSON document, no newline in it); returns false when it was dropped
  // (too large or an I/O error).
  bool Append(std::string line);
  void Close();
  const std::string& path() const { return path_; }

 private:
  std::mutex mu_;
  std::FILE* file_ = nullptr;
  std::string path_;
  std::uint64_t bytes_max_ = 0;
  std::uint64_t bytes_ = 0;
};

}  // namespace rc::service
