// The journal: an append-only, hash-chained event log in RocksDB; FlatBuffers records.
//
// Every acknowledged event is durable (WAL + fsync, group commit across concurrent appenders).
// A record is one Event plus its envelope: dense seq (1, 2, ...), wall time, the seq of the input
// that caused it (0 for an input itself), the SHA-256 of the previous record's stored bytes, and
// its own hash. One Append is one group (an input followed by its derived decisions) written in
// one WriteBatch.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "statemachine/events.h"
#include "statemachine/state.h"
#include "statemachine/status.h"

namespace rc::journal {

using Hash = std::array<std::uint8_t, 32>;  // SHA-256

inline constexpr std::size_t kRecordBytesMax = 64 * 1024;  // larger records are refused
inline constexpr std::size_t kGroupEventsMax = 1024;       // events in one Append
inline constexpr std::size_t kPendingAppendsMax = 4096;    // group-commit queue bound

struct Record {
  std::uint64_t seq = 0;
  std::int64_t wall_time_ms = 0;
  std::uint64_t cause_seq = 0;  // 0: an input (or client binding); else the seq of its input
  Hash prev_hash{};
  Hash hash{};  // SHA-256 over the stored bytes of this record
  Event event;
};

struct AppendRequest {
  // The head seq the caller believes is current (0 = empty journal). Unset: append at the head,
  // ordered by the journal (concurrent bindings); the controller always sets it.
  std::optional<std::uint64_t> expected_head_seq;
  // Idempotency key for the whole group. Same key + same event bytes -> the original seqs
  // (duplicate = true, nothing written); same key + different bytes -> Conflict. Empty: none.
  std::string client_event_id;
  std::int64_t wall_time_ms = 0;
  // events[0] is the input (cause_seq 0); events[1..] are derived from it (cause_seq = its seq).
  std::vector<Event> events;
};

struct AppendResult {
  std::uint64_t first_seq = 0;
  std::uint64_t last_seq = 0;
  bool duplicate = false;
};

struct Options {
  bool create_if_missing = true;
  bool sync = true;                    // fsync each group commit (off only in benchmarks)
  std::uint64_t snapshot_every = 10000;  // write a folded-state snapshot every N events (0: never)
  bool read_only = false;              // open as a secondary reader (works while a writer runs)
  std::string secondary_path;          // scratch dir for the secondary instance ("" = temp)
  // Long scans (Scan, Refold, open) read RocksDB on a second thread while the caller decodes,
  // verifies and folds; false: one thread (benchmarks compare the two).
  bool scan_pipelined = true;
};

// A ticket for an enqueued group: seqs are assigned at Enqueue, durability is awaited at Wait.
struct Ticket {
  AppendResult result;
  std::uint64_t batch_id = 0;
};

class Journal {
 public:
  virtual ~Journal() = default;

  // Opens or creates the journal at `path`. Errors: Busy ("journal already open by another
  // process", naming the holder's LOCK path), Corruption (naming the path; never auto-repaired).
  [[nodiscard]] static Result<std::unique_ptr<Journal>> Open(const std::string& path,
                                                             const Options& options);

  // Validates, assigns seqs and enqueues the group for the next group commit. Non-blocking apart
  // from a short internal lock; call Wait before acting on the events. Validation includes the
  // fold: every event must apply() to the journal's folded state (an illegal group is refused
  // whole, nothing written), and events[1..] must be exactly decide(state, events[0]).
  [[nodiscard]] virtual Result<Ticket> Enqueue(const AppendRequest& request) = 0;

  // The controller's entry point: under the journal's lock, decide(state, input); if accepted,
  // enqueue [input, decisions...] as one group and fold it. Returns the ticket and the derived
  // decisions; a rejection (Rejected / InvalidArgument / Conflict) writes nothing.
  struct Submitted {
    Ticket ticket;
    std::vector<Event> decisions;
  };
  [[nodiscard]] virtual Result<Submitted> Submit(const Event& input, std::int64_t wall_time_ms,
                                                 const std::string& client_event_id = "") = 0;

  // The folded state after every enqueued group (a copy, taken under the lock).
  virtual State state() const = 0;
  // Blocks until the ticket's group is durable (or the commit failed: the journal is then
  // unusable and every later call fails).
  [[nodiscard]] virtual Status Wait(const Ticket& ticket) = 0;
  // Enqueue + Wait.
  [[nodiscard]] virtual Result<AppendResult> Append(const AppendRequest& request) = 0;

  virtual std::uint64_t head_seq() const = 0;  // last durable-or-enqueued seq
  virtual Hash head_hash() const = 0;

  [[nodiscard]] virtual Result<Record> Read(std::uint64_t seq) = 0;
  // Visits records from_seq..to_seq inclusive (to_seq 0 = head) in order; decodes, verifies the
  // FlatBuffers structure and the hash chain; stops at the first error or non-OK visitor status.
  [[nodiscard]] virtual Status Scan(std::uint64_t from_seq, std::uint64_t to_seq,
                                    const std::function<Status(const Record&)>& visit) = 0;
  // Seqs of the records that name this rollout (admission, finish, abandonment), in order.
  [[nodiscard]] virtual Result<std::vector<std::uint64_t>> RolloutSeqs(
      const std::string& rollout_id) = 0;

  // Folded state at head: latest snapshot + tail (equal to a full refold, checked in tests).
  [[nodiscard]] virtual Result<State> LoadState() = 0;
  // Full refold from seq 1 (no snapshot).
  [[nodiscard]] virtual Result<State> Refold(std::uint64_t until_seq = 0) = 0;
  [[nodiscard]] virtual Status WriteSnapshot(std::uint64_t seq, const State& state) = 0;

  // For secondary readers: catch up with the live writer.
  [[nodiscard]] virtual Status CatchUp() = 0;
  // Point-in-time copy (RocksDB checkpoint) for offline audit.
  [[nodiscard]] virtual Status Checkpoint(const std::string& dir) = 0;
  // Reads every SST block and checks its checksum (offline audit; Corruption names the file).
  [[nodiscard]] virtual Status VerifyChecksum() = 0;
  // Flushes memtables to SST files (audit and corruption tests; appends never need it).
  [[nodiscard]] virtual Status Flush() = 0;
  // Flushes, then compacts every column family to its bottom level and waits (offline
  // maintenance and benchmarks: a compacted journal scans without background work competing).
  [[nodiscard]] virtual Status Compact() = 0;
};

}  // namespace rc::journal
