// The RocksDB journal: column families, group commit, hash chain, snapshots, secondary readers.
//
// Column families (keys are big-endian so that bytewise order is numeric order):
//   events       BE64(seq)                      -> record bytes (codec.h grammar)
//   rollouts     u8(len) ‖ rollout_id ‖ BE64(seq) -> ""            (RolloutSeqs)
//                u8(len) ‖ rollout_id           -> BE64(admission seq) (ids are used once: a
//                                                  point lookup at admission)
//   idempotency  client_event_id                -> BE64(first_seq) ‖ BE64(last_seq) ‖
//   SHA-256(group)
//                where group = concat over events of BE32(len) ‖ EncodeEventOnly(event)
//   snapshots    BE64(seq) ‖ "f"                -> EncodeFleetState(fold of 1..seq, hash of
//                                                  record seq; before v9 without the hash)
//                BE64(seq)                      -> EncodeState(...): written before fleets; never
//                                                  loaded (it lacks the fleet's label order)
//   meta         "head_seq" -> BE64, "head_hash" -> 32 bytes, "schema_version" -> BE64,
//                "open_torn_tail" -> BE64(bytes unread) ‖ sentence: what a writer's open found
//                lost (a torn WAL tail), kept until an executor's start recorded it,
//                "open_torn_tail_moved" -> SHA-256 of the TORN_TAIL file it was kept from,
//                "durable_mark_written" -> BE64(1): a writer marked the journal (see DURABLE)
// Every group commit is one WriteBatch over all of them (WAL on, sync = Options.sync), written by
// one committer thread; waiters sleep with the stall deadline.
//
// A clean close commits what is pending, flushes every memtable (the WAL is then not needed),
// and writes the file CLOSED beside the database: "seq N, hash H" and a SHA-256 of those lines,
// written whole and synced as CLOSED.tmp, then renamed (a close that dies midway leaves no CLOSED).
// A file and not a meta key: the record must survive the loss of the very SST files it vouches
// for, so that "closed at seq N but holds only M records" can be said. A writer removes it
// (synced) before it accepts appends, so a crash afterwards leaves no stale record.
//
// The durable mark, the file DURABLE, is written as CLOSED is, its rename then synced into the
// directory: the seq and hash of the writer's durable head and the MANIFEST it runs on, at the end
// of the writer's open, at most Options::durable_mark_interval_ms after each commit, and when the
// writer stops. Every open reads both records before the records. The writer's open checks the
// journal on a read-only open first (which writes and deletes nothing), and only then lets RocksDB
// open it for writing, which deletes what its MANIFEST leaves obsolete. What that check finds
// lost (a torn WAL tail) is written first to the file TORN_TAIL beside the database, as the marks
// are, and moved into the meta key open_torn_tail once RocksDB's open made the WAL obsolete.
#include <pthread.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/listener.h>
#include <rocksdb/metadata.h>
#include <rocksdb/options.h>
#include <rocksdb/slice_transform.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/table.h>
#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/version.h>
#include <rocksdb/wal_filter.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "journal/codec.h"
#include "journal/journal.h"
#include "statemachine/hex.h"
#include "statemachine/text.h"

// The oldest RocksDB the journal is built and tested with: Debian 12's (docs/architecture.md).
static_assert(ROCKSDB_MAJOR > 7 || (ROCKSDB_MAJOR == 7 && ROCKSDB_MINOR >= 8),
              "the journal needs RocksDB 7.8 or later");

namespace rc::journal {
namespace {

enum Cf : std::size_t {
  kDefaultCf = 0,
  kEventsCf,
  kRolloutsCf,
  kIdemCf,
  kSnapshotsCf,
  kMetaCf,
  kCfCount
};
const char* const kCfNames[kCfCount] = {"default",     "events",    "rollouts",
                                        "idempotency", "snapshots", "meta"};
const char kHeadSeqKey[] = "head_seq";
const char kHeadHashKey[] = "head_hash";
const char kSchemaKey[] = "schema_version";
// What a writer's open found lost, kept until an executor's start recorded it
// (Journal::ForgetRecordedTornTail): RocksDB's open makes the torn WAL obsolete, and a start that
// died before its RecoveryStarted would otherwise leave the finding nowhere.
const char kOpenTornTailKey[] = "open_torn_tail";
// The kept sentence at most (this open's findings and an earlier one's joined, each cut to half).
constexpr std::size_t kKeptTornTailBytesMax = 2048;
// The bytes a kept or found torn tail may count: far past any journal's WALs, and low enough that
// the three an open reports together cannot wrap a uint64.
constexpr std::uint64_t kTornTailBytesUnreadMax = std::uint64_t{1} << 60;
// The SHA-256 of the TORN_TAIL file (below) whose finding open_torn_tail holds: a writer that
// died after keeping it and before removing the file leaves one that is not reported twice.
const char kMovedFoundKey[] = "open_torn_tail_moved";
// Present once a writer wrote a durable mark: a journal holding it without a mark file lost that
// file. Flushed into a table file at once (RecordMarked), never left only in the WAL a cut takes.
const char kMarkedKey[] = "durable_mark_written";
// What a writer's check found lost (a torn WAL tail, an open's unacknowledged tables), written
// beside the database before RocksDB's open makes the torn WAL obsolete, and removed once the
// open kept it in open_torn_tail: between the two it is the finding's only trace. Written as the
// durable mark is (whole, synced, renamed, the directory synced).
const char kFoundFile[] = "TORN_TAIL";
const char kFoundTmpFile[] = "TORN_TAIL.tmp";
constexpr const char* kFoundTitle = "rolloutcore journal torn tail found by a writer's open";
// Its title, the bytes, the sentence in hex (kKeptTornTailBytesMax at most) and a check: a larger
// file is damage, refused before it is read.
constexpr std::uint64_t kFoundFileBytesMax = 8192;
// How an open reports a finding an earlier open kept.
constexpr const char* kEarlierFinding =
    "found by an earlier open, not yet recorded by an executor's start: ";
const char kClosedFile[] = "CLOSED";  // the clean-close record beside the database
// A clean-close record is three short lines and a check (under 200 bytes): a larger file is
// damage, refused before it is read rather than allocated whole.
constexpr std::uint64_t kClosedMarkBytesMax = 1024;
// CLOSED being written: never read, removed by the next writer (a close that died midway).
const char kClosedTmpFile[] = "CLOSED.tmp";
// The durable mark (Options::durable_mark_interval_ms), written as CLOSED is.
const char kDurableFile[] = "DURABLE";
const char kDurableTmpFile[] = "DURABLE.tmp";
// A secondary reader may list a file the writer's compaction just deleted: it catches up and
// checks again, this many times.
constexpr int kLiveFileChecksMax = 3;
// A reader that finds the LOCK held by another process tries again for this long before it reads
// the journal as beside a live writer: another reader (replay, audit) holds it only while it opens.
constexpr std::uint32_t kLockWaitMs = 1000;
constexpr std::uint32_t kLockPollMs = 25;
// A secondary whose records end before a mark it read before them catches up with the writer and
// looks again, this many times in all (a live writer marks only what its WAL already holds).
constexpr int kMarkChecksMax = 3;
constexpr std::uint32_t kMarkCatchUpPauseMs = 20;
// Without the LOCK, listing the column families may find the MANIFEST it read gone (a writer's
// open switched CURRENT and deleted it): tried again while CURRENT changes, this many times in all.
constexpr int kColumnFamilyListingsMax = 3;
// RocksDB raises a max_open_files below this to it.
constexpr std::uint32_t kTableFilesOpenMin = 20;
// What a writer holds open beside its table files (Options::OpenFilesMax): the WALs not yet
// flushed away, the MANIFEST, LOCK, RocksDB's directory handles and the journal's, the tables a
// flush and compactions are writing, the mark or clean-close record being written. RocksDB's table
// cache keeps 10 of max_open_files for such files too; this margin does not count on them.
constexpr std::uint32_t kFilesBesideTablesMax = 32;
// Scans read SST files sequentially: read ahead in large chunks instead of block by block.
constexpr std::size_t kScanReadaheadBytes = 2 * 1024 * 1024;
// Data blocks of `events` (RocksDB's default is 4 KiB): replay reads every block, and per-block
// work (read, checksum, block iterator setup) is paid once per ~20 records at 4 KiB.
constexpr std::size_t kEventsBlockBytes = 32 * 1024;
// Scans of at least this many records run as two stages: a reader thread walks the RocksDB
// iterator and copies raw (key, value) pairs into batches; the caller decodes, verifies, chains
// and visits them in order (the iterator was ~half of a replay's CPU, the rest is ours).
constexpr std::uint64_t kPipelinedScanRecordsMin = 4096;
constexpr std::size_t kScanBatchBytes = 256 * 1024;  // a batch is handed over past this size
constexpr std::size_t kScanBatchesMax = 4;           // bounds the reader's lead (~1 MiB)

std::string BE64(std::uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
  return out;
}

std::uint64_t ParseBE64(std::string_view s) {
  RC_CHECK(s.size() == 8);
  std::uint64_t v = 0;
  for (char c : s) v = (v << 8) | static_cast<std::uint8_t>(c);
  return v;
}

std::string_view View(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

std::string RolloutPrefix(const std::string& rollout_id) {
  RC_CHECK(rollout_id.size() <= 255);
  return std::string(1, static_cast<char>(rollout_id.size())) + rollout_id;
}

const std::string* RolloutIdOf(const Event& e) {
  if (const auto* a = std::get_if<RolloutAdmitted>(&e)) return &a->rollout_id;
  if (const auto* f = std::get_if<RolloutFinished>(&e)) return &f->rollout_id;
  if (const auto* t = std::get_if<TrajectoryRecorded>(&e)) return &t->rollout_id;
  return nullptr;
}

// A group of the unnamed engine hashes its events alone, as before fleets, so that keys used
// then still match; a group naming an engine hashes each event's engine too.
Hash GroupDigest(const std::vector<FleetEvent>& group) {
  std::string all;
  for (const FleetEvent& e : group) {
    const std::string bytes = EncodeEventOnly(e.event);
    all += BE64(bytes.size()).substr(4);
    all += bytes;
  }
  for (const FleetEvent& e : group) {
    if (!e.engine.empty()) all += "engine " + BE64(e.engine.size()).substr(4) + e.engine;
  }
  return Sha256(all);
}

// The snapshot keys (see above): a fleet snapshot is 9 bytes; 8 bytes is an older State's.
constexpr char kFleetSnapshotTag = 'f';
std::string FleetSnapshotKey(std::uint64_t seq) { return BE64(seq) + kFleetSnapshotTag; }

// The unnamed engine's state: empty in a journal of named engines.
const State& UnnamedEngine(const FleetState& fleet) { return engine_state(fleet, ""); }

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  const std::string msg = what + ": " + s.ToString();
  if (s.IsCorruption()) return Status::Corruption(msg);
  if (s.IsNotFound()) return Status::NotFound(msg);
  if (s.IsInvalidArgument()) return Status::InvalidArgument(msg);
  if (s.IsBusy() || s.IsTryAgain()) return Status::Busy(msg);
  return Status::IOError(msg);
}

std::string SeqList(const std::vector<FleetEvent>& events, std::size_t from) {
  std::string out = "[";
  for (std::size_t i = from; i < events.size(); ++i) {
    if (i > from) out += ", ";
    out += event_name(events[i].event);
    if (!events[i].engine.empty()) out += "@" + events[i].engine;
  }
  return out + "]";
}

// A request's events with their engines; InvalidArgument when the engines do not pair up.
Result<std::vector<FleetEvent>> GroupOf(const AppendRequest& request) {
  const std::size_t n = request.events.size();
  if (!request.engines.empty() && request.engines.size() != n) {
    return Status::InvalidArgument("append names " + std::to_string(request.engines.size()) +
                                   " engines for " + std::to_string(n) + " events");
  }
  std::vector<FleetEvent> group;
  group.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    group.push_back(
        FleetEvent{request.engines.empty() ? "" : request.engines[i], request.events[i]});
  }
  return group;
}

struct IdemEntry {
  std::uint64_t first_seq = 0;
  std::uint64_t last_seq = 0;
  Hash digest{};
  std::uint64_t batch_id = 0;     // 0: durable
  std::vector<FleetEvent> group;  // kept while pending, for Submit's duplicate answer
  Hash last_hash{};               // kept while pending; read from record last_seq once durable
};

std::string EncodeIdem(const IdemEntry& e) {
  return BE64(e.first_seq) + BE64(e.last_seq) +
         std::string(reinterpret_cast<const char*>(e.digest.data()), e.digest.size());
}

struct PendingAdmission {
  std::uint64_t seq = 0;
  std::uint64_t batch_id = 0;
};

// The point-lookup key of a rollout id (its first use): the RolloutSeqs prefix alone.
std::string RolloutIdKey(const std::string& rollout_id) { return RolloutPrefix(rollout_id); }

// What an open found lost: bytes of WAL it could not read, and a sentence naming what (without
// the journal's path, which recovery() adds last).
struct TornFinding {
  std::uint64_t bytes_unread = 0;
  std::string sentence;  // "" when nothing was found
};

std::string JoinFindings(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return a + b;
  return a + " | " + b;
}

// The finding a writer's open keeps: its own and an earlier one still kept, each cut to half the
// bound (the distinguishing parts come first in each), so that neither crowds the other out.
constexpr std::size_t kKeptFindingHalfBytes = (kKeptTornTailBytesMax - 3) / 2;

TornFinding KeptFinding(const TornFinding& own, const TornFinding& earlier) {
  constexpr std::size_t kHalf = kKeptFindingHalfBytes;
  const std::size_t each = earlier.sentence.empty() ? kKeptTornTailBytesMax : kHalf;
  return TornFinding{own.bytes_unread + earlier.bytes_unread,
                     JoinFindings(text::utf8_prefix(own.sentence, each),
                                  text::utf8_prefix(earlier.sentence, kHalf))};
}

std::string EncodeTornFinding(const TornFinding& f) { return BE64(f.bytes_unread) + f.sentence; }

bool SameFinding(const TornFinding& a, const TornFinding& b) {
  return a.bytes_unread == b.bytes_unread && a.sentence == b.sentence;
}

std::string EncodeFoundFile(const TornFinding& f) {
  const std::string lines = std::string(kFoundTitle) + "\nbytes " + std::to_string(f.bytes_unread) +
                            "\nsentence " + hex::encode(std::string_view(f.sentence)) + "\n";
  return lines + "check " + HashHex(Sha256(lines)) + "\n";
}

// Only the exact encoding of a finding (a sentence of 1..kKeptTornTailBytesMax bytes) is one.
std::optional<TornFinding> DecodeFoundFile(const std::string& text) {
  const std::string head = std::string(kFoundTitle) + "\nbytes ";
  if (text.compare(0, head.size(), head) != 0) return std::nullopt;
  const std::size_t bytes_end = text.find('\n', head.size());
  const std::string sentence_tag = "\nsentence ";
  if (bytes_end == std::string::npos ||
      text.compare(bytes_end, sentence_tag.size(), sentence_tag) != 0) {
    return std::nullopt;
  }
  std::uint64_t bytes = 0;
  const char* first = text.data() + head.size();
  const auto [at, ec] = std::from_chars(first, text.data() + bytes_end, bytes);
  if (ec != std::errc() || at != text.data() + bytes_end) return std::nullopt;
  if (bytes > kTornTailBytesUnreadMax) return std::nullopt;
  const std::size_t hex_at = bytes_end + sentence_tag.size();
  const std::size_t hex_end = text.find('\n', hex_at);
  if (hex_end == std::string::npos) return std::nullopt;
  Result<std::string> sentence =
      hex::decode(std::string_view(text).substr(hex_at, hex_end - hex_at));
  if (!sentence.ok() || sentence->empty() || sentence->size() > kKeptTornTailBytesMax) {
    return std::nullopt;
  }
  TornFinding f{bytes, std::move(sentence.value())};
  if (EncodeFoundFile(f) != text) return std::nullopt;
  return f;
}

// The seqs a key of an obsolete table names (see the key layouts above), first..last.
struct SeqSpan {
  std::uint64_t first = UINT64_MAX;
  std::uint64_t last = 0;
  bool empty() const { return first > last; }
  void Add(const SeqSpan& s) {
    first = std::min(first, s.first);
    last = std::max(last, s.last);
  }
  std::string Name() const {
    return first == last ? "seq " + std::to_string(first)
                         : "seqs " + std::to_string(first) + ".." + std::to_string(last);
  }
};

// The seqs a key of column family `cf` names: an event's key is its seq; a rollout's index key
// ends with it and its point key's value is the admission's; an idempotency value carries its
// group's first and last; a snapshot's key starts with it. nullopt: the key names none (meta,
// default, or malformed).
std::optional<SeqSpan> SeqsOfKey(std::size_t cf, std::string_view key, std::string_view value) {
  auto one = [](std::string_view be64) { return SeqSpan{ParseBE64(be64), ParseBE64(be64)}; };
  switch (cf) {
    case kEventsCf:
      if (key.size() == 8) return one(key);
      break;
    case kRolloutsCf: {
      if (key.empty()) break;
      const std::size_t id_end = 1 + static_cast<std::uint8_t>(key[0]);
      if (key.size() == id_end && value.size() == 8) return one(value);
      if (key.size() == id_end + 8) return one(key.substr(id_end));
      break;
    }
    case kIdemCf: {
      if (value.size() != 48) break;
      const SeqSpan group{ParseBE64(value.substr(0, 8)), ParseBE64(value.substr(8, 8))};
      if (!group.empty()) return group;
      break;
    }
    case kSnapshotsCf:
      if (key.size() >= 8) return one(key.substr(0, 8));
      break;
    default:
      break;
  }
  return std::nullopt;
}

// The table files RocksDB takes for obsolete that hold keys the journal lacks, all of seqs past
// its head and every mark (CheckObsoleteTables): what an open that died left.
struct UnackedTables {
  SeqSpan seqs;
  std::uint64_t head = 0;
  std::size_t count = 0;
  std::string names;  // the first kUnackedTablesNamedMax
  static constexpr std::size_t kUnackedTablesNamedMax = 8;

  void Add(const std::string& name, const SeqSpan& lacked, std::uint64_t at_head) {
    seqs.Add(lacked);
    head = at_head;
    if (++count <= kUnackedTablesNamedMax) names += (names.empty() ? "" : ", ") + name;
  }
};

// Where a cleanly closed journal ended, or (the durable mark) how far it was durable.
struct ClosedMark {
  std::uint64_t seq = 0;
  Hash hash{};
  std::uint64_t manifest = 0;  // the durable mark's only: the MANIFEST number the writer ran on
  bool operator==(const ClosedMark&) const = default;
};

// The first line of each mark file says what it records.
constexpr const char* kClosedTitle = "rolloutcore journal closed cleanly";
constexpr const char* kDurableTitle = "rolloutcore journal durable through";

bool IsDurableTitle(const char* title) { return std::string_view(title) == kDurableTitle; }

std::string MarkLines(const char* title, const ClosedMark& m) {
  std::string lines =
      std::string(title) + "\nseq " + std::to_string(m.seq) + "\nhash " + HashHex(m.hash) + "\n";
  if (IsDurableTitle(title)) lines += "manifest " + std::to_string(m.manifest) + "\n";
  return lines;
}

std::string EncodeMark(const char* title, const ClosedMark& m) {
  const std::string lines = MarkLines(title, m);
  return lines + "check " + HashHex(Sha256(lines)) + "\n";
}

std::string EncodeClosedMark(const ClosedMark& m) { return EncodeMark(kClosedTitle, m); }

// Only the exact encoding of its own fields under `title` is a mark.
std::optional<ClosedMark> DecodeMark(const char* title, const std::string& text) {
  const std::size_t seq_at = std::string(title).size() + 1;
  if (text.compare(0, seq_at, std::string(title) + "\n") != 0) return std::nullopt;
  std::uint64_t seq = 0;
  std::uint64_t manifest = 0;
  char hash_hex[65] = {0};
  const bool durable = IsDurableTitle(title);
  const int fields = std::sscanf(text.c_str() + seq_at, "seq %lu\nhash %64s\nmanifest %lu", &seq,
                                 hash_hex, &manifest);
  if (fields != (durable ? 3 : 2)) return std::nullopt;
  Result<Hash> hash = ParseHashHex(hash_hex);
  if (!hash.ok()) return std::nullopt;
  const ClosedMark m{seq, *hash, durable ? manifest : 0};
  if (text != EncodeMark(title, m)) return std::nullopt;
  return m;
}

// The WAL's framing (RocksDB's log format, no recycling, no WAL compression): 32 KiB blocks;
// a record is written as fragments, each with a 7-byte header; a block tail shorter than a
// header is zero padding. Advances `at` (a log's write position) past one record of `bytes`.
constexpr std::uint64_t kWalBlockBytes = 32768;
constexpr std::uint64_t kWalHeaderBytes = 7;
void AdvancePastWalRecord(std::uint64_t& at, std::uint64_t bytes) {
  std::uint64_t left = bytes;
  bool first = true;
  while (first || left > 0) {
    first = false;
    std::uint64_t in_block = at % kWalBlockBytes;
    if (kWalBlockBytes - in_block < kWalHeaderBytes) {
      at += kWalBlockBytes - in_block;
      in_block = 0;
    }
    const std::uint64_t fragment = std::min(left, kWalBlockBytes - in_block - kWalHeaderBytes);
    at += kWalHeaderBytes + fragment;
    left -= fragment;
  }
}

// The largest events-column-family key (a seq) a WriteBatch puts.
class EventSeqsInBatch final : public rocksdb::WriteBatch::Handler {
 public:
  explicit EventSeqsInBatch(std::uint32_t events_cf) : events_cf_(events_cf) {}
  rocksdb::Status PutCF(std::uint32_t cf, const rocksdb::Slice& key,
                        const rocksdb::Slice&) override {
    if (cf == events_cf_ && key.size() == 8) last_ = std::max(last_, ParseBE64(View(key)));
    return rocksdb::Status::OK();
  }
  rocksdb::Status DeleteCF(std::uint32_t, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status SingleDeleteCF(std::uint32_t, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status DeleteRangeCF(std::uint32_t, const rocksdb::Slice&,
                                const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status MergeCF(std::uint32_t, const rocksdb::Slice&, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  void LogData(const rocksdb::Slice&) override {}
  std::uint64_t last() const { return last_; }

 private:
  const std::uint32_t events_cf_;
  std::uint64_t last_ = 0;
};

// Watches crash recovery replay the WAL: per log, the bytes its complete records span (by the
// framing above), and the last seq replayed. A WAL longer than that had a tail recovery could not
// read (kTolerateCorruptedTailRecords drops it silently).
class WalReplay final : public rocksdb::WalFilter {
 public:
  struct Log {
    std::uint64_t read_bytes = 0;
    std::uint64_t records = 0;
  };
  void ColumnFamilyLogNumberMap(const std::map<std::uint32_t, std::uint64_t>& cf_log,
                                const std::map<std::string, std::uint32_t>& cf_ids) override {
    for (const auto& [cf, log] : cf_log) {
      (void)cf;
      min_log_ = min_log_.has_value() ? std::min(*min_log_, log) : log;
    }
    if (auto it = cf_ids.find(kCfNames[kEventsCf]); it != cf_ids.end()) events_cf_ = it->second;
  }
  WalProcessingOption LogRecordFound(unsigned long long log_number, const std::string&,
                                     const rocksdb::WriteBatch& batch, rocksdb::WriteBatch*,
                                     bool* batch_changed) override {
    *batch_changed = false;
    Log& log = logs_[log_number];
    AdvancePastWalRecord(log.read_bytes, batch.GetDataSize());
    ++log.records;
    EventSeqsInBatch seqs(events_cf_);
    batch.Iterate(&seqs).PermitUncheckedError();  // informative only
    last_seq_ = std::max(last_seq_, seqs.last());
    return WalProcessingOption::kContinueProcessing;
  }
  const char* Name() const override { return "rolloutcore-wal-replay"; }

  // Logs before this one were flushed before the crash: recovery does not read them.
  std::optional<std::uint64_t> min_log() const { return min_log_; }
  std::uint64_t read_bytes(std::uint64_t log) const {
    auto it = logs_.find(log);
    return it == logs_.end() ? 0 : it->second.read_bytes;
  }
  std::uint64_t last_seq() const { return last_seq_; }

 private:
  std::optional<std::uint64_t> min_log_;
  std::uint32_t events_cf_ = ~std::uint32_t{0};
  std::map<std::uint64_t, Log> logs_;
  std::uint64_t last_seq_ = 0;
};

// The number of a WAL file's name ("000012.log"); nullopt for any other name, including digits
// past 64 bits (RocksDB never writes one: such a file is not a WAL it reads).
std::optional<std::uint64_t> WalNumber(std::string_view name) {
  constexpr std::string_view kSuffix = ".log";
  if (name.size() <= kSuffix.size() || name.substr(name.size() - kSuffix.size()) != kSuffix) {
    return std::nullopt;
  }
  const std::string_view digits = name.substr(0, name.size() - kSuffix.size());
  if (digits.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  std::uint64_t number = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), number);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return number;
}

// Whether `name` is RocksDB's name for a file numbered with `suffix` ("000012.sst"): an
// operator's "serve.log" is not one.
bool Numbered(std::string_view name, std::string_view suffix) {
  if (name.size() <= suffix.size() || name.substr(name.size() - suffix.size()) != suffix) {
    return false;
  }
  const std::string_view digits = name.substr(0, name.size() - suffix.size());
  return digits.find_first_not_of("0123456789") == std::string_view::npos;
}

// The files of a database directory a writer changes (CURRENT, MANIFESTs, tables, WALs): name ->
// size in bytes. One deleted between the listing and its size (a writer's) is left out.
using DbFiles = std::map<std::string, std::uint64_t>;

Result<DbFiles> ListDbFiles(rocksdb::Env* env, const std::string& dir) {
  std::vector<std::string> names;
  rocksdb::Status s = env->GetChildren(dir, &names);
  if (!s.ok()) return FromRocks(s, "list " + dir);
  DbFiles out;
  for (const std::string& name : names) {
    if (name != "CURRENT" && name.rfind("MANIFEST-", 0) != 0 && !Numbered(name, ".sst") &&
        !WalNumber(name).has_value()) {
      continue;
    }
    std::uint64_t size = 0;
    s = env->GetFileSize(dir + "/" + name, &size);
    if (s.IsNotFound() || s.IsPathNotFound()) continue;
    if (!s.ok()) return FromRocks(s, "size of " + dir + "/" + name);
    out[name] = size;
  }
  return out;
}

// The WALs among `files`: number -> size in bytes.
std::map<std::uint64_t, std::uint64_t> WalsOf(const DbFiles& files) {
  std::map<std::uint64_t, std::uint64_t> out;
  for (const auto& [name, size] : files) {
    if (const std::optional<std::uint64_t> number = WalNumber(name)) out[*number] = size;
  }
  return out;
}

std::string WalName(std::uint64_t number) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%06llu.log", static_cast<unsigned long long>(number));
  return buf;
}

// A scratch directory removed with its contents when this goes out of scope, on every path.
class ScratchDir {
 public:
  ScratchDir() = default;
  ~ScratchDir() {
    if (!owned_) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  Status MakeTemp() {
    std::error_code ec;
    const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
    if (ec) return Status::IOError("no temporary directory for a secondary: " + ec.message());
    std::string tmpl = (tmp / "rc-journal-secondary-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) return Status::IOError("mkdtemp failed for " + tmpl);
    path_ = tmpl;
    owned_ = true;
    return Status::OK();
  }
  void Use(const std::string& path) { path_ = path; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool owned_ = false;
};

// Holds a file lock taken with Env::LockFile; releases it at scope exit.
class HeldLock {
 public:
  HeldLock(rocksdb::Env* env, rocksdb::FileLock* lock) : env_(env), lock_(lock) {}
  ~HeldLock() {
    if (lock_ != nullptr) env_->UnlockFile(lock_).PermitUncheckedError();
  }
  HeldLock(const HeldLock&) = delete;
  HeldLock& operator=(const HeldLock&) = delete;

 private:
  rocksdb::Env* env_;
  rocksdb::FileLock* lock_;
};

// The RocksDB instance, its column family handles and the WAL filter its recovery reads through.
// The journal shares it with each open-time step running on a helper thread (RunBounded), and the
// last owner closes it: a step left running past its deadline never touches a closed or freed
// database, and the journal's destructor never closes one under it (a close waits for background
// work that the same stalled storage may hold).
struct RocksDb {
  WalReplay wal_replay;  // RocksDB keeps a pointer to it: declared first, so destroyed last
  std::unique_ptr<rocksdb::DB> db;
  std::vector<rocksdb::ColumnFamilyHandle*> cfs;

  RocksDb() = default;
  RocksDb(const RocksDb&) = delete;
  RocksDb& operator=(const RocksDb&) = delete;
  ~RocksDb() {
    if (db == nullptr) return;
    for (auto* h : cfs) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db->Close().PermitUncheckedError();
  }
};

// What a helper thread of RunBounded reports, shared with the caller that may stop waiting.
struct StepOutcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
};

// Runs one open-time write, flush or sync (or the removal of a kept torn tail) with the deadline a
// group commit has: not done within `deadline_ms` (0: no deadline, and it runs on the caller's
// thread), it is Timeout naming the journal and `what`. A RocksDB or file system call cannot be
// cancelled, so the step runs on a helper thread that owns (by shared_ptr, in `step`'s captures)
// everything it touches, the database included. One past its deadline is detached and left to
// finish or hang; the caller is expected to exit. Nothing ever joins a stuck helper: the one
// joined has finished, and dropped its captures before it said so (nothing of the journal is
// destroyed on it).
Status RunBounded(std::uint32_t deadline_ms, const std::string& path, const std::string& what,
                  std::function<Status()> step) {
  if (deadline_ms == 0) return step();
  auto outcome = std::make_shared<StepOutcome>();
  std::thread helper;
  try {
    helper = std::thread([outcome, step = std::move(step)]() mutable {
      pthread_setname_np(pthread_self(), "rc-journal-open");
      Status status = step();
      step = nullptr;
      std::lock_guard<std::mutex> l(outcome->mu);
      outcome->status = std::move(status);
      outcome->done = true;
      outcome->cv.notify_all();
    });
  } catch (const std::system_error& e) {  // a thread limit: the step never ran
    return Status::Unavailable("journal at " + path + ": no thread for " + what + ": " + e.what());
  }
  std::unique_lock<std::mutex> l(outcome->mu);
  if (!outcome->cv.wait_for(l, std::chrono::milliseconds(deadline_ms),
                            [&] { return outcome->done; })) {
    l.unlock();
    helper.detach();
    return Status::Timeout("journal at " + path + ": " + what + " did not finish within " +
                           std::to_string(deadline_ms) +
                           " ms (the storage stalled); the call cannot be cancelled and runs on: "
                           "exit, and open the journal again once the storage answers");
  }
  Status status = outcome->status;
  l.unlock();
  helper.join();
  return status;
}

// Raw (key, value) pairs copied out of the iterator, values 8-byte aligned so that DecodeRecord
// reads them in place.
struct ScanBatch {
  struct Entry {
    std::size_t key_at, key_bytes, value_at, value_bytes;
    Hash value_sha256;  // computed on the reader thread: the chain's hash of the stored bytes
  };
  std::string bytes;
  std::vector<Entry> entries;

  void Add(const rocksdb::Slice& key, const rocksdb::Slice& value) {
    Entry e{bytes.size(), key.size(), 0, value.size(), {}};
    bytes.append(key.data(), key.size());
    bytes.resize((bytes.size() + 7) / 8 * 8);
    e.value_at = bytes.size();
    bytes.append(value.data(), value.size());
    e.value_sha256 = Sha256(std::string_view(bytes.data() + e.value_at, e.value_bytes));
    entries.push_back(e);
  }
  std::string_view Key(const Entry& e) const { return {bytes.data() + e.key_at, e.key_bytes}; }
  std::string_view Value(const Entry& e) const {
    return {bytes.data() + e.value_at, e.value_bytes};
  }
};

// The bounded hand-over between a scan's reader thread and its caller: kScanBatchesMax batches
// circulate (free -> filled by the reader -> checked by the caller -> free), in order.
class ScanQueue {
 public:
  ScanQueue() {
    for (ScanBatch& b : storage_) {
      b.bytes.reserve(kScanBatchBytes + kRecordBytesMax + 64);
      free_.push_back(&b);
    }
  }
  // Reader: an empty batch to fill, or nullptr once the caller stopped the scan.
  ScanBatch* TakeFree() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return stopped_ || !free_.empty(); });
    if (stopped_) return nullptr;
    ScanBatch* b = free_.back();
    free_.pop_back();
    return b;
  }
  void PushFilled(ScanBatch* b) {
    std::lock_guard<std::mutex> l(mu_);
    filled_.push_back(b);
    cv_.notify_all();
  }
  // Reader: no more batches; `status` is the iterator's final status.
  void Finish(rocksdb::Status status) {
    std::lock_guard<std::mutex> l(mu_);
    finished_ = true;
    status_ = std::move(status);
    cv_.notify_all();
  }
  // Caller: the next filled batch in iteration order, or nullptr when the reader finished.
  ScanBatch* TakeFilled() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return finished_ || !filled_.empty(); });
    if (filled_.empty()) return nullptr;
    ScanBatch* b = filled_.front();
    filled_.pop_front();
    return b;
  }
  void Recycle(ScanBatch* b) {
    b->bytes.clear();
    b->entries.clear();
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(b);
    cv_.notify_all();
  }
  // Caller: the scan failed or its visitor stopped it; the reader stops at its next batch.
  void Stop() {
    std::lock_guard<std::mutex> l(mu_);
    stopped_ = true;
    cv_.notify_all();
  }
  rocksdb::Status status() {
    std::lock_guard<std::mutex> l(mu_);
    RC_CHECK(finished_);
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  ScanBatch storage_[kScanBatchesMax];
  std::vector<ScanBatch*> free_;
  std::deque<ScanBatch*> filled_;
  bool stopped_ = false;
  bool finished_ = false;
  rocksdb::Status status_;
};

// What a load from disk produced.
struct Loaded {
  FleetState fleet;
  std::uint64_t head_seq = 0;
  Hash head_hash{};
  std::uint64_t snapshot_seq = 0;
  bool legacy_snapshot_passed = false;  // a newer snapshot of the older format was not loaded
};

class RocksJournal final : public Journal {
 public:
  RocksJournal(std::string path, Options options)
      : path_(std::move(path)),
        options_(std::move(options)),
        env_(options_.env != nullptr ? options_.env : rocksdb::Env::Default()) {}
  ~RocksJournal() override;

  Status OpenDb();

  Result<Ticket> Enqueue(const AppendRequest& request) override;
  Result<Submitted> Submit(const Event& input, std::int64_t wall_time_ms,
                           const std::string& client_event_id) override;
  Result<FleetSubmitted> SubmitFleet(const FleetEvent& input, std::int64_t wall_time_ms,
                                     const std::string& client_event_id) override;
  Result<bool> KeyHeld(const std::string& key) override;
  Result<FleetSubmitted> SubmitFleetIf(const FleetEvent& input, std::int64_t wall_time_ms,
                                       const Precondition& holds) override;
  Result<FleetSubmitted> SubmitFleetLocked(const FleetEvent& input, std::int64_t wall_time_ms,
                                           const std::string& client_event_id);
  State state() const override {
    std::lock_guard<std::mutex> l(mu_);
    return UnnamedEngine(fleet_);
  }
  void ReadState(const std::function<void(const State&)>& read) const override {
    std::lock_guard<std::mutex> l(mu_);
    read(UnnamedEngine(fleet_));
  }
  FleetState fleet_state() const override {
    std::lock_guard<std::mutex> l(mu_);
    return fleet_;
  }
  void ReadFleetState(const std::function<void(const FleetState&)>& read) const override {
    std::lock_guard<std::mutex> l(mu_);
    read(fleet_);
  }
  bool is_fleet() const override {
    std::lock_guard<std::mutex> l(mu_);
    return fleet_.named;
  }
  Status Wait(const Ticket& ticket) override;
  Status WaitForHead() override;
  void WaitAsync(const Ticket& ticket, DurableFn done) override;
  Result<AppendResult> Append(const AppendRequest& request) override;
  bool failed() const override {
    std::unique_lock<std::mutex> l(mu_);
    CheckStall();
    const bool failed = !failed_.ok();
    RunAsyncWaiters(l, failed ? UINT64_MAX : durable_batch_id_);
    return failed;
  }
  Status failure() const override {
    std::unique_lock<std::mutex> l(mu_);
    CheckStall();
    Status failure = failed_;
    RunAsyncWaiters(l, failure.ok() ? durable_batch_id_ : UINT64_MAX);
    return failure;
  }
  void Stop(const Status& why) override {
    RC_CHECK(!why.ok());
    std::unique_lock<std::mutex> l(mu_);
    if (!failed_.ok()) return;
    failed_ = why;
    BatchCv(open_batch_id_).notify_all();
    BatchCv(open_batch_id_ + 1).notify_all();
    commit_cv_.notify_all();
    RunAsyncWaiters(l, UINT64_MAX);
  }
  Recovery recovery() const override { return recovery_; }
  std::uint64_t head_seq() const override {
    std::lock_guard<std::mutex> l(mu_);
    return head_seq_;
  }
  Hash head_hash() const override {
    std::lock_guard<std::mutex> l(mu_);
    return head_hash_;
  }
  std::uint64_t durable_seq() const override {
    std::lock_guard<std::mutex> l(mu_);
    return durable_seq_;
  }
  Result<Record> Read(std::uint64_t seq) override;
  Status Scan(std::uint64_t from_seq, std::uint64_t to_seq,
              const std::function<Status(const Record&)>& visit) override;
  Result<std::vector<std::uint64_t>> RolloutSeqs(const std::string& rollout_id) override;
  Result<FleetState> LoadFleetState() override;
  Result<FleetState> RefoldFleet(std::uint64_t until_seq) override;
  Result<State> LoadState() override;
  Result<State> Refold(std::uint64_t until_seq) override;
  Status WriteSnapshot(std::uint64_t seq, const FleetState& fleet) override;
  Status CatchUp() override;
  Status Checkpoint(const std::string& dir) override;
  Status VerifyChecksum() override;
  Status Flush() override;
  Status Compact() override;
  Status Close() override;
  Status ForgetRecordedTornTail() override;

 private:
  // Open, by role. Each leaves the database open and the in-memory head loaded, or returns an
  // error.
  Status OpenWriter();
  // The check before writing and RocksDB's open for writing, again while a reader took the LOCK
  // between them.
  Status CheckAndOpenForWriting();
  Status CheckBeforeWriting(std::chrono::steady_clock::time_point lock_until);
  Status CheckMarkedRecordsBeforeWriting();
  Status CheckMarksUnchanged();
  Status OpenReadOnly();
  // The LOCK, another process's waited for until `until`.
  rocksdb::Status LockBriefly(rocksdb::FileLock** lock,
                              std::chrono::steady_clock::time_point until);
  Status OpenReadOnlyChecked(const std::map<std::uint64_t, std::uint64_t>& wals, bool locked);
  // Reads the marks, checks CURRENT against the durable mark and the column families, opens the
  // journal read-only into rocks_ (nothing written, nothing deleted) and checks its live files.
  Status OpenReadOnlyView(int max_open_files, bool locked);
  Status CheckFilesUnchanged(const DbFiles& before, const rocksdb::Status& lock_error);
  Status OpenSecondary();
  Status CheckMarksBesideWriter();
  rocksdb::Options DbOptions() const;
  std::vector<rocksdb::ColumnFamilyDescriptor> Descriptors(const rocksdb::Options& opts) const;
  // `lock_taken`: set when the open failed because another process held the LOCK.
  Status OpenRocksWriter(bool* lock_taken);
  // RunBounded with the journal's path and commit_stall_timeout_ms.
  Status OpenStep(const std::string& what, std::function<Status()> step) const;
  Status CheckDirectory();
  Result<std::string> ReadCurrent();
  Result<std::uint64_t> CurrentManifestNumber();
  Status ReadMarks();
  Status CheckCurrentNotStale();
  Status CheckColumnFamilies(bool locked);
  Status ListFamilies(bool locked, std::vector<std::string>* names);
  Status CheckLiveFiles();
  Status CheckObsoleteTables();
  Status CheckObsoleteTable(const std::string& name, SeqSpan* lacked);
  Status CheckUnacknowledged(const std::string& name, const SeqSpan& lacked,
                             std::uint64_t head) const;
  Status ObsoleteTableRefused(const std::string& name, const std::string& what,
                              const std::string& why) const;
  Result<bool> NeverWritten();
  Result<std::uint64_t> ViewHead();
  Status CheckSchema();
  Status StampSchemaVersion();
  Status LoadHead();
  Result<std::optional<ClosedMark>> ReadMark(const char* name, const char* title,
                                             const std::string& what);
  // The clean-close record found at open against the head read (`head_hash`: its record's).
  Status CheckClosedMark(std::uint64_t head, const Hash& head_hash) const;
  // The records reach `m` (its seq is at most `head`) and hold its record there.
  Status CheckRecordsReach(const ClosedMark& m, std::uint64_t head, const std::string& mark);
  Status CheckDurableMark(std::uint64_t head);
  Status MarkAtOpen();
  // Writes the durable mark if the durable head moved since the last one: once due
  // (durable_mark_interval_ms after the last) or, with `due_now`, at once. Requires mu_.
  void MarkDurable(std::unique_lock<std::mutex>& l, bool due_now);
  bool MarkPending() const;  // requires mu_
  void WaitForWorkOrMark(std::unique_lock<std::mutex>& l);
  Status RemoveClosedMark();
  Status WriteAtOpen(const std::string& what, rocksdb::WriteBatch batch, bool sync) const;
  Status SnapshotPastOlderFormat();
  // The snapshot of `fleet` at durable `seq`, carrying the hash of record `seq`.
  Result<std::string> SnapshotBytes(std::uint64_t seq, const FleetState& fleet);
  // `head`: the head recovery reached (the torn batch's seqs would follow it).
  void CheckWalTail(const std::map<std::uint64_t, std::uint64_t>& wals_before, std::uint64_t head);
  void NoteUnackedTables();
  // The writer's check: this open's finding, on the read-only view, kept in TORN_TAIL before
  // RocksDB's open (`held`: the LOCK, held until the write returns).
  Status FindBeforeWriting(const std::shared_ptr<HeldLock>& held);
  Status ReadFoundFile();
  void DropPendingFoundAgain();
  TornFinding FindingToKeep() const;
  Status RemoveFoundFile();
  Result<bool> Marked();
  Status CheckMarkFilesPresent();
  Status RecordMarked();
  Status ReadKeptTornTail();
  Status ReadMovedFound();
  void ReportTornTails();
  Status KeepTornTail();
  void StopCommitter();
  Status CloseCleanly();

  Status Usable() const;    // requires mu_
  void CheckStall() const;  // requires mu_: fails the journal once a commit is past its deadline
  // `group` is the request's events with their engines (GroupOf); `decided`: its events[1..]
  // are fleet_decide's already. Fills `original_decisions` (when given) with events[1..].
  Result<Ticket> EnqueueLocked(const AppendRequest& request, const std::vector<FleetEvent>& group,
                               bool decided, std::vector<FleetEvent>* original_decisions);
  // The group an idempotency key recorded (requires mu_).
  Result<std::vector<FleetEvent>> IdemGroup(const IdemEntry& entry);
  Result<FleetSubmitted> ResubmitLocked(const FleetEvent& input, const std::string& key,
                                        const IdemEntry& entry);
  Result<std::optional<IdemEntry>> FindIdem(const std::string& key);       // requires mu_
  Status CheckIdemSeqs(const std::string& key, const IdemEntry& e) const;  // requires mu_
  Status CheckRolloutIdsUnused(const std::vector<FleetEvent>& group);      // requires mu_
  Status CheckIndexedAdmission(const std::string& id, std::uint64_t seq);  // requires mu_
  Result<std::optional<FleetSnapshot>> LatestSnapshot(std::uint64_t head_seq, bool* legacy_passed);
  // EnqueueLocked's steps (each requires mu_).
  struct EncodedGroup {
    std::vector<std::string> records;
    std::vector<Hash> hashes;
  };
  Result<Ticket> DuplicateTicket(const std::string& key, const IdemEntry& entry, const Hash& digest,
                                 std::vector<FleetEvent>* original_decisions);
  Status CheckDecisions(const std::vector<FleetEvent>& group) const;
  static Status CheckKeySize(const std::string& key);
  Status CheckQueueRoom(const Event& input) const;
  void FoldGroup(const std::vector<FleetEvent>& group);
  // SubmitFleet's steps once the input is new: every check that can refuse it, then the fold in
  // place (fleet_step), then the records.
  Result<EncodedGroup> CheckSubmittable(const std::vector<FleetEvent>& group,
                                        const AppendRequest& request);
  Status FoldRefusesFirst(const FleetEvent& input, const Status& refused) const;
  Result<FleetSubmitted> StepAndStage(std::vector<FleetEvent> group, const AppendRequest& request,
                                      EncodedGroup input_record);
  // Encodes and chains the group's records; `done` holds those of its first events already
  // encoded (the input's, by CheckSubmittable).
  Result<EncodedGroup> EncodeGroup(std::int64_t wall_time_ms, const std::vector<FleetEvent>& group,
                                   EncodedGroup done = {}) const;
  Ticket StageGroup(const std::string& key, const Hash& digest,
                    const std::vector<FleetEvent>& group, const EncodedGroup& encoded);
  void StageRecord(std::uint64_t seq, const Event& event, const std::string& bytes);
  void CommitterLoop();
  void WaitCommitWindow(std::unique_lock<std::mutex>& l);
  // Runs (outside mu_, which `l` holds on entry and on return) every async waiter whose batch is
  // <= upto: with OK when durable, else with failed_. UINT64_MAX: all of them (the journal failed).
  void RunAsyncWaiters(std::unique_lock<std::mutex>& l, std::uint64_t upto) const;
  // `strict`: a snapshot whose chain hash is not its record's is Corruption. A read-only open is
  // not strict, so that replay and audit can read a damaged journal and report it (they ask
  // LoadFleetState, which is); a writer's open is.
  Result<Loaded> LoadFromDb(bool strict);
  Status ScanRange(std::uint64_t from_seq, std::uint64_t to_seq, const Hash& prev_hash,
                   const std::function<Status(const Record&)>& visit);
  Result<std::uint64_t> ReadHeadSeq();
  Status CheckNoSnapshotPastHead(std::uint64_t head_seq);
  // The stored record at `seq`: NotFound when none is stored.
  Result<Record> ReadStored(std::uint64_t seq);
  // The same, for a record that `claim` (the head, a snapshot, an index entry) says exists: a
  // missing one is Corruption naming the seq and the claim. Neither takes mu_.
  Result<Record> ReadExpected(std::uint64_t seq, const std::string& claim);
  Result<Hash> HashAt(std::uint64_t seq, const std::string& claim);

  const std::string path_;
  const Options options_;
  rocksdb::Env* const env_;
  ScratchDir secondary_dir_;  // declared before rocks_: removed after the DB closed
  // The database, empty until opened; shared with open-time steps (RunBounded).
  std::shared_ptr<RocksDb> rocks_ = std::make_shared<RocksDb>();
  Recovery recovery_;  // set once by Open
  TornFinding found_;  // what this open found lost (ReportTornTails)
  TornFinding kept_;   // what an earlier writer's open found and kept (ReadKeptTornTail)
  // What an earlier writer's check found and its open did not keep (TORN_TAIL; ReadFoundFile):
  // empty once open_torn_tail holds it (its SHA-256 is kMovedFoundKey's) or this open found it
  // again (the same torn WAL: DropPendingFoundAgain).
  TornFinding pending_;
  std::optional<std::string> found_file_;  // TORN_TAIL's text, as read or as this open wrote it
  bool marked_key_ = false;                // the writer's: kMarkedKey was present at its open
  UnackedTables unacked_tables_;           // set by CheckObsoleteTables
  // The writer's: the meta key holds a finding (ForgetRecordedTornTail removes it). Set by the
  // open, then guarded by mu_.
  bool torn_tail_kept_ = false;
  bool opened_ = false;           // Open succeeded: only then may a close record a clean close
  std::optional<Status> closed_;  // Close()'s answer, once it ran
  bool fresh_ = false;            // no journal in the directory yet (CheckDirectory)
  bool legacy_snapshot_passed_ = false;                   // set by LoadHead (see Loaded)
  std::uint64_t stored_schema_version_ = kSchemaVersion;  // as CheckSchema read it

  mutable std::mutex mu_;
  // Waiters of batch b sleep on batch_cv_[b % 2]. Only two batches exist at a time (the one being
  // written and the open one), so a finished batch wakes its own waiters only.
  std::condition_variable batch_cv_[2];
  std::condition_variable& BatchCv(std::uint64_t batch_id) { return batch_cv_[batch_id % 2]; }
  std::condition_variable commit_cv_;  // wakes the committer: a group is open, or stop
  FleetState fleet_;
  std::uint64_t head_seq_ = 0;  // last enqueued seq
  Hash head_hash_{};
  std::uint64_t durable_seq_ = 0;
  Hash durable_hash_{};    // the hash of durable_seq_'s record
  mutable Status failed_;  // set once; never cleared (fail-stop)
  // Group commit: groups collect in open_batch_ while the committer writes the previous batch.
  rocksdb::WriteBatch open_batch_;
  std::size_t open_groups_ = 0;
  std::uint64_t open_batch_id_ = 1;
  std::uint64_t durable_batch_id_ = 0;
  // The newest batch some Wait needs durable. The committer writes a batch only when asked, so a
  // batch holds exactly what was enqueued before the first Wait on it: group commit for many
  // threads, and for one thread (the simulator) the same batches on every run, hence the same
  // crash outcomes.
  std::uint64_t wanted_batch_id_ = 0;
  std::uint64_t writing_batch_id_ = 0;  // 0: no write in flight
  bool marking_ = false;                // the durable mark is being written (the stall clock runs)
  std::chrono::steady_clock::time_point write_started_;
  std::optional<std::chrono::steady_clock::time_point> last_mark_;  // the committer's only
  std::uint64_t marked_seq_ = 0;            // the seq of the last mark this writer wrote
  std::uint64_t manifest_number_ = 0;       // the MANIFEST this writer runs on
  std::optional<ClosedMark> durable_mark_;  // the durable mark found at open
  std::optional<ClosedMark> closed_mark_;   // the clean-close record found at open
  std::map<std::uint64_t, std::uint64_t> wals_at_open_;  // the writer's, before RocksDB's open
  // The journal's directory, synced after each mark's rename (a rename is durable only then);
  // opened by the writer's open, shared with the open-time step that writes the first mark.
  std::shared_ptr<rocksdb::Directory> dir_;
  bool stopping_ = false;
  std::size_t pending_groups_ = 0;
  std::unordered_map<std::string, IdemEntry> idem_pending_;
  std::unordered_map<std::string, PendingAdmission> admitted_pending_;
  // WaitAsync's callbacks by batch id; mutable: failed() fires them when it detects a stall.
  mutable std::multimap<std::uint64_t, DurableFn> async_waiters_;
  std::thread committer_;  // last: started after everything above exists
};

// The database closes with its last owner: here, unless an open-time step still runs on it.
RocksJournal::~RocksJournal() { (void)Close(); }

Status RocksJournal::Close() {
  if (closed_) return *closed_;
  StopCommitter();
  closed_ = Status::OK();
  if (opened_ && !options_.read_only) closed_ = CloseCleanly();
  std::lock_guard<std::mutex> l(mu_);
  // Nothing is appended after the clean-close record: it names the journal's last record.
  if (failed_.ok()) failed_ = Status::Unavailable("journal at " + path_ + " is closed");
  return *closed_;
}

// The committer commits what is open unless the journal failed; a waiter still unanswered then
// hears that the journal closed. A commit the durable mark does not cover yet is marked now: the
// clean close may fail (a flush on a full disk), and its record would then guard nothing.
void RocksJournal::StopCommitter() {
  if (!committer_.joinable()) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  commit_cv_.notify_all();
  committer_.join();
  std::unique_lock<std::mutex> l(mu_);
  MarkDurable(l, /*due_now=*/true);
  if (failed_.ok() && !async_waiters_.empty()) {
    failed_ = Status::Unavailable("journal at " + path_ + " closed before the commit");
  }
  RunAsyncWaiters(l, UINT64_MAX);
}

namespace {

// A mark written whole to `tmp_name` and synced before the rename makes it `name`: a crash
// meanwhile leaves the previous mark (or none), never a torn one that no open accepts. The rename
// is durable once `dir` (the journal's directory; nullptr: not synced) is synced: until then a
// power loss may bring the previous mark back.
rocksdb::Status WriteMarkFile(rocksdb::Env* env, rocksdb::Directory* dir, const std::string& path,
                              const char* tmp_name, const char* name, const std::string& text) {
  const std::string tmp = path + "/" + tmp_name;
  rocksdb::Status written = rocksdb::WriteStringToFile(env, text, tmp, /*should_sync=*/true);
  if (written.ok()) written = env->RenameFile(tmp, path + "/" + name);
  if (written.ok() && dir != nullptr) return dir->Fsync();
  if (!written.ok()) env->DeleteFile(tmp).PermitUncheckedError();
  return written;
}

}  // namespace

// Flush every memtable, then record where the journal ended; only if nothing failed. Written
// while this process still holds the LOCK, so no other writer can have started. The record is
// written whole to CLOSED.tmp and synced before the rename makes it CLOSED: a crash meanwhile
// leaves no CLOSED (the journal reads as crashed, as it was), never a torn one that no open
// accepts. Every step goes through the Env, where tests inject faults.
Status RocksJournal::CloseCleanly() {
  ClosedMark mark;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!failed_.ok()) return failed_;
    if (pending_groups_ != 0) {
      return Status::Unavailable("journal at " + path_ + ": groups still uncommitted at close");
    }
    mark = ClosedMark{durable_seq_, head_hash_};
  }
  RC_RETURN_IF_ERROR(Flush());
  const rocksdb::Status written = WriteMarkFile(env_, /*dir=*/nullptr, path_, kClosedTmpFile,
                                                kClosedFile, EncodeClosedMark(mark));
  if (!written.ok()) return FromRocks(written, "record the clean close");
  // Not synced, the rename may be lost: the journal then reads as crashed, which it may.
  std::unique_ptr<rocksdb::Directory> dir;
  if (env_->NewDirectory(path_, &dir).ok()) dir->Fsync().PermitUncheckedError();
  return Status::OK();
}

inline constexpr std::size_t kArenaBlockBytes = 1 << 20;

namespace {

// RocksDB's own log goes to stderr, one escaped line a message, never to a LOG file in the
// journal's directory: on a full disk that file's writer failed once and RocksDB's recovery
// thread wrote to it again (an assertion in Debian's build, so an abort instead of a fail-stop).
class StderrRocksLogger final : public rocksdb::Logger {
 public:
  explicit StderrRocksLogger(bool print)
      : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL), print_(print) {}
  using rocksdb::Logger::Logv;
  // A message names paths and files, which may hold any bytes: escaped as every line from outside
  // is (text::escape_line), cut between UTF-8 sequences, never inside one.
  void Logv(const char* format, va_list ap) override {
    // A sequence is at most 4 bytes: the 3 past the bound tell whether the cut splits one.
    char buf[kLineBytesMax + 4];
    const int n = std::vsnprintf(buf, sizeof buf, format, ap);
    if (n < 0 || !print_) return;
    std::string message = text::utf8_prefix(std::string(buf), kLineBytesMax);
    const bool cut = message.size() < static_cast<std::size_t>(n);
    while (!message.empty() && message.back() == '\n') message.pop_back();
    const std::string line =
        "rolloutcore: journal: rocksdb: " + text::escape_line(message) + (cut ? " [cut]" : "");
    std::fprintf(stderr, "%s\n", line.c_str());
  }

 private:
  static constexpr std::size_t kLineBytesMax = 1024;  // longer messages are cut
  const bool print_;
};

// A background write error (a full disk included) leaves RocksDB stopped: the journal fails and
// the process exits and reopens, never a resume inside the process that could hide what failed.
class NoAutoRecovery final : public rocksdb::EventListener {
 public:
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason /*reason*/, rocksdb::Status /*error*/,
                            bool* auto_recovery) override {
    *auto_recovery = false;
  }
};

}  // namespace

rocksdb::Options RocksJournal::DbOptions() const {
  rocksdb::Options opts;
  opts.env = env_;
  // Only a journal that does not exist yet is created, with its column families: an existing
  // one lacking a family is damaged (CheckColumnFamilies), never given an empty one.
  opts.create_if_missing = options_.create_if_missing && !options_.read_only && fresh_;
  opts.create_missing_column_families = opts.create_if_missing;
  opts.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  opts.paranoid_checks = true;
  opts.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  opts.info_log = std::make_shared<StderrRocksLogger>(options_.rocksdb_log_to_stderr);
  opts.listeners.push_back(std::make_shared<NoAutoRecovery>());
  opts.max_bgerror_resume_count = 0;
  // Read-only and secondary opens keep every table open (they set -1).
  opts.max_open_files = static_cast<int>(std::min<std::uint32_t>(
      std::max(options_.table_files_open_max, kTableFilesOpenMin), INT32_MAX));
  // The MANIFEST records each WAL the writer creates (and a closed one's synced size): an open
  // refuses a journal whose WAL file was removed or cut short, rather than recovering less.
  opts.track_and_verify_wals_in_manifest = true;
  // Column families flush together. A group commit is one WriteBatch over all of them; a family
  // flushed alone (its memtable filled first) would hold its part of later groups in SST files
  // while the rest (the records, the head) lived in the WAL only, so a lost or cut WAL would
  // leave, say, a snapshot past the head. RocksDB refuses atomic_flush only beside
  // enable_pipelined_write and best_efforts_recovery (neither is set); the WAL filter reads the
  // WAL at recovery whatever flushes; read-only and secondary opens never flush.
  opts.atomic_flush = true;
  return opts;
}

std::vector<rocksdb::ColumnFamilyDescriptor> RocksJournal::Descriptors(
    const rocksdb::Options& opts) const {
  std::vector<rocksdb::ColumnFamilyDescriptor> descs;
  for (const char* name : kCfNames) descs.emplace_back(name, rocksdb::ColumnFamilyOptions(opts));
  // Each memtable zero-fills its first arena block when created (at open, and at every flush): at
  // the default (write_buffer_size / 8 = 8 MiB) that was most of the cost of opening a journal.
  for (auto& d : descs) d.options.arena_block_size = kArenaBlockBytes;
  // Records are mostly SHA-256 hashes and short ids (they compress little) and replay reads every
  // block: Snappy decompression was ~12% of a 1M-event replay's CPU. New SSTs of `events` are
  // written uncompressed; existing compressed SSTs stay readable (the type is per block).
  descs[kEventsCf].options.compression = rocksdb::kNoCompression;
  // Event keys are big-endian seqs, each past the last: one insert hint for the whole family
  // (the empty prefix) lets the memtable insert there instead of searching its skip list.
  descs[kEventsCf].options.memtable_insert_with_hint_prefix_extractor.reset(
      rocksdb::NewFixedPrefixTransform(0));
  {
    rocksdb::BlockBasedTableOptions table;
    table.block_size = kEventsBlockBytes;
    descs[kEventsCf].options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  }
  {
    // Admission looks up an id that is (almost always) absent: a whole-key filter answers that
    // without reading a data block.
    rocksdb::BlockBasedTableOptions table;
    table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
    descs[kRolloutsCf].options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
    descs[kRolloutsCf].options.memtable_whole_key_filtering = true;
    descs[kRolloutsCf].options.memtable_prefix_bloom_size_ratio = 0.05;
    // Ids serve mints share a prefix and count up, so an admission's two keys land next to the
    // last admission's: the same one-hint insert as events (a finish's key, next to its own
    // admission, searches as before).
    descs[kRolloutsCf].options.memtable_insert_with_hint_prefix_extractor.reset(
        rocksdb::NewFixedPrefixTransform(0));
  }
  return descs;
}

// Whether LockFile failed because a process holds the LOCK. RocksDB's POSIX Env says "While lock
// file" when fcntl refused the lock (another process holds it) and "lock hold by current
// process" when this one does; its in-memory Env says "lock is already held". Any other failure
// (the LOCK could not be opened for writing: a read-only mount, no permission) tells nothing
// about a writer.
bool LockHeldByAProcess(const rocksdb::Status& s) {
  const std::string msg = s.ToString();
  return msg.find("While lock file") != std::string::npos ||
         msg.find("lock hold by current process") != std::string::npos ||
         msg.find("lock is already held") != std::string::npos;
}

// Whether LockFile failed because another process holds the LOCK (fcntl refused it).
bool LockHeldByAnotherProcess(const rocksdb::Status& s) {
  return s.ToString().find("While lock file") != std::string::npos;
}

// Only RocksDB's wording of a held lock says Busy: the message names the journal's path too, and
// a path with "lock" in it (".../block-store/...") must not make a damaged file read as busy.
Status OpenError(const std::string& path, const rocksdb::Status& s) {
  const std::string msg = s.ToString();
  if (s.IsIOError() && LockHeldByAProcess(s)) {
    return Status::Busy("journal already open by another process: " + path + "/LOCK (" + msg + ")");
  }
  if (s.IsCorruption()) {
    return Status::Corruption("journal at " + path +
                              " is corrupt; refusing to open (never auto-repaired): " + msg);
  }
  return Status::IOError("cannot open journal at " + path + ": " + msg);
}

// The open of a journal whose CURRENT exists: a file of it that is missing or not a file (its
// MANIFEST, a table, a WAL) is damage to the journal, not a wrong path or a permission.
Status ExistingOpenError(const std::string& path, const rocksdb::Status& s) {
  const std::string msg = s.ToString();
  const bool file_lost = msg.find("No such file or directory") != std::string::npos ||
                         msg.find("Is a directory") != std::string::npos ||
                         msg.find("Not a directory") != std::string::npos;
  if (!s.IsIOError() || LockHeldByAProcess(s) || !(s.IsPathNotFound() || file_lost)) {
    return OpenError(path, s);
  }
  return Status::Corruption("journal at " + path +
                            " lacks a file its CURRENT or MANIFEST names, or one is not a file; "
                            "damaged, refusing to open (never auto-repaired): " +
                            msg);
}

Status RocksJournal::OpenStep(const std::string& what, std::function<Status()> step) const {
  return RunBounded(options_.commit_stall_timeout_ms, path_, what, std::move(step));
}

// RocksDB's open replays the whole WAL, up to several memtables of records, where a group commit
// writes one batch: it gets this many times the commit deadline, so that a large healthy journal
// on a slow disk is not refused while a hung one still is.
inline constexpr std::uint32_t kRocksOpenDeadlineFactor = 6;

// RocksDB's open of the writer replays the WAL (through the WAL filter), may flush what it
// replayed, and writes a new MANIFEST and OPTIONS file, each synced: an open-time step. It opens
// into a database of its own, taken as the journal's only once the open returned in time.
Status RocksJournal::OpenRocksWriter(bool* lock_taken) {
  *lock_taken = false;
  auto opened = std::make_shared<RocksDb>();
  auto taken = std::make_shared<std::atomic<bool>>(false);
  rocksdb::Options opts = DbOptions();
  opts.wal_filter = &opened->wal_replay;
  std::vector<rocksdb::ColumnFamilyDescriptor> descs = Descriptors(opts);
  const std::uint64_t deadline_ms =
      std::uint64_t{options_.commit_stall_timeout_ms} * kRocksOpenDeadlineFactor;
  const Status s = RunBounded(
      static_cast<std::uint32_t>(std::min<std::uint64_t>(deadline_ms, UINT32_MAX)), path_,
      "RocksDB's open (WAL recovery, MANIFEST)",
      [opened, taken, opts, descs, path = path_, fresh = fresh_] {
        rocksdb::DB* raw = nullptr;
        const rocksdb::Status s = rocksdb::DB::Open(opts, path, descs, &opened->cfs, &raw);
        opened->db.reset(raw);
        if (s.ok()) return Status::OK();
        taken->store(LockHeldByAnotherProcess(s));  // read before the status is mapped
        return fresh ? OpenError(path, s) : ExistingOpenError(path, s);
      });
  if (!s.ok()) {
    *lock_taken = taken->load();
    return s;
  }
  RC_CHECK(opened->db != nullptr && opened->cfs.size() == kCfCount);
  rocks_ = std::move(opened);
  return Status::OK();
}

Status RocksJournal::OpenDb() {
  Status s = options_.read_only ? OpenReadOnly() : OpenWriter();
  if (!s.ok() && s.message().find(path_) == std::string::npos) {
    return Status(s.code(), "journal at " + path_ + ": " + s.message());
  }
  opened_ = s.ok();
  return s;
}

// The writer's open: what RocksDB's open would change is checked first on a read-only view
// (CheckBeforeWriting); then RocksDB opens the journal for writing and the head it loads is
// checked again, before the writer marks it and accepts appends.
Status RocksJournal::OpenWriter() {
  RC_RETURN_IF_ERROR(CheckDirectory());
  RC_RETURN_IF_ERROR(CheckAndOpenForWriting());
  if (!fresh_) RC_RETURN_IF_ERROR(CheckMarksUnchanged());
  Result<std::uint64_t> manifest = CurrentManifestNumber();
  if (!manifest.ok()) return manifest.status();
  manifest_number_ = *manifest;
  {
    // Background compaction may already run: keep the files it obsoletes until the check ends.
    RC_RETURN_IF_ERROR(
        FromRocks(rocks_->db->DisableFileDeletions(), "disable file deletions in " + path_));
    const Status live = CheckLiveFiles();
    RC_RETURN_IF_ERROR(FromRocks(rocks_->db->EnableFileDeletions(/*force=*/false),
                                 "enable file deletions in " + path_));
    RC_RETURN_IF_ERROR(live);
  }
  RC_RETURN_IF_ERROR(CheckSchema());
  RC_RETURN_IF_ERROR(LoadHead());
  RC_RETURN_IF_ERROR(CheckClosedMark(head_seq_, head_hash_));
  recovery_.clean_close = closed_mark_.has_value();
  RC_RETURN_IF_ERROR(CheckDurableMark(head_seq_));
  {
    Result<bool> marked = Marked();
    if (!marked.ok()) return marked.status();
    marked_key_ = *marked;
  }
  // What this open found was found on the read-only view and kept in TORN_TAIL before RocksDB's
  // open (FindBeforeWriting), which made the torn WAL obsolete.
  RC_RETURN_IF_ERROR(ReadKeptTornTail());
  ReportTornTails();
  // From here on a crash must not look like a clean close.
  RC_RETURN_IF_ERROR(RemoveClosedMark());
  RC_RETURN_IF_ERROR(KeepTornTail());
  RC_RETURN_IF_ERROR(StampSchemaVersion());
  RC_RETURN_IF_ERROR(SnapshotPastOlderFormat());
  RC_RETURN_IF_ERROR(MarkAtOpen());
  RC_RETURN_IF_ERROR(RecordMarked());
  try {
    committer_ = std::thread([this] { CommitterLoop(); });
  } catch (const std::system_error& e) {  // a thread limit: the journal never accepts appends
    return Status::Unavailable("journal at " + path_ +
                               ": no thread for its committer: " + e.what());
  }
  return Status::OK();
}

// The check releases the LOCK and RocksDB's open takes it again. A reader (replay, audit) polls
// the LOCK (LockBriefly) and may take it between the two: RocksDB's open then fails on a LOCK
// another process holds, and the check and the open run again, for at most kLockWaitMs in all
// (the reader holds it only while it opens). A writer that came between is Busy.
Status RocksJournal::CheckAndOpenForWriting() {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kLockWaitMs);
  while (true) {
    if (!fresh_) RC_RETURN_IF_ERROR(CheckBeforeWriting(until));
    bool lock_taken = false;
    const Status opened = OpenRocksWriter(&lock_taken);
    if (opened.ok() || !lock_taken || std::chrono::steady_clock::now() >= until) return opened;
    std::this_thread::sleep_for(std::chrono::milliseconds(kLockPollMs));
  }
}

// RocksDB's open of the writer replays the WAL into table files, starts a new MANIFEST and
// deletes every WAL and table file the MANIFEST CURRENT names leaves obsolete: a journal that lost
// acknowledged records must be refused before that, while its files are as they were. So the
// journal is first opened read-only (which writes and deletes nothing) and checked there: its
// column families and live files, a CURRENT older than the durable mark's MANIFEST, records held
// only by table files RocksDB would delete, records that end before a mark. Under the LOCK
// (another process's waited for until `lock_until`), so that no writer starts meanwhile;
// RocksDB's open takes it again (CheckAndOpenForWriting).
Status RocksJournal::CheckBeforeWriting(std::chrono::steady_clock::time_point lock_until) {
  rocksdb::FileLock* lock = nullptr;
  const rocksdb::Status locked = LockBriefly(&lock, lock_until);
  if (!locked.ok()) return OpenError(path_, locked);
  const auto held = std::make_shared<HeldLock>(env_, lock);
  Result<DbFiles> files = ListDbFiles(env_, path_);
  if (!files.ok()) return files.status();
  wals_at_open_ = WalsOf(*files);
  RC_RETURN_IF_ERROR(OpenReadOnlyView(DbOptions().max_open_files, /*locked=*/true));
  RC_RETURN_IF_ERROR(CheckObsoleteTables());
  RC_RETURN_IF_ERROR(CheckMarkedRecordsBeforeWriting());
  RC_RETURN_IF_ERROR(FindBeforeWriting(held));
  rocks_ = std::make_shared<RocksDb>();  // the view closes before RocksDB's open
  return Status::OK();
}

// Between the check and RocksDB's open (which holds the LOCK from its start) another writer may
// have opened and closed the journal, moving its marks: what was checked is then not what opened.
Status RocksJournal::CheckMarksUnchanged() {
  const std::optional<ClosedMark> closed = closed_mark_;
  const std::optional<ClosedMark> durable = durable_mark_;
  RC_RETURN_IF_ERROR(ReadMarks());
  if (closed == closed_mark_ && durable == durable_mark_) return Status::OK();
  return Status::Busy("journal at " + path_ +
                      ": another writer opened it between its check and RocksDB's open (its "
                      "marks moved); open it again");
}

// The view's head against the marks: a clean close's head and hash, the durable mark's seq and
// the record there (after the head's own first check, a snapshot past it, as LoadHead checks it
// first). The rest (the chain, the snapshots' records) is checked once the writer opened:
// RocksDB's open loses nothing those checks find missing. A journal that holds neither a schema
// version nor a record (an emptied WAL, or a creation that died before its first write) is one
// the writer would start empty (CheckSchema): its head is 0 (ViewHead).
Status RocksJournal::CheckMarkedRecordsBeforeWriting() {
  RC_RETURN_IF_ERROR(CheckMarkFilesPresent());
  if (!closed_mark_ && !durable_mark_) return Status::OK();
  Result<std::uint64_t> head = ViewHead();
  if (!head.ok()) return head.status();
  RC_RETURN_IF_ERROR(CheckNoSnapshotPastHead(*head));
  if (closed_mark_) {
    Result<Hash> head_hash = HashAt(*head, "the head");
    if (!head_hash.ok()) return head_hash.status();
    RC_RETURN_IF_ERROR(CheckClosedMark(*head, *head_hash));
  }
  return CheckDurableMark(*head);
}

// A journal no writer holds opens as a plain read-only DB while this holds its LOCK (no writer
// can start mid-open); one a writer holds opens as a secondary instance. A LOCK that cannot be
// taken for another reason opens read-only with every check all the same (never a secondary:
// it skips the tail check, and a torn journal would read as healthy); nothing then kept a writer
// out, so the open stands only if the journal's files did not change meanwhile.
Status RocksJournal::OpenReadOnly() {
  RC_RETURN_IF_ERROR(CheckDirectory());
  if (fresh_) return Status::NotFound("no journal at " + path_ + " (no CURRENT file)");
  rocksdb::FileLock* lock = nullptr;
  const rocksdb::Status locked =
      LockBriefly(&lock, std::chrono::steady_clock::now() + std::chrono::milliseconds(kLockWaitMs));
  if (!locked.ok() && LockHeldByAProcess(locked)) return OpenSecondary();
  HeldLock held(env_, locked.ok() ? lock : nullptr);
  Result<DbFiles> files = ListDbFiles(env_, path_);
  if (!files.ok()) return files.status();
  const Status checked = OpenReadOnlyChecked(WalsOf(*files), locked.ok());
  if (locked.ok()) return checked;
  // Without the LOCK a writer may have run meanwhile: what failed (a mark past the records read,
  // a file it deleted) then tells nothing about the journal.
  const Status unchanged = CheckFilesUnchanged(*files, locked);
  return unchanged.ok() ? checked : unchanged;
}

// The LOCK. Another process holding it is waited for until `until` (kLockWaitMs from the open's
// start): a reader (replay, audit) holds it only while it opens, and one beside it would
// otherwise be read as beside a live writer. A LOCK this process holds is not waited for (a
// writer here holds it for good).
rocksdb::Status RocksJournal::LockBriefly(rocksdb::FileLock** lock,
                                          std::chrono::steady_clock::time_point until) {
  while (true) {
    const rocksdb::Status s = env_->LockFile(path_ + "/LOCK", lock);
    if (s.ok() || !LockHeldByAnotherProcess(s) || std::chrono::steady_clock::now() >= until) {
      return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kLockPollMs));
  }
}

// The read-only open and its checks: live files, table files RocksDB would take for obsolete,
// schema, head, clean close, durable mark, WAL tail, and what an earlier writer's open kept.
Status RocksJournal::OpenReadOnlyChecked(const std::map<std::uint64_t, std::uint64_t>& wals,
                                         bool locked) {
  // Every table file is opened (and its footer read) now.
  RC_RETURN_IF_ERROR(OpenReadOnlyView(/*max_open_files=*/-1, locked));
  RC_RETURN_IF_ERROR(CheckObsoleteTables());
  RC_RETURN_IF_ERROR(CheckMarkFilesPresent());
  RC_RETURN_IF_ERROR(CheckSchema());
  RC_RETURN_IF_ERROR(LoadHead());
  RC_RETURN_IF_ERROR(CheckClosedMark(head_seq_, head_hash_));
  recovery_.clean_close = closed_mark_.has_value();
  RC_RETURN_IF_ERROR(CheckDurableMark(head_seq_));
  CheckWalTail(wals, recovery_.head_seq);
  NoteUnackedTables();
  RC_RETURN_IF_ERROR(ReadKeptTornTail());
  DropPendingFoundAgain();
  ReportTornTails();
  return Status::OK();
}

Status RocksJournal::OpenReadOnlyView(int max_open_files, bool locked) {
  RC_RETURN_IF_ERROR(CheckColumnFamilies(locked));
  // Read before the records: a mark only moves after what it names is durable, and a writer's
  // open removes TORN_TAIL only after the records keep its finding.
  RC_RETURN_IF_ERROR(ReadMarks());
  RC_RETURN_IF_ERROR(ReadFoundFile());
  RC_RETURN_IF_ERROR(CheckCurrentNotStale());
  rocksdb::Options opts = DbOptions();
  opts.max_open_files = max_open_files;
  opts.wal_filter = &rocks_->wal_replay;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s =
      rocksdb::DB::OpenForReadOnly(opts, path_, Descriptors(opts), &rocks_->cfs, &raw);
  if (!s.ok()) return locked ? ExistingOpenError(path_, s) : OpenError(path_, s);
  rocks_->db.reset(raw);
  RC_CHECK(rocks_->cfs.size() == kCfCount);
  return CheckLiveFiles();
}

// Without the LOCK nothing kept a writer out while the journal was checked: what was checked is
// the journal only if the files a writer changes (CURRENT and MANIFESTs at its open, WALs as it
// appends, tables as it flushes and compacts) are as they were before the open.
Status RocksJournal::CheckFilesUnchanged(const DbFiles& before, const rocksdb::Status& lock_error) {
  Result<DbFiles> after = ListDbFiles(env_, path_);
  if (after.ok() && *after == before) return Status::OK();
  return Status::Busy("journal at " + path_ + " changed while it was checked without its LOCK (" +
                      lock_error.ToString() +
                      "): a writer may be running; the journal cannot be checked now");
}

// Beside a live writer: a secondary instance, which follows it. The marks are read before the
// records and checked against them (CheckMarksBesideWriter); the WAL tail is not checked (the
// writer appends to it).
Status RocksJournal::OpenSecondary() {
  if (options_.secondary_path.empty()) {
    RC_RETURN_IF_ERROR(secondary_dir_.MakeTemp());
  } else {
    secondary_dir_.Use(options_.secondary_path);
  }
  RC_RETURN_IF_ERROR(CheckColumnFamilies(/*locked=*/false));
  // Read before the records: a live writer marks only what its WAL already holds.
  RC_RETURN_IF_ERROR(ReadMarks());
  RC_RETURN_IF_ERROR(ReadFoundFile());
  RC_RETURN_IF_ERROR(CheckCurrentNotStale());
  rocksdb::Options opts = DbOptions();
  opts.max_open_files = -1;  // required by secondary instances
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::OpenAsSecondary(opts, path_, secondary_dir_.path(),
                                                   Descriptors(opts), &rocks_->cfs, &raw);
  if (!s.ok()) return OpenError(path_, s);  // a live writer may have moved a file meanwhile
  rocks_->db.reset(raw);
  RC_CHECK(rocks_->cfs.size() == kCfCount);
  recovery_.live_writer = true;
  Status live = CheckLiveFiles();
  for (int i = 1; !live.ok() && i < kLiveFileChecksMax; ++i) {
    RC_RETURN_IF_ERROR(
        FromRocks(rocks_->db->TryCatchUpWithPrimary(), "catch up with primary at " + path_));
    live = CheckLiveFiles();
  }
  RC_RETURN_IF_ERROR(live);
  RC_RETURN_IF_ERROR(CheckSchema());
  RC_RETURN_IF_ERROR(LoadHead());
  RC_RETURN_IF_ERROR(CheckMarksBesideWriter());
  RC_RETURN_IF_ERROR(ReadKeptTornTail());
  ReportTornTails();
  return Status::OK();
}

// A writer only adds records past what the marks read before the records name (its open checked
// the journal reached them; a clean close it started after included): records that end before a
// mark, after catching up with the writer a few times, were lost. The clean close is not reported
// (a writer removes its record before it appends).
Status RocksJournal::CheckMarksBesideWriter() {
  RC_RETURN_IF_ERROR(CheckMarkFilesPresent());
  std::uint64_t floor = durable_mark_ ? durable_mark_->seq : 0;
  if (closed_mark_) floor = std::max(floor, closed_mark_->seq);
  for (int i = 1; head_seq() < floor && i < kMarkChecksMax; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kMarkCatchUpPauseMs));
    RC_RETURN_IF_ERROR(CatchUp());
  }
  const std::uint64_t head = head_seq();
  if (closed_mark_) {
    RC_RETURN_IF_ERROR(CheckRecordsReach(*closed_mark_, head,
                                         std::string("its clean-close record ") + kClosedFile));
  }
  return CheckDurableMark(head);
}

namespace {

// Files only a journal's directory holds once it was created: RocksDB's (a MANIFEST, tables, WALs,
// blobs, options, identity) and the clean-close record. Not LOCK and LOG: RocksDB writes them
// before anything else, so a creation that died at once leaves only them.
bool IsJournalFile(std::string_view name) {
  return name.rfind("MANIFEST-", 0) == 0 || name.rfind("OPTIONS-", 0) == 0 || name == "IDENTITY" ||
         name == kClosedFile || name == kClosedTmpFile || name == kDurableFile ||
         name == kDurableTmpFile || name == kFoundFile || name == kFoundTmpFile ||
         Numbered(name, ".sst") || Numbered(name, ".log") || Numbered(name, ".blob");
}

constexpr std::size_t kNamedFilesMax = 8;  // files an error names, at most

}  // namespace

// Sets fresh_: no CURRENT and nothing of a journal (a new one may be created there). Files of a
// journal without its CURRENT are damage (Corruption): an open would otherwise create a new,
// empty journal beside them. With a CURRENT, each open checks its column families
// (CheckColumnFamilies) once it knows whether it holds the LOCK.
Status RocksJournal::CheckDirectory() {
  const rocksdb::Status current = env_->FileExists(path_ + "/CURRENT");
  if (current.ok()) return Status::OK();
  if (!current.IsNotFound()) return FromRocks(current, "look for " + path_ + "/CURRENT");
  fresh_ = true;
  if (env_->FileExists(path_).IsNotFound()) return Status::OK();
  std::vector<std::string> names;
  RC_RETURN_IF_ERROR(FromRocks(env_->GetChildren(path_, &names), "list " + path_));
  std::sort(names.begin(), names.end());
  std::string found;
  std::size_t count = 0;
  for (const std::string& name : names) {
    if (!IsJournalFile(name)) continue;
    if (++count <= kNamedFilesMax) found += (found.empty() ? "" : ", ") + name;
  }
  if (count == 0) return Status::OK();
  return Status::Corruption(
      "journal at " + path_ + " has no CURRENT file but holds " + std::to_string(count) +
      " journal files (" + found + (count > kNamedFilesMax ? ", ..." : "") +
      "): its CURRENT was lost; refusing to open or to create a new journal over them (never "
      "auto-repaired; if a creation died before any record was written, remove the directory)");
}

namespace {

// The number of a "MANIFEST-<digits>" name; nullopt for any other name.
std::optional<std::uint64_t> ManifestNumber(std::string_view name) {
  constexpr std::string_view kPrefix = "MANIFEST-";
  if (name.substr(0, kPrefix.size()) != kPrefix || name.size() == kPrefix.size()) return {};
  std::uint64_t n = 0;
  const char* end = name.data() + name.size();
  const auto [at, ec] = std::from_chars(name.data() + kPrefix.size(), end, n);
  if (ec != std::errc() || at != end) return {};
  return n;
}

}  // namespace

// CURRENT's text: the name of the MANIFEST it points at, and a newline.
Result<std::string> RocksJournal::ReadCurrent() {
  std::string current;
  RC_RETURN_IF_ERROR(FromRocks(rocksdb::ReadFileToString(env_, path_ + "/CURRENT", &current),
                               "read " + path_ + "/CURRENT"));
  return current;
}

// The MANIFEST number CURRENT names.
Result<std::uint64_t> RocksJournal::CurrentManifestNumber() {
  Result<std::string> read = ReadCurrent();
  if (!read.ok()) return read.status();
  std::string current = std::move(read.value());
  while (!current.empty() && current.back() == '\n') current.pop_back();
  const std::optional<std::uint64_t> named = ManifestNumber(current);
  if (named) return *named;
  return Status::Corruption("journal at " + path_ +
                            ": CURRENT does not name a MANIFEST; damaged, refusing to open (never "
                            "auto-repaired)");
}

// RocksDB numbers each new MANIFEST past every file before it, and the durable mark names the one
// its writer ran on: a CURRENT naming an older one is a CURRENT (and MANIFEST) older than the
// journal's other files, restored or copied over them. RocksDB would recover the older state and
// delete the newer files as obsolete, so it is refused before any open. (A MANIFEST left by an
// open that died before CURRENT named it is newer than both, and changes nothing.) A MANIFEST of
// the mark's number but older (a copy, or one cut short) passes here: CheckObsoleteTables and the
// mark's seq see what it lost.
Status RocksJournal::CheckCurrentNotStale() {
  if (!durable_mark_) return Status::OK();
  Result<std::uint64_t> named = CurrentManifestNumber();
  if (!named.ok() || *named >= durable_mark_->manifest) return named.status();
  return Status::Corruption(
      "journal at " + path_ + ": CURRENT names MANIFEST-" + std::to_string(*named) +
      ", older than the MANIFEST-" + std::to_string(durable_mark_->manifest) +
      " its writer ran on (its durable mark " + kDurableFile +
      "): CURRENT is older than the journal's files (restored or copied over them); refusing to "
      "open, which would recover the older state and delete the newer files (never "
      "auto-repaired)");
}

// A family the MANIFEST lacks would be created empty by the open: a lost index read as an empty
// one (admissions of used ids, retried keys written twice). Refused before the open.
Status RocksJournal::CheckColumnFamilies(bool locked) {
  std::vector<std::string> names;
  RC_RETURN_IF_ERROR(ListFamilies(locked, &names));
  std::string missing;
  for (const char* name : kCfNames) {
    if (std::find(names.begin(), names.end(), name) != names.end()) continue;
    missing += std::string(missing.empty() ? "" : ", ") + name;
  }
  if (missing.empty()) return Status::OK();
  return Status::Corruption("journal at " + path_ + " lacks the column famil" +
                            (missing.find(',') == std::string::npos ? "y " : "ies ") + missing +
                            " (its MANIFEST lists " + std::to_string(names.size()) +
                            "): damaged; refusing to open (never auto-repaired; a journal whose "
                            "creation died before it was complete holds no records: remove the "
                            "directory to create it again)");
}

// The column families the MANIFEST CURRENT names lists. Under the LOCK (`locked`) no writer moves
// CURRENT meanwhile: a MANIFEST it names that cannot be read is damage. Without it, a writer's open
// may have switched CURRENT and deleted the MANIFEST just read: the listing is tried again while
// CURRENT changes, and a failure that stays is left to an open that holds the LOCK to call damage
// (OpenError: Busy, or an I/O error).
Status RocksJournal::ListFamilies(bool locked, std::vector<std::string>* names) {
  rocksdb::DBOptions db_options;
  db_options.env = env_;
  Result<std::string> current = locked ? Result<std::string>(std::string()) : ReadCurrent();
  rocksdb::Status s = rocksdb::DB::ListColumnFamilies(db_options, path_, names);
  for (int i = 1; !s.ok() && !locked && i < kColumnFamilyListingsMax; ++i) {
    Result<std::string> now = ReadCurrent();
    // CURRENT stayed: the failure stands.
    if (!current.ok() || !now.ok() || *now == *current) break;
    current = std::move(now);
    names->clear();
    s = rocksdb::DB::ListColumnFamilies(db_options, path_, names);
  }
  if (s.ok()) return Status::OK();
  return locked ? ExistingOpenError(path_, s) : OpenError(path_, s);
}

// Every live file the MANIFEST lists must exist with its recorded size, before anything is read.
Status RocksJournal::CheckLiveFiles() {
  std::vector<rocksdb::LiveFileMetaData> files;
  rocks_->db->GetLiveFilesMetaData(&files);
  for (const rocksdb::LiveFileMetaData& f : files) {
    const std::string file = f.directory + "/" + f.relative_filename;
    std::uint64_t size = 0;
    const rocksdb::Status s = env_->GetFileSize(file, &size);
    const std::string where =
        " (column family " + f.column_family_name + ", level " + std::to_string(f.level) + ")";
    if (!s.ok()) {
      return Status::Corruption(
          "journal at " + path_ + ": live file " + f.relative_filename + where +
          " listed by the MANIFEST is missing or unreadable: " + s.ToString());
    }
    if (size != f.size) {
      return Status::Corruption("journal at " + path_ + ": live file " + f.relative_filename +
                                where + " is " + std::to_string(size) +
                                " bytes but the MANIFEST recorded " + std::to_string(f.size));
    }
  }
  return Status::OK();
}

// RocksDB takes a table file the MANIFEST CURRENT names does not list for obsolete, and the
// writer's open deletes it. What a flush or a compaction that died leaves behind holds only keys
// the journal still holds (in a WAL its recovery reads again, or in the tables they were compacted
// from). So does what an open that died leaves, with one exception: RocksDB's open writes the WAL
// it recovers into synced tables before it switches CURRENT, without syncing that WAL first, so
// its tables may hold a last batch that was in the page cache only (its writer killed before the
// fsync: never acknowledged), which a power loss then took from the WAL. Any other key the
// journal as opened lacks is a record that would be lost, under a CURRENT or MANIFEST older than
// the journal's tables (restored or copied over them, or a MANIFEST cut short). The marks tell the
// two apart (CheckUnacknowledged); a table that holds such an unacknowledged tail is reported
// (NoteUnackedTables) and left for RocksDB to delete.
Status RocksJournal::CheckObsoleteTables() {
  unacked_tables_ = {};
  std::vector<rocksdb::LiveFileMetaData> files;
  rocks_->db->GetLiveFilesMetaData(&files);
  std::set<std::string> live;
  for (const rocksdb::LiveFileMetaData& f : files) live.insert(f.relative_filename);
  std::vector<std::string> names;
  RC_RETURN_IF_ERROR(FromRocks(env_->GetChildren(path_, &names), "list " + path_));
  std::sort(names.begin(), names.end());
  std::optional<std::uint64_t> head;  // the journal's, read once a table holds a key it lacks
  for (const std::string& name : names) {
    if (!Numbered(name, ".sst") || live.count(name) != 0) continue;
    SeqSpan lacked;
    RC_RETURN_IF_ERROR(CheckObsoleteTable(name, &lacked));
    if (lacked.empty()) continue;
    if (!head.has_value()) {
      Result<std::uint64_t> read = ViewHead();
      if (!read.ok()) return read.status();
      head = *read;
    }
    RC_RETURN_IF_ERROR(CheckUnacknowledged(name, lacked, *head));
    unacked_tables_.Add(name, lacked, *head);
  }
  return Status::OK();
}

namespace {

constexpr const char* kOlderCurrent =
    "CURRENT or its MANIFEST is older than the journal's table files (restored or copied over "
    "them, or cut short)";

}  // namespace

// The seqs of the keys an obsolete table file holds that the journal lacks, into `lacked`. A table
// that is damaged (Corruption: what a flush, compaction or open that died leaves cut short or
// unfinished) holds nothing RocksDB could read past the damage either: what was read before it
// counts, the rest is passed over. Any other error reading it (I/O, descriptors, memory) tells
// nothing of the table: it is the open's error. A key that names no seq is refused here (nothing
// shows it was never acknowledged), except the kept torn tail and its file's hash (a finding, not
// a record, which a writer removes once it was recorded) and the record that the journal is
// marked (a flush that died after writing its table leaves a copy of it).
Status RocksJournal::CheckObsoleteTable(const std::string& name, SeqSpan* lacked) {
  const std::string file = path_ + "/" + name;
  rocksdb::SstFileReader reader(DbOptions());
  const rocksdb::Status opened = reader.Open(file);
  if (opened.IsCorruption()) return Status::OK();
  RC_RETURN_IF_ERROR(FromRocks(opened, "read the table file " + file));
  const std::shared_ptr<const rocksdb::TableProperties> props = reader.GetTableProperties();
  if (props == nullptr) return Status::OK();
  const auto named = std::find(std::begin(kCfNames), std::end(kCfNames), props->column_family_name);
  if (named == std::end(kCfNames)) return Status::OK();  // not a family of the journal
  const auto cf = static_cast<std::size_t>(named - std::begin(kCfNames));
  std::unique_ptr<rocksdb::Iterator> obsolete(reader.NewIterator(rocksdb::ReadOptions()));
  std::unique_ptr<rocksdb::Iterator> held(
      rocks_->db->NewIterator(rocksdb::ReadOptions(), rocks_->cfs[cf]));
  for (obsolete->SeekToFirst(); obsolete->Valid(); obsolete->Next()) {
    held->Seek(obsolete->key());
    if (held->Valid() && held->key() == obsolete->key()) continue;
    RC_RETURN_IF_ERROR(FromRocks(held->status(), "read " + path_));
    const std::string_view key = View(obsolete->key());
    if (cf == kMetaCf && (key == kOpenTornTailKey || key == kMovedFoundKey || key == kMarkedKey)) {
      continue;
    }
    const std::optional<SeqSpan> seqs = SeqsOfKey(cf, key, View(obsolete->value()));
    if (!seqs.has_value()) {
      return ObsoleteTableRefused(name, std::string("a key of the column family ") + kCfNames[cf],
                                  "and it names no seq, so nothing shows it was never "
                                  "acknowledged: " +
                                      std::string(kOlderCurrent));
    }
    lacked->Add(*seqs);
  }
  const rocksdb::Status read = obsolete->status();
  if (read.IsCorruption()) return Status::OK();
  return FromRocks(read, "read the table file " + file);
}

// The seqs an obsolete table holds that the journal lacks (`lacked`) are an open's unacknowledged
// tail only if they all lie past the head the journal holds and that head reaches every mark: the
// durable mark and a clean close say how far records were acknowledged. A seq at or below the
// head is a hole; records that end before a mark lost acknowledged ones (refused here as the mark
// check would); and without a mark nothing shows the seqs were never acknowledged. Past the mark,
// the commits of its last interval are the documented limit (journal.h), as for a cut WAL.
Status RocksJournal::CheckUnacknowledged(const std::string& name, const SeqSpan& lacked,
                                         std::uint64_t head) const {
  const std::string at = "its head seq " + std::to_string(head);
  std::uint64_t marked = 0;
  if (durable_mark_) marked = durable_mark_->seq;
  if (closed_mark_) marked = std::max(marked, closed_mark_->seq);
  std::string why;
  if (lacked.first <= head) {
    why = "at or below " + at + ": " + kOlderCurrent;
  } else if (!durable_mark_ && !closed_mark_) {
    why = "past " + at +
          ", but without a durable mark or a clean-close record nothing shows they were never "
          "acknowledged: " +
          kOlderCurrent + ", or an open died after RocksDB wrote them";
  } else if (head < marked) {
    why = "past " + at + ", which ends before the seq " + std::to_string(marked) +
          " its marks name: " + kOlderCurrent;
  } else {
    return Status::OK();
  }
  return ObsoleteTableRefused(name, "keys of " + lacked.Name(), why);
}

Status RocksJournal::ObsoleteTableRefused(const std::string& name, const std::string& what,
                                          const std::string& why) const {
  return Status::Corruption("journal at " + path_ + ": table file " + name +
                            ", which the MANIFEST CURRENT names does not list (RocksDB would "
                            "delete it), holds " +
                            what + ", which the journal lacks, " + why +
                            "; refusing to open, which would lose those records (never "
                            "auto-repaired)");
}

// The head the journal as opened holds: 0 for one that holds neither a schema version nor a
// record (NeverWritten).
Result<std::uint64_t> RocksJournal::ViewHead() {
  Result<bool> unwritten = NeverWritten();
  if (!unwritten.ok()) return unwritten.status();
  return *unwritten ? Result<std::uint64_t>(0) : ReadHeadSeq();
}

// Whether the journal holds neither a schema version nor a record.
Result<bool> RocksJournal::NeverWritten() {
  std::string version;
  const rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kSchemaKey, &version);
  if (s.ok()) return false;
  if (!s.IsNotFound()) return FromRocks(s, "read schema_version in " + path_);
  std::unique_ptr<rocksdb::Iterator> it(
      rocks_->db->NewIterator(rocksdb::ReadOptions(), rocks_->cfs[kEventsCf]));
  it->SeekToFirst();
  RC_RETURN_IF_ERROR(FromRocks(it->status(), "scan events of " + path_));
  return !it->Valid();
}

// A new journal gets its schema version and an explicit empty head in one write; an existing one
// must carry the supported schema version.
Status RocksJournal::CheckSchema() {
  std::string version;
  rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kSchemaKey, &version);
  if (s.IsNotFound() && !options_.read_only) {
    std::unique_ptr<rocksdb::Iterator> it(
        rocks_->db->NewIterator(rocksdb::ReadOptions(), rocks_->cfs[kEventsCf]));
    it->SeekToFirst();
    RC_RETURN_IF_ERROR(FromRocks(it->status(), "scan events of " + path_));
    if (it->Valid()) {
      return Status::Corruption("journal at " + path_ + " holds records but no schema_version");
    }
    rocksdb::WriteBatch batch;
    RC_CHECK(batch.Put(rocks_->cfs[kMetaCf], kSchemaKey, BE64(kSchemaVersion)).ok());
    RC_CHECK(batch.Put(rocks_->cfs[kMetaCf], kHeadSeqKey, BE64(0)).ok());
    RC_CHECK(batch.Put(rocks_->cfs[kMetaCf], kHeadHashKey, std::string(32, '\0')).ok());
    return WriteAtOpen("the write of schema_version and the empty head", std::move(batch),
                       /*sync=*/true);
  }
  if (s.IsNotFound()) {
    return Status::Corruption("journal at " + path_ +
                              " has no schema_version (damaged, or not a journal)");
  }
  if (!s.ok()) return FromRocks(s, "read schema_version in " + path_);
  if (version.size() != 8 || ParseBE64(version) == 0) {
    return Status::Corruption("journal at " + path_ + " has a malformed schema_version");
  }
  stored_schema_version_ = ParseBE64(version);
  if (stored_schema_version_ > kSchemaVersion) {
    return Status::InvalidArgument(
        "journal at " + path_ + " was written by a newer rolloutcore (schema " +
        std::to_string(stored_schema_version_) + "; this one reads up to " +
        std::to_string(kSchemaVersion) + "): its records may hold fields this one would drop");
  }
  return Status::OK();
}

// A writer about to append records of this binary's schema says so first, so that an older
// binary refuses the journal instead of reading those records without their new fields.
Status RocksJournal::StampSchemaVersion() {
  if (stored_schema_version_ >= kSchemaVersion) return Status::OK();
  rocksdb::WriteBatch batch;
  RC_CHECK(batch.Put(rocks_->cfs[kMetaCf], kSchemaKey, BE64(kSchemaVersion)).ok());
  RC_RETURN_IF_ERROR(WriteAtOpen("the write of schema_version", std::move(batch), /*sync=*/true));
  stored_schema_version_ = kSchemaVersion;
  return Status::OK();
}

Status RocksJournal::LoadHead() {
  Result<Loaded> loaded = LoadFromDb(/*strict=*/!options_.read_only);
  if (!loaded.ok()) {
    return Status(loaded.status().code(), "journal at " + path_ + ": " + loaded.status().message());
  }
  std::lock_guard<std::mutex> l(mu_);
  legacy_snapshot_passed_ = loaded->legacy_snapshot_passed;
  fleet_ = std::move(loaded->fleet);
  head_seq_ = durable_seq_ = loaded->head_seq;
  head_hash_ = durable_hash_ = loaded->head_hash;
  recovery_.head_seq = head_seq_;
  return Status::OK();
}

// A mark file (`what`), absent or whole: one larger than a mark or not exactly one is damage.
Result<std::optional<ClosedMark>> RocksJournal::ReadMark(const char* name, const char* title,
                                                         const std::string& what) {
  const std::string file = path_ + "/" + name;
  const rocksdb::Status exists = env_->FileExists(file);
  if (exists.IsNotFound()) return std::optional<ClosedMark>();
  std::uint64_t bytes = 0;
  rocksdb::Status s = exists.ok() ? env_->GetFileSize(file, &bytes) : exists;
  if (!s.ok()) return FromRocks(s, "read " + what + " " + file);
  if (bytes > kClosedMarkBytesMax) {
    return Status::Corruption("journal at " + path_ + ": " + what + " " + file + " is " +
                              std::to_string(bytes) + " bytes; one is at most " +
                              std::to_string(kClosedMarkBytesMax));
  }
  std::string text;
  s = rocksdb::ReadFileToString(env_, file, &text);
  if (!s.ok()) return FromRocks(s, "read " + what + " " + file);
  std::optional<ClosedMark> mark = DecodeMark(title, text);
  if (!mark.has_value()) {
    return Status::Corruption("journal at " + path_ + ": " + what + " " + file + " is malformed");
  }
  return mark;
}

// Records up to the durable mark were acknowledged: a journal that ends before it, or holds
// other records there, lost acknowledged records (a WAL cut or removed, a CURRENT or MANIFEST
// older than the journal's files), which its open would otherwise take for a crash's torn tail.
// A clean close records where the journal ended. Both are read before the records.
Status RocksJournal::ReadMarks() {
  Result<std::optional<ClosedMark>> closed =
      ReadMark(kClosedFile, kClosedTitle, "the clean-close record");
  if (!closed.ok()) return closed.status();
  Result<std::optional<ClosedMark>> durable =
      ReadMark(kDurableFile, kDurableTitle, "the durable mark");
  if (!durable.ok()) return durable.status();
  closed_mark_ = *closed;
  durable_mark_ = *durable;
  return Status::OK();
}

Status RocksJournal::CheckRecordsReach(const ClosedMark& m, std::uint64_t head,
                                       const std::string& mark) {
  const std::string was = "seq " + std::to_string(m.seq) + " (hash " + HashHex(m.hash) +
                          ") was durable, as " + mark + " records";
  if (m.seq > head) {
    return Status::Corruption("journal at " + path_ + " holds records through seq " +
                              std::to_string(head) + " but " + was + ": records " +
                              std::to_string(head + 1) + ".." + std::to_string(m.seq) +
                              " were lost after they were acknowledged (a WAL file cut or removed, "
                              "or a CURRENT or MANIFEST older than the journal's files); refusing "
                              "to open (never auto-repaired)");
  }
  Result<Hash> at = HashAt(m.seq, mark);
  if (!at.ok()) return at.status();
  if (*at == m.hash) return Status::OK();
  return Status::Corruption("journal at " + path_ + ": " + was +
                            ", but the record there hashes to " + HashHex(*at) +
                            ": the journal's records are not the ones acknowledged");
}

Status RocksJournal::CheckDurableMark(std::uint64_t head) {
  if (!durable_mark_) return Status::OK();
  return CheckRecordsReach(*durable_mark_, head, std::string("its durable mark ") + kDurableFile);
}

Status RocksJournal::CheckClosedMark(std::uint64_t head, const Hash& head_hash) const {
  if (!closed_mark_ || (head == closed_mark_->seq && head_hash == closed_mark_->hash)) {
    return Status::OK();
  }
  return Status::Corruption(
      "journal at " + path_ + " was closed at seq " + std::to_string(closed_mark_->seq) + " hash " +
      HashHex(closed_mark_->hash) + " but holds only " + std::to_string(head) +
      " records (head hash " + HashHex(head_hash) + ")");
}

namespace {

// A file and its .tmp (never read: only the rename makes the file), removed and the directory
// synced; `what` names them.
Status RemoveFilesSynced(rocksdb::Env* env, const std::string& path, const char* name,
                         const char* tmp_name, const std::string& what) {
  bool removed = false;
  for (const char* each : {name, tmp_name}) {
    const std::string file = path + "/" + each;
    const rocksdb::Status exists = env->FileExists(file);
    if (exists.IsNotFound()) continue;
    RC_RETURN_IF_ERROR(FromRocks(exists, "look for " + file));
    RC_RETURN_IF_ERROR(FromRocks(env->DeleteFile(file), "remove " + what + " " + file));
    removed = true;
  }
  if (!removed) return Status::OK();
  std::unique_ptr<rocksdb::Directory> dir;
  RC_RETURN_IF_ERROR(FromRocks(env->NewDirectory(path, &dir), "open directory " + path));
  return FromRocks(dir->Fsync(), "sync directory " + path);
}

}  // namespace

// Before the writer accepts appends, as an open-time step. The step holds the database too, so
// that a stuck removal leaves its close to the step's thread (RocksDb).
Status RocksJournal::RemoveClosedMark() {
  return OpenStep(
      "the removal of the clean-close record", [env = env_, path = path_, rocks = rocks_] {
        (void)rocks;  // held, not used
        return RemoveFilesSynced(env, path, kClosedFile, kClosedTmpFile, "the clean-close record");
      });
}

// `batch` written (WAL synced when `sync`) as an open-time step; `what` names it.
Status RocksJournal::WriteAtOpen(const std::string& what, rocksdb::WriteBatch batch,
                                 bool sync) const {
  return OpenStep(what, [rocks = rocks_, batch = std::move(batch), sync, what]() mutable {
    rocksdb::WriteOptions wo;
    wo.sync = sync;
    return FromRocks(rocks->db->Write(wo, &batch), what);
  });
}

// A journal whose newest snapshot is of an older format refolded past it: the fleet is
// snapshotted at the head now, so that the next open does not refold again.
Status RocksJournal::SnapshotPastOlderFormat() {
  if (!legacy_snapshot_passed_ || head_seq_ == 0 || options_.snapshot_every == 0) {
    return Status::OK();
  }
  Result<std::string> bytes = SnapshotBytes(head_seq_, fleet_);
  // Too large to decode: the fold keeps starting lower, as when StageGroup skips a snapshot.
  if (bytes.status().code() == Code::kInvalidArgument) {
    std::fprintf(stderr, "rolloutcore: journal: %s\n", bytes.status().message().c_str());
    return Status::OK();
  }
  if (!bytes.ok()) return bytes.status();
  rocksdb::WriteBatch batch;
  RC_CHECK(batch.Put(rocks_->cfs[kSnapshotsCf], FleetSnapshotKey(head_seq_), *bytes).ok());
  return WriteAtOpen("the write of the snapshot at seq " + std::to_string(head_seq_),
                     std::move(batch), options_.sync);
}

// Compares each WAL recovery read with its size on disk before the open: the difference is a
// tail recovery dropped. What is knowable: the file, the bytes, the last seq recovered. The seqs
// of a torn group are not (its batch is unreadable); they would follow the recovered head. The
// sentence names them first: it is recorded cut to a bound, and the journal's path (any length)
// comes last (ReportTornTails).
void RocksJournal::CheckWalTail(const std::map<std::uint64_t, std::uint64_t>& wals_before,
                                std::uint64_t head) {
  const WalReplay& wal_replay = rocks_->wal_replay;
  if (!wal_replay.min_log().has_value()) return;  // nothing was replayed (no WAL read)
  std::string detail;
  for (const auto& [number, size] : wals_before) {
    if (number < *wal_replay.min_log()) continue;  // flushed before: recovery does not read it
    const std::uint64_t read = wal_replay.read_bytes(number);
    if (size == read) continue;
    if (!detail.empty()) detail += "; ";
    if (size < read) {
      detail += WalName(number) + ": recovery read " + std::to_string(read) + " bytes of a " +
                std::to_string(size) + "-byte file (framing not understood; tail unknown)";
      continue;
    }
    found_.bytes_unread += size - read;
    detail += WalName(number) + ": " + std::to_string(size - read) + " of " + std::to_string(size) +
              " bytes after its last complete batch could not be read";
  }
  if (detail.empty()) return;
  found_.sentence = JoinFindings(
      found_.sentence, "torn WAL tail: " + detail + "; recovered through seq " +
                           std::to_string(head) + "; records from seq " + std::to_string(head + 1) +
                           " on that the torn batch held, if any, are lost (unacknowledged "
                           "unless a client holds a later acknowledged head)");
}

// The tables an open that died left holding an unacknowledged tail (CheckObsoleteTables) are
// reported as a torn tail is: records past the head were lost, unacknowledged as far as the marks
// tell. The writer's open lets RocksDB delete them (and keeps the finding: KeepTornTail); a
// read-only open leaves them.
void RocksJournal::NoteUnackedTables() {
  const UnackedTables& t = unacked_tables_;
  if (t.count == 0) return;
  const std::string names =
      t.names + (t.count > UnackedTables::kUnackedTablesNamedMax ? ", ..." : "");
  found_.sentence = JoinFindings(
      found_.sentence,
      "unacknowledged tail in tables an open that died left: " + std::to_string(t.count) +
          " table file" + (t.count == 1 ? "" : "s") + " (" + names + ") held " + t.seqs.Name() +
          ", past the head seq " + std::to_string(t.head) +
          " and every mark, which the WAL they were recovered from lost (unacknowledged unless a "
          "client holds a later acknowledged head); a writer's open deletes them");
}

// The finding an earlier writer's open kept (KeepTornTail), if any: a value that is not one is
// damage.
Status RocksJournal::ReadKeptTornTail() {
  kept_ = {};
  std::string v;
  const rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kOpenTornTailKey, &v);
  if (s.IsNotFound()) return ReadMovedFound();
  if (!s.ok()) return FromRocks(s, std::string("read ") + kOpenTornTailKey + " in " + path_);
  if (v.size() <= 8 || v.size() > 8 + kKeptTornTailBytesMax ||
      ParseBE64(std::string_view(v).substr(0, 8)) > kTornTailBytesUnreadMax) {
    return Status::Corruption("journal at " + path_ + ": meta " + kOpenTornTailKey + " of " +
                              std::to_string(v.size()) +
                              " bytes is not a kept torn tail (bytes unread and a sentence)");
  }
  kept_ = TornFinding{ParseBE64(std::string_view(v).substr(0, 8)), v.substr(8)};
  return ReadMovedFound();
}

// TORN_TAIL's finding is already in open_torn_tail when kMovedFoundKey holds its SHA-256 (a
// writer's open died between keeping it and removing the file): not pending, not reported twice.
Status RocksJournal::ReadMovedFound() {
  std::string v;
  const rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kMovedFoundKey, &v);
  if (s.IsNotFound()) return Status::OK();
  if (!s.ok()) return FromRocks(s, std::string("read ") + kMovedFoundKey + " in " + path_);
  const Hash file_hash = found_file_ ? Sha256(*found_file_) : Hash{};
  if (v.size() != file_hash.size()) {
    return Status::Corruption("journal at " + path_ + ": meta " + kMovedFoundKey + " of " +
                              std::to_string(v.size()) + " bytes is not a SHA-256");
  }
  if (found_file_ && std::memcmp(v.data(), file_hash.data(), file_hash.size()) == 0) {
    pending_ = {};
  }
  return Status::OK();
}

// TORN_TAIL, absent or whole (bounded, exactly one finding's encoding): anything else is damage.
Status RocksJournal::ReadFoundFile() {
  pending_ = {};
  found_file_.reset();
  const std::string file = path_ + "/" + kFoundFile;
  const rocksdb::Status exists = env_->FileExists(file);
  if (exists.IsNotFound()) return Status::OK();
  std::uint64_t bytes = 0;
  rocksdb::Status s = exists.ok() ? env_->GetFileSize(file, &bytes) : exists;
  // A writer beside this reader removes the file once its finding is kept: gone is absent.
  if (s.IsNotFound() || s.IsPathNotFound()) return Status::OK();
  if (!s.ok()) return FromRocks(s, "read the torn tail found " + file);
  if (bytes > kFoundFileBytesMax) {
    return Status::Corruption("journal at " + path_ + ": the torn tail found " + file + " is " +
                              std::to_string(bytes) + " bytes; one is at most " +
                              std::to_string(kFoundFileBytesMax));
  }
  std::string text;
  s = rocksdb::ReadFileToString(env_, file, &text);
  if (s.IsNotFound() || s.IsPathNotFound()) return Status::OK();
  if (!s.ok()) return FromRocks(s, "read the torn tail found " + file);
  std::optional<TornFinding> found = DecodeFoundFile(text);
  if (!found.has_value()) {
    return Status::Corruption("journal at " + path_ + ": the torn tail found " + file +
                              " is malformed");
  }
  pending_ = std::move(*found);
  found_file_ = std::move(text);
  return Status::OK();
}

// An earlier writer's open that died before RocksDB's open recovered the WAL leaves the same torn
// tail for this open to find: one finding, reported once.
// One that died after writing its own finding joined with an earlier one (KeptFinding) leaves
// that join: its own part is found again, and only the earlier part stays pending.
void RocksJournal::DropPendingFoundAgain() {
  if (found_.sentence.empty()) return;
  if (SameFinding(pending_, KeptFinding(found_, {}))) {
    pending_ = {};
    return;
  }
  const std::string own = text::utf8_prefix(found_.sentence, kKeptFindingHalfBytes) + " | ";
  if (pending_.sentence.size() > own.size() && pending_.sentence.compare(0, own.size(), own) == 0 &&
      pending_.bytes_unread >= found_.bytes_unread) {
    pending_ = TornFinding{pending_.bytes_unread - found_.bytes_unread,
                           pending_.sentence.substr(own.size())};
  }
}

// What TORN_TAIL must hold: this open's finding first, then one an earlier open's check kept
// there, each cut to half the bound when both are present.
TornFinding RocksJournal::FindingToKeep() const {
  if (pending_.sentence.empty()) return KeptFinding(found_, {});  // cut as TORN_TAIL holds it
  if (found_.sentence.empty()) return pending_;
  return KeptFinding(found_, pending_);
}

// The writer's check finds what RocksDB's open would lose on the read-only view (the same WAL
// replay, the tables it would delete) and keeps it in TORN_TAIL, synced with its rename, before
// that open: a crash or error anywhere after it leaves the finding for every later open. An
// open-time step holding the LOCK, so that no other writer rewrites TORN_TAIL.tmp under a write
// left running past its deadline.
Status RocksJournal::FindBeforeWriting(const std::shared_ptr<HeldLock>& held) {
  found_ = {};
  Result<std::uint64_t> head = ViewHead();
  if (!head.ok()) return head.status();
  CheckWalTail(wals_at_open_, *head);
  NoteUnackedTables();
  RC_RETURN_IF_ERROR(ReadKeptTornTail());
  DropPendingFoundAgain();
  const TornFinding keep = FindingToKeep();
  if (keep.sentence.empty()) return Status::OK();
  const std::string text = EncodeFoundFile(keep);
  if (found_file_ == text) return Status::OK();
  RC_RETURN_IF_ERROR(
      OpenStep("the write of the torn tail it found", [env = env_, path = path_, held, text] {
        (void)held;  // held, not used
        std::unique_ptr<rocksdb::Directory> dir;
        RC_RETURN_IF_ERROR(FromRocks(env->NewDirectory(path, &dir), "open directory " + path));
        return FromRocks(WriteMarkFile(env, dir.get(), path, kFoundTmpFile, kFoundFile, text),
                         "write the torn tail found " + path + "/" + kFoundFile);
      }));
  found_file_ = text;
  return Status::OK();
}

// TORN_TAIL once open_torn_tail keeps its finding: an open-time step holding the database.
Status RocksJournal::RemoveFoundFile() {
  RC_RETURN_IF_ERROR(
      OpenStep("the removal of the torn tail found", [env = env_, path = path_, rocks = rocks_] {
        (void)rocks;  // held, not used
        return RemoveFilesSynced(env, path, kFoundFile, kFoundTmpFile, "the torn tail found");
      }));
  found_file_.reset();
  return Status::OK();
}

// What this open found, then what an earlier writer's open found (TORN_TAIL) or kept and no
// executor's start recorded yet, then the journal's path.
void RocksJournal::ReportTornTails() {
  const std::string kept = JoinFindings(pending_.sentence, kept_.sentence);
  const std::string earlier = kept.empty() ? "" : kEarlierFinding + kept;
  const std::string all = JoinFindings(found_.sentence, earlier);
  recovery_.wal_bytes_unread = found_.bytes_unread + pending_.bytes_unread + kept_.bytes_unread;
  recovery_.torn_tail = all.empty() ? "" : all + " (journal at " + path_ + ")";
}

// A torn tail the writer's check found (TORN_TAIL) is kept (synced) in the meta key before the
// writer accepts appends, with one an earlier open kept, and only then is TORN_TAIL removed:
// RocksDB's open made the torn WAL (or the dead open's tables) obsolete, so until an executor's
// start records the finding and forgets it (ForgetRecordedTornTail), the meta key is its only
// trace. The file's SHA-256 is kept with it: a crash before the removal reports it once.
// Open-time steps (WriteAtOpen, RemoveFoundFile).
Status RocksJournal::KeepTornTail() {
  torn_tail_kept_ = !kept_.sentence.empty();
  const TornFinding keep = FindingToKeep();
  if (keep.sentence.empty()) return found_file_ ? RemoveFoundFile() : Status::OK();
  RC_CHECK(found_file_.has_value());  // FindBeforeWriting wrote it, or an earlier open did
  rocksdb::WriteBatch batch;
  RC_CHECK(
      batch.Put(rocks_->cfs[kMetaCf], kOpenTornTailKey, EncodeTornFinding(KeptFinding(keep, kept_)))
          .ok());
  const Hash moved = Sha256(*found_file_);
  RC_CHECK(batch
               .Put(rocks_->cfs[kMetaCf], kMovedFoundKey,
                    std::string(reinterpret_cast<const char*>(moved.data()), moved.size()))
               .ok());
  RC_RETURN_IF_ERROR(
      WriteAtOpen("the write of the torn tail it found", std::move(batch), /*sync=*/true));
  torn_tail_kept_ = true;
  return RemoveFoundFile();
}

// The finding kept is removed (synced) under the commit deadline, as an open-time step is: a
// removal that fails or stalls fails the journal as a failed commit does.
Status RocksJournal::ForgetRecordedTornTail() {
  {
    std::lock_guard<std::mutex> l(mu_);
    RC_RETURN_IF_ERROR(Usable());
    if (!torn_tail_kept_) return Status::OK();
  }
  const Status removed =
      RunBounded(options_.commit_stall_timeout_ms, path_, "the removal of the kept torn tail",
                 [rocks = rocks_] {
                   rocksdb::WriteOptions wo;
                   wo.sync = true;
                   rocksdb::WriteBatch batch;
                   RC_CHECK(batch.Delete(rocks->cfs[kMetaCf], kOpenTornTailKey).ok());
                   RC_CHECK(batch.Delete(rocks->cfs[kMetaCf], kMovedFoundKey).ok());
                   return FromRocks(rocks->db->Write(wo, &batch), "remove the kept torn tail");
                 });
  if (removed.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    torn_tail_kept_ = false;
    return Status::OK();
  }
  const std::string& msg = removed.message();
  Stop(Status(removed.code(), msg.find(path_) != std::string::npos
                                  ? msg
                                  : "journal at " + path_ + " failed: " + msg));
  return failure();
}

Result<std::uint64_t> RocksJournal::ReadHeadSeq() {
  std::string v;
  rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kHeadSeqKey, &v);
  // Every journal has a head from its creation (0 when empty): a missing one is lost, never 0.
  if (s.IsNotFound())
    return Status::Corruption("meta head_seq is missing: the journal's head is lost");
  if (!s.ok()) return FromRocks(s, "read head_seq");
  if (v.size() != 8) return Status::Corruption("meta head_seq is not 8 bytes");
  return ParseBE64(v);
}

Result<Hash> RocksJournal::HashAt(std::uint64_t seq, const std::string& claim) {
  if (seq == 0) return Hash{};
  Result<Record> r = ReadExpected(seq, claim);
  if (!r.ok()) return r.status();
  return r->hash;
}

// A group's snapshot is written in the group's batch, with the head: one past the head means the
// records up to it (and the head that counted them) were lost while it survived, e.g. a cut WAL
// beside flushed SST files. The last snapshot key alone tells.
Status RocksJournal::CheckNoSnapshotPastHead(std::uint64_t head_seq) {
  std::unique_ptr<rocksdb::Iterator> it(
      rocks_->db->NewIterator(rocksdb::ReadOptions(), rocks_->cfs[kSnapshotsCf]));
  it->SeekToLast();
  if (!it->Valid()) return FromRocks(it->status(), "seek the last snapshot");
  const std::string_view key = View(it->key());
  if (key.size() < 8) {
    return Status::Corruption("snapshot key of " + std::to_string(key.size()) +
                              " bytes is not a seq and its tag");
  }
  const std::uint64_t seq = ParseBE64(key.substr(0, 8));
  if (seq <= head_seq) return Status::OK();
  return Status::Corruption("snapshot at seq " + std::to_string(seq) + " lies past the head seq " +
                            std::to_string(head_seq) + ": records " + std::to_string(head_seq + 1) +
                            ".." + std::to_string(seq) +
                            " were written and then lost (a cut or lost WAL)");
}

namespace {

// The fold starts from a snapshot only if the record at its seq is the one the snapshot was folded
// to: one copied from another journal, or left by a damaged or partly restored one, would start
// the process from a state these records never reached. A snapshot written before v9 carries no
// chain hash; for it, what is checked is only that the record at its seq exists and decodes, that
// it counts the events its key says, that its state keeps the fold's rules, and that the records
// after it chain from that record and apply to it (a snapshot copied from another journal's same
// seq can pass those).
Status CheckSnapshotChain(std::uint64_t seq, const std::optional<Hash>& carried,
                          const Hash& record_hash) {
  if (!carried.has_value() || *carried == record_hash) return Status::OK();
  return Status::Corruption(
      "snapshot at seq " + std::to_string(seq) + " carries the chain hash " + HashHex(*carried) +
      " but the record at seq " + std::to_string(seq) + " hashes to " + HashHex(record_hash) +
      ": the snapshot is not of this journal's records (copied from another journal, or left by "
      "a damaged or partial restore); refusing to start from it (never auto-repaired)");
}

}  // namespace

Result<Loaded> RocksJournal::LoadFromDb(bool strict) {
  Result<std::uint64_t> head = ReadHeadSeq();
  if (!head.ok()) return head.status();
  RC_RETURN_IF_ERROR(CheckNoSnapshotPastHead(*head));
  Loaded out;
  out.head_seq = *head;
  Result<std::optional<FleetSnapshot>> snapshot =
      LatestSnapshot(out.head_seq, &out.legacy_snapshot_passed);
  if (!snapshot.ok()) return snapshot.status();
  std::optional<Hash> chain_hash;
  if (snapshot->has_value()) {
    out.snapshot_seq = (*snapshot)->events;
    chain_hash = (*snapshot)->chain_hash;
    out.fleet = std::move((*snapshot)->fleet);
  }
  Result<Hash> prev =
      HashAt(out.snapshot_seq, "the snapshot at seq " + std::to_string(out.snapshot_seq));
  if (!prev.ok()) return prev.status();
  if (strict) RC_RETURN_IF_ERROR(CheckSnapshotChain(out.snapshot_seq, chain_hash, *prev));
  out.head_hash = *prev;
  RC_RETURN_IF_ERROR(ScanRange(out.snapshot_seq + 1, out.head_seq, *prev, [&](const Record& r) {
    Status st = fleet_apply(out.fleet, FleetEvent{r.engine, r.event});
    if (!st.ok()) {
      return Status::Corruption("seq " + std::to_string(r.seq) + ": " + event_name(r.event) +
                                " does not apply to the folded state: " + st.ToString());
    }
    out.head_hash = r.hash;
    return Status::OK();
  }));
  // The stored head hash must match the chain, and nothing may exist past the head.
  std::string stored_hash;
  rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kHeadHashKey, &stored_hash);
  if (s.IsNotFound()) return Status::Corruption("meta head_hash is missing");
  if (!s.ok()) return FromRocks(s, "read head_hash");
  if (stored_hash.size() != 32 || std::memcmp(stored_hash.data(), out.head_hash.data(), 32) != 0) {
    return Status::Corruption("meta head_hash does not match the hash of seq " +
                              std::to_string(out.head_seq));
  }
  std::unique_ptr<rocksdb::Iterator> it(
      rocks_->db->NewIterator(rocksdb::ReadOptions(), rocks_->cfs[kEventsCf]));
  it->Seek(BE64(out.head_seq + 1));
  if (it->Valid()) {
    return Status::Corruption("record stored past the head seq " + std::to_string(out.head_seq));
  }
  RC_RETURN_IF_ERROR(FromRocks(it->status(), "scan events past head"));
  return out;
}

// The newest fleet snapshot at or below the head. Snapshots an older version wrote are passed
// over: 8-byte keys (one engine's State) lack the fleet's label order, and a named fleet's
// snapshot without `removed` may have dropped removed engines' counters. The fold restarts from
// the newest fleet snapshot before them, or from seq 1.
Result<std::optional<FleetSnapshot>> RocksJournal::LatestSnapshot(std::uint64_t head_seq,
                                                                  bool* legacy_passed) {
  rocksdb::ReadOptions ro;
  const std::string upper = BE64(head_seq + 1);
  rocksdb::Slice upper_slice(upper);
  ro.iterate_upper_bound = &upper_slice;
  std::unique_ptr<rocksdb::Iterator> it(rocks_->db->NewIterator(ro, rocks_->cfs[kSnapshotsCf]));
  for (it->SeekToLast(); it->Valid(); it->Prev()) {
    const std::string_view key = View(it->key());
    if (key.size() == 8) {
      *legacy_passed = true;
      continue;
    }
    if (key.size() != 9 || key[8] != kFleetSnapshotTag) {
      return Status::Corruption("snapshot key of " + std::to_string(key.size()) +
                                " bytes is not a seq and its tag");
    }
    const std::string at = "snapshot at seq " + std::to_string(ParseBE64(key.substr(0, 8)));
    Result<FleetSnapshot> snapshot = DecodeFleetState(View(it->value()));
    if (!snapshot.ok()) return Status::Corruption(at + ": " + snapshot.status().message());
    // The key's seq, the events the snapshot says it folded, and those its state counts agree.
    if (snapshot->events != ParseBE64(key.substr(0, 8)) ||
        snapshot->fleet.events != snapshot->events) {
      return Status::Corruption(at + " counts " + std::to_string(snapshot->fleet.events) +
                                " events, not the " + std::to_string(ParseBE64(key.substr(0, 8))) +
                                " records up to its seq");
    }
    if (!snapshot->counts_removed && snapshot->fleet.named) {
      *legacy_passed = true;
      continue;
    }
    return std::optional<FleetSnapshot>(std::move(snapshot.value()));
  }
  RC_RETURN_IF_ERROR(FromRocks(it->status(), "scan snapshots"));
  return std::optional<FleetSnapshot>();
}

Status RocksJournal::Usable() const {
  CheckStall();
  if (!failed_.ok()) return failed_;
  // Once closing, no group is queued: the committer's last pass may already have run.
  if (stopping_) return Status::Unavailable("journal at " + path_ + " is closing");
  if (options_.read_only)
    return Status::InvalidArgument("journal at " + path_ + " is open read-only");
  return Status::OK();
}

Result<std::optional<IdemEntry>> RocksJournal::FindIdem(const std::string& key) {
  if (auto it = idem_pending_.find(key); it != idem_pending_.end()) {
    return std::optional<IdemEntry>(it->second);
  }
  std::string v;
  rocksdb::Status s = rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kIdemCf], key, &v);
  if (s.IsNotFound()) return std::optional<IdemEntry>();
  if (!s.ok()) return FromRocks(s, "read idempotency key");
  if (v.size() != 48) return Status::Corruption("idempotency entry for '" + key + "' is malformed");
  IdemEntry e;
  e.first_seq = ParseBE64(std::string_view(v).substr(0, 8));
  e.last_seq = ParseBE64(std::string_view(v).substr(8, 8));
  std::memcpy(e.digest.data(), v.data() + 16, 32);
  RC_RETURN_IF_ERROR(CheckIdemSeqs(key, e));
  return std::optional<IdemEntry>(std::move(e));
}

// A stored entry names one durable group: its seqs are read back (and copied, under the lock)
// for every retry of its key, so a damaged range is refused before anything is read.
Status RocksJournal::CheckIdemSeqs(const std::string& key, const IdemEntry& e) const {
  if (e.first_seq >= 1 && e.first_seq <= e.last_seq && e.last_seq <= durable_seq_ &&
      e.last_seq - e.first_seq < kGroupEventsMax) {
    return Status::OK();
  }
  return Status::Corruption("idempotency entry for '" + key + "' names seqs " +
                            std::to_string(e.first_seq) + ".." + std::to_string(e.last_seq) +
                            ", not one group of the durable journal 1.." +
                            std::to_string(durable_seq_));
}

Result<Ticket> RocksJournal::EnqueueLocked(const AppendRequest& request,
                                           const std::vector<FleetEvent>& group, bool decided,
                                           std::vector<FleetEvent>* original_decisions) {
  RC_RETURN_IF_ERROR(Usable());
  if (group.empty()) return Status::InvalidArgument("append of an empty group");
  if (group.size() > kGroupEventsMax) {
    return Status::InvalidArgument("group of " + std::to_string(group.size()) + " events exceeds " +
                                   std::to_string(kGroupEventsMax));
  }
  RC_RETURN_IF_ERROR(CheckKeySize(request.client_event_id));
  // Idempotency first: a retried group answers with its original seqs even if the head moved.
  Hash digest{};
  if (!request.client_event_id.empty()) {
    digest = GroupDigest(group);
    Result<std::optional<IdemEntry>> found = FindIdem(request.client_event_id);
    if (!found.ok()) return found.status();
    if (found->has_value()) {
      return DuplicateTicket(request.client_event_id, **found, digest, original_decisions);
    }
  }
  if (request.expected_head_seq.has_value() && *request.expected_head_seq != head_seq_) {
    return Status::Conflict("expected head seq " + std::to_string(*request.expected_head_seq) +
                            " but the head is " + std::to_string(head_seq_));
  }
  RC_RETURN_IF_ERROR(CheckQueueRoom(group.front().event));
  RC_RETURN_IF_ERROR(CheckRolloutIdsUnused(group));
  if (!decided) RC_RETURN_IF_ERROR(CheckDecisions(group));
  Result<EncodedGroup> encoded = EncodeGroup(request.wall_time_ms, group);
  if (!encoded.ok()) return encoded.status();
  FoldGroup(group);
  const Ticket ticket = StageGroup(request.client_event_id, digest, group, *encoded);
  if (original_decisions != nullptr) original_decisions->assign(group.begin() + 1, group.end());
  return ticket;
}

// The answer to a retried idempotency key: the original seqs (and decisions), or Conflict.
Result<Ticket> RocksJournal::DuplicateTicket(const std::string& key, const IdemEntry& e,
                                             const Hash& digest,
                                             std::vector<FleetEvent>* original_decisions) {
  if (e.digest != digest) {
    return Status::Conflict("client_event_id '" + key + "' was used for seqs " +
                            std::to_string(e.first_seq) + ".." + std::to_string(e.last_seq) +
                            " with different events");
  }
  if (original_decisions != nullptr) {
    Result<std::vector<FleetEvent>> original = IdemGroup(e);
    if (!original.ok()) return original.status();
    original_decisions->assign(original->begin() + 1, original->end());
  }
  Hash last_hash = e.last_hash;
  if (e.batch_id == 0) {
    Result<Record> last = ReadExpected(e.last_seq, "idempotency key '" + key + "'");
    if (!last.ok()) return last.status();
    last_hash = last->hash;
  }
  return Ticket{AppendResult{e.first_seq, e.last_seq, last_hash, true}, e.batch_id};
}

Result<std::vector<FleetEvent>> RocksJournal::IdemGroup(const IdemEntry& e) {
  if (e.batch_id != 0) return e.group;
  std::vector<FleetEvent> group;
  const std::string claim = "the idempotency entry of seqs " + std::to_string(e.first_seq) + ".." +
                            std::to_string(e.last_seq);
  for (std::uint64_t seq = e.first_seq; seq <= e.last_seq; ++seq) {
    Result<Record> r = ReadExpected(seq, claim);
    if (!r.ok()) return r.status();
    group.push_back(FleetEvent{r->engine, r->event});
  }
  return group;
}

// events[1..] must be exactly what the fold decides for events[0].
Status RocksJournal::CheckDecisions(const std::vector<FleetEvent>& group) const {
  Result<std::vector<FleetEvent>> d = fleet_decide(fleet_, group[0]);
  if (!d.ok()) return d.status();
  RC_RETURN_IF_ERROR(check_new_requests(fleet_, group[0]));  // a new group: today's rules
  if (d->size() == group.size() - 1 && std::equal(d->begin(), d->end(), group.begin() + 1)) {
    return Status::OK();
  }
  return Status::InvalidArgument(std::string("events after the input ") +
                                 event_name(group[0].event) +
                                 " are not its decisions: decide gives " + SeqList(*d, 0) +
                                 ", the group has " + SeqList(group, 1));
}

// Encodes before anything changes, so that a refusal (a record over the bound) changes nothing.
Result<RocksJournal::EncodedGroup> RocksJournal::EncodeGroup(std::int64_t wall_time_ms,
                                                             const std::vector<FleetEvent>& group,
                                                             EncodedGroup out) const {
  RC_CHECK(out.records.size() == out.hashes.size() && out.records.size() <= group.size());
  const std::uint64_t first_seq = head_seq_ + 1;
  out.records.reserve(group.size());
  out.hashes.reserve(group.size());
  Hash prev = out.hashes.empty() ? head_hash_ : out.hashes.back();
  std::size_t bytes = 0;
  for (const std::string& done : out.records) bytes += done.size();
  for (std::size_t i = out.records.size(); i < group.size(); ++i) {
    Record r;
    r.seq = first_seq + i;
    r.wall_time_ms = wall_time_ms;
    r.cause_seq = i == 0 ? 0 : first_seq;
    r.prev_hash = prev;
    r.event = group[i].event;
    r.engine = group[i].engine;
    out.records.push_back(EncodeRecord(r));
    if (out.records.back().size() > kRecordBytesMax) {
      return Status::InvalidArgument(std::string(event_name(r.event)) + " encodes to " +
                                     std::to_string(out.records.back().size()) + " bytes, over " +
                                     std::to_string(kRecordBytesMax));
    }
    bytes += out.records.back().size();
    if (bytes > kGroupBytesMax) {
      return Status::InvalidArgument("a group of " + std::to_string(group.size()) +
                                     " events encodes to more than " +
                                     std::to_string(kGroupBytesMax) + " bytes");
    }
    prev = Sha256(out.records.back());
    out.hashes.push_back(prev);
  }
  return out;
}

Result<bool> RocksJournal::KeyHeld(const std::string& key) {
  if (key.empty()) return Status::InvalidArgument("an idempotency key must not be empty");
  RC_RETURN_IF_ERROR(CheckKeySize(key));
  std::lock_guard<std::mutex> l(mu_);
  Result<std::optional<IdemEntry>> found = FindIdem(key);
  if (!found.ok()) return found.status();
  return found->has_value();
}

Status RocksJournal::CheckKeySize(const std::string& key) {
  if (key.size() <= kIdBytesMax) return Status::OK();
  return Status::InvalidArgument("client_event_id exceeds " + std::to_string(kIdBytesMax) +
                                 " bytes");
}

namespace {

// The tiers of journal.h's kControlGroupsReserve.
std::size_t QueueRoomFor(const Event& input) {
  if (std::holds_alternative<RolloutAdmitted>(input)) return kPendingAppendsMax;
  if (family_of(input) == Family::kBinding) return kPendingAppendsMax + kControlGroupsReserve;
  return kPendingAppendsMax + 2 * kControlGroupsReserve;
}

}  // namespace

Status RocksJournal::CheckQueueRoom(const Event& input) const {
  const std::size_t room = QueueRoomFor(input);
  if (pending_groups_ < room) return Status::OK();
  return Status::Busy("group-commit queue full (" + std::to_string(room) + " groups pending)");
}

// fleet_decide already applied these to a copy, so they must apply.
void RocksJournal::FoldGroup(const std::vector<FleetEvent>& group) {
  for (const FleetEvent& e : group) {
    Status st = fleet_apply(fleet_, e);
    if (!st.ok()) std::fprintf(stderr, "rolloutcore: journal apply: %s\n", st.ToString().c_str());
    RC_CHECK(st.ok());
  }
}

// Stages a group the fold already holds (fleet_.events counts it).
Ticket RocksJournal::StageGroup(const std::string& key, const Hash& digest,
                                const std::vector<FleetEvent>& group, const EncodedGroup& encoded) {
  const std::uint64_t first_seq = head_seq_ + 1;
  const std::uint64_t last_seq = head_seq_ + group.size();
  for (std::size_t i = 0; i < group.size(); ++i) {
    StageRecord(first_seq + i, group[i].event, encoded.records[i]);
  }
  if (!key.empty()) {
    IdemEntry entry{first_seq, last_seq, digest, open_batch_id_, group, encoded.hashes.back()};
    RC_CHECK(open_batch_.Put(rocks_->cfs[kIdemCf], key, EncodeIdem(entry)).ok());
    idem_pending_[key] = std::move(entry);
  }
  const std::uint64_t every = options_.snapshot_every;
  if (every > 0 && (head_seq_ / every) != (last_seq / every)) {
    RC_CHECK(fleet_.events == last_seq);
    // A snapshot past the decoder's bound is not written (it would fail the next open): the
    // fold restarts from an earlier one. It carries the hash of its seq's record, which the open
    // compares with that record.
    std::string snapshot = EncodeFleetState(fleet_, last_seq, encoded.hashes.back());
    if (snapshot.size() <= kFleetStateBytesMax) {
      RC_CHECK(
          open_batch_.Put(rocks_->cfs[kSnapshotsCf], FleetSnapshotKey(last_seq), snapshot).ok());
    } else {
      std::fprintf(stderr, "rolloutcore: journal: snapshot at seq %llu not written: %zu bytes\n",
                   static_cast<unsigned long long>(last_seq), snapshot.size());
    }
  }
  head_seq_ = last_seq;
  head_hash_ = encoded.hashes.back();
  open_groups_++;  // committed once a waiter asks for it (Wait)
  pending_groups_++;
  return Ticket{AppendResult{first_seq, last_seq, head_hash_, false}, open_batch_id_};
}

void RocksJournal::StageRecord(std::uint64_t seq, const Event& event, const std::string& bytes) {
  RC_CHECK(open_batch_.Put(rocks_->cfs[kEventsCf], BE64(seq), bytes).ok());
  if (const std::string* rid = RolloutIdOf(event)) {
    RC_CHECK(open_batch_.Put(rocks_->cfs[kRolloutsCf], RolloutPrefix(*rid) + BE64(seq), "").ok());
  }
  if (const auto* admitted = std::get_if<RolloutAdmitted>(&event)) {
    RC_CHECK(
        open_batch_.Put(rocks_->cfs[kRolloutsCf], RolloutIdKey(admitted->rollout_id), BE64(seq))
            .ok());
    admitted_pending_[admitted->rollout_id] = PendingAdmission{seq, open_batch_id_};
  }
}

// Rollout ids are unique for the journal's life, fleet-wide: an admission of an id with any
// record in the journal (its first use is a point key) or admitted by a pending group is refused.
Status RocksJournal::CheckRolloutIdsUnused(const std::vector<FleetEvent>& group) {
  for (std::size_t i = 0; i < group.size(); ++i) {
    const auto* admitted = std::get_if<RolloutAdmitted>(&group[i].event);
    if (admitted == nullptr) continue;
    const std::string& id = admitted->rollout_id;
    if (id.empty() || id.size() > kIdBytesMax) {
      return Status::InvalidArgument("rollout_id must be 1.." + std::to_string(kIdBytesMax) +
                                     " bytes");
    }
    auto used_at = [&](std::uint64_t seq) {
      return Status::Conflict("rollout id '" + id + "' was already used at seq " +
                              std::to_string(seq));
    };
    for (std::size_t j = 0; j < i; ++j) {
      const auto* earlier = std::get_if<RolloutAdmitted>(&group[j].event);
      if (earlier != nullptr && earlier->rollout_id == id) return used_at(head_seq_ + 1 + j);
    }
    if (auto it = admitted_pending_.find(id); it != admitted_pending_.end())
      return used_at(it->second.seq);
    std::string v;
    const rocksdb::Status s =
        rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kRolloutsCf], RolloutIdKey(id), &v);
    if (s.ok()) {
      if (v.size() != 8)
        return Status::Corruption("rollout index entry for '" + id + "' is malformed");
      RC_RETURN_IF_ERROR(CheckIndexedAdmission(id, ParseBE64(v)));
      return used_at(ParseBE64(v));
    }
    if (!s.IsNotFound()) return FromRocks(s, "read rollout index");
  }
  return Status::OK();
}

// The rollout index vouches for an admission of `id` at `seq`: a seq past the head, or a record
// there that admits another id, is a damaged journal (the id's refusal would rest on nothing).
Status RocksJournal::CheckIndexedAdmission(const std::string& id, std::uint64_t seq) {
  const std::string claim = "the rollout index says '" + id + "' was admitted there";
  if (seq == 0 || seq > head_seq_) {
    return Status::Corruption("rollout index: '" + id + "' admitted at seq " + std::to_string(seq) +
                              ", past the head seq " + std::to_string(head_seq_));
  }
  Result<Record> r = ReadExpected(seq, claim);
  if (!r.ok()) return r.status();
  const auto* admitted = std::get_if<RolloutAdmitted>(&r->event);
  if (admitted == nullptr || admitted->rollout_id != id) {
    return Status::Corruption("the record at seq " + std::to_string(seq) +
                              " is not the admission " + "of '" + id + "' the rollout index names");
  }
  return Status::OK();
}

Result<Ticket> RocksJournal::Enqueue(const AppendRequest& request) {
  Result<std::vector<FleetEvent>> group = GroupOf(request);
  if (!group.ok()) return group.status();
  std::lock_guard<std::mutex> l(mu_);
  return EnqueueLocked(request, *group, /*decided=*/false, nullptr);
}

Result<Journal::Submitted> RocksJournal::Submit(const Event& input, std::int64_t wall_time_ms,
                                                const std::string& client_event_id) {
  if (is_fleet_event(input)) {
    return Status::InvalidArgument(std::string(event_name(input)) +
                                   " is a fleet's event: submit it with SubmitFleet");
  }
  Result<FleetSubmitted> fleet = SubmitFleet(FleetEvent{"", input}, wall_time_ms, client_event_id);
  if (!fleet.ok()) return fleet.status();
  Submitted out{fleet->ticket, {}};
  out.decisions.reserve(fleet->decisions.size());
  for (FleetEvent& d : fleet->decisions) {
    // The unnamed engine's input derives only its own decisions: it has no fleet to speak for.
    RC_CHECK(d.engine.empty() && !is_fleet_event(d.event));
    out.decisions.push_back(std::move(d.event));
  }
  return out;
}

Result<Journal::FleetSubmitted> RocksJournal::SubmitFleet(const FleetEvent& input,
                                                          std::int64_t wall_time_ms,
                                                          const std::string& client_event_id) {
  std::lock_guard<std::mutex> l(mu_);
  return SubmitFleetLocked(input, wall_time_ms, client_event_id);
}

Result<Journal::FleetSubmitted> RocksJournal::SubmitFleetIf(const FleetEvent& input,
                                                            std::int64_t wall_time_ms,
                                                            const Precondition& holds) {
  RC_CHECK(holds != nullptr);
  std::lock_guard<std::mutex> l(mu_);
  RC_RETURN_IF_ERROR(Usable());
  RC_RETURN_IF_ERROR(holds(fleet_));
  return SubmitFleetLocked(input, wall_time_ms, "");
}

Result<Journal::FleetSubmitted> RocksJournal::SubmitFleetLocked(
    const FleetEvent& input, std::int64_t wall_time_ms, const std::string& client_event_id) {
  RC_RETURN_IF_ERROR(Usable());
  // With an idempotency key, a retry must be recognised before deciding (the state moved on).
  Result<std::optional<IdemEntry>> found = std::optional<IdemEntry>();
  if (!client_event_id.empty()) found = FindIdem(client_event_id);
  if (!found.ok()) return found.status();
  if (found->has_value()) return ResubmitLocked(input, client_event_id, **found);
  AppendRequest request;
  request.client_event_id = client_event_id;
  request.wall_time_ms = wall_time_ms;
  std::vector<FleetEvent> group{input};
  Result<EncodedGroup> input_record = CheckSubmittable(group, request);
  if (!input_record.ok()) return FoldRefusesFirst(input, input_record.status());
  return StepAndStage(std::move(group), request, std::move(input_record.value()));
}

// What could refuse the input apart from the fold: the key's size, a full queue, a rollout id
// used before (an input's only; decisions admit nothing), and the input's record over the bound.
// Returns that record, encoded as the group's first.
Result<RocksJournal::EncodedGroup> RocksJournal::CheckSubmittable(
    const std::vector<FleetEvent>& group, const AppendRequest& request) {
  RC_CHECK(group.size() == 1);  // the input alone
  RC_RETURN_IF_ERROR(CheckKeySize(request.client_event_id));
  RC_RETURN_IF_ERROR(CheckQueueRoom(group[0].event));
  if (std::holds_alternative<RolloutAdmitted>(group[0].event)) {
    RC_RETURN_IF_ERROR(CheckRolloutIdsUnused(group));
  }
  return EncodeGroup(request.wall_time_ms, group);
}

// The fold speaks first, as it did when it decided before these checks: an input it refuses is
// answered with its reason (a caller tells a refusal from an unknown outcome by it), whatever
// else would refuse it. Only on a refusal, so the copy fleet_decide makes is off the hot path.
Status RocksJournal::FoldRefusesFirst(const FleetEvent& input, const Status& refused) const {
  Result<std::vector<FleetEvent>> d = fleet_decide(fleet_, input);
  return d.ok() ? refused : d.status();
}

// The fold takes the input in place (a refusal changes nothing). Its decisions are the fold's and
// bounded, so their records encode: one that did not would leave memory ahead of the journal.
Result<Journal::FleetSubmitted> RocksJournal::StepAndStage(std::vector<FleetEvent> group,
                                                           const AppendRequest& request,
                                                           EncodedGroup input_record) {
  Result<std::vector<FleetEvent>> d = fleet_step(fleet_, group[0]);
  if (!d.ok()) return d.status();
  group.insert(group.end(), d->begin(), d->end());
  RC_CHECK(group.size() <= kGroupEventsMax);  // the fold's bound (journal.h)
  Result<EncodedGroup> encoded = EncodeGroup(request.wall_time_ms, group, std::move(input_record));
  if (!encoded.ok()) {
    std::fprintf(stderr, "rolloutcore: journal: a decision does not encode: %s\n",
                 encoded.status().ToString().c_str());
  }
  RC_CHECK(encoded.ok());
  const Hash digest = request.client_event_id.empty() ? Hash{} : GroupDigest(group);
  FleetSubmitted out;
  out.ticket = StageGroup(request.client_event_id, digest, group, *encoded);
  out.decisions = std::move(d.value());
  return out;
}

// A retry is the recorded input whatever rule version each carries: a fleet update recorded
// before stall_judged_per_group existed reads false, and the same request posted again says true.
bool SameInput(const FleetEvent& recorded, FleetEvent retried) {
  const auto* was = std::get_if<FleetUpdateRequested>(&recorded.event);
  auto* now = std::get_if<FleetUpdateRequested>(&retried.event);
  if (was != nullptr && now != nullptr) now->stall_judged_per_group = was->stall_judged_per_group;
  return recorded == retried;
}

// A retried key: compared against the recorded input only (its decisions depended on the state
// then), and answered with the original seqs and decisions.
Result<Journal::FleetSubmitted> RocksJournal::ResubmitLocked(const FleetEvent& input,
                                                             const std::string& key,
                                                             const IdemEntry& entry) {
  Result<std::vector<FleetEvent>> original = IdemGroup(entry);
  if (!original.ok()) return original.status();
  if (!SameInput((*original)[0], input)) {
    return Status::Conflict("client_event_id '" + key + "' was used for seq " +
                            std::to_string(entry.first_seq) + " with a different input");
  }
  AppendRequest request;
  request.client_event_id = key;
  FleetSubmitted out;
  Result<Ticket> t = EnqueueLocked(request, *original, /*decided=*/true, &out.decisions);
  if (!t.ok()) return t.status();
  out.ticket = *t;
  return out;
}

// The committer: writes each open batch as one WriteBatch (sync per Options.sync) while the next
// one fills. Nothing is marked durable before the write (and its WAL sync) returned OK; a failed
// or late write fails the journal and the committer stops writing.
void RocksJournal::CommitterLoop() {
  pthread_setname_np(pthread_self(), "rc-journal");  // for top -H, perf and gdb
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    WaitForWorkOrMark(l);
    if (!failed_.ok() || open_groups_ == 0) break;  // failed, or stopping with nothing open
    WaitCommitWindow(l);
    if (!failed_.ok()) break;  // stopped during the window: its waiters were told already
    rocksdb::WriteBatch batch;
    std::swap(batch, open_batch_);
    const std::uint64_t batch_id = open_batch_id_++;
    const std::size_t groups = open_groups_;
    open_groups_ = 0;
    const std::uint64_t head = head_seq_;
    const Hash head_hash = head_hash_;
    RC_CHECK(batch.Put(rocks_->cfs[kMetaCf], kHeadSeqKey, BE64(head)).ok());
    RC_CHECK(batch
                 .Put(rocks_->cfs[kMetaCf], kHeadHashKey,
                      rocksdb::Slice(reinterpret_cast<const char*>(head_hash_.data()), 32))
                 .ok());
    writing_batch_id_ = batch_id;
    write_started_ = std::chrono::steady_clock::now();
    l.unlock();
    rocksdb::WriteOptions wo;
    wo.sync = options_.sync;
    const rocksdb::Status s = rocks_->db->Write(wo, &batch);
    l.lock();
    writing_batch_id_ = 0;
    if (!failed_.ok()) {  // the stall deadline passed while this write ran: it stays unacknowledged
      BatchCv(batch_id).notify_all();
      BatchCv(batch_id + 1).notify_all();
      RunAsyncWaiters(l, UINT64_MAX);
      break;
    }
    if (!s.ok()) {
      // In-memory state is now ahead of the disk: the process must exit and reopen.
      failed_ = Status::IOError(
          "journal at " + path_ + " failed: the group commit of seqs up to " +
          std::to_string(head) +
          " was not made durable; reopen to recover from what is durable: " + s.ToString());
      BatchCv(batch_id).notify_all();
      BatchCv(batch_id + 1).notify_all();  // every later waiter must see failed_
      RunAsyncWaiters(l, UINT64_MAX);
      break;
    }
    durable_batch_id_ = batch_id;
    durable_seq_ = head;
    durable_hash_ = head_hash;
    pending_groups_ -= groups;
    for (auto it = idem_pending_.begin(); it != idem_pending_.end();) {
      it = it->second.batch_id <= batch_id ? idem_pending_.erase(it) : std::next(it);
    }
    for (auto it = admitted_pending_.begin(); it != admitted_pending_.end();) {
      it = it->second.batch_id <= batch_id ? admitted_pending_.erase(it) : std::next(it);
    }
    RC_CHECK(open_batch_id_ == batch_id + 1);
    BatchCv(batch_id).notify_all();  // this batch's waiters: durable now
    // Let the woken waiters enqueue their next groups before the next batch is taken: one fsync
    // then covers them too (taking the batch at once halved the groups per fsync).
    RunAsyncWaiters(l, batch_id);
    l.unlock();
    std::this_thread::yield();
    l.lock();
    MarkDurable(l, /*due_now=*/false);
  }
}

// A commit since the last mark that the next mark is still to cover.
bool RocksJournal::MarkPending() const {
  return options_.sync && failed_.ok() && durable_seq_ != marked_seq_ && last_mark_.has_value();
}

// Until a batch is wanted (or stop, or failure); meanwhile a pending mark is written once due, so
// the mark trails the durable head by at most durable_mark_interval_ms, idle or not.
void RocksJournal::WaitForWorkOrMark(std::unique_lock<std::mutex>& l) {
  auto work = [&] {
    return (open_groups_ > 0 && wanted_batch_id_ >= open_batch_id_) || stopping_ || !failed_.ok();
  };
  const auto interval = std::chrono::milliseconds(options_.durable_mark_interval_ms);
  while (!work()) {
    if (!MarkPending()) {
      commit_cv_.wait(l);
    } else if (!commit_cv_.wait_until(l, *last_mark_ + interval, work)) {
      MarkDurable(l, /*due_now=*/false);
    }
  }
}

// The head the writer recovered is marked before it accepts appends, naming the MANIFEST it runs
// on: an idle writer's journal is guarded from its open on, and a journal without a mark is one
// no writer of this version opened yet (or a copy of one, a checkpoint). An open-time step; it
// opens the directory handle that every mark's rename is then synced through. The step holds the
// database too: one left running past its deadline keeps the LOCK until it returns, so no other
// writer rewrites DURABLE.tmp under it (which it could then rename, half written, over DURABLE).
Status RocksJournal::MarkAtOpen() {
  if (!options_.sync) return Status::OK();  // without fsync nothing is durable: no mark
  const ClosedMark mark{durable_seq_, durable_hash_, manifest_number_};
  auto dir = std::make_shared<std::unique_ptr<rocksdb::Directory>>();
  RC_RETURN_IF_ERROR(OpenStep(
      "the write of the durable mark",
      [env = env_, path = path_, dir, text = EncodeMark(kDurableTitle, mark), rocks = rocks_] {
        (void)rocks;  // held, not used
        RC_RETURN_IF_ERROR(FromRocks(env->NewDirectory(path, dir.get()), "open directory " + path));
        return FromRocks(WriteMarkFile(env, dir->get(), path, kDurableTmpFile, kDurableFile, text),
                         "write the durable mark " + path + "/" + kDurableFile);
      }));
  std::lock_guard<std::mutex> l(mu_);
  dir_ = std::shared_ptr<rocksdb::Directory>(std::move(*dir));
  marked_seq_ = mark.seq;
  last_mark_ = std::chrono::steady_clock::now();
  return Status::OK();
}

// Whether a writer ever wrote a durable mark for this journal (kMarkedKey).
Result<bool> RocksJournal::Marked() {
  std::string v;
  const rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kMetaCf], kMarkedKey, &v);
  if (s.IsNotFound()) return false;
  if (!s.ok()) return FromRocks(s, std::string("read ") + kMarkedKey + " in " + path_);
  return true;
}

// A journal a writer marked holds its durable mark (DURABLE) from then on, and a clean close adds
// CLOSED: with neither, the mark file was removed or never restored with the journal's files, and
// with it the check that the records reach what was acknowledged (a WAL cut at a batch boundary
// would otherwise read as a healthy, shorter journal). A journal never marked (written without
// sync, by an older version, or whose creation died before its first mark) has no such key.
Status RocksJournal::CheckMarkFilesPresent() {
  if (durable_mark_ || closed_mark_) return Status::OK();
  Result<bool> marked = Marked();
  if (!marked.ok()) return marked.status();
  if (!*marked) return Status::OK();
  return Status::Corruption(
      "journal at " + path_ +
      " records that its writer wrote a durable mark, but its durable mark " + path_ + "/" +
      kDurableFile + " is missing (and there is no clean-close record " + kClosedFile +
      "): the file was removed or not restored with the journal, and without it records lost "
      "after they were acknowledged cannot be told from a crash; refusing to open (never "
      "auto-repaired; restore " +
      kDurableFile + " from the journal's copy)");
}

// The first mark a writer wrote for this journal (MarkAtOpen, just before) is recorded in the
// journal: a synced put, then every column family flushed, so that the key lives in a table file
// (a key only in the WAL would be cut with it; flushing every family retires the WAL whole). After
// the mark file, never before: a crash in between leaves a mark without the key (guarded as
// before), never the key without a mark (a journal refused for good). An open-time step holding
// the database.
Status RocksJournal::RecordMarked() {
  if (!options_.sync || marked_key_) return Status::OK();
  RC_RETURN_IF_ERROR(
      OpenStep("the record that the journal is marked", [path = path_, rocks = rocks_] {
        rocksdb::WriteOptions wo;
        wo.sync = true;
        rocksdb::Status s = rocks->db->Put(wo, rocks->cfs[kMetaCf], kMarkedKey, BE64(1));
        if (s.ok()) {
          rocksdb::FlushOptions fo;
          fo.wait = true;
          s = rocks->db->Flush(fo, rocks->cfs);
        }
        return FromRocks(s, "record that the journal at " + path + " is marked");
      }));
  marked_key_ = true;
  return Status::OK();
}

// The durable mark follows the durable head, at most every durable_mark_interval_ms, never ahead
// of it (without fsync nothing is durable: no mark). It is written with the lock released, under
// the group commit's stall deadline, its rename synced into the directory; a failed write fails
// the journal as a failed commit does.
void RocksJournal::MarkDurable(std::unique_lock<std::mutex>& l, bool due_now) {
  const auto now = std::chrono::steady_clock::now();
  const auto interval = std::chrono::milliseconds(options_.durable_mark_interval_ms);
  if (!options_.sync || !failed_.ok() || durable_seq_ == marked_seq_) return;
  if (!due_now && last_mark_ && now - *last_mark_ < interval) return;
  const ClosedMark mark{durable_seq_, durable_hash_, manifest_number_};
  last_mark_ = now;
  marking_ = true;
  write_started_ = now;
  l.unlock();
  const rocksdb::Status written = WriteMarkFile(env_, dir_.get(), path_, kDurableTmpFile,
                                                kDurableFile, EncodeMark(kDurableTitle, mark));
  l.lock();
  marking_ = false;
  if (written.ok()) marked_seq_ = mark.seq;
  if (written.ok() || !failed_.ok()) return;
  failed_ =
      Status::IOError("journal at " + path_ + " failed: its durable mark (seq " +
                      std::to_string(mark.seq) + ") could not be written: " + written.ToString());
  BatchCv(open_batch_id_).notify_all();
  BatchCv(open_batch_id_ + 1).notify_all();
  RunAsyncWaiters(l, UINT64_MAX);
}

// Groups submitted while the committer waits join the batch it is about to take; a stop ends the
// wait at once, and so does Stop() (the owner fail-stopped: the batch is then never written). No
// write is in progress meanwhile, so nothing else can fail the journal (CheckStall needs one).
void RocksJournal::WaitCommitWindow(std::unique_lock<std::mutex>& l) {
  RC_CHECK(failed_.ok() && writing_batch_id_ == 0);
  const std::uint32_t window_us = std::min(options_.commit_window_us, kCommitWindowUsMax);
  if (window_us == 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(window_us);
  commit_cv_.wait_until(l, until, [&] { return stopping_ || !failed_.ok(); });
  RC_CHECK(l.owns_lock() && open_groups_ > 0);
}

void RocksJournal::CheckStall() const {
  const bool writing = writing_batch_id_ != 0 || marking_;
  if (!writing || options_.commit_stall_timeout_ms == 0 || !failed_.ok()) return;
  const auto late = std::chrono::steady_clock::now() - write_started_;
  if (late < std::chrono::milliseconds(options_.commit_stall_timeout_ms)) return;
  const std::string what =
      marking_ ? "its durable mark was not written" : "a group commit was not durable";
  failed_ = Status::Timeout("journal at " + path_ + " failed: " + what + " within " +
                            std::to_string(options_.commit_stall_timeout_ms) +
                            " ms (fsync stalled); exit and recover from what is durable");
}

// Groups commit in batch order: the open batch (or the one being written) is the last to wait for.
Status RocksJournal::WaitForHead() {
  Ticket last;
  {
    std::lock_guard<std::mutex> l(mu_);
    last.batch_id = open_groups_ > 0 ? open_batch_id_ : open_batch_id_ - 1;
  }
  return Wait(last);
}

Status RocksJournal::Wait(const Ticket& ticket) {
  std::unique_lock<std::mutex> l(mu_);
  RC_CHECK(ticket.batch_id <= open_batch_id_);
  const auto timeout = std::chrono::milliseconds(options_.commit_stall_timeout_ms);
  if (ticket.batch_id > wanted_batch_id_) {
    wanted_batch_id_ = ticket.batch_id;
    commit_cv_.notify_one();
  }
  while (true) {
    if (ticket.batch_id <= durable_batch_id_) return Status::OK();
    CheckStall();
    if (!failed_.ok()) {
      BatchCv(ticket.batch_id).notify_all();
      BatchCv(ticket.batch_id + 1).notify_all();
      commit_cv_.notify_all();
      const Status failure = failed_;
      RunAsyncWaiters(l, UINT64_MAX);
      return failure;
    }
    if (timeout.count() == 0) {
      BatchCv(ticket.batch_id).wait(l);
    } else if (writing_batch_id_ != 0 || marking_) {
      BatchCv(ticket.batch_id).wait_until(l, write_started_ + timeout);
    } else {
      BatchCv(ticket.batch_id).wait_for(l, timeout);
    }
  }
}

void RocksJournal::WaitAsync(const Ticket& ticket, DurableFn done) {
  RC_CHECK(done != nullptr);
  std::unique_lock<std::mutex> l(mu_);
  RC_CHECK(ticket.batch_id <= open_batch_id_);
  CheckStall();
  if (ticket.batch_id <= durable_batch_id_ || !failed_.ok()) {
    const Status st = ticket.batch_id <= durable_batch_id_ ? Status::OK() : failed_;
    l.unlock();
    done(st);
    return;
  }
  async_waiters_.emplace(ticket.batch_id, std::move(done));
  if (ticket.batch_id > wanted_batch_id_) {
    wanted_batch_id_ = ticket.batch_id;
    commit_cv_.notify_one();
  }
}

void RocksJournal::RunAsyncWaiters(std::unique_lock<std::mutex>& l, std::uint64_t upto) const {
  RC_CHECK(l.owns_lock());
  if (async_waiters_.empty() || async_waiters_.begin()->first > upto) return;
  const auto end = upto == UINT64_MAX ? async_waiters_.end() : async_waiters_.upper_bound(upto);
  std::vector<DurableFn> ready;
  for (auto it = async_waiters_.begin(); it != end; ++it) ready.push_back(std::move(it->second));
  async_waiters_.erase(async_waiters_.begin(), end);
  const Status st = upto == UINT64_MAX ? failed_ : Status::OK();
  RC_CHECK(upto != UINT64_MAX || !st.ok());
  l.unlock();
  for (DurableFn& fn : ready) fn(st);
  l.lock();
}

Result<AppendResult> RocksJournal::Append(const AppendRequest& request) {
  Result<Ticket> t = Enqueue(request);
  if (!t.ok()) return t.status();
  RC_RETURN_IF_ERROR(Wait(*t));
  return t->result;
}

// Below the durable head every seq holds a record: a missing one was lost (Corruption); past it,
// none is stored yet (NotFound).
Result<Record> RocksJournal::Read(std::uint64_t seq) {
  std::uint64_t durable = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    durable = durable_seq_;
  }
  if (seq == 0 || seq > durable) return ReadStored(seq);
  return ReadExpected(seq, "the head (seq " + std::to_string(durable) + ")");
}

Result<Record> RocksJournal::ReadExpected(std::uint64_t seq, const std::string& claim) {
  Result<Record> r = ReadStored(seq);
  if (r.ok() || r.status().code() != Code::kNotFound) return r;
  return Status::Corruption("the record at seq " + std::to_string(seq) + " is missing, but " +
                            claim + " says it exists");
}

Result<Record> RocksJournal::ReadStored(std::uint64_t seq) {
  std::string v;
  rocksdb::Status s =
      rocks_->db->Get(rocksdb::ReadOptions(), rocks_->cfs[kEventsCf], BE64(seq), &v);
  if (s.IsNotFound()) return Status::NotFound("no record at seq " + std::to_string(seq));
  if (!s.ok()) return FromRocks(s, "read seq " + std::to_string(seq));
  Result<Record> r = DecodeRecord(v);
  if (!r.ok())
    return Status::Corruption("seq " + std::to_string(seq) + ": " + r.status().message());
  if (r->seq != seq) {
    return Status::Corruption("seq " + std::to_string(seq) + ": stored record says seq " +
                              std::to_string(r->seq));
  }
  return r;
}

Status RocksJournal::ScanRange(std::uint64_t from_seq, std::uint64_t to_seq, const Hash& prev_hash,
                               const std::function<Status(const Record&)>& visit) {
  if (from_seq > to_seq) return Status::OK();
  rocksdb::ReadOptions ro;
  const std::string lower = BE64(from_seq);
  const std::string upper = BE64(to_seq + 1);
  rocksdb::Slice lower_slice(lower), upper_slice(upper);
  ro.iterate_lower_bound = &lower_slice;
  ro.iterate_upper_bound = &upper_slice;
  ro.fill_cache = false;  // a scan reads each block once: keep it out of the block cache
  ro.readahead_size = kScanReadaheadBytes;
  std::unique_ptr<rocksdb::Iterator> it(rocks_->db->NewIterator(ro, rocks_->cfs[kEventsCf]));
  std::uint64_t expect = from_seq;
  Hash prev = prev_hash;
  auto name = [&] { return "seq " + std::to_string(expect); };  // built only on errors
  // Every stored pair, in order: key, decode (FlatBuffers verification + SHA-256), chain, visit.
  auto check = [&](std::string_view key_bytes, std::string_view value,
                   const Hash* value_sha256) -> Status {
    if (key_bytes.size() != 8) return Status::Corruption(name() + ": malformed key");
    const std::uint64_t key = ParseBE64(key_bytes);
    if (key != expect) {
      return Status::Corruption(name() + " is missing (next stored seq is " + std::to_string(key) +
                                ")");
    }
    Result<Record> r =
        value_sha256 != nullptr ? DecodeRecord(value, *value_sha256) : DecodeRecord(value);
    if (!r.ok()) return Status::Corruption(name() + ": " + r.status().message());
    if (r->seq != key) {
      return Status::Corruption(name() + ": stored record says seq " + std::to_string(r->seq));
    }
    if (r->prev_hash != prev) {
      return Status::Corruption(name() + ": hash chain broken: prev_hash " + HashHex(r->prev_hash) +
                                " != hash of seq " + std::to_string(key - 1) + " " + HashHex(prev));
    }
    if (r->cause_seq >= key) {
      return Status::Corruption(name() + ": cause_seq " + std::to_string(r->cause_seq) +
                                " is not before it");
    }
    prev = r->hash;
    RC_RETURN_IF_ERROR(visit(*r));
    ++expect;
    return Status::OK();
  };
  rocksdb::Status iter_status;
  if (!options_.scan_pipelined || to_seq - from_seq + 1 < kPipelinedScanRecordsMin) {
    for (it->Seek(lower); it->Valid(); it->Next()) {
      RC_RETURN_IF_ERROR(check(View(it->key()), View(it->value()), nullptr));
    }
    iter_status = it->status();
  } else {
    // The reader copies bytes and hashes them (SHA-256, the chain's hash); every check stays on
    // this thread, in order, so errors and visitor stops are the serial scan's. On any error the
    // reader is stopped and joined first.
    ScanQueue queue;
    std::thread reader;
    try {
      reader = std::thread([&] {
        ScanBatch* b = queue.TakeFree();
        for (it->Seek(lower); b != nullptr && it->Valid(); it->Next()) {
          b->Add(it->key(), it->value());
          if (b->bytes.size() >= kScanBatchBytes) {
            queue.PushFilled(b);
            b = queue.TakeFree();
          }
        }
        if (b != nullptr) queue.PushFilled(b);
        queue.Finish(it->status());
      });
    } catch (const std::system_error& e) {  // a thread limit: nothing was read
      return Status::Unavailable("journal at " + path_ +
                                 ": no thread for a scan's reader: " + e.what());
    }
    Status failed;
    while (ScanBatch* b = queue.TakeFilled()) {
      for (const ScanBatch::Entry& e : b->entries) {
        failed = check(b->Key(e), b->Value(e), &e.value_sha256);
        if (!failed.ok()) break;
      }
      queue.Recycle(b);
      if (!failed.ok()) break;
    }
    if (!failed.ok()) queue.Stop();
    reader.join();
    RC_RETURN_IF_ERROR(failed);
    iter_status = queue.status();
  }
  RC_RETURN_IF_ERROR(FromRocks(iter_status, "scan events at seq " + std::to_string(expect)));
  if (expect != to_seq + 1) {
    return Status::Corruption("seq " + std::to_string(expect) +
                              " is missing: the journal ends at " + std::to_string(expect - 1) +
                              " but its head is " + std::to_string(to_seq));
  }
  return Status::OK();
}

Status RocksJournal::Scan(std::uint64_t from_seq, std::uint64_t to_seq,
                          const std::function<Status(const Record&)>& visit) {
  std::uint64_t durable;
  {
    std::lock_guard<std::mutex> l(mu_);
    durable = durable_seq_;
  }
  if (to_seq == 0) to_seq = durable;
  if (to_seq > durable) {
    return Status::InvalidArgument("scan to seq " + std::to_string(to_seq) +
                                   " past the durable head " + std::to_string(durable));
  }
  if (from_seq == 0) from_seq = 1;
  if (from_seq > to_seq) return Status::OK();
  Result<Hash> prev = HashAt(from_seq - 1, "the head (seq " + std::to_string(durable) + ")");
  if (!prev.ok()) return prev.status();
  return ScanRange(from_seq, to_seq, *prev, visit);
}

Result<std::vector<std::uint64_t>> RocksJournal::RolloutSeqs(const std::string& rollout_id) {
  if (rollout_id.empty() || rollout_id.size() > kIdBytesMax) {
    return Status::InvalidArgument("rollout_id must be 1.." + std::to_string(kIdBytesMax) +
                                   " bytes");
  }
  const std::string prefix = RolloutPrefix(rollout_id);
  std::vector<std::uint64_t> out;
  std::unique_ptr<rocksdb::Iterator> it(
      rocks_->db->NewIterator(rocksdb::ReadOptions(), rocks_->cfs[kRolloutsCf]));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    if (it->key().size() == prefix.size()) continue;  // the id's point key (RolloutIdKey)
    if (it->key().size() != prefix.size() + 8)
      return Status::Corruption("malformed rollout index key");
    out.push_back(ParseBE64(View(it->key()).substr(prefix.size())));
  }
  RC_RETURN_IF_ERROR(FromRocks(it->status(), "scan rollout index"));
  return out;
}

Result<FleetState> RocksJournal::LoadFleetState() {
  Result<Loaded> loaded = LoadFromDb(/*strict=*/true);
  if (!loaded.ok()) return loaded.status();
  return std::move(loaded->fleet);
}

Result<FleetState> RocksJournal::RefoldFleet(std::uint64_t until_seq) {
  FleetState fleet;
  RC_RETURN_IF_ERROR(Scan(1, until_seq, [&](const Record& r) {
    Status st = fleet_apply(fleet, FleetEvent{r.engine, r.event});
    if (!st.ok()) {
      return Status::Corruption("seq " + std::to_string(r.seq) + ": " + event_name(r.event) +
                                " does not apply: " + st.ToString());
    }
    return Status::OK();
  }));
  return fleet;
}

namespace {
Result<State> UnnamedEngineOf(Result<FleetState> fleet) {
  if (!fleet.ok()) return fleet.status();
  if (fleet->named) {
    return Status::InvalidArgument("the journal holds a fleet of named engines, not one engine");
  }
  return UnnamedEngine(*fleet);
}
}  // namespace

Result<State> RocksJournal::LoadState() { return UnnamedEngineOf(LoadFleetState()); }

Result<State> RocksJournal::Refold(std::uint64_t until_seq) {
  return UnnamedEngineOf(RefoldFleet(until_seq));
}

Status RocksJournal::WriteSnapshot(std::uint64_t seq, const FleetState& fleet) {
  Result<std::string> bytes = SnapshotBytes(seq, fleet);
  if (!bytes.ok()) return bytes.status();
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  return FromRocks(rocks_->db->Put(wo, rocks_->cfs[kSnapshotsCf], FleetSnapshotKey(seq), *bytes),
                   "write snapshot");
}

Result<std::string> RocksJournal::SnapshotBytes(std::uint64_t seq, const FleetState& fleet) {
  std::uint64_t durable = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    RC_RETURN_IF_ERROR(Usable());
    durable = durable_seq_;
  }
  if (seq == 0 || seq > durable) {
    return Status::InvalidArgument("snapshot at seq " + std::to_string(seq) +
                                   " outside the durable journal 1.." + std::to_string(durable));
  }
  // A cheap guard against a snapshot of the wrong point: the fold counts every event applied.
  if (fleet.events != seq) {
    return Status::InvalidArgument("snapshot state counts " + std::to_string(fleet.events) +
                                   " events, not " + std::to_string(seq));
  }
  Result<Hash> chain_hash = HashAt(seq, "the durable head (seq " + std::to_string(durable) + ")");
  if (!chain_hash.ok()) return chain_hash.status();
  std::string bytes = EncodeFleetState(fleet, seq, *chain_hash);
  if (bytes.size() > kFleetStateBytesMax) {  // the next open could not decode it
    return Status::InvalidArgument("snapshot at seq " + std::to_string(seq) + " is " +
                                   std::to_string(bytes.size()) + " bytes, over the bound of " +
                                   std::to_string(kFleetStateBytesMax) + ": not written");
  }
  return bytes;
}

Status RocksJournal::CatchUp() {
  if (!options_.read_only) return Status::OK();
  RC_RETURN_IF_ERROR(
      FromRocks(rocks_->db->TryCatchUpWithPrimary(), "catch up with primary at " + path_));
  Result<std::uint64_t> head = ReadHeadSeq();
  if (!head.ok()) return head.status();
  std::lock_guard<std::mutex> l(mu_);
  if (*head < head_seq_) {
    return Status::Corruption("primary head " + std::to_string(*head) + " is behind " +
                              std::to_string(head_seq_) + " seen before");
  }
  FleetState next = fleet_;
  Hash hash = head_hash_;
  RC_RETURN_IF_ERROR(ScanRange(head_seq_ + 1, *head, head_hash_, [&](const Record& r) {
    Status st = fleet_apply(next, FleetEvent{r.engine, r.event});
    if (!st.ok()) return Status::Corruption("seq " + std::to_string(r.seq) + ": " + st.ToString());
    hash = r.hash;
    return Status::OK();
  }));
  fleet_ = std::move(next);
  head_seq_ = durable_seq_ = *head;
  head_hash_ = hash;
  return Status::OK();
}

// The durable mark goes with the copy (read before it: it names only records the copy holds): a
// journal whose writer marked it opens only beside its mark (CheckMarkFilesPresent).
Status RocksJournal::Checkpoint(const std::string& dir) {
  Result<std::optional<ClosedMark>> durable =
      ReadMark(kDurableFile, kDurableTitle, "the durable mark");
  if (!durable.ok()) return durable.status();
  rocksdb::Checkpoint* raw = nullptr;
  RC_RETURN_IF_ERROR(
      FromRocks(rocksdb::Checkpoint::Create(rocks_->db.get(), &raw), "create checkpoint"));
  std::unique_ptr<rocksdb::Checkpoint> cp(raw);
  RC_RETURN_IF_ERROR(FromRocks(cp->CreateCheckpoint(dir), "checkpoint into " + dir));
  if (!durable->has_value()) return Status::OK();
  std::unique_ptr<rocksdb::Directory> copy_dir;
  RC_RETURN_IF_ERROR(FromRocks(env_->NewDirectory(dir, &copy_dir), "open directory " + dir));
  return FromRocks(WriteMarkFile(env_, copy_dir.get(), dir, kDurableTmpFile, kDurableFile,
                                 EncodeMark(kDurableTitle, **durable)),
                   "copy the durable mark into " + dir);
}

Status RocksJournal::VerifyChecksum() {
  return FromRocks(rocks_->db->VerifyChecksum(), "verify checksums of " + path_);
}

Status RocksJournal::Flush() {
  if (options_.read_only) return Status::InvalidArgument("flush on a read-only journal");
  rocksdb::FlushOptions fo;
  fo.wait = true;
  return FromRocks(rocks_->db->Flush(fo, rocks_->cfs), "flush " + path_);
}

Status RocksJournal::Compact() {
  if (options_.read_only) return Status::InvalidArgument("compact on a read-only journal");
  RC_RETURN_IF_ERROR(Flush());
  rocksdb::CompactRangeOptions co;
  co.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForceOptimized;
  for (std::size_t cf = 0; cf < kCfCount; ++cf) {
    RC_RETURN_IF_ERROR(FromRocks(rocks_->db->CompactRange(co, rocks_->cfs[cf], nullptr, nullptr),
                                 std::string("compact ") + kCfNames[cf] + " of " + path_));
  }
  return Status::OK();
}

}  // namespace

Result<Hash> ParseHashHex(std::string_view hex) {
  if (hex.size() != 64)
    return Status::InvalidArgument("a hash is 64 hex digits, got " + std::to_string(hex.size()) +
                                   " characters");
  Hash out{};
  const Status decoded = rc::hex::decode_into(hex, out);  // `hex` alone is the parameter
  if (!decoded.ok())
    return Status::InvalidArgument("a hash is 64 hex digits: " + decoded.message());
  return out;
}

std::uint32_t Options::OpenFilesMax() const {
  const std::uint32_t tables = std::min<std::uint32_t>(
      std::max(table_files_open_max, kTableFilesOpenMin), INT32_MAX);  // as DbOptions sets it
  return tables + kFilesBesideTablesMax;
}

Result<std::unique_ptr<Journal>> Journal::Open(const std::string& path, const Options& options) {
  if (path.empty()) return Status::InvalidArgument("journal path is empty");
  auto journal = std::make_unique<RocksJournal>(path, options);
  RC_RETURN_IF_ERROR(journal->OpenDb());
  return std::unique_ptr<Journal>(std::move(journal));
}

}  // namespace rc::journal
