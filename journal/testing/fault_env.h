// A fault-injecting RocksDB Env for tests and simulators: the real journal runs over it and,
// on command, an Append or a Sync of a file of one kind (WAL, SST, MANIFEST, other) or the fsync
// of a directory fails with EIO or ENOSPC, a Sync stalls, or a simulated crash drops every byte
// that was not synced (whole, or leaving a torn prefix of it). A hook can run just before a file
// is opened for reading, or a directory opened (another process acting at that moment).
//
// Usage:
//   FaultEnv faults;                       // wraps Env::Default() (or pass NewMemEnv(...))
//   Options o; o.env = faults.env();
//   faults.Inject(FileKind::kWal, FileOp::kSync, Fault::kEio);
//   ... the journal's next group commit fails ...
//   faults.Crash();                        // from here nothing reaches the files
//   journal.reset();                       // "the process died"
//   faults.DropUnsyncedData(Torn::kNone, seed);
//   faults.Restart();                      // faults cleared; reopen the journal
//
// Lifetime: the FaultEnv must outlive every DB opened over env(). Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <rocksdb/env.h>
#include <rocksdb/status.h>

namespace rc::journal::testing {

// kDirectory: a directory opened with NewDirectory, whose fsync makes the files created, renamed
// and deleted in it durable (only FileOp::kSync applies); KindOf never names it.
enum class FileKind : std::uint8_t { kWal, kSst, kManifest, kOther, kDirectory };
enum class FileOp : std::uint8_t { kAppend, kSync };  // kSync: Sync and Fsync
// kCrash: the simulated process dies at that operation: it fails (EIO), and so does every later
// one, as after Crash() (a close that dies midway, say).
enum class Fault : std::uint8_t { kEio, kEnospc, kCrash };
// What DropUnsyncedData leaves of a file's unsynced bytes.
enum class Torn : std::uint8_t {
  kNone,          // nothing: the file ends at its last successful sync
  kRandomPrefix,  // a seeded random prefix of them (a torn write), possibly empty or all
};

// The kind of a RocksDB file, by its name ("000012.log", "000013.sst", "MANIFEST-000005").
FileKind KindOf(const std::string& path);
const char* KindName(FileKind kind);

class FaultEnv {
 public:
  // Wraps `base`'s file system (nullptr: Env::Default()); `base` must outlive this.
  explicit FaultEnv(rocksdb::Env* base = nullptr);
  ~FaultEnv();
  FaultEnv(const FaultEnv&) = delete;
  FaultEnv& operator=(const FaultEnv&) = delete;

  // The Env to pass as journal::Options::env.
  rocksdb::Env* env() const { return env_.get(); }

  // After `skip` more successful `op`s on files of `kind`, every later one fails with `fault`
  // (EIO: IOError; ENOSPC: IOError NoSpace) and leaves the file unchanged.
  void Inject(FileKind kind, FileOp op, Fault fault, std::uint32_t skip = 0);
  // Every later Sync/Fsync of a file of `kind` sleeps `stall_ms` before it runs (0: no stall).
  void StallSync(FileKind kind, std::uint32_t stall_ms);
  // `hook` runs once, on the opening thread, just before the next file whose name (the part after
  // the last '/') starts with `name_prefix` is opened for sequential reading (how RocksDB reads
  // CURRENT, a MANIFEST or a WAL); nullptr removes it. The open then proceeds as the files are.
  void BeforeNextRead(const std::string& name_prefix, std::function<void()> hook);
  // `hook` runs once, on the opening thread, just before the next directory is opened with
  // NewDirectory (RocksDB's open for writing opens the database's directory just before it takes
  // the LOCK; a read-only open opens none); nullptr removes it.
  void BeforeNextDirectory(std::function<void()> hook);
  // Removes every injected fault, stall and hook (not the crash state).
  void Clear();
  // Operations failed by injection (or by the crash state) so far.
  std::uint64_t failures() const;
  // Bytes appended to files of `kind` and not yet synced.
  std::uint64_t UnsyncedBytes(FileKind kind) const;

  // The simulated process is gone: every later append, sync, create, rename and delete fails
  // and changes nothing. Close the DB after this (its close writes nothing durable).
  void Crash();
  // Truncates every tracked file to its last synced size (kNone) or to that plus a seeded random
  // part of its unsynced bytes (kRandomPrefix), as a power loss would. Call after Crash() once
  // the DB is closed. `kept_unsynced_bytes` (optional) receives the unsynced bytes left in place.
  // Returns the first error met.
  rocksdb::Status DropUnsyncedData(Torn torn, std::uint64_t seed,
                                   std::uint64_t* kept_unsynced_bytes = nullptr);
  // Leaves the crash state and clears faults: the next open sees the files as they are.
  void Restart();

  class Fs;  // the wrapping file system (implementation detail)

 private:
  std::shared_ptr<Fs> fs_;
  std::unique_ptr<rocksdb::Env> env_;
};

}  // namespace rc::journal::testing
