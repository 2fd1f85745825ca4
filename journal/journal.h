// The journal: an append-only, hash-chained event log in RocksDB; FlatBuffers records.
//
// Every acknowledged event is durable (WAL + fsync, group commit across concurrent appenders).
// A record is one Event plus its envelope: dense seq (1, 2, ...), wall time, the seq of the input
// that caused it (0 for an input itself), the SHA-256 of the previous record's stored bytes, and
// its own hash. One Append is one group (an input followed by its derived decisions) written in
// one WriteBatch.
//
// Fail-stop: any write or sync error, or a group commit that is not durable within
// Options::commit_stall_timeout_ms, fails the journal: that Wait and every later call return the
// failure (naming the journal's path), nothing more is written, and the process is expected to
// exit and recover from what is durable. Nothing is acknowledged (Wait OK) before its batch's
// WAL sync returned OK.
//
// Never silently shorter: Open verifies that every live file the MANIFEST lists exists with its
// recorded size, a missing head is Corruption, a clean close records where the journal ended
// (seq and hash, in the file CLOSED beside the database) and the writer's durable mark how far it
// was durable (DURABLE, see Options::durable_mark_interval_ms): a later open refuses a journal
// whose records end before either or differ there, and a WAL tail that crash recovery could not
// read is reported (Recovery).
// Limit: after a crash (no clean close), acknowledged groups the mark did not cover yet (the last
// durable_mark_interval_ms of commits) cut away exactly at a WAL batch boundary leave no trace in
// the journal itself; only an external witness of an acknowledged head
// (AppendResult::last_seq/last_hash, checked with `rolloutcore audit --expect-head`) detects
// that loss.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "statemachine/events.h"
#include "statemachine/fleet.h"
#include "statemachine/state.h"
#include "statemachine/status.h"

namespace rocksdb {
class Env;
}

namespace rc::journal {

using Hash = std::array<std::uint8_t, 32>;  // SHA-256

// Parses 64 hex digits (upper or lower case) into a Hash; InvalidArgument otherwise.
[[nodiscard]] Result<Hash> ParseHashHex(std::string_view hex);

inline constexpr std::size_t kRecordBytesMax = 64 * 1024;  // larger records are refused
// A group is an input and what the fold derives from it, so its bound is the fold's: a recovery
// abandons every proxied rollout of its engine (kActiveRolloutsMax at most), beside a few
// lifecycle decisions of that engine (an end and a transition) and the fleet's settlement (a
// removal of each leaving engine, an update's end). Every group the fold derives fits: serve
// must never refuse, let alone abort on, the recovery it submits at every start.
inline constexpr std::size_t kLifecycleDecisionsMax = 16;
inline constexpr std::size_t kGroupEventsMax =
    1 + kActiveRolloutsMax + kLifecycleDecisionsMax + kFleetEnginesMax + 1;
// An abandonment (RolloutFinished of an id and an engine name of kIdBytesMax each) encodes to
// fewer bytes than this (tests/journal/store_test.cc checks the largest): a group's bytes are
// bounded by kGroupBytesMax, which one WriteBatch and one WAL record hold (RocksDB counts a
// batch's bytes and entries in 32 bits).
inline constexpr std::size_t kAbandonRecordBytesMax = 1024;
inline constexpr std::size_t kGroupBytesMax =
    kActiveRolloutsMax * kAbandonRecordBytesMax +
    (kGroupEventsMax - kActiveRolloutsMax) * kRecordBytesMax;
static_assert(kGroupEventsMax > kActiveRolloutsMax + kFleetEnginesMax,
              "a recovery abandoning every rollout of a full engine must fit one group");
static_assert(kGroupBytesMax < (std::size_t{1} << 31), "a group must fit one WriteBatch");
inline constexpr std::size_t kPendingAppendsMax = 4096;  // group-commit queue bound
// Admissions fill the group-commit queue to kPendingAppendsMax. The other bindings (a finish ends
// a rollout an admission already holds) get kControlGroupsReserve groups more, and the executor's
// own inputs (intents, observations, the monitor's, the fleet's; a few per engine at once) twice
// that: a flood of admissions never starves a finish (serve fail-stops on a finish it cannot make
// durable), and nothing clients send leaves an effect performed without its observation.
inline constexpr std::size_t kControlGroupsReserve = 1024;
inline constexpr std::uint32_t kCommitWindowUsMax = 10000;  // Options::commit_window_us

struct Record {
  std::uint64_t seq = 0;
  std::int64_t wall_time_ms = 0;
  std::uint64_t cause_seq = 0;  // 0: an input (or client binding); else the seq of its input
  Hash prev_hash{};
  Hash hash{};  // SHA-256 over the stored bytes of this record
  Event event;
  // The engine of a fleet a per-engine event belongs to; "" for a journal of one engine and for
  // the fleet's own events (statemachine/fleet.h).
  std::string engine;
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
  // The engine of each event (statemachine/fleet.h): empty when every event is the unnamed
  // engine's (a journal of one engine); else exactly one per event, "" for a fleet event.
  std::vector<std::string> engines;
};

struct AppendResult {
  std::uint64_t first_seq = 0;
  std::uint64_t last_seq = 0;
  // The hash of record last_seq: once Wait returned OK, (last_seq, last_hash) is an acknowledged
  // head a client can keep as a witness (`rolloutcore audit --expect-head SEQ:HASH`).
  Hash last_hash{};
  bool duplicate = false;
};

struct Options {
  bool create_if_missing = true;
  bool sync = true;                      // fsync each group commit (off only in benchmarks)
  std::uint64_t snapshot_every = 10000;  // write a folded-state snapshot every N events (0: never)
  // Read-only: a journal no writer holds opens as a plain read-only DB (WAL tail checked); one a
  // writer holds opens as a secondary instance (works while the writer runs; tail not checked;
  // the durable mark and a clean close are still checked: the records must reach them). A LOCK
  // another process holds is tried again for a second first (another reader holds it only while
  // it opens). A LOCK this process cannot take for another reason (a read-only mount, no
  // permission) opens as a plain read-only DB with every check, refused (Busy) if the journal's
  // files (CURRENT, MANIFEST, tables, WALs) changed meanwhile.
  bool read_only = false;
  std::string secondary_path;  // scratch dir for a secondary instance ("" = temp, removed)
  // The RocksDB Env (file system, threads, clock); nullptr: rocksdb::Env::Default(). Tests pass
  // an in-memory or fault-injecting one (journal/testing/fault_env.h). Must outlive the journal,
  // and an open-time write left running past its deadline (see Open).
  rocksdb::Env* env = nullptr;
  // A group commit not durable within this fails the journal (Wait returns Timeout); 0: no limit.
  // Each write the writer's Open performs has the same deadline (Open returns Timeout).
  std::uint32_t commit_stall_timeout_ms = 10000;
  // Once a group is wanted durable, the committer waits this long before it takes the batch, so
  // groups submitted meanwhile share its fsync; 0: it takes the batch at once. At most
  // kCommitWindowUsMax.
  std::uint32_t commit_window_us = 0;
  // Long scans (Scan, Refold, open) read RocksDB on a second thread while the caller decodes,
  // verifies and folds; false: one thread (benchmarks compare the two).
  bool scan_pipelined = true;
  // The writer records its durable head (seq and hash) in the file DURABLE beside the database at
  // most this often (0: after every group commit): an open then refuses a journal whose records
  // end before it (a WAL cut or removed, a stale MANIFEST), which would otherwise read as a crash
  // that lost only unacknowledged writes.
  // The writer also marks the head it recovered at the end of its open, and a commit not yet
  // marked when it closes (before the clean close, which may fail).
  std::uint32_t durable_mark_interval_ms = 250;
  // Table files the writer keeps open at most (RocksDB's max_open_files; RocksDB raises a value
  // below 20 to 20): past it the least recently used are closed and opened again when read.
  // Nothing is ever deleted from a journal, so unbounded its open files would grow with it (about
  // 16 a GB). Read-only opens keep every table open (each is checked as it opens).
  std::uint32_t table_files_open_max = 256;
  // The descriptors a writer over these options holds at most: its table files (above) and the
  // files beside them (WALs, MANIFEST, LOCK, directories, the tables a flush and a compaction are
  // writing, the durable mark being written). What its owner keeps free for the journal.
  std::uint32_t OpenFilesMax() const;
  // RocksDB's own warnings and errors go to stderr, one escaped line each (never to a LOG file in
  // the journal's directory); false drops them (the simulator, whose faults make thousands).
  bool rocksdb_log_to_stderr = true;
};

// What Open found on disk about how the journal ended before.
struct Recovery {
  bool clean_close = false;  // a clean-close record was present and matched the head
  bool live_writer = false;  // read-only beside a live writer (secondary): the tail is not checked
  std::uint64_t head_seq = 0;  // the head recovered
  // Bytes of the WAL that crash recovery could not read (a torn tail: a group cut mid-write). Its
  // seqs are unknowable (the torn batch is unreadable): they would follow head_seq.
  std::uint64_t wal_bytes_unread = 0;
  // "" or a sentence of what was lost, the journal's path last: a torn WAL tail (the WAL file(s),
  // the bytes, the seqs), and table files an open that died left holding seqs past the head and
  // every mark (its recovery of a WAL whose last batch, never acknowledged, a power loss then
  // took). What a writer's open found is kept in the journal until an executor's start recorded
  // it (Journal::ForgetRecordedTornTail): every open until then reports it too, after its own
  // findings, as "found by an earlier open, not yet recorded by an executor's start: ...", its
  // bytes counted in wal_bytes_unread.
  std::string torn_tail;
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
  // process", naming the holder's LOCK path), Corruption (naming the path; never auto-repaired:
  // a live file missing or of the wrong size, a missing head, a snapshot past the head, a record
  // missing that the head or a snapshot says exists, a snapshot whose chain hash is not the hash
  // of the record at its seq or that counts other than its seq's events, fewer records than a
  // clean close recorded, records that end before the durable mark or differ at it, a CURRENT
  // older than the durable mark's MANIFEST, a table file the MANIFEST does not list that holds
  // records the journal lacks at or below its head or a mark, or in a journal without a mark, a
  // column family the MANIFEST lacks, a journal's files without their CURRENT). Only a directory
  // holding none of a journal's files is created (create_if_missing). A torn WAL tail opens (crash
  // recovery) and is reported by recovery(), as are table files an open that died left holding
  // only seqs past the head, which reaches every mark (an unacknowledged tail).
  // The writer checks the marks, CURRENT and the table files on a read-only open before RocksDB
  // opens the journal for writing (which deletes the files its MANIFEST leaves obsolete): a
  // journal refused for records it lost keeps every file it had. A reader that takes the LOCK
  // between that check and RocksDB's open is waited for (both run again, for a second at most).
  // The writer's open writes (RocksDB's own open and recovery, the schema and head keys, the
  // removal of the clean-close record, the torn tail it found, a snapshot, the durable mark):
  // each not done within Options::commit_stall_timeout_ms (when nonzero) is Timeout naming the
  // path and the write. Such a write cannot be cancelled: it runs on, detached, holding the
  // database open until it returns, and the caller is expected to exit (a later Open in this
  // process meanwhile is Busy).
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

  // The fleet's submit: the same, for an input that names its engine (or a fleet event). The
  // decisions name theirs. Submit(input) is SubmitFleet({"", input}) on a journal of one engine.
  struct FleetSubmitted {
    Ticket ticket;
    std::vector<FleetEvent> decisions;
  };
  [[nodiscard]] virtual Result<FleetSubmitted> SubmitFleet(
      const FleetEvent& input, std::int64_t wall_time_ms,
      const std::string& client_event_id = "") = 0;

  // SubmitFleet without an idempotency key, refused with `holds`'s status (nothing written) unless
  // holds(the fleet's state) is OK: checked under the lock that decides, so no other submit can
  // change what it saw. `holds` must be short and must not call back into the journal.
  using Precondition = std::function<Status(const FleetState&)>;
  [[nodiscard]] virtual Result<FleetSubmitted> SubmitFleetIf(const FleetEvent& input,
                                                             std::int64_t wall_time_ms,
                                                             const Precondition& holds) = 0;

  // Whether a group was enqueued under the idempotency key `key` (durable, or pending its group
  // commit): a submit under it is then answered as that group's retry. Reads only.
  [[nodiscard]] virtual Result<bool> KeyHeld(const std::string& key) = 0;

  // The journal folds a FleetState (statemachine/fleet.h); one that never named an engine holds
  // the unnamed engine "" alone, and folds exactly as the single-engine fold.
  // The unnamed engine's state after every enqueued group (a copy, taken under the lock); an
  // empty State for a journal of named engines (is_fleet()).
  virtual State state() const = 0;
  // Calls `read` on that state under the lock, without copying it: for callers that need a few
  // fields of a state whose active rollouts may number in the tens of thousands. `read` must be
  // short and must not call back into the journal.
  virtual void ReadState(const std::function<void(const State&)>& read) const = 0;
  // The whole fleet's folded state (a copy), and the same without copying it.
  virtual FleetState fleet_state() const = 0;
  virtual void ReadFleetState(const std::function<void(const FleetState&)>& read) const = 0;
  // True once an engine joined: the journal holds named engines, not the unnamed one.
  virtual bool is_fleet() const = 0;
  // Blocks until the ticket's group is durable. If its commit failed, or was not durable within
  // commit_stall_timeout_ms (Timeout), returns the journal's failure; see fail-stop above.
  [[nodiscard]] virtual Status Wait(const Ticket& ticket) = 0;
  // Blocks until every group enqueued so far (by any caller) is durable, as Wait does: what the
  // fold shows now is then what the journal says.
  [[nodiscard]] virtual Status WaitForHead() = 0;
  // Wait without blocking: `done` runs exactly once, with OK when the ticket's group is durable
  // or with the journal's failure, on the committer thread (or on the caller's, when that is
  // already decided; or on the thread that detects a stalled commit through failed()). `done`
  // must be short and must not call back into the journal: event loops post it onward.
  using DurableFn = std::function<void(Status)>;
  virtual void WaitAsync(const Ticket& ticket, DurableFn done) = 0;
  // True once the journal failed (a write or sync error, or a commit stalled past its deadline);
  // failure() is then the error every call returns, naming the journal's path.
  virtual bool failed() const = 0;
  virtual Status failure() const = 0;
  // Fails the journal from outside (its owner fail-stopped for a reason of its own): from now on
  // every call returns `why` and nothing more is written, so no thread still running can mutate
  // anything on the journal's word. A group being written meanwhile may reach the disk, never
  // acknowledged. No effect on a journal that already failed.
  virtual void Stop(const Status& why) = 0;
  // What Open found about how the journal ended before (clean close, torn tail).
  virtual Recovery recovery() const = 0;
  // The writer's: forgets the torn tail its open found and kept (and any an earlier open kept),
  // once the executor's record of it (a RecoveryStarted carrying recovery()) is durable; later
  // opens then no longer report it. The removal is synced, under commit_stall_timeout_ms; its
  // failure fails the journal. OK when nothing is kept; InvalidArgument on a read-only journal.
  [[nodiscard]] virtual Status ForgetRecordedTornTail() = 0;
  // Enqueue + Wait.
  [[nodiscard]] virtual Result<AppendResult> Append(const AppendRequest& request) = 0;

  virtual std::uint64_t head_seq() const = 0;  // last durable-or-enqueued seq
  virtual Hash head_hash() const = 0;
  // The last seq whose group commit returned OK (<= head_seq()): what a crash now would keep.
  // The default suits only a journal whose groups are durable once enqueued; a wrapper forwards.
  virtual std::uint64_t durable_seq() const { return head_seq(); }

  // NotFound past the durable head; a record missing at or below it was lost: Corruption.
  [[nodiscard]] virtual Result<Record> Read(std::uint64_t seq) = 0;
  // Visits records from_seq..to_seq inclusive (to_seq 0 = head) in order; decodes, verifies the
  // FlatBuffers structure and the hash chain; stops at the first error or non-OK visitor status.
  [[nodiscard]] virtual Status Scan(std::uint64_t from_seq, std::uint64_t to_seq,
                                    const std::function<Status(const Record&)>& visit) = 0;
  // Seqs of the records that name this rollout (admission, finish, abandonment), in order.
  [[nodiscard]] virtual Result<std::vector<std::uint64_t>> RolloutSeqs(
      const std::string& rollout_id) = 0;

  // Folded state at head: latest snapshot + tail (equal to a full refold, checked in tests).
  [[nodiscard]] virtual Result<FleetState> LoadFleetState() = 0;
  // Full refold from seq 1 (no snapshot).
  [[nodiscard]] virtual Result<FleetState> RefoldFleet(std::uint64_t until_seq = 0) = 0;
  // The same, of the unnamed engine; FailedPrecondition for a journal of named engines.
  [[nodiscard]] virtual Result<State> LoadState() = 0;
  [[nodiscard]] virtual Result<State> Refold(std::uint64_t until_seq = 0) = 0;
  // Stores `fleet` as the folded state at durable `seq` (it must count seq events).
  [[nodiscard]] virtual Status WriteSnapshot(std::uint64_t seq, const FleetState& fleet) = 0;

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
  // The writer's clean close: commits what is open, flushes, and records where the journal ended
  // (the next open then checks nothing was lost). The first failure on the way, or the journal's
  // own earlier one: the journal then reads as crashed on the next open, and everything
  // acknowledged is durable all the same. Call it last; the destructor closes a journal it was not
  // called on (OK for a read-only one).
  [[nodiscard]] virtual Status Close() = 0;
};

}  // namespace rc::journal
