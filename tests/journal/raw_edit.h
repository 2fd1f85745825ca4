// Tests that damage a closed journal on purpose: its RocksDB opened directly, as a tool outside
// the journal would.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

namespace rc::journal::testing {

// The journal's key of `seq` (big-endian, as journal/rocks_journal.cc stores it).
inline std::string SeqKey(std::uint64_t seq) {
  std::string key(8, '\0');
  for (int i = 0; i < 8; ++i) key[7 - i] = static_cast<char>((seq >> (8 * i)) & 0xff);
  return key;
}

using RawEdit = std::function<void(rocksdb::DB&, const std::vector<rocksdb::ColumnFamilyHandle*>&)>;

// Opens a closed journal's RocksDB directly, as a tool outside the journal would, and applies
// `edit` to its column families (handles in the journal's order: default, events, rollouts,
// idempotency, snapshots, meta).
inline void EditRaw(const std::string& path, const RawEdit& edit) {
  std::vector<rocksdb::ColumnFamilyDescriptor> descs;
  for (const char* name : {"default", "events", "rollouts", "idempotency", "snapshots", "meta"}) {
    descs.emplace_back(name, rocksdb::ColumnFamilyOptions());
  }
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  ASSERT_TRUE(rocksdb::DB::Open(rocksdb::DBOptions(), path, descs, &handles, &db).ok());
  edit(*db, handles);
  for (auto* h : handles) ASSERT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
  ASSERT_TRUE(db->Close().ok());
  delete db;
}

// Replaces the stored value at `seq` (events column family).
inline void OverwriteEvent(const std::string& path, std::uint64_t seq, const std::string& value) {
  EditRaw(path, [&](rocksdb::DB& db, const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[1], SeqKey(seq), value).ok());
  });
}

}  // namespace rc::journal::testing
