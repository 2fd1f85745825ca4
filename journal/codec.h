// Record, State and FleetState codec: rc::Event + envelope <-> FlatBuffers bytes, and the SHA-256
// hash chain.
//
// Stored record (value of the `events` column family), grammar:
//   record      := u32le(size - 4) ‖ flatbuffer(Record)   (FlatBuffers size-prefixed form, so a
//                  truncated or extended value fails verification), file_identifier "RCJ1" at
//                  bytes 8..11, 12 <= size <= kRecordBytesMax
//   Record      := { seq: u64, wall_time_ms: i64, cause_seq: u64, prev_hash: [u8; 32],
//                    payload_type: u8 in 1..31 (18 = TrajectoryRecorded, schema v2; 25..31 the
//                    fleet's events, v7), payload: <table for payload_type>,
//                    engine: string (v7; absent for one unnamed engine and for fleet events) }
//   hash(record) := SHA-256(record bytes exactly as stored); record[n].prev_hash =
//   hash(record[n-1]),
//                   record[1].prev_hash = 32 zero bytes
// Stored snapshot (value of the `snapshots` column family):
//   snapshot    := flatbuffer(State) ‖ SHA-256(flatbuffer(State))   (the last 32 bytes)
//   fleet snapshot (v8) := flatbuffer(FleetSnapshotState) ‖ SHA-256(flatbuffer(...)), each
//                  engine's State inside as its own `snapshot` bytes, 8 + 32 <= size <=
//                  kFleetStateBytesMax; chain_hash (v9, 32 bytes when present) = hash(record
//                  `events`)
// Decoding never trusts the bytes: length bound first, copy to 8-byte-aligned storage, FlatBuffers
// Verifier (depth 16, tables 4096), identifier, unknown union tags and out-of-range enums rejected.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "encoding/sha256.h"
#include "journal/journal.h"
#include "statemachine/events.h"
#include "statemachine/fleet.h"
#include "statemachine/state.h"
#include "statemachine/status.h"

namespace rc::journal {

inline constexpr std::size_t kStateBytesMax = 64u * 1024 * 1024;  // snapshot bound (65536 rollouts)
// A fleet snapshot holds up to kFleetEnginesMax engine snapshots, but not each at its own bound:
// 256 x 64 MiB is 16 GiB, past FlatBuffers' 2 GiB buffer limit (and RocksDB's for one value). Half
// that limit, 1 GiB, holds 16 engines at kStateBytesMax, or a full fleet of 256 engines with 4 MiB
// each (some 4000 active rollouts each at the 1 KiB per rollout kStateBytesMax allows); an engine
// nearer its own bound than that is bounded by the fleet's bytes, not its own.
inline constexpr std::size_t kFleetStateBytesMax = 16 * kStateBytesMax;
static_assert(kFleetStateBytesMax < (std::size_t{1} << 31));
inline constexpr std::uint32_t kVerifierDepthMax = 16;
inline constexpr std::uint32_t kVerifierTablesMax = 4096;
inline constexpr std::uint8_t kPayloadTagMax = 31;  // rc::fb::Payload::MAX
// The schema generation of journal/events.fbs: one above the last frozen journal/schema/events.v<N>
// .fbs. A journal records the newest generation that wrote to it; a binary refuses one stamped
// newer than its own, whose records may hold fields it would drop without a word. Journals from
// before generations were counted hold 1.
inline constexpr std::uint32_t kSchemaVersion = 9;

// hash(record) above; one SHA-256 for every layer (encoding/sha256.h).
using encoding::Sha256;
static_assert(std::is_same_v<Hash, encoding::Sha256Digest>);
// Lowercase hex, 64 characters.
std::string HashHex(const Hash& hash);

// Encodes the record's envelope (seq, wall_time_ms, cause_seq, prev_hash) and event. The record's
// hash field is ignored; compute it with Sha256 over the returned bytes.
std::string EncodeRecord(const Record& record);
// Decodes stored bytes into a Record and sets record.hash = Sha256(bytes). Errors: Corruption
// with a message naming what is wrong (size, identifier, structure, unknown type, enum range).
[[nodiscard]] Result<Record> DecodeRecord(std::string_view bytes);
// The same, with Record::hash taken from `bytes_sha256`, which the caller computed over exactly
// these bytes (a scan hashes on its reader thread while the caller decodes).
[[nodiscard]] Result<Record> DecodeRecord(std::string_view bytes, const Hash& bytes_sha256);

// Canonical bytes of one event alone (envelope zeroed): the idempotency digest is over these.
std::string EncodeEventOnly(const Event& event);

// Snapshot bytes: State flatbuffer followed by its SHA-256.
std::string EncodeState(const State& state);
// Errors: Corruption naming what is wrong (size, hash, structure, a bound, a duplicate, an enum
// range, or a field the fold would have refused in the event that carried it: the hash proves
// only what the writer stored, and a decision derived from such a field would stop the process).
[[nodiscard]] Result<State> DecodeState(std::string_view bytes);

// A fleet's folded state after `events` records (the snapshot's seq), as stored in the snapshots
// column family. Same framing as EncodeState (FlatBuffers + SHA-256). `chain_hash` is the hash
// of record `events`, which the journal compares with that record before it loads the snapshot.
// The writer must not store bytes over kFleetStateBytesMax: DecodeFleetState refuses them.
std::string EncodeFleetState(const FleetState& fleet, std::uint64_t events, const Hash& chain_hash);
// Without the chain hash, as writers before v9 stored a snapshot: for tests of the journals such
// writers left, and for round trips of the state alone (a journal never writes this form).
std::string EncodeFleetState(const FleetState& fleet, std::uint64_t events);
// The bytes a writer from before `removed` existed stored (no removed engines' counters, no chain
// hash): for tests of the journals such writers left.
std::string EncodeFleetStateWithoutRemoved(const FleetState& fleet, std::uint64_t events);
struct FleetSnapshot {
  FleetState fleet;  // fleet.events == events
  std::uint64_t events = 0;
  // false: written before removed engines' counters were kept, so fleet.removed may undercount.
  bool counts_removed = true;
  // The hash of record `events` the writer folded to; nullopt: written before v9 kept it.
  std::optional<Hash> chain_hash;
};
// Errors: Corruption naming what is wrong (size, hash, structure, a bound, a duplicate, an enum
// range, an engine's own snapshot, a chain hash that is not 32 bytes, or the fleet invariant that
// does not hold). Never throws.
[[nodiscard]] Result<FleetSnapshot> DecodeFleetState(std::string_view bytes);

}  // namespace rc::journal
