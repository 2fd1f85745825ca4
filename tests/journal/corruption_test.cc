// Corruption tests: a journal is written and closed, its files are damaged on disk, and the
// reopen must refuse (or Scan / VerifyChecksum must fail naming the damage): never a silently
// short journal. Damage: a byte flipped mid-WAL, a byte flipped in an SST, a stored value replaced.
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <filesystem>
#include <fstream>

#include "journal/codec.h"
#include "journal/journal.h"
#include "journal/testing/fault_env.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"

namespace rc::journal {
namespace {

namespace fs = std::filesystem;
using testing::OverwriteEvent;
using testing::TempDir;

// Writes bootstrap + `admissions` admission groups and closes the journal.
void WriteJournal(const std::string& path, int admissions, const Options& o, bool flush) {
  Result<std::unique_ptr<Journal>> j = Journal::Open(path, o);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(testing::Group(g)).ok());
  for (int i = 0; i < admissions; ++i) {
    ASSERT_TRUE(
        (*j)->Append(testing::Group({make_admission((*j)->state(), "r" + std::to_string(i))}))
            .ok());
  }
  if (flush) {
    ASSERT_TRUE((*j)->Flush().ok());
  }
}

fs::path LargestWithExtension(const std::string& dir, const std::string& ext) {
  fs::path best;
  std::uintmax_t best_size = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ext && e.file_size() > best_size) {
      best = e.path();
      best_size = e.file_size();
    }
  }
  return best;
}

void FlipByte(const fs::path& file, std::uintmax_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << file;
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

// Proves a byte flipped in the middle of the WAL of a crashed journal (a clean close flushes the
// WAL away) makes Open refuse with Corruption naming the path; catches the default recovery
// mode's silent truncation of half the acknowledged events.
TEST(Corruption, MidWalByteFlipRefusesToOpen) {
  TempDir dir;
  Options o;
  o.snapshot_every = 0;
  {
    testing::FaultEnv faults;
    Options crashing = o;
    crashing.env = faults.env();
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), crashing);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (auto& g : testing::BootstrapGroups()) ASSERT_TRUE((*j)->Append(testing::Group(g)).ok());
    for (int i = 0; i < 300; ++i) {
      ASSERT_TRUE(
          (*j)->Append(testing::Group({make_admission((*j)->state(), "r" + std::to_string(i))}))
              .ok());
    }
    faults.Crash();  // every group was synced: the WAL is whole, only the clean close is missing
  }
  const fs::path wal = LargestWithExtension(dir.path(), ".log");
  ASSERT_FALSE(wal.empty());
  ASSERT_GT(fs::file_size(wal), 10000u);
  FlipByte(wal, fs::file_size(wal) / 2);
  Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
  ASSERT_FALSE(j.ok()) << "opened with head " << (*j)->head_seq() << " of 304";
  EXPECT_EQ(j.status().code(), Code::kCorruption);
  EXPECT_NE(j.status().message().find(dir.path()), std::string::npos) << j.status().message();
}

// Proves a byte flipped inside an SST data block is reported (Open, Scan or VerifyChecksum fails
// with a message naming the damage); catches reads that skip block checksums.
TEST(Corruption, SstByteFlipIsReported) {
  TempDir dir;
  Options o;
  o.snapshot_every = 0;
  WriteJournal(dir.path(), 300, o, /*flush=*/true);
  const fs::path sst = LargestWithExtension(dir.path(), ".sst");
  ASSERT_FALSE(sst.empty());
  FlipByte(sst, fs::file_size(sst) / 3);
  Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
  std::string reported;
  if (!j.ok()) {
    reported = j.status().ToString();
  } else {
    Status scan = (*j)->Scan(1, 0, [](const Record&) { return Status::OK(); });
    Status verify = (*j)->VerifyChecksum();
    ASSERT_FALSE(scan.ok() && verify.ok()) << "SST corruption went unnoticed";
    reported = scan.ok() ? verify.ToString() : scan.ToString();
  }
  std::printf("reported: %s\n", reported.c_str());
  EXPECT_TRUE(reported.find("Corruption") != std::string::npos ||
              reported.find("checksum") != std::string::npos)
      << reported;
}

// Proves a well-formed forged record (valid FlatBuffers, different content) stored at seq 7 is
// caught by the hash chain at seq 8, whether Open refolds over it or a later Scan reaches it;
// catches a journal that trusts structure instead of the chain.
TEST(Corruption, ForgedValueBreaksTheChainAtTheNextSeq) {
  for (std::uint64_t every : {std::uint64_t{0}, std::uint64_t{20}}) {
    TempDir dir;
    Options o;
    o.snapshot_every = every;
    WriteJournal(dir.path(), 40, o, /*flush=*/false);
    Result<Record> original = [&] {
      auto j = Journal::Open(dir.path(), o);
      RC_CHECK(j.ok());
      return (*j)->Read(7);
    }();
    ASSERT_TRUE(original.ok());
    Record forged = *original;
    std::get<RolloutAdmitted>(forged.event).rollout_id = "forged";
    OverwriteEvent(dir.path(), 7, EncodeRecord(forged));
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
    std::string reported;
    if (every == 0) {
      ASSERT_FALSE(j.ok()) << "refold over a forged record succeeded";
      reported = j.status().message();
    } else {
      ASSERT_TRUE(j.ok()) << j.status().ToString();  // the snapshot at 40 hides seq 7 from Open
      Status scan = (*j)->Scan(1, 0, [](const Record&) { return Status::OK(); });
      ASSERT_FALSE(scan.ok());
      reported = scan.message();
    }
    EXPECT_NE(reported.find("seq 8: hash chain broken"), std::string::npos) << reported;
  }
}

// Proves a record that names an engine this journal never joined (forged bytes with a valid
// chain up to it) is refused by seq, never folded as the journal's one engine; catches a reader
// that ignores the engine field and binds rollouts of another engine to this one.
TEST(Corruption, ARecordNamingAnEngineIsRefused) {
  TempDir dir;
  Options o;
  o.snapshot_every = 0;
  WriteJournal(dir.path(), 20, o, /*flush=*/false);
  Record named;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    Result<Record> r = (*j)->Read(9);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    named = *r;
  }
  named.engine = "engine-b";
  OverwriteEvent(dir.path(), 9, EncodeRecord(named));
  Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
  ASSERT_FALSE(j.ok());
  const std::string& m = j.status().message();
  EXPECT_NE(m.find("seq 9: "), std::string::npos) << m;
  EXPECT_NE(m.find("does not apply"), std::string::npos) << m;
  EXPECT_NE(m.find("no engine 'engine-b' in the fleet"), std::string::npos) << m;
}

// Proves a flipped byte inside a stored value is named by seq; catches a decoder error that
// loses the position of the damage.
TEST(Corruption, FlippedStoredValueIsNamedBySeq) {
  TempDir dir;
  Options o;
  o.snapshot_every = 0;
  WriteJournal(dir.path(), 20, o, /*flush=*/false);
  std::string bytes;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    bytes = EncodeRecord(*(*j)->Read(12));
  }
  bytes[bytes.size() / 2] ^= 0x01;
  OverwriteEvent(dir.path(), 12, bytes);
  Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
  ASSERT_FALSE(j.ok());
  const std::string& m = j.status().message();
  EXPECT_TRUE(m.find("seq 12") != std::string::npos || m.find("seq 13") != std::string::npos) << m;
}

// Proves a long scan (thousands of records, across snapshots) visits every record before the
// damage in order, names the damaged seq, and stops when its visitor fails; would catch a scan
// losing or reordering records, an error hidden behind a snapshot, or a scan that runs on after
// its visitor stopped it.
TEST(Corruption, LongScanNamesTheSeqAndStopsOnVisitorError) {
  TempDir dir;
  Options o;
  o.snapshot_every = 3000;  // the snapshot hides the damage from Open; Scan must find it
  o.sync = false;           // 9000 appends: durability is not what this test is about
  WriteJournal(dir.path(), 9000, o, /*flush=*/false);
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    std::uint64_t next = 1;
    Status clean = (*j)->Scan(1, 0, [&](const Record& r) {
      return r.seq == next++ ? Status::OK() : Status::Internal("out of order");
    });
    ASSERT_TRUE(clean.ok()) << clean.ToString();
    EXPECT_EQ(next, (*j)->head_seq() + 1);
    EXPECT_GT((*j)->head_seq(), 9000u);
    std::uint64_t visited = 0;
    Status stopped = (*j)->Scan(1, 0, [&](const Record& r) {
      ++visited;
      return r.seq == 5000 ? Status::Internal("visitor stops at 5000") : Status::OK();
    });
    EXPECT_EQ(stopped.message(), "visitor stops at 5000");
    EXPECT_EQ(visited, 5000u);
  }
  std::string bytes;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    bytes = EncodeRecord(*(*j)->Read(7777));
  }
  bytes[bytes.size() / 2] ^= 0x01;
  OverwriteEvent(dir.path(), 7777, bytes);
  auto j = Journal::Open(dir.path(), o);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  std::uint64_t last = 0;
  Status scan = (*j)->Scan(1, 0, [&](const Record& r) {
    last = r.seq;
    return Status::OK();
  });
  ASSERT_FALSE(scan.ok());
  EXPECT_TRUE(scan.message().find("seq 7777") != std::string::npos ||
              scan.message().find("seq 7778") != std::string::npos)
      << scan.message();
  EXPECT_GE(last, 7776u) << "records before the damage were not all visited";
  EXPECT_LE(last, 7777u);
}

}  // namespace
}  // namespace rc::journal

namespace rc::journal {
namespace {

// Proves the two-stage scan (reader thread + checking caller) visits exactly the records of the
// one-thread scan, in order, before and after Compact, and names the same damaged seq; would catch
// records dropped, duplicated or reordered at batch boundaries, or an error lost between threads.
TEST(Corruption, TwoStageScanMatchesOneThreadScan) {
  TempDir dir;
  Options o;
  o.snapshot_every = 5000;  // the snapshot hides the damage (seq 4321) from Open; Scan must find it
  o.sync = false;           // 6000 appends: durability is not what this test is about
  WriteJournal(dir.path(), 6000, o, /*flush=*/true);
  auto visit_all = [&](bool pipelined, std::vector<std::uint64_t>& seqs,
                       std::vector<Hash>& hashes) {
    Options read = o;
    read.scan_pipelined = pipelined;
    auto j = Journal::Open(dir.path(), read);
    RC_CHECK(j.ok());
    seqs.clear();
    hashes.clear();
    return (*j)->Scan(1, 0, [&](const Record& r) {
      seqs.push_back(r.seq);
      hashes.push_back(r.hash);
      return Status::OK();
    });
  };
  std::vector<std::uint64_t> seqs_one, seqs_two;
  std::vector<Hash> hashes_one, hashes_two;
  ASSERT_TRUE(visit_all(false, seqs_one, hashes_one).ok());
  ASSERT_TRUE(visit_all(true, seqs_two, hashes_two).ok());
  ASSERT_GT(seqs_one.size(), 6000u);
  EXPECT_EQ(seqs_one, seqs_two);
  EXPECT_EQ(hashes_one, hashes_two);
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    ASSERT_TRUE((*j)->Compact().ok());
  }
  ASSERT_TRUE(visit_all(true, seqs_two, hashes_two).ok());
  EXPECT_EQ(seqs_one, seqs_two);
  EXPECT_EQ(hashes_one, hashes_two);
  std::string bytes;
  {
    auto j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok());
    bytes = EncodeRecord(*(*j)->Read(4321));
  }
  bytes[bytes.size() / 2] ^= 0x01;
  OverwriteEvent(dir.path(), 4321, bytes);
  Status one = visit_all(false, seqs_one, hashes_one);
  Status two = visit_all(true, seqs_two, hashes_two);
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.ToString(), two.ToString());
  EXPECT_EQ(seqs_one, seqs_two);
  EXPECT_TRUE(one.message().find("seq 432") != std::string::npos) << one.message();
}

}  // namespace
}  // namespace rc::journal
