// TrajectoryLog: a bounded JSON-lines file of what each proxied rollout saw (prompt and output
// token ids, logprobs), keyed by rollout id and the seq of its admission. The journal's
// TrajectoryRecorded parts hold choice 0; this file holds every choice as the engine reported
// it, for `audit`. Lines are appended at rollout end; when the file reaches bytes_max it is
// renamed to <path>.1 (replacing an older one) and a new file begins, so at most 2 * bytes_max
// bytes are kept. A line larger than kTrajectoryLineBytesMax is dropped (counted), never
// truncated into invalid JSON.
//
// Append only queues the line: one writer thread owns the file, so a stalled filesystem (NFS)
// never blocks the event loops that call Append. The writer takes the lines queued within a few
// milliseconds of each other and writes them with one call. The queue is bounded in lines and in
// bytes; a line that does not fit is dropped and counted. A write that fails part-way is cut back
// off the file (or, when that fails too, the next line starts on a fresh line), so a broken line
// never merges with the next record.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "effects/thread_start.h"
#include "statemachine/status.h"

namespace rc::service {

inline constexpr std::size_t kTrajectoryLineBytesMax = std::size_t{16} << 20;

// What the writer's queue may hold (lines not yet handed to the file, newlines included).
struct TrajectoryQueueLimits {
  std::size_t lines_max = 4096;
  std::uint64_t bytes_max = std::uint64_t{64} << 20;
};
static_assert(TrajectoryQueueLimits{}.bytes_max >= kTrajectoryLineBytesMax,
              "the largest line fits an empty queue");

// How long Close waits, by default, for the writer to finish the lines queued before it.
inline constexpr std::uint64_t kTrajectoryDrainTimeoutMsDefault = 5000;

// Lines since Open. Every line given to Append ends as exactly one of written or dropped, or is
// still queued or in flight.
struct TrajectoryLogStats {
  std::uint64_t written = 0;
  // Too large, the queue full, the log closed, an I/O error, or abandoned by Close's deadline.
  std::uint64_t dropped = 0;
  std::uint64_t queued_lines = 0;
  std::uint64_t queued_bytes = 0;
  bool in_flight = false;  // the writer is inside a write
};

class TrajectoryLog {
 public:
  struct Shared;  // the queue and the file, shared with the writer thread (trajectories.cc)

  TrajectoryLog() = default;
  ~TrajectoryLog();
  TrajectoryLog(const TrajectoryLog&) = delete;
  TrajectoryLog& operator=(const TrajectoryLog&) = delete;

  // Opens (creates) the file and starts the writer (its thread got from `starter`; empty:
  // std::thread); once, before any Append. A writer the system refuses is Unavailable naming it,
  // and the log is left as never opened (the file closed, Append drops).
  [[nodiscard]] Status Open(const std::string& path, std::uint64_t bytes_max,
                            TrajectoryQueueLimits limits = {},
                            const effects::ThreadStarter& starter = {});
  // Queues one line (one JSON document, no newline in it) without waiting for the file. False:
  // dropped now (too large, the queue full, not open). True: queued; the writer may still drop
  // it on an I/O error (stats().dropped).
  bool Append(std::string line);
  // True once every line queued so far is written or dropped; false at the deadline.
  bool Drain(std::uint64_t timeout_ms);
  // Stops the writer after it has written what is queued, waiting at most drain_timeout_ms; past
  // that the writer is left to finish the one write it is in (it starts no other) and the lines
  // not written are dropped, logged, counted and returned (those of that write may still reach
  // the file). Idempotent; not concurrent with itself or Open.
  std::uint64_t Close(std::uint64_t drain_timeout_ms = kTrajectoryDrainTimeoutMsDefault);
  TrajectoryLogStats stats() const;
  const std::string& path() const { return path_; }

 private:
  std::shared_ptr<Shared> shared_;
  std::thread writer_;
  std::string path_;
};

}  // namespace rc::service
