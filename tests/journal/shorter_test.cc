// The journal is never silently shorter: a closed journal whose SST files were truncated or
// deleted, whose WAL was cut, whose head key is gone or that holds less than its clean close
// recorded is refused (read-only tools and writer alike), never read as a shorter healthy
// journal; nor is one that lost its CURRENT or a column family; a close that dies midway leaves a
// journal that opens, and so does one whose open died leaving tables of its unacknowledged tail;
// a torn tail is reported until an executor recorded it; odd file names and a bad TMPDIR are
// statuses, never exceptions; read-only opens leave no scratch directory behind.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "encoding/sha256.h"
#include "journal/codec.h"
#include "journal/journal.h"
#include "journal/testing/fault_env.h"
#include "statemachine/hex.h"
#include "statemachine/text.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"

namespace rc::journal {
namespace {

namespace fs = std::filesystem;
using testing::EditRaw;
using testing::Group;
using testing::SeqKey;
using testing::TempDir;

Options ReadOnly() {
  Options o;
  o.read_only = true;
  o.create_if_missing = false;
  return o;
}

// Writes bootstrap (4 records) + `admissions` admissions (ids `prefix`0, `prefix`1, ...), one
// group each; returns the head.
std::uint64_t WriteJournal(const std::string& path, int admissions, Options o = {},
                           const std::string& prefix = "r") {
  auto j = Journal::Open(path, o);
  RC_CHECK(j.ok());
  for (auto& g : testing::BootstrapGroups()) RC_CHECK((*j)->Append(Group(g)).ok());
  for (int i = 0; i < admissions; ++i) {
    RC_CHECK((*j)->Append(Group({make_admission((*j)->state(), prefix + std::to_string(i))})).ok());
  }
  return (*j)->head_seq();
}

// Counts the records a read-only open can scan, or returns its error.
Result<std::uint64_t> ReadableRecords(const std::string& path) {
  auto j = Journal::Open(path, ReadOnly());
  if (!j.ok()) return j.status();
  std::uint64_t n = 0;
  Status s = (*j)->Scan(1, 0, [&](const Record&) {
    ++n;
    return Status::OK();
  });
  if (!s.ok()) return s;
  if (!(*j)->recovery().torn_tail.empty()) return Status::Corruption((*j)->recovery().torn_tail);
  return n;
}

std::vector<fs::path> FilesWithExtension(const std::string& dir, const std::string& ext) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ext) out.push_back(e.path());
  }
  return out;
}

// A number field of the journal's durable mark (DURABLE's "seq N", "manifest N" lines), or
// nullopt when there is no mark or no such line.
std::optional<std::uint64_t> MarkField(const std::string& path, const std::string& field) {
  std::ifstream in(fs::path(path) / "DURABLE");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + " ", 0) != 0) continue;
    std::uint64_t v = 0;
    const char* begin = line.data() + field.size() + 1;
    const char* end = line.data() + line.size();
    const auto [at, ec] = std::from_chars(begin, end, v);
    if (ec == std::errc() && at == end) return v;
  }
  return std::nullopt;
}

// Waits (at most 5 s) until the durable mark names `seq`: nothing the writer marks later can then
// race a fault armed after it.
bool WaitForMark(const std::string& path, std::uint64_t seq) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (MarkField(path, "seq") != seq) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// The name of the MANIFEST CURRENT names ("MANIFEST-000012").
std::string CurrentManifestName(const std::string& path) {
  std::ifstream in(fs::path(path) / "CURRENT");
  std::string name;
  std::getline(in, name);
  return name;
}

// The MANIFEST number CURRENT names.
std::uint64_t CurrentManifest(const std::string& path) {
  const std::string name = CurrentManifestName(path);
  const std::string prefix = "MANIFEST-";
  RC_CHECK(name.rfind(prefix, 0) == 0);
  std::uint64_t v = 0;
  const auto [at, ec] = std::from_chars(name.data() + prefix.size(), name.data() + name.size(), v);
  RC_CHECK(ec == std::errc() && at == name.data() + name.size());
  return v;
}

// Holds a journal's LOCK, as another reader's open does while it runs, until released.
class LockHolder {
 public:
  explicit LockHolder(const std::string& path) {
    RC_CHECK(rocksdb::Env::Default()->LockFile(path + "/LOCK", &lock_).ok());
  }
  ~LockHolder() { Release(); }
  LockHolder(const LockHolder&) = delete;
  LockHolder& operator=(const LockHolder&) = delete;
  void Release() {
    if (lock_ == nullptr) return;
    RC_CHECK(rocksdb::Env::Default()->UnlockFile(lock_).ok());
    lock_ = nullptr;
  }

 private:
  rocksdb::FileLock* lock_ = nullptr;
};

// A child process that takes a journal's LOCK as RocksDB does (fcntl F_SETLK: a write lock on the
// whole file), as another reader's open does while it runs, and holds it for `hold_ms`. The
// constructor returns once the child holds it (held()), or failed to within 5 s.
class ChildLockHolder {
 public:
  ChildLockHolder(const std::string& path, int hold_ms) {
    const std::string lock_file = path + "/LOCK";
    int ready[2];
    RC_CHECK(::pipe(ready) == 0);
    pid_ = ::fork();
    RC_CHECK(pid_ >= 0);
    if (pid_ == 0) HoldInChild(lock_file.c_str(), ready[1], hold_ms);
    ::close(ready[1]);
    pollfd p{ready[0], POLLIN, 0};
    char byte = 0;
    held_ = ::poll(&p, 1, 5000) == 1 && ::read(ready[0], &byte, 1) == 1;
    ::close(ready[0]);
  }
  ~ChildLockHolder() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  ChildLockHolder(const ChildLockHolder&) = delete;
  ChildLockHolder& operator=(const ChildLockHolder&) = delete;
  bool held() const { return held_; }

 private:
  // Async-signal-safe calls only: the test process has threads (RocksDB's, a journal's).
  [[noreturn]] static void HoldInChild(const char* lock_file, int ready_fd, int hold_ms) {
    const int fd = ::open(lock_file, O_RDWR | O_CREAT, 0644);
    struct flock whole {};
    whole.l_type = F_WRLCK;
    whole.l_whence = SEEK_SET;
    const timespec pause{0, 1000 * 1000};
    bool locked = false;
    for (int i = 0; fd >= 0 && !locked && i < 5000; ++i) {
      locked = ::fcntl(fd, F_SETLK, &whole) == 0;
      if (!locked) ::nanosleep(&pause, nullptr);
    }
    const char byte = 1;
    if (!locked || ::write(ready_fd, &byte, 1) != 1) ::_exit(1);
    const timespec hold{hold_ms / 1000, (hold_ms % 1000) * 1000L * 1000L};
    ::nanosleep(&hold, nullptr);
    ::_exit(0);  // the LOCK is released with the process
  }

  pid_t pid_ = -1;
  bool held_ = false;
};

// Proves that truncating (to 0 bytes) or deleting the SST files of a compacted, closed journal
// makes the read-only open and the writer's open fail with Corruption naming a missing or
// short live file; catches the reproduced bug where replay and audit reported "records: 0 ...
// verification: OK" (a secondary instance skipped the unreadable files, a missing head read 0).
TEST(Shorter, TruncatedOrDeletedSstFilesAreRefused) {
  for (bool remove : {false, true}) {
    SCOPED_TRACE(remove ? "deleted" : "truncated to 0");
    TempDir dir;
    WriteJournal(dir.path(), 66);
    {
      auto j = Journal::Open(dir.path(), Options{});
      ASSERT_TRUE(j.ok());
      ASSERT_TRUE((*j)->Compact().ok());
    }
    const std::vector<fs::path> ssts = FilesWithExtension(dir.path(), ".sst");
    ASSERT_FALSE(ssts.empty());
    for (const fs::path& sst : ssts) {
      if (remove) {
        fs::remove(sst);
      } else {
        fs::resize_file(sst, 0);
      }
    }
    Result<std::uint64_t> read = ReadableRecords(dir.path());
    ASSERT_FALSE(read.ok()) << "read " << *read << " records of 70 as a healthy journal";
    EXPECT_EQ(read.status().code(), Code::kCorruption) << read.status().ToString();
    const std::string& m = read.status().message();  // RocksDB's own check names .ldb, ours .sst
    EXPECT_TRUE(m.find(".sst") != std::string::npos || m.find(".ldb") != std::string::npos) << m;
    EXPECT_NE(read.status().message().find(dir.path()), std::string::npos)
        << read.status().ToString();
    Result<std::unique_ptr<Journal>> writer = Journal::Open(dir.path(), Options{});
    EXPECT_FALSE(writer.ok()) << "the writer opened with head " << (*writer)->head_seq();
  }
}

// Proves that cutting the WAL of a cleanly closed journal (at any length) never yields fewer
// records than were written: a clean close flushed them to SST files; catches the reproduced
// bug where a cut WAL read as a shorter healthy journal (44 or 53 of 70, "verification: OK").
TEST(Shorter, CutWalOfAClosedJournalIsNeverShorter) {
  TempDir dir;
  Options o;
  o.snapshot_every = 0;
  const std::uint64_t head = WriteJournal(dir.path(), 66, o);
  ASSERT_EQ(head, 70u);
  for (const fs::path& wal : FilesWithExtension(dir.path(), ".log")) {
    fs::resize_file(wal, fs::file_size(wal) * 2 / 3);
  }
  Result<std::uint64_t> read = ReadableRecords(dir.path());
  if (read.ok()) {
    EXPECT_EQ(*read, head) << "a cut WAL was read as a shorter healthy journal";
  }
}

// Proves a journal holding less than its clean close recorded (an older copy of its files beside
// the newer CLOSED record) is refused with "closed at seq N hash H but holds only M records";
// catches a rollback to an earlier state of the files that no per-file check can see.
TEST(Shorter, FewerRecordsThanTheCleanCloseRecordedIsRefused) {
  TempDir dir;
  const std::string path = dir.sub("journal");
  const std::string old_copy = dir.sub("old");
  Hash closed_hash{};
  {
    auto j = Journal::Open(path, Options{});
    ASSERT_TRUE(j.ok());
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    for (int i = 0; i < 36; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    ASSERT_TRUE((*j)->Checkpoint(old_copy).ok());  // 40 records
    for (int i = 36; i < 66; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    closed_hash = (*j)->head_hash();
  }
  ASSERT_TRUE(fs::exists(path + "/CLOSED"));
  fs::copy_file(path + "/CLOSED", old_copy + "/CLOSED");
  for (const Options& o : {ReadOnly(), Options{}}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(old_copy, o);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), Code::kCorruption);
    EXPECT_NE(j.status().message().find("was closed at seq 70 hash " + HashHex(closed_hash) +
                                        " but holds only 40 records"),
              std::string::npos)
        << j.status().message();
  }
  auto j = Journal::Open(path, ReadOnly());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_TRUE((*j)->recovery().clean_close);
  EXPECT_EQ((*j)->head_seq(), 70u);
}

// Deletes the meta head_seq key through RocksDB directly.
void DeleteHeadKey(const std::string& path) {
  EditRaw(path, [](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[5], "head_seq").ok());
  });
}

// Lowers the head of a closed journal to `head` (whose record hash is `head_hash`): deletes the
// records after it and rewrites the head keys, leaving every other column family as it was.
void LowerHead(const std::string& path, std::uint64_t head, const Hash& head_hash,
               std::uint64_t old_head) {
  EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    for (std::uint64_t seq = head + 1; seq <= old_head; ++seq) {
      ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(seq)).ok());
    }
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_seq", SeqKey(head)).ok());
    const std::string hash(reinterpret_cast<const char*>(head_hash.data()), head_hash.size());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "head_hash", hash).ok());
  });
}

void DeleteRecord(const std::string& path, std::uint64_t seq) {
  EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Delete(rocksdb::WriteOptions(), cf[1], SeqKey(seq)).ok());
  });
}

// The stored fleet snapshot at `seq` of a closed journal ("" when there is none).
std::string SnapshotAt(const std::string& path, std::uint64_t seq) {
  std::string value;
  EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[4], SeqKey(seq) + "f", &value).ok());
  });
  return value;
}

// Stores `value` as the fleet snapshot at `seq` of a closed journal, flushed (it survives however
// the WAL is read).
void PutSnapshot(const std::string& path, std::uint64_t seq, const std::string& value) {
  EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[4], SeqKey(seq) + "f", value).ok());
    ASSERT_TRUE(db.Flush(rocksdb::FlushOptions(), cf).ok());
  });
}

Options Writer(Options o) {
  o.create_if_missing = false;
  return o;
}

// Proves a journal whose head lies below a stored snapshot (its last records and head lost, the
// snapshot kept, as a cut WAL beside an already flushed snapshots column family leaves it) is
// refused by the read-only tools and the writer with Corruption naming both seqs; catches the
// open that skipped every snapshot past the head and read the journal as a healthy, shorter one.
TEST(Shorter, SnapshotPastTheHeadIsCorruption) {
  TempDir dir;
  Options o;
  o.snapshot_every = 10;
  const std::uint64_t head = WriteJournal(dir.path(), 20, o);  // snapshots at seqs 10 and 20
  ASSERT_EQ(head, 24u);
  Hash hash_17{};
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    Result<Record> r = (*j)->Read(17);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    hash_17 = r->hash;
  }
  LowerHead(dir.path(), 17, hash_17, head);
  fs::remove(dir.path() + "/CLOSED");  // as if it had crashed: the head and snapshots must tell
  Options writer = o;
  writer.create_if_missing = false;
  for (const Options& opened : {ReadOnly(), writer}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), opened);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq() << ": snapshot 20 unseen";
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find("snapshot at seq 20 lies past the head seq 17"),
              std::string::npos)
        << j.status().message();
    EXPECT_NE(j.status().message().find(dir.path()), std::string::npos) << j.status().message();
  }
}

// Proves a record missing where the head or a snapshot says one exists is Corruption naming its
// seq (Read and Scan below the head; the open, for the record at the snapshot it loads from),
// while a seq past the head stays NotFound; catches the NotFound that made `rolloutcore audit`
// exit 2 (usage) for a damaged journal instead of 3.
TEST(Shorter, MissingRecordTheJournalVouchesForIsCorruption) {
  TempDir dir;
  Options o;
  o.snapshot_every = 10;
  const std::uint64_t head = WriteJournal(dir.path(), 20, o);  // snapshots at seqs 10 and 20
  ASSERT_EQ(head, 24u);
  DeleteRecord(dir.path(), 7);  // hidden from the open by the snapshot at 20
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    Result<Record> missing = (*j)->Read(7);
    EXPECT_EQ(missing.status().code(), Code::kCorruption) << missing.status().ToString();
    EXPECT_NE(missing.status().message().find("seq 7 is missing"), std::string::npos)
        << missing.status().message();
    EXPECT_EQ((*j)->Read(head + 1).status().code(), Code::kNotFound);
    Status from_8 = (*j)->Scan(8, 0, [](const Record&) { return Status::OK(); });
    EXPECT_EQ(from_8.code(), Code::kCorruption) << from_8.ToString();
    EXPECT_NE(from_8.message().find("seq 7 is missing"), std::string::npos) << from_8.message();
  }
  DeleteRecord(dir.path(), 20);  // the record the snapshot at 20 continues from
  for (const Options& opened : {ReadOnly(), o}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), opened);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find(
                  "the record at seq 20 is missing, but the snapshot at seq 20 says it exists"),
              std::string::npos)
        << j.status().message();
  }
}

// Proves the snapshots a writer stores carry the hash of their seq's record, and that one copied
// from another journal (same seq, another history) is refused by the writer's open, and by the
// state a restart loads as the read-only tools read it, with Corruption naming its seq and the
// hash it carries; catches the open that started the fold from a state these records never
// reached (another journal's rollouts active).
TEST(Shorter, ASnapshotOfAnotherJournalIsCorruption) {
  TempDir mine, other;
  Options o;
  o.snapshot_every = 10;
  ASSERT_EQ(WriteJournal(mine.path(), 20, o, "m"), 24u);  // snapshots at seqs 10 and 20
  ASSERT_EQ(WriteJournal(other.path(), 20, o, "o"), 24u);
  const std::string foreign = SnapshotAt(other.path(), 20);
  Result<FleetSnapshot> decoded = DecodeFleetState(foreign);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  ASSERT_TRUE(decoded->chain_hash.has_value()) << "a snapshot written without its record's hash";
  {
    auto j = Journal::Open(other.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    Result<Record> r20 = (*j)->Read(20);
    ASSERT_TRUE(r20.ok()) << r20.status().ToString();
    EXPECT_EQ(*decoded->chain_hash, r20->hash);
  }
  PutSnapshot(mine.path(), 20, foreign);
  auto names_the_snapshot = [&](const Status& st) {
    EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("snapshot at seq 20 carries the chain hash " +
                                HashHex(*decoded->chain_hash)),
              std::string::npos)
        << st.message();
  };
  Result<std::unique_ptr<Journal>> writer = Journal::Open(mine.path(), Writer(o));
  ASSERT_FALSE(writer.ok()) << "opened with rollouts of another journal active: "
                            << (*writer)->state().active.count("o0");
  names_the_snapshot(writer.status());
  EXPECT_NE(writer.status().message().find(mine.path()), std::string::npos);
  // The read-only tools open it, to report it: the state a restart loads is Corruption.
  Result<std::unique_ptr<Journal>> tools = Journal::Open(mine.path(), ReadOnly());
  ASSERT_TRUE(tools.ok()) << tools.status().ToString();
  names_the_snapshot((*tools)->LoadFleetState().status());
}

// Proves a snapshot stored under a seq other than the one it folded to (the snapshot at 10 put
// at 20) is refused by the read-only tools and the writer with Corruption naming the seq and
// both counts; catches an open that trusts the key and folds records 21.. onto the state at 10,
// ten records never applied.
TEST(Shorter, ASnapshotUnderAnotherSeqIsCorruption) {
  TempDir dir;
  Options o;
  o.snapshot_every = 10;
  ASSERT_EQ(WriteJournal(dir.path(), 20, o), 24u);
  PutSnapshot(dir.path(), 20, SnapshotAt(dir.path(), 10));
  for (const Options& opened : {ReadOnly(), Writer(o)}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), opened);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find(
                  "snapshot at seq 20 counts 10 events, not the 20 records up to its seq"),
              std::string::npos)
        << j.status().message();
  }
}

// Proves a journal whose newest snapshot was stored before snapshots carried a chain hash opens
// (read-only and writer) from that snapshot: record 12 (above the snapshot at 10, below the one
// at 20) is deleted, which only a fold starting at 20 never reads; catches a reader that refuses
// the older encoding, or passes over it and refolds from below.
TEST(Shorter, ASnapshotWithoutAChainHashStillOpens) {
  TempDir dir;
  Options o;
  o.snapshot_every = 10;
  ASSERT_EQ(WriteJournal(dir.path(), 20, o), 24u);
  FleetState at_20;
  State head_state;
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    Result<FleetState> refolded = (*j)->RefoldFleet(20);
    ASSERT_TRUE(refolded.ok()) << refolded.status().ToString();
    at_20 = *refolded;
    head_state = (*j)->state();
  }
  PutSnapshot(dir.path(), 20, EncodeFleetState(at_20, 20));  // the encoding without the hash
  DeleteRecord(dir.path(), 12);
  for (const Options& opened : {ReadOnly(), Writer(o)}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), opened);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), 24u);
    EXPECT_EQ((*j)->state(), head_state);
    Result<FleetState> loaded = (*j)->LoadFleetState();
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ(*loaded, (*j)->fleet_state());
  }
}

// Proves a rollout index entry the events do not back (past the head, or at a record that admits
// another id) makes a reuse of that id Corruption, not a 409; catches a damaged index that
// refused ids forever with a conflict naming a record the journal never held.
TEST(Shorter, ARolloutIndexEntryTheEventsDoNotBackIsCorruption) {
  TempDir dir;
  const std::uint64_t head = WriteJournal(dir.path(), 3);  // r0..r2 at seqs 5..7
  ASSERT_EQ(head, 7u);
  // An id's index key is its length byte, then the id (journal/rocks_journal.cc).
  auto key = [](const std::string& id) {
    return std::string(1, static_cast<char>(id.size())) + id;
  };
  EditRaw(dir.path(), [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[2], key("ghost"), SeqKey(head + 5)).ok());
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[2], key("r1"), SeqKey(5)).ok());  // r0's
  });
  auto j = Journal::Open(dir.path(), Options{});
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (const char* id : {"ghost", "r1"}) {
    Status st = (*j)->Append(Group({make_admission((*j)->state(), id)})).status();
    EXPECT_EQ(st.code(), Code::kCorruption) << id << ": " << st.ToString();
  }
  Status reused = (*j)->Append(Group({make_admission((*j)->state(), "r2")})).status();
  EXPECT_EQ(reused.code(), Code::kConflict) << reused.ToString();  // a true reuse stays a 409
}

// Proves a journal stamped with a newer schema than this binary's is refused (read-only and
// writer alike), and that a writer stamps an older journal with its own before appending;
// catches an older binary reading records of a newer schema without their new fields (the
// verifier skips unknown fields), which replay then folded as if they were not there.
TEST(Shorter, AJournalOfANewerSchemaIsRefusedAndAnOlderOneIsStamped) {
  auto stamp = [](const std::string& path, std::uint64_t version) {
    EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
      ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[5], "schema_version", SeqKey(version)).ok());
    });
  };
  auto stamped = [](const std::string& path) {
    std::string v;
    EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
      ASSERT_TRUE(db.Get(rocksdb::ReadOptions(), cf[5], "schema_version", &v).ok());
    });
    return v;
  };
  TempDir newer;
  WriteJournal(newer.path(), 2);
  EXPECT_EQ(stamped(newer.path()), SeqKey(kSchemaVersion)) << "a new journal names its schema";
  stamp(newer.path(), kSchemaVersion + 1);
  for (const Options& o : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(newer.path(), o);
    ASSERT_FALSE(j.ok());
    EXPECT_EQ(j.status().code(), Code::kInvalidArgument) << j.status().ToString();
    EXPECT_NE(j.status().message().find("written by a newer rolloutcore"), std::string::npos);
  }
  TempDir older;
  WriteJournal(older.path(), 2);
  stamp(older.path(), 1);
  EXPECT_TRUE(ReadableRecords(older.path()).ok());
  EXPECT_EQ(stamped(older.path()), SeqKey(1)) << "a read-only open wrote to the journal";
  { ASSERT_TRUE(Journal::Open(older.path(), Options{}).ok()); }
  EXPECT_EQ(stamped(older.path()), SeqKey(kSchemaVersion));
}

// Proves kSchemaVersion is one above the last frozen schema; catches a schema frozen (a release)
// without the generation that tells older binaries to keep out.
TEST(Shorter, TheSchemaGenerationFollowsTheFrozenSchemas) {
  std::uint32_t frozen = 0;
  for (const auto& e : fs::directory_iterator(fs::path(RC_JOURNAL_SCHEMA_DIR))) {
    frozen += e.path().extension() == ".fbs" ? 1 : 0;
  }
  EXPECT_EQ(kSchemaVersion, frozen + 1);
}

// Proves a missing head is Corruption, never an empty journal; catches the reproduced bug where
// a lost head_seq read as 0 and the journal as "records: 0, verification: OK".
TEST(Shorter, MissingHeadIsCorruption) {
  TempDir dir;
  WriteJournal(dir.path(), 6);
  DeleteHeadKey(dir.path());
  fs::remove(dir.path() + "/CLOSED");  // as if it had crashed: only the head itself can tell
  for (const Options& o : {ReadOnly(), Options{}}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), Code::kCorruption);
    EXPECT_NE(j.status().message().find("head_seq is missing"), std::string::npos)
        << j.status().message();
  }
}

// Proves that a crashed journal whose WAL was cut inside its last batch opens read-only with the
// torn tail reported (the WAL file, the bytes, the seq it follows), and that a cut exactly at a
// batch boundary is only detectable with a witness of an acknowledged head (the documented
// limit); catches a torn tail read as a shorter healthy journal ("53 records, OK").
TEST(Shorter, CutWalOfACrashedJournalIsReportedTorn) {
  TempDir dir;
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  o.durable_mark_interval_ms = UINT32_MAX;  // the cuts below lie after the mark (its first batch)
  AppendResult witness;
  std::vector<std::uintmax_t> wal_sizes;  // WAL size after each group
  fs::path wal;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    wal = FilesWithExtension(dir.path(), ".log").at(0);
    for (int i = 0; i < 66; ++i) {
      Result<AppendResult> r =
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))}));
      ASSERT_TRUE(r.ok());
      witness = *r;
      wal_sizes.push_back(fs::file_size(wal));
    }
    faults.Crash();  // no clean close: the records live in the WAL only
  }
  faults.Restart();
  ASSERT_EQ(FilesWithExtension(dir.path(), ".log").size(), 1u);
  // Inside the last batch: torn, reported.
  const std::uintmax_t full = wal_sizes.back();
  const std::uintmax_t cut = wal_sizes[wal_sizes.size() - 2] + 9;
  fs::resize_file(wal, cut);
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    const Recovery rec = (*j)->recovery();
    EXPECT_EQ((*j)->head_seq(), 69u);
    EXPECT_EQ(rec.wal_bytes_unread, 9u) << rec.torn_tail;
    EXPECT_NE(
        rec.torn_tail.find(wal.filename().string() + ": 9 of " + std::to_string(cut) + " bytes"),
        std::string::npos)
        << rec.torn_tail;
    EXPECT_NE(rec.torn_tail.find("from seq 70"), std::string::npos) << rec.torn_tail;
    EXPECT_LT(cut, full);
  }
  // At the batch boundary: the journal itself cannot tell; the acknowledged witness can.
  fs::resize_file(wal, wal_sizes[wal_sizes.size() - 2]);
  auto j = Journal::Open(dir.path(), ReadOnly());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_TRUE((*j)->recovery().torn_tail.empty());
  EXPECT_EQ((*j)->head_seq(), witness.last_seq - 1);
  EXPECT_EQ((*j)->Read(witness.last_seq).status().code(), Code::kNotFound);
}

// A journal left without a clean close: its WAL, and the WAL's size after each group.
struct CrashedJournal {
  fs::path wal;
  std::vector<std::uintmax_t> wal_sizes;  // after each group, in order: each a batch boundary
};

// Writes bootstrap + `admissions` admissions (ids `prefix`0, `prefix`1, ...) without a clean
// close, the durable mark following every group commit.
CrashedJournal WriteCrashedJournal(const std::string& path, int admissions,
                                   const std::string& prefix = "r") {
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  o.durable_mark_interval_ms = 0;
  CrashedJournal out;
  {
    auto j = Journal::Open(path, o);
    RC_CHECK(j.ok());
    out.wal = FilesWithExtension(path, ".log").at(0);
    auto append = [&](const AppendRequest& group) {
      RC_CHECK((*j)->Append(group).ok());
      out.wal_sizes.push_back(fs::file_size(out.wal));
    };
    for (auto& g : testing::BootstrapGroups()) append(Group(g));
    for (int i = 0; i < admissions; ++i) {
      append(Group({make_admission((*j)->state(), prefix + std::to_string(i))}));
    }
    RC_CHECK(FilesWithExtension(path, ".log").size() == 1);
    faults.Crash();  // no clean close: the records live in the WAL only
  }
  faults.Restart();
  return out;
}

// Proves that a crashed journal whose WAL was emptied, cut at a batch boundary or removed after
// its records were durable is refused by read-only opens and the writer alike, naming the durable
// mark or the missing WAL; catches the reproduced bug where such a journal audited "INTACT" and
// serve reused the lost, acknowledged seqs.
TEST(Shorter, AWalCutOrRemovedBelowTheDurableMarkIsRefused) {
  for (const char* how : {"emptied", "cut at a batch", "removed"}) {
    SCOPED_TRACE(how);
    TempDir dir;
    const CrashedJournal crashed = WriteCrashedJournal(dir.path(), 20);
    const fs::path& wal = crashed.wal;
    if (std::string(how) == "removed") {
      fs::remove(wal);
    } else {
      // A boundary between groups halfway through: whole batches, far below the mark.
      const std::uintmax_t at_batch = crashed.wal_sizes.at(crashed.wal_sizes.size() / 2);
      fs::resize_file(wal, std::string(how) == "emptied" ? 0 : at_batch);
    }
    Result<std::uint64_t> read = ReadableRecords(dir.path());
    ASSERT_FALSE(read.ok()) << "read " << *read << " of 24 records as a healthy journal";
    EXPECT_EQ(read.status().code(), Code::kCorruption) << read.status().ToString();
    Result<std::unique_ptr<Journal>> writer = Journal::Open(dir.path(), Options{});
    ASSERT_FALSE(writer.ok()) << "the writer opened with head " << (*writer)->head_seq();
    EXPECT_EQ(writer.status().code(), Code::kCorruption) << writer.status().ToString();
    if (std::string(how) != "removed") {
      EXPECT_NE(writer.status().message().find("durable mark"), std::string::npos)
          << writer.status().ToString();
    }
  }
}

// Proves the durable mark catches up with the last commit once the writer goes idle (within its
// interval, without a later commit): a WAL then cut below that commit is refused; catches a mark
// written only after commits, which left a plan's last records unguarded for good.
TEST(Shorter, AnIdleWritersLastCommitIsMarked) {
  TempDir dir;
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  o.durable_mark_interval_ms = 100;
  fs::path wal;
  std::uintmax_t before_last = 0;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    wal = FilesWithExtension(dir.path(), ".log").at(0);
    before_last = fs::file_size(wal);
    Result<AppendResult> last = (*j)->Append(Group({make_admission((*j)->state(), "last")}));
    ASSERT_TRUE(last.ok());
    // Idle from here on: only the writer's own schedule can mark the last commit.
    ASSERT_TRUE(WaitForMark(dir.path(), last->last_seq)) << "the idle writer never marked it";
    faults.Crash();
  }
  faults.Restart();
  fs::resize_file(wal, before_last);
  Result<std::uint64_t> read = ReadableRecords(dir.path());
  ASSERT_FALSE(read.ok()) << "read " << *read << " records: the last commit went unmarked";
  EXPECT_NE(read.status().message().find("durable mark"), std::string::npos)
      << read.status().ToString();
}

// Proves the durable mark is checked against the record at its seq, not only the head: a mark at
// a seq the journal holds, taken from a journal whose records differ there (other rollout ids),
// is Corruption naming the hash, for readers and the writer; catches a check that compares seqs
// alone (a copied mark past the head never reaches the hash comparison).
TEST(Shorter, ADurableMarkOfOtherRecordsIsRefused) {
  TempDir dir;
  WriteCrashedJournal(dir.path(), 5);  // seqs 1..9, admissions r0..r4 at 5..9
  TempDir other;
  WriteCrashedJournal(other.path(), 3, "o");  // seqs 1..7, admissions o0..o2 at 5..7
  const std::optional<std::uint64_t> seq = MarkField(other.path(), "seq");
  ASSERT_TRUE(seq.has_value());
  ASSERT_GE(*seq, 5u) << "the mark must name a record that differs between the journals";
  ASSERT_LE(*seq, 9u) << "the mark must name a record the journal holds";
  ASSERT_EQ(MarkField(other.path(), "manifest"), MarkField(dir.path(), "manifest"))
      << "journals written alike run on the same MANIFEST: the copied mark must pass that check";
  fs::copy_file(fs::path(other.path()) / "DURABLE", fs::path(dir.path()) / "DURABLE",
                fs::copy_options::overwrite_existing);
  Result<std::uint64_t> read = ReadableRecords(dir.path());
  ASSERT_FALSE(read.ok()) << "read " << *read << " records under another journal's mark";
  Result<std::unique_ptr<Journal>> writer = Journal::Open(dir.path(), Options{});
  ASSERT_FALSE(writer.ok()) << "the writer opened under another journal's mark";
  for (const Status& st : {read.status(), writer.status()}) {
    EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("but the record there hashes to"), std::string::npos)
        << st.ToString();
  }
  // The same journal's own mark opens.
  TempDir fine;
  WriteCrashedJournal(fine.path(), 5);
  Result<std::uint64_t> ok = ReadableRecords(fine.path());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(*ok, 9u);
}

// Proves a CURRENT (and its MANIFEST) older than the journal's other files is refused before
// RocksDB opens, by read-only opens and the writer, and that the newer files are still there
// afterwards, whether the journal holds a durable mark (whose MANIFEST is newer) or none (a
// journal no writer of this version opened: the newer tables hold records the older MANIFEST
// lacks); catches the reproduced bug where such a journal audited INTACT with fewer records and
// the writer's open deleted the newer tables as obsolete.
TEST(Shorter, AStaleCurrentIsRefusedAndNothingIsDeleted) {
  for (bool marked : {true, false}) {
    SCOPED_TRACE(marked ? "with a durable mark" : "without a durable mark");
    TempDir dir;
    TempDir saved;
    WriteJournal(dir.path(), 10);
    for (const auto& e : fs::directory_iterator(dir.path())) {
      const std::string name = e.path().filename().string();
      if (name == "CURRENT" || name.rfind("MANIFEST-", 0) == 0) {
        fs::copy_file(e.path(), fs::path(saved.path()) / name);
      }
    }
    {  // reopened: a newer MANIFEST, more tables
      auto j = Journal::Open(dir.path(), Options{});
      ASSERT_TRUE(j.ok()) << j.status().ToString();
      for (int i = 0; i < 10; ++i) {
        ASSERT_TRUE(
            (*j)->Append(Group({make_admission((*j)->state(), "s" + std::to_string(i))})).ok());
      }
    }
    const std::vector<fs::path> tables = FilesWithExtension(dir.path(), ".sst");
    ASSERT_FALSE(tables.empty());
    for (const auto& e : fs::directory_iterator(saved.path())) {
      fs::copy_file(e.path(), fs::path(dir.path()) / e.path().filename(),
                    fs::copy_options::overwrite_existing);
    }
    fs::remove(fs::path(dir.path()) / "CLOSED");
    if (!marked) {
      ASSERT_TRUE(fs::remove(fs::path(dir.path()) / "DURABLE"));
    }
    const std::string why = marked ? "older than the MANIFEST" : "RocksDB would delete it";
    Result<std::uint64_t> read = ReadableRecords(dir.path());
    ASSERT_FALSE(read.ok()) << "read " << *read << " records of a stale CURRENT as healthy";
    Result<std::unique_ptr<Journal>> writer = Journal::Open(dir.path(), Options{});
    ASSERT_FALSE(writer.ok()) << "the writer opened with head " << (*writer)->head_seq();
    for (const Status& st : {read.status(), writer.status()}) {
      EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
      EXPECT_NE(st.message().find(why), std::string::npos) << st.ToString();
    }
    for (const fs::path& table : tables) {
      EXPECT_TRUE(fs::exists(table)) << table << " was deleted by a refused open";
    }
  }
}

// Proves an older copy of the very MANIFEST CURRENT names (the number the durable mark names too,
// cut back to before a flush) is refused by read-only opens and the writer, and that the writer's
// refused open deletes none of the tables that copy does not list; catches the writer whose
// RocksDB open deleted those tables (and with them every record flushed) before its checks
// refused the journal.
TEST(Shorter, AnOlderCopyOfTheCurrentManifestIsRefusedAndNothingIsDeleted) {
  TempDir dir;
  TempDir saved;
  Options o;
  o.snapshot_every = 0;
  std::string manifest;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    manifest = CurrentManifestName(dir.path());
    ASSERT_TRUE(fs::exists(dir.sub(manifest))) << manifest;
    fs::copy_file(dir.sub(manifest), fs::path(saved.path()) / manifest);
    const fs::path first_wal = FilesWithExtension(dir.path(), ".log").at(0);
    ASSERT_TRUE((*j)->Flush().ok());  // records 1..24 into tables; their WAL becomes obsolete
    for (int i = 20; i < 30; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (fs::exists(first_wal) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_FALSE(fs::exists(first_wal)) << "RocksDB kept the flushed WAL";
    (*j)->Stop(Status::Unavailable("stopped by the test: no clean close"));
  }
  const std::vector<fs::path> tables = FilesWithExtension(dir.path(), ".sst");
  ASSERT_FALSE(tables.empty());
  fs::copy_file(fs::path(saved.path()) / manifest, dir.sub(manifest),
                fs::copy_options::overwrite_existing);
  for (const Options& opened : {ReadOnly(), Writer(o)}) {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), opened);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find("RocksDB would delete it"), std::string::npos)
        << j.status().ToString();
  }
  for (const fs::path& table : tables) {
    EXPECT_TRUE(fs::exists(table)) << table << " was deleted by a refused open";
  }
}

// Proves a journal whose MANIFEST is gone (CURRENT names a missing file) is Corruption, the
// journal damaged, not IOError (a wrong path or a permission); catches the reproduced exit 2
// where the tools must say exit 3, JOURNAL DAMAGED.
TEST(Shorter, AMissingManifestIsDamageNotAnIoError) {
  TempDir dir;
  WriteJournal(dir.path(), 3);
  for (const auto& e : fs::directory_iterator(dir.path())) {
    if (e.path().filename().string().rfind("MANIFEST-", 0) == 0) fs::remove(e.path());
  }
  for (bool read_only : {true, false}) {
    Result<std::unique_ptr<Journal>> j =
        Journal::Open(dir.path(), read_only ? ReadOnly() : Options{});
    ASSERT_FALSE(j.ok());
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
  }
}

// Writes bootstrap + 66 admissions (70 records) without a clean close, then cuts the WAL 9 bytes
// into its last batch: the head recovered is 69 and the tail is torn.
void WriteTornJournal(const std::string& path) {
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  o.durable_mark_interval_ms = UINT32_MAX;  // the cut lies after the mark (its first batch)
  fs::path wal;
  std::uintmax_t before_last = 0;  // the WAL's size before the last group
  {
    auto j = Journal::Open(path, o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    wal = FilesWithExtension(path, ".log").at(0);
    for (int i = 0; i < 66; ++i) {
      before_last = fs::file_size(wal);
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    faults.Crash();  // no clean close: the records live in the WAL only
  }
  faults.Restart();
  fs::resize_file(wal, before_last + 9);
}

// Both a read-only open and the writer's refuse the journal at `path` with `code`, naming `what`.
void ExpectBothOpensRefuse(const std::string& path, Code code, const std::string& what) {
  for (const Options& each : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(path, each);
    ASSERT_FALSE(j.ok()) << (each.read_only ? "read-only" : "writer") << " opened with head "
                         << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), code) << j.status().ToString();
    EXPECT_NE(j.status().message().find(what), std::string::npos) << j.status().ToString();
  }
}

// An Env whose LockFile fails as on a read-only mount (the LOCK cannot be opened for writing),
// which says nothing about a writer. Files whose names end with `growing` look 100 bytes longer
// from their second size query on: a writer at work while the journal is checked.
class NoLockEnv final : public rocksdb::EnvWrapper {
 public:
  // `growing`: "" none; ".log" a writer appending; ".sst" a writer flushing and compacting.
  explicit NoLockEnv(std::string growing = "")
      : rocksdb::EnvWrapper(rocksdb::Env::Default()), growing_(std::move(growing)) {}
  const char* Name() const override { return "RolloutCoreNoLockEnv"; }
  rocksdb::Status LockFile(const std::string& f, rocksdb::FileLock** l) override {
    *l = nullptr;
    return rocksdb::Status::IOError("while open a file for lock: " + f, "Read-only file system");
  }
  rocksdb::Status GetFileSize(const std::string& f, std::uint64_t* size) override {
    rocksdb::Status s = rocksdb::EnvWrapper::GetFileSize(f, size);
    const bool grows = !growing_.empty() && f.size() > growing_.size() &&
                       f.compare(f.size() - growing_.size(), growing_.size(), growing_) == 0;
    if (!s.ok() || !grows) return s;
    std::lock_guard<std::mutex> l(mu_);
    if (!sized_.insert(f).second) *size += 100;
    return s;
  }

 private:
  const std::string growing_;
  std::mutex mu_;
  std::set<std::string> sized_;  // growing files whose size was asked once
};

Options ReadOnlyOver(rocksdb::Env* env) {
  Options o = ReadOnly();
  o.env = env;
  return o;
}

// Proves a journal whose LOCK cannot be taken while no process holds it (a read-only mount) opens
// read-only with its torn WAL tail reported; catches the fallback to a secondary instance on any
// lock failure, which skips the tail and clean-close checks and read the torn journal as healthy.
TEST(Shorter, UnlockableJournalIsCheckedNotReadAsASecondary) {
  TempDir dir;
  WriteTornJournal(dir.path());
  NoLockEnv env;
  auto j = Journal::Open(dir.path(), ReadOnlyOver(&env));
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  const Recovery rec = (*j)->recovery();
  EXPECT_FALSE(rec.live_writer) << "read as beside a live writer: the tail went unchecked";
  EXPECT_EQ((*j)->head_seq(), 69u);
  EXPECT_EQ(rec.wal_bytes_unread, 9u) << rec.torn_tail;
  EXPECT_NE(rec.torn_tail.find("from seq 70"), std::string::npos) << rec.torn_tail;
}

// Proves the same through the real file system: a LOCK without write permission (what a reader
// of another user's journal meets) still yields the torn tail; catches the secondary fallback on
// "permission denied". Skipped as root, for whom the permission bits refuse nothing.
TEST(Shorter, ReadOnlyLockFileIsCheckedNotReadAsASecondary) {
  if (::geteuid() == 0) GTEST_SKIP() << "root opens a read-only LOCK for writing all the same";
  TempDir dir;
  WriteTornJournal(dir.path());
  const fs::path lock = fs::path(dir.path()) / "LOCK";
  ASSERT_TRUE(fs::exists(lock));
  fs::permissions(lock, fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  auto j = Journal::Open(dir.path(), ReadOnly());
  fs::permissions(lock, fs::perms::owner_write, fs::perm_options::add);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_FALSE((*j)->recovery().live_writer);
  EXPECT_EQ((*j)->recovery().wal_bytes_unread, 9u) << (*j)->recovery().torn_tail;
}

// Proves an open without the LOCK is refused (Busy, saying why) when the WAL changed while the
// journal was checked; catches checks that would report a live writer's half-written batch as a
// torn tail, or a journal that moved on as the one checked.
TEST(Shorter, WalChangedDuringAnUnlockedOpenIsRefused) {
  TempDir dir;
  WriteTornJournal(dir.path());
  NoLockEnv env(".log");
  auto j = Journal::Open(dir.path(), ReadOnlyOver(&env));
  ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
  EXPECT_EQ(j.status().code(), Code::kBusy) << j.status().ToString();
  EXPECT_NE(j.status().message().find("changed while it was checked without its LOCK"),
            std::string::npos)
      << j.status().message();
}

std::size_t SecondaryDirsIn(const std::string& tmp) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(tmp)) {
    if (e.path().filename().string().rfind("rc-journal-secondary-", 0) == 0) ++n;
  }
  return n;
}

// Proves read-only opens remove their scratch directory on every path: no writer (no secondary
// needed), beside a live writer (success), beside a live writer with a missing live file
// (failure); catches the reproduced leak of rc-journal-secondary-* directories on failed opens.
TEST(Shorter, ReadOnlyOpensLeaveNoScratchDirectory) {
  TempDir dir;
  TempDir tmp;
  const char* old_tmpdir = std::getenv("TMPDIR");
  const std::string saved = old_tmpdir != nullptr ? old_tmpdir : "";
  setenv("TMPDIR", tmp.path().c_str(), 1);
  const std::string path = dir.sub("journal");
  WriteJournal(path, 6);
  {
    auto j = Journal::Open(path, ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_FALSE((*j)->recovery().live_writer);
    EXPECT_EQ(SecondaryDirsIn(tmp.path()), 0u);
  }
  EXPECT_FALSE(Journal::Open(dir.sub("missing"), ReadOnly()).ok());
  EXPECT_EQ(SecondaryDirsIn(tmp.path()), 0u);
  {
    auto writer = Journal::Open(path, Options{});
    ASSERT_TRUE(writer.ok());
    {
      auto j = Journal::Open(path, ReadOnly());
      ASSERT_TRUE(j.ok()) << j.status().ToString();
      EXPECT_TRUE((*j)->recovery().live_writer);
      EXPECT_EQ((*j)->head_seq(), 10u);
      EXPECT_EQ(SecondaryDirsIn(tmp.path()), 1u);
    }
    EXPECT_EQ(SecondaryDirsIn(tmp.path()), 0u);
    ASSERT_TRUE((*writer)->Flush().ok());
    for (const fs::path& sst : FilesWithExtension(path, ".sst")) fs::remove(sst);
    Result<std::unique_ptr<Journal>> j = Journal::Open(path, ReadOnly());
    EXPECT_FALSE(j.ok()) << "a secondary opened with its live files deleted";
    // (A secondary instance does not install a MANIFEST version whose files are missing: it
    // sees an older one, without the schema record here, and the open fails on that.)
    if (!j.ok()) {
      EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    }
    EXPECT_EQ(SecondaryDirsIn(tmp.path()), 0u) << "a failed open left its scratch directory";
  }
  if (old_tmpdir != nullptr) {
    setenv("TMPDIR", saved.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
}

// Proves a clean close that dies while it writes its record (the process gone at the record's
// sync, its unsynced bytes lost) leaves a journal that opens as a crashed one, for readers and
// the writer, and that the writer removes the CLOSED.tmp left behind; catches CLOSED written in
// place, whose torn record made every later open refuse the journal.
TEST(Shorter, ACloseThatDiesWritingItsRecordLeavesAnOpenableJournal) {
  TempDir dir;
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    // The durable mark covers the head first: no mark written later syncs a file of that kind.
    ASSERT_TRUE(WaitForMark(dir.path(), 4)) << "the durable mark never covered the head";
    // The close flushes (SST and MANIFEST files), then syncs its record: the process dies there.
    faults.Inject(testing::FileKind::kOther, testing::FileOp::kSync, testing::Fault::kCrash);
  }
  ASSERT_TRUE(faults.DropUnsyncedData(testing::Torn::kNone, 1).ok());
  faults.Restart();
  EXPECT_FALSE(fs::exists(dir.sub("CLOSED")));
  EXPECT_TRUE(fs::exists(dir.sub("CLOSED.tmp"))) << "the close did not die writing its record";
  for (const Options& each : {ReadOnlyOver(faults.env()), o}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), 4u);
    EXPECT_FALSE((*j)->recovery().clean_close);
  }
  EXPECT_FALSE(fs::exists(dir.sub("CLOSED.tmp"))) << "the writer left the torn record";
  auto j = Journal::Open(dir.path(), ReadOnlyOver(faults.env()));
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_TRUE((*j)->recovery().clean_close) << "the writer's own close recorded nothing";
}

// Proves a clean-close record far larger than any real one (damage, or a file put in its place)
// is refused by its size before it is read, as Corruption naming the size. Catches a CLOSED file
// read whole into memory before it is checked: a file of gigabytes would be allocated at every
// open of the journal by serve, replay and audit.
TEST(Shorter, AnOversizedCloseRecordIsRefusedBeforeItIsRead) {
  TempDir dir;
  {
    auto j = Journal::Open(dir.path(), Options{});
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
  }
  ASSERT_TRUE(fs::exists(dir.sub("CLOSED")));
  fs::resize_file(dir.sub("CLOSED"), 4u << 20);
  ExpectBothOpensRefuse(dir.path(), Code::kCorruption, "is 4194304 bytes; one is at most 1024");
}

// Restores TMPDIR at scope exit.
class ScopedTmpdir {
 public:
  explicit ScopedTmpdir(const std::string& value) {
    const char* old = std::getenv("TMPDIR");
    if (old != nullptr) saved_ = old;
    setenv("TMPDIR", value.c_str(), 1);
  }
  ~ScopedTmpdir() {
    if (saved_.has_value()) {
      setenv("TMPDIR", saved_->c_str(), 1);
    } else {
      unsetenv("TMPDIR");
    }
  }
  ScopedTmpdir(const ScopedTmpdir&) = delete;
  ScopedTmpdir& operator=(const ScopedTmpdir&) = delete;

 private:
  std::optional<std::string> saved_;
};

// Proves a file named like a WAL whose number 64 bits cannot hold is ignored as RocksDB ignores
// it, and a TMPDIR that is not a directory makes a secondary's open an IOError; catches the
// std::out_of_range (std::stoull) and std::filesystem_error (temp_directory_path) that escaped
// Journal::Open and ended `rolloutcore` with an uncaught exception.
TEST(Shorter, OddWalNamesAndABadTmpdirAreStatusesNotExceptions) {
  TempDir dir;
  WriteJournal(dir.path(), 2);
  std::ofstream(dir.sub("123456789012345678901234567890.log")) << "not a WAL";
  for (const Options& o : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), 6u);
  }
  TempDir other;
  const std::string not_a_dir = other.sub("file");
  std::ofstream(not_a_dir) << "x";
  auto writer = Journal::Open(dir.path(), Options{});
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  Result<std::unique_ptr<Journal>> reader = Status::Internal("not opened");
  {
    ScopedTmpdir tmpdir(not_a_dir);
    reader = Journal::Open(dir.path(), ReadOnly());  // a secondary, in a temporary directory
  }
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kIOError) << reader.status().ToString();
  EXPECT_NE(reader.status().message().find("temporary directory"), std::string::npos)
      << reader.status().message();
}

// Proves a journal whose MANIFEST lacks the rollout index or the idempotency column family is
// Corruption naming it, for the writer and for readers (`audit` exits 3); catches the writer
// that created the missing family empty (a lost index opened as a healthy, empty one) and the
// readers' IOError ("cannot open", a usage error).
TEST(Shorter, AMissingColumnFamilyIsCorruption) {
  for (const std::size_t cf : {std::size_t{2}, std::size_t{3}}) {
    const std::string name = cf == 2 ? "rollouts" : "idempotency";
    TempDir dir;
    WriteJournal(dir.path(), 2);
    EditRaw(dir.path(), [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& h) {
      ASSERT_TRUE(db.DropColumnFamily(h[cf]).ok());
    });
    for (const Options& o : {ReadOnly(), Options{}}) {
      auto j = Journal::Open(dir.path(), o);
      ASSERT_FALSE(j.ok()) << name << " opened with head " << (*j)->head_seq();
      EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
      EXPECT_NE(j.status().message().find("lacks the column family " + name), std::string::npos)
          << j.status().message();
    }
  }
}

// Proves a directory that lost its CURRENT but holds the journal's MANIFEST, SST and WAL files is
// Corruption for the writer (which creates nothing there) and for readers, while a directory a
// creation left with only LOCK and LOG (or an operator's own serve.log) still becomes a new
// journal; catches the writer that created a fresh, empty journal over the old files
// (create_if_missing) and the readers' NotFound.
TEST(Shorter, ALostCurrentIsCorruptionNotANewJournal) {
  TempDir dir;
  WriteJournal(dir.path(), 2);
  ASSERT_TRUE(fs::remove(dir.sub("CURRENT")));
  for (const Options& o : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find("no CURRENT file but holds"), std::string::npos)
        << j.status().message();
  }
  EXPECT_FALSE(fs::exists(dir.sub("CURRENT"))) << "a new journal was created over the old one";
  TempDir early;
  std::ofstream(early.sub("LOCK")) << "";
  std::ofstream(early.sub("LOG")) << "a creation that died before its MANIFEST";
  std::ofstream(early.sub("serve.log")) << "an operator's own log beside the journal";
  auto j = Journal::Open(early.path(), Options{});
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)->head_seq(), 0u);
}

// Proves a live file that cannot be read (a table file replaced by a directory) is an I/O error
// naming that file even when the journal's path holds the word "lock", for the read-only tools
// and the writer; catches the open that matched "lock" anywhere in RocksDB's message, path
// included, and reported a damaged journal as "already open by another process".
TEST(Shorter, AnUnreadableFileUnderAPathNamingALockIsNotBusy) {
  TempDir dir;
  const std::string path = dir.path() + "/block-store";
  WriteJournal(path, 66);
  {
    auto j = Journal::Open(path, Options{});
    ASSERT_TRUE(j.ok());
    ASSERT_TRUE((*j)->Compact().ok());
  }
  const std::vector<fs::path> ssts = FilesWithExtension(path, ".sst");
  ASSERT_FALSE(ssts.empty());
  fs::remove(ssts.front());
  fs::create_directory(ssts.front());
  Result<std::uint64_t> read = ReadableRecords(path);
  ASSERT_FALSE(read.ok()) << "read " << *read << " records";
  Result<std::unique_ptr<Journal>> writer = Journal::Open(path, Options{});
  ASSERT_FALSE(writer.ok());
  for (const Status& st : {read.status(), writer.status()}) {
    EXPECT_NE(st.code(), Code::kBusy) << st.ToString();
    EXPECT_EQ(st.message().find("already open"), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(ssts.front().filename().string()), std::string::npos)
        << st.ToString();
  }
}

// Proves a read-only open that finds the LOCK held (as a second audit does while the first one
// opens) and reads the journal as a secondary instance still refuses records that end before the
// durable mark or the clean close, and still opens a healthy journal; catches the secondary
// fallback that skipped every mark and read a WAL cut below the mark as INTACT, "beside a live
// writer".
TEST(Shorter, AReaderBesideTheLockHolderStillChecksTheMarks) {
  TempDir healthy;
  WriteCrashedJournal(healthy.path(), 20);
  {
    LockHolder other_reader(healthy.path());
    auto j = Journal::Open(healthy.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_TRUE((*j)->recovery().live_writer) << "not read as a secondary";
    EXPECT_EQ((*j)->head_seq(), 24u);
  }
  TempDir cut;
  const CrashedJournal crashed = WriteCrashedJournal(cut.path(), 20);
  fs::resize_file(crashed.wal, crashed.wal_sizes.at(crashed.wal_sizes.size() / 2));
  {
    LockHolder other_reader(cut.path());
    auto j = Journal::Open(cut.path(), ReadOnly());
    ASSERT_FALSE(j.ok()) << "a secondary read " << (*j)->head_seq() << " of 24 records as healthy";
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find("durable mark"), std::string::npos)
        << j.status().ToString();
  }
  TempDir closed;
  const std::string path = closed.sub("journal");
  const std::string old_copy = closed.sub("old");
  {
    auto j = Journal::Open(path, Options{});
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    ASSERT_TRUE((*j)->Checkpoint(old_copy).ok());  // 4 records
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
  }
  fs::copy_file(path + "/CLOSED", old_copy + "/CLOSED");  // closed at seq 10
  LockHolder other_reader(old_copy);
  auto j = Journal::Open(old_copy, ReadOnly());
  ASSERT_FALSE(j.ok()) << "a secondary read " << (*j)->head_seq() << " of 10 records as healthy";
  EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
  EXPECT_NE(j.status().message().find("clean-close record"), std::string::npos)
      << j.status().ToString();
}

// Proves a read-only open without the LOCK (a read-only mount) whose check fails on records that
// end before the durable mark answers Busy when the WALs changed meanwhile (a writer appending:
// what it read tells nothing), and Corruption when nothing changed; catches a reader that called
// a live writer's journal damaged because it read a mark newer than the records it saw.
TEST(Shorter, ALockLessReaderWhoseWalChangedIsBusyNotDamaged) {
  TempDir dir;
  const CrashedJournal crashed = WriteCrashedJournal(dir.path(), 20);
  fs::resize_file(crashed.wal, crashed.wal_sizes.at(crashed.wal_sizes.size() / 2));
  NoLockEnv appending(".log");
  auto busy = Journal::Open(dir.path(), ReadOnlyOver(&appending));
  ASSERT_FALSE(busy.ok()) << "opened with head " << (*busy)->head_seq();
  EXPECT_EQ(busy.status().code(), Code::kBusy) << busy.status().ToString();
  NoLockEnv still;
  auto damaged = Journal::Open(dir.path(), ReadOnlyOver(&still));
  ASSERT_FALSE(damaged.ok()) << "opened with head " << (*damaged)->head_seq();
  EXPECT_EQ(damaged.status().code(), Code::kCorruption) << damaged.status().ToString();
  EXPECT_NE(damaged.status().message().find("durable mark"), std::string::npos)
      << damaged.status().ToString();
}

// Proves a read-only open without the LOCK whose check fails on a table file (it changed size
// while the journal was checked: a writer's flush or compaction, WAL files untouched) answers
// Busy; catches the unlocked open that compared only WAL files and called a live writer's
// compacted journal damaged ("live file missing or of the wrong size").
TEST(Shorter, ALockLessReaderBesideACompactionIsBusyNotDamaged) {
  TempDir dir;
  WriteJournal(dir.path(), 6);  // closed cleanly: its records in table files
  ASSERT_FALSE(FilesWithExtension(dir.path(), ".sst").empty());
  NoLockEnv compacting(".sst");
  auto j = Journal::Open(dir.path(), ReadOnlyOver(&compacting));
  ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq();
  EXPECT_EQ(j.status().code(), Code::kBusy) << j.status().ToString();
  EXPECT_NE(j.status().message().find("changed while it was checked without its LOCK"),
            std::string::npos)
      << j.status().message();
}

// Proves the MANIFESTs (and recovered tables) that writer opens leave when they die before CURRENT
// names their MANIFEST (twice: a stalled start killed, then another) do not make the journal
// refused: read-only opens and the writer then open it with every acknowledged record; catches a
// check that refuses a MANIFEST newer than CURRENT's with files numbered after it (both
// leftovers), which no open ever got past.
TEST(Shorter, ManifestsLeftByOpensThatDiedAreNotRefused) {
  TempDir dir;
  WriteCrashedJournal(dir.path(), 20);  // 24 records in the WAL only
  Hash head_hash{};
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    ASSERT_EQ((*j)->head_seq(), 24u);
    head_hash = (*j)->head_hash();
  }
  for (int died = 0; died < 2; ++died) {
    testing::FaultEnv faults;
    Options o;
    o.env = faults.env();
    // RocksDB's open recovers the WAL into tables and writes and syncs a new MANIFEST, then syncs
    // the file that would become CURRENT (the first "other" file it syncs): the process dies.
    faults.Inject(testing::FileKind::kOther, testing::FileOp::kSync, testing::Fault::kCrash);
    auto j = Journal::Open(dir.path(), o);
    ASSERT_FALSE(j.ok()) << "the open did not die";
    ASSERT_TRUE(faults.DropUnsyncedData(testing::Torn::kNone, 1).ok());
    faults.Restart();
  }
  std::size_t manifests = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    manifests += e.path().filename().string().rfind("MANIFEST-", 0) == 0 ? 1 : 0;
  }
  ASSERT_GE(manifests, 3u) << "the opens that died left no MANIFEST behind";
  for (const Options& each : {ReadOnly(), Writer(Options{})}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), 24u);
    EXPECT_EQ((*j)->head_hash(), head_hash);
    EXPECT_TRUE((*j)->Scan(1, 0, [](const Record&) { return Status::OK(); }).ok());
  }
}

// Proves a read-only open beside the LOCK's holder whose listing of the column families finds the
// MANIFEST it read gone (a writer's open switched CURRENT and deleted it just then) reads CURRENT
// again and opens; catches the listing whose "No such file" made a healthy journal Corruption
// ("damaged, never auto-repaired").
TEST(Shorter, AManifestAWritersOpenReplacedMidListingIsNotDamage) {
  TempDir dir;
  WriteJournal(dir.path(), 6);
  const std::string old_manifest = CurrentManifestName(dir.path());
  testing::FaultEnv faults;
  LockHolder other(dir.path());
  bool replaced = false;
  faults.BeforeNextRead("MANIFEST-", [&] {
    other.Release();  // a writer starts: its open switches CURRENT and deletes the old MANIFEST
    auto writer = Journal::Open(dir.path(), Options{});
    replaced = writer.ok() && !fs::exists(dir.sub(old_manifest));
  });
  auto j = Journal::Open(dir.path(), ReadOnlyOver(faults.env()));
  ASSERT_TRUE(replaced) << "the writer's open did not replace " << old_manifest;
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)->head_seq(), 10u);
}

// Proves the writer marks the head it recovered, and the MANIFEST it runs on, before it accepts
// appends: after a crash whose last records no mark covered, a reopen that commits nothing leaves
// a mark of those records; catches a writer that marked only after its first commit, so that an
// idle writer guarded neither the records it recovered nor its MANIFEST.
TEST(Shorter, AWriterMarksTheHeadItRecoversAtOpen) {
  TempDir dir;
  Options idle;
  idle.durable_mark_interval_ms = UINT32_MAX;  // no mark after a commit: the open's alone
  {
    testing::FaultEnv faults;
    Options o = idle;
    o.env = faults.env();
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    for (int i = 0; i < 5; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    faults.Crash();  // no clean close, and no mark at the close
    j->reset();
    faults.Restart();
  }
  ASSERT_NE(MarkField(dir.path(), "seq"), std::optional<std::uint64_t>(9));
  auto j = Journal::Open(dir.path(), idle);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  ASSERT_EQ((*j)->head_seq(), 9u);
  EXPECT_EQ(MarkField(dir.path(), "seq"), std::optional<std::uint64_t>(9));
  EXPECT_EQ(MarkField(dir.path(), "manifest"),
            std::optional<std::uint64_t>(CurrentManifest(dir.path())));
}

// Proves a writer that closes while its last commits are not marked yet (the interval not due)
// marks them before its clean close, so that a clean close that then fails (a flush on a full
// disk) leaves them guarded; catches a stop that dropped the pending mark, leaving the last
// commits guarded by neither record.
TEST(Shorter, AWriterMarksItsLastCommitsWhenItStops) {
  TempDir dir;
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.durable_mark_interval_ms = UINT32_MAX;  // never due while it runs
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    EXPECT_EQ(MarkField(dir.path(), "seq"), std::optional<std::uint64_t>(0));
    faults.Inject(testing::FileKind::kSst, testing::FileOp::kAppend, testing::Fault::kEnospc);
    EXPECT_FALSE((*j)->Close().ok()) << "the clean close's flush did not fail";
  }
  faults.Clear();
  EXPECT_FALSE(fs::exists(dir.sub("CLOSED")));
  EXPECT_EQ(MarkField(dir.path(), "seq"), std::optional<std::uint64_t>(4));
}

// Proves a read-only open that finds the LOCK held by another process (another reader's open)
// waits for it and then opens as a plain read-only DB with its WAL tail checked, no earlier than
// the LOCK was released; catches a reader that took a LOCK another process holds for a live
// writer at once (a secondary, which checks no tail), the retry the in-process LockHolder never
// reaches.
TEST(Shorter, AReaderWaitsOutAnotherProcessHoldingTheLockThenChecksTheTail) {
  TempDir dir;
  WriteTornJournal(dir.path());
  ChildLockHolder other_reader(dir.path(), 300);
  ASSERT_TRUE(other_reader.held()) << "the child never took the LOCK";
  const auto t0 = std::chrono::steady_clock::now();
  auto j = Journal::Open(dir.path(), ReadOnly());
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_FALSE((*j)->recovery().live_writer) << "read as beside a live writer: no tail checked";
  EXPECT_EQ((*j)->recovery().wal_bytes_unread, 9u) << (*j)->recovery().torn_tail;
  EXPECT_GE(waited, std::chrono::milliseconds(250)) << "opened while another process held it";
}

// Proves a writer whose RocksDB open finds the LOCK taken by another process just after the
// writer's own check released it (a reader polling the LOCK took it then) waits for that reader
// and opens; catches the writer that failed Busy ("journal already open by another process")
// because a reader slipped in between its check and RocksDB's open.
TEST(Shorter, AWriterWaitsOutAReaderThatTookTheLockBetweenItsCheckAndItsOpen) {
  TempDir dir;
  const std::uint64_t head = WriteJournal(dir.path(), 3);
  testing::FaultEnv faults;
  std::optional<ChildLockHolder> reader;
  // RocksDB's open for writing opens the journal's directory just before it takes the LOCK; the
  // check before it (a read-only open) opens none.
  faults.BeforeNextDirectory([&] { reader.emplace(dir.path(), 300); });
  Options o;
  o.env = faults.env();
  auto j = Journal::Open(dir.path(), o);
  ASSERT_TRUE(reader.has_value() && reader->held()) << "no reader took the LOCK in between";
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)->head_seq(), head);
}

// Proves a journal opens with its acknowledged head when an open that died left tables holding
// a group past every mark, never acknowledged: its writer was killed at that group's WAL sync
// (its bytes in the page cache only), the next open died after RocksDB recovered that WAL into
// synced tables but before CURRENT named its MANIFEST, and a power loss then cut the WAL back to
// what was synced. Read-only opens and the writer open, report those tables' seq, and the writer
// lets RocksDB delete them; without a durable mark (nothing shows the seq was never acknowledged)
// the journal is still refused. Catches the check that refused such a healthy journal for good
// (a table "holds the record at seq 25, which the journal lacks").
TEST(Shorter, TablesADeadOpenLeftPastEveryMarkAreAnUnacknowledgedTail) {
  TempDir dir;
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  o.durable_mark_interval_ms = 0;  // every acknowledged group is marked
  fs::path wal;
  std::uintmax_t acked_wal_bytes = 0;
  std::uint64_t acked = 0;
  Hash acked_hash{};
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "r" + std::to_string(i))})).ok());
    }
    acked = (*j)->head_seq();
    acked_hash = (*j)->head_hash();
    ASSERT_TRUE(WaitForMark(dir.path(), acked)) << "the mark never covered the head";
    wal = FilesWithExtension(dir.path(), ".log").at(0);
    acked_wal_bytes = fs::file_size(wal);
    // Killed at the next group's WAL sync: its bytes reached the file, never acknowledged.
    faults.Inject(testing::FileKind::kWal, testing::FileOp::kSync, testing::Fault::kCrash);
    ASSERT_FALSE((*j)->Append(Group({make_admission((*j)->state(), "unacked")})).ok());
  }
  faults.Restart();  // a kill, not a power loss: the unsynced bytes stay in the WAL
  ASSERT_GT(fs::file_size(wal), acked_wal_bytes);
  const std::vector<fs::path> live_tables = FilesWithExtension(dir.path(), ".sst");
  {
    // RocksDB's open recovers the WAL (the unacknowledged seq included) into synced tables and a
    // new MANIFEST, then syncs the file that would become CURRENT (the first "other" file it
    // syncs): the process dies there.
    faults.Inject(testing::FileKind::kOther, testing::FileOp::kSync, testing::Fault::kCrash);
    auto j = Journal::Open(dir.path(), o);
    ASSERT_FALSE(j.ok()) << "the open did not die";
  }
  // The power fails: what was never synced is lost, the WAL's unacknowledged group with it.
  ASSERT_TRUE(faults.DropUnsyncedData(testing::Torn::kNone, 1).ok());
  faults.Restart();
  fs::resize_file(wal, acked_wal_bytes);
  std::vector<fs::path> dead_tables;
  for (const fs::path& t : FilesWithExtension(dir.path(), ".sst")) {
    const bool live = std::find(live_tables.begin(), live_tables.end(), t) != live_tables.end();
    if (!live && fs::file_size(t) > 0) dead_tables.push_back(t);
  }
  ASSERT_FALSE(dead_tables.empty()) << "the open that died left no table";
  const std::string seq = "seq " + std::to_string(acked + 1);
  {
    // No durable mark: nothing shows the table's seq was never acknowledged.
    TempDir saved;
    fs::copy_file(dir.sub("DURABLE"), saved.sub("DURABLE"));
    fs::remove(dir.sub("DURABLE"));
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), ReadOnly());
    fs::copy_file(saved.sub("DURABLE"), dir.sub("DURABLE"));
    ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq() << " without a mark";
    EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
    EXPECT_NE(j.status().message().find("RocksDB would delete it"), std::string::npos)
        << j.status().ToString();
  }
  for (const Options& each : {ReadOnly(), o}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), acked);
    EXPECT_EQ((*j)->head_hash(), acked_hash);
    EXPECT_TRUE((*j)->Scan(1, 0, [](const Record&) { return Status::OK(); }).ok());
    const std::string torn = (*j)->recovery().torn_tail;
    EXPECT_NE(torn.find("unacknowledged tail in tables an open that died left"), std::string::npos)
        << torn;
    EXPECT_NE(torn.find("held " + seq + ", past the head"), std::string::npos) << torn;
  }
  for (const fs::path& t : dead_tables) {
    EXPECT_FALSE(fs::exists(t)) << t << " outlived the writer's open";
  }
  auto j = Journal::Open(dir.path(), ReadOnly());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)->head_seq(), acked);
  EXPECT_NE((*j)->recovery().torn_tail.find("found by an earlier open"), std::string::npos)
      << (*j)->recovery().torn_tail;
}

// Proves a table file the MANIFEST does not list that cannot be read for another reason than
// damage (a dangling link in its place: it cannot even be sized, an I/O error) fails the open
// (read-only and writer) naming it, and is left in place, while one cut short (what a flush,
// compaction or open that died leaves) is passed over; catches the check that took any error
// reading such a file for a harmless leftover, which RocksDB's open then deleted unread.
TEST(Shorter, AnObsoleteTableThatCannotBeReadIsAnErrorUnlessItIsDamaged) {
  TempDir dir;
  const std::uint64_t head = WriteJournal(dir.path(), 6);
  const std::vector<fs::path> tables = FilesWithExtension(dir.path(), ".sst");
  ASSERT_FALSE(tables.empty());
  fs::copy_file(tables.front(), dir.sub("999998.sst"));
  fs::resize_file(dir.sub("999998.sst"), fs::file_size(tables.front()) / 2);
  for (const Options& each : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), head);
  }
  fs::create_symlink(dir.sub("nowhere"), dir.sub("999999.sst"));
  ExpectBothOpensRefuse(dir.path(), Code::kIOError, "999999.sst");
  EXPECT_TRUE(fs::is_symlink(dir.sub("999999.sst")));
}

// Proves the torn-tail sentence names the WAL file, the bytes and the seq recovered through before
// the journal's path, which comes last: the copy an executor's start records (cut to
// kTextBytesMax) keeps them under a path of 4040 bytes; catches the sentence that began with the
// path, whose cut kept little else (replay and audit tell recorded torn tails apart by it).
TEST(Shorter, ATornTailSentenceNamesWhatWasTornBeforeTheJournalsPath) {
  TempDir dir;
  constexpr std::size_t kPathBytes = 4040;  // files in it stay below PATH_MAX
  std::string path = dir.path();
  ASSERT_LT(path.size() + 2, kPathBytes);
  while (path.size() + 201 <= kPathBytes) path += "/" + std::string(200, 'p');
  if (path.size() + 1 < kPathBytes) path += "/" + std::string(kPathBytes - path.size() - 1, 'q');
  ASSERT_EQ(path.size(), kPathBytes);
  fs::create_directories(path);
  WriteTornJournal(path);
  auto j = Journal::Open(path, ReadOnly());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  const std::string torn = (*j)->recovery().torn_tail;
  const std::string recorded = text::utf8_prefix(torn, kTextBytesMax);
  EXPECT_EQ(recorded.rfind("torn WAL tail: ", 0), 0u) << recorded;
  EXPECT_NE(recorded.find(".log: 9 of "), std::string::npos) << recorded;
  EXPECT_NE(recorded.find("recovered through seq 69"), std::string::npos) << recorded;
  const std::string last = " (journal at " + path + ")";
  ASSERT_GT(torn.size(), last.size());
  EXPECT_EQ(torn.substr(torn.size() - last.size()), last) << "the path is not last";
}

// Proves the torn tail a writer's open found is kept in the journal until the executor forgets
// it: after a clean close (nothing recorded it) the next opens, read-only and writer, report it
// as found by an earlier open, with its bytes; once ForgetRecordedTornTail ran, none does (a
// read-only journal cannot forget); catches the finding lost when serve's start failed before its
// RecoveryStarted recorded it (the torn WAL made obsolete by RocksDB's open, then the clean close
// read as a healthy ending).
TEST(Shorter, ATornTailAWritersOpenFoundIsReportedUntilForgotten) {
  TempDir dir;
  WriteTornJournal(dir.path());
  {
    auto j = Journal::Open(dir.path(), Options{});
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    const Recovery rec = (*j)->recovery();
    EXPECT_EQ(rec.wal_bytes_unread, 9u) << rec.torn_tail;
    EXPECT_EQ(rec.torn_tail.rfind("torn WAL tail: ", 0), 0u) << rec.torn_tail;
    ASSERT_TRUE((*j)->Close().ok());
  }
  ASSERT_TRUE(fs::exists(dir.sub("CLOSED")));
  const std::string earlier =
      "found by an earlier open, not yet recorded by an executor's start: torn WAL tail: ";
  for (const Options& each : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    const Recovery rec = (*j)->recovery();
    EXPECT_TRUE(rec.clean_close);
    EXPECT_EQ(rec.wal_bytes_unread, 9u) << rec.torn_tail;
    EXPECT_EQ(rec.torn_tail.rfind(earlier, 0), 0u) << rec.torn_tail;
    EXPECT_NE(rec.torn_tail.find("recovered through seq 69"), std::string::npos) << rec.torn_tail;
    const Status forgot = (*j)->ForgetRecordedTornTail();
    if (each.read_only) {
      EXPECT_EQ(forgot.code(), Code::kInvalidArgument) << forgot.ToString();
    } else {
      ASSERT_TRUE(forgot.ok()) << forgot.ToString();
    }
  }
  for (const Options& each : {ReadOnly(), Options{}}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_TRUE((*j)->recovery().torn_tail.empty()) << (*j)->recovery().torn_tail;
    EXPECT_EQ((*j)->recovery().wal_bytes_unread, 0u);
  }
}

// Proves the torn tail a writer's open keeps survives a crash (it is synced with the open), is
// reported by a reader beside the live writer too, and that a writer's open that finds a torn
// tail of its own while an earlier one is still kept reports and keeps both, its own first, bytes
// summed; catches a finding written without a sync, one only the writer's recovery() reports, and
// an earlier finding replaced by the next.
TEST(Shorter, AKeptTornTailSurvivesACrashAndIsKeptBesideANewOne) {
  TempDir dir;
  WriteTornJournal(dir.path());  // 9 bytes torn after seq 69
  testing::FaultEnv faults;
  Options o;
  o.env = faults.env();
  o.snapshot_every = 0;
  o.durable_mark_interval_ms = UINT32_MAX;  // the open's mark alone: the next cut lies past it
  const std::string earlier = "found by an earlier open";
  fs::path wal;
  std::uintmax_t before_last = 0;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    ASSERT_EQ((*j)->recovery().wal_bytes_unread, 9u) << (*j)->recovery().torn_tail;
    {
      auto beside = Journal::Open(dir.path(), ReadOnly());
      ASSERT_TRUE(beside.ok()) << beside.status().ToString();
      EXPECT_TRUE((*beside)->recovery().live_writer);
      EXPECT_EQ((*beside)->recovery().wal_bytes_unread, 9u) << (*beside)->recovery().torn_tail;
      EXPECT_NE((*beside)->recovery().torn_tail.find(earlier), std::string::npos)
          << (*beside)->recovery().torn_tail;
    }
    const std::vector<fs::path> wals = FilesWithExtension(dir.path(), ".log");
    ASSERT_EQ(wals.size(), 1u);
    wal = wals.front();
    for (int i = 0; i < 3; ++i) {
      before_last = fs::file_size(wal);
      ASSERT_TRUE(
          (*j)->Append(Group({make_admission((*j)->state(), "s" + std::to_string(i))})).ok());
    }
    faults.Crash();  // no clean close
  }
  ASSERT_TRUE(faults.DropUnsyncedData(testing::Torn::kNone, 1).ok());
  faults.Restart();
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), 72u);
    EXPECT_FALSE((*j)->recovery().clean_close);
    EXPECT_EQ((*j)->recovery().wal_bytes_unread, 9u) << "the kept finding did not survive";
    EXPECT_NE((*j)->recovery().torn_tail.find(earlier), std::string::npos)
        << (*j)->recovery().torn_tail;
  }
  fs::resize_file(wal, before_last + 5);  // a torn tail of its own: 5 bytes of the last group
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    const Recovery rec = (*j)->recovery();
    EXPECT_EQ((*j)->head_seq(), 71u);
    EXPECT_EQ(rec.wal_bytes_unread, 14u) << rec.torn_tail;
    const std::size_t own = rec.torn_tail.find(": 5 of ");
    const std::size_t kept = rec.torn_tail.find(earlier);
    ASSERT_NE(own, std::string::npos) << rec.torn_tail;
    ASSERT_NE(kept, std::string::npos) << rec.torn_tail;
    EXPECT_LT(own, kept) << rec.torn_tail;
    EXPECT_NE(rec.torn_tail.find(": 9 of ", kept), std::string::npos) << rec.torn_tail;
  }
  auto j = Journal::Open(dir.path(), ReadOnly());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  const Recovery rec = (*j)->recovery();
  EXPECT_EQ(rec.wal_bytes_unread, 14u) << rec.torn_tail;
  const std::size_t kept = rec.torn_tail.find(earlier);
  ASSERT_NE(kept, std::string::npos) << rec.torn_tail;
  EXPECT_NE(rec.torn_tail.find(": 5 of ", kept), std::string::npos) << rec.torn_tail;
  EXPECT_NE(rec.torn_tail.find(": 9 of ", kept), std::string::npos) << rec.torn_tail;
}

// Proves a torn tail the writer's open found survives a crash at each WAL sync of that open in
// turn, those after RocksDB's open removed the torn WAL included (the sync of the meta key that
// keeps the finding): a read-only open afterwards still reports the 9 bytes unread after seq 69,
// and the next writer keeps them once and removes TORN_TAIL; catches the finding that lived only
// in memory between RocksDB's open and that sync, so that a crash there read as an intact journal.
TEST(Shorter, ATornTailSurvivesACrashAnywhereInTheWritersOpen) {
  bool opened = false;       // the crash fell past the open: every sync of it was tried
  bool window_seen = false;  // a crash fell after RocksDB's open removed the torn WAL
  for (std::uint32_t skip = 0; skip < 8 && !opened; ++skip) {
    SCOPED_TRACE("WAL syncs before the crash: " + std::to_string(skip));
    TempDir dir;
    WriteTornJournal(dir.path());
    const std::vector<fs::path> torn_wals = FilesWithExtension(dir.path(), ".log");
    ASSERT_EQ(torn_wals.size(), 1u);
    testing::FaultEnv faults;
    Options o;
    o.env = faults.env();
    o.snapshot_every = 0;
    faults.Inject(testing::FileKind::kWal, testing::FileOp::kSync, testing::Fault::kCrash, skip);
    opened = Journal::Open(dir.path(), o).ok();
    if (opened) break;
    // The power fails: the meta key's unsynced write goes with it.
    ASSERT_TRUE(faults.DropUnsyncedData(testing::Torn::kNone, 1).ok());
    faults.Restart();
    window_seen = window_seen || !fs::exists(torn_wals.front());
    {
      auto j = Journal::Open(dir.path(), ReadOnly());
      ASSERT_TRUE(j.ok()) << j.status().ToString();
      EXPECT_EQ((*j)->head_seq(), 69u);
      EXPECT_EQ((*j)->recovery().wal_bytes_unread, 9u) << "the finding was lost in the crash";
      EXPECT_NE((*j)->recovery().torn_tail.find("from seq 70"), std::string::npos)
          << (*j)->recovery().torn_tail;
    }
    {
      auto j = Journal::Open(dir.path(), Options{});
      ASSERT_TRUE(j.ok()) << j.status().ToString();
      EXPECT_EQ((*j)->recovery().wal_bytes_unread, 9u) << (*j)->recovery().torn_tail;
    }
    EXPECT_FALSE(fs::exists(dir.sub("TORN_TAIL"))) << "kept, yet its file stayed";
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->recovery().wal_bytes_unread, 9u) << (*j)->recovery().torn_tail;
  }
  EXPECT_TRUE(opened) << "every WAL sync tried failed the open";
  EXPECT_TRUE(window_seen) << "no crash fell after RocksDB's open removed the torn WAL";
}

// Proves a found torn tail that cannot be parsed (TORN_TAIL damaged) is refused as Corruption by
// read-only opens and the writer, naming the file; catches a damaged finding read as none.
TEST(Shorter, ADamagedTornTailFileIsCorruption) {
  TempDir dir;
  WriteJournal(dir.path(), 2);
  std::ofstream(dir.sub("TORN_TAIL")) << "rolloutcore journal torn tail found by a writer's open\n";
  ExpectBothOpensRefuse(dir.path(), Code::kCorruption, "TORN_TAIL");
}

// Proves a TORN_TAIL that an open which died left holding its own finding joined with an earlier
// one reports the torn tail found again once, beside the earlier finding, with the bytes of both
// counted once; catches the finding reported twice, its bytes growing with each open that died.
TEST(Shorter, AJoinedTornTailFileCountsTheFindingFoundAgainOnce) {
  TempDir dir;
  WriteTornJournal(dir.path());
  std::string own;
  std::uint64_t own_bytes = 0;
  {
    auto j = Journal::Open(dir.path(), ReadOnly());
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    own = (*j)->recovery().torn_tail;
    own_bytes = (*j)->recovery().wal_bytes_unread;
  }
  const std::string suffix = " (journal at " + dir.path() + ")";
  ASSERT_GT(own.size(), suffix.size());
  ASSERT_EQ(own.substr(own.size() - suffix.size()), suffix) << own;
  own.resize(own.size() - suffix.size());
  const std::string joined = own + " | an earlier torn tail";
  const std::string lines = "rolloutcore journal torn tail found by a writer's open\nbytes " +
                            std::to_string(own_bytes + 5) + "\nsentence " +
                            hex::encode(std::string_view(joined)) + "\n";
  std::ofstream(dir.sub("TORN_TAIL")) << lines << "check " << encoding::Sha256Hex(lines) << "\n";
  auto j = Journal::Open(dir.path(), ReadOnly());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)->recovery().wal_bytes_unread, own_bytes + 5);
  const std::string torn = (*j)->recovery().torn_tail;
  EXPECT_EQ(torn.find(own), 0u) << torn;
  EXPECT_EQ(torn.find(own, 1), std::string::npos) << "reported twice: " << torn;
  EXPECT_NE(torn.find("an earlier torn tail"), std::string::npos) << torn;
}

// Proves a TORN_TAIL well formed in every other way but counting more bytes than any journal
// holds is Corruption, not a finding; catches a crafted count (2^64 - 1) that wrapped the sums of
// bytes unread an open reports and keeps.
TEST(Shorter, ATornTailFileCountingPastAnyJournalIsCorruption) {
  TempDir dir;
  WriteJournal(dir.path(), 2);
  const std::string lines =
      "rolloutcore journal torn tail found by a writer's open\nbytes 18446744073709551615\n"
      "sentence 78\n";
  std::ofstream(dir.sub("TORN_TAIL")) << lines << "check " << encoding::Sha256Hex(lines) << "\n";
  ExpectBothOpensRefuse(dir.path(), Code::kCorruption, "TORN_TAIL");
}

// Proves a journal whose writer marked it is refused (Corruption naming DURABLE) by read-only
// opens and the writer once its durable mark was removed and its WAL then cut at a batch
// boundary, and that the refused writer marks nothing; catches the never-shorter check a missing
// mark switched off, which read the cut journal as a healthy shorter one and marked its cut head.
TEST(Shorter, AWalCutAfterTheDurableMarkWasRemovedIsRefused) {
  TempDir dir;
  const CrashedJournal crashed = WriteCrashedJournal(dir.path(), 20);
  ASSERT_TRUE(fs::remove(dir.sub("DURABLE")));
  fs::resize_file(crashed.wal, crashed.wal_sizes.at(crashed.wal_sizes.size() / 2));
  Result<std::uint64_t> read = ReadableRecords(dir.path());
  ASSERT_FALSE(read.ok()) << "read " << *read << " of 24 records as a healthy journal";
  Result<std::unique_ptr<Journal>> writer = Journal::Open(dir.path(), Options{});
  ASSERT_FALSE(writer.ok()) << "the writer opened with head " << (*writer)->head_seq();
  for (const Status& st : {read.status(), writer.status()}) {
    EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("DURABLE"), std::string::npos) << st.ToString();
  }
  EXPECT_FALSE(fs::exists(dir.sub("DURABLE"))) << "the refused writer marked the cut head";
}

// Proves a journal no writer ever marked (written without sync, left without a clean close) opens
// read-only and for writing, and that once a syncing writer marked it, removing its mark is
// refused; catches the check that refused every journal without a mark, and the record of the
// first mark never written.
TEST(Shorter, AJournalNeverMarkedOpensUntilAWriterMarksIt) {
  TempDir dir;
  Options unsynced;
  unsynced.sync = false;
  {
    testing::FaultEnv faults;
    Options o = unsynced;
    o.env = faults.env();
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(Group(g)).ok());
    faults.Crash();  // a kill: no clean close, the files stay as written
    j->reset();
    faults.Restart();
  }
  ASSERT_FALSE(fs::exists(dir.sub("DURABLE")));
  ASSERT_FALSE(fs::exists(dir.sub("CLOSED")));
  for (const Options& each : {ReadOnly(), unsynced, Options{}}) {
    auto j = Journal::Open(dir.path(), each);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    EXPECT_EQ((*j)->head_seq(), 4u);
  }
  ASSERT_TRUE(fs::exists(dir.sub("DURABLE")));
  fs::remove(dir.sub("CLOSED"));
  ASSERT_TRUE(fs::remove(dir.sub("DURABLE")));
  auto j = Journal::Open(dir.path(), ReadOnly());
  ASSERT_FALSE(j.ok()) << "opened a marked journal without its mark";
  EXPECT_EQ(j.status().code(), Code::kCorruption) << j.status().ToString();
}

}  // namespace
}  // namespace rc::journal
