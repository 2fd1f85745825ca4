// Codec unit tests: round trips of every event alternative and of State, and clear errors on
// malformed bytes (truncated, oversized, unknown union type, wrong identifier, bad enums, bit
// flips).
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "journal/codec.h"
#include "journal/events_generated.h"
#include "journal/json.h"
#include "tests/journal/raw_edit.h"
#include "tests/journal/test_util.h"
#include "tests/statemachine/fleet_helpers.h"

namespace rc::journal {
namespace {

using testing::SampleEvents;
using testing::SampleIdentity;

Record SampleRecord(const Event& e) {
  Record r;
  r.seq = 42;
  r.wall_time_ms = 1700000000123;
  r.cause_seq = 41;
  for (std::size_t i = 0; i < r.prev_hash.size(); ++i)
    r.prev_hash[i] = static_cast<std::uint8_t>(i * 7);
  r.event = e;
  return r;
}

// Proves every alternative survives encode/decode field for field; catches a field
// or alternative the codec forgets (it would decode to a default value or the wrong type).
TEST(Codec, RoundTripsEveryEventAlternative) {
  std::set<std::size_t> covered;
  for (const Event& e : SampleEvents()) {
    covered.insert(e.index());
    const Record in = SampleRecord(e);
    const std::string bytes = EncodeRecord(in);
    Result<Record> out = DecodeRecord(bytes);
    ASSERT_TRUE(out.ok()) << event_name(e) << ": " << out.status().ToString();
    EXPECT_EQ(out->event, e) << event_name(e);
    EXPECT_EQ(out->seq, in.seq);
    EXPECT_EQ(out->wall_time_ms, in.wall_time_ms);
    EXPECT_EQ(out->cause_seq, in.cause_seq);
    EXPECT_EQ(out->prev_hash, in.prev_hash);
    EXPECT_EQ(out->hash, Sha256(bytes));
    EXPECT_EQ(out->engine, "");
  }
  EXPECT_EQ(covered.size(), std::variant_size_v<Event>);
}

// Proves a record names its engine through a round trip, and a record of the one unnamed engine
// stores no engine field at all (its bytes are those an older build wrote); catches an engine
// dropped by the codec, or every old journal's hashes changing.
TEST(Codec, RoundTripsTheEngineAndOmitsItWhenUnnamed) {
  Record in = SampleRecord(RolloutFinished{"r-1", RolloutOutcome::kCompleted, 1, 2});
  in.engine = "engine-7";
  Result<Record> out = DecodeRecord(EncodeRecord(in));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->engine, "engine-7");
  EXPECT_EQ(out->event, in.event);
  in.engine.clear();
  const std::string unnamed = EncodeRecord(in);
  const fb::Record* r = fb::GetSizePrefixedRecord(unnamed.data());
  EXPECT_EQ(r->engine(), nullptr);
  in.engine = "x";
  EXPECT_GT(EncodeRecord(in).size(), unnamed.size());
}

// Proves a fleet update journaled before stall_judged_per_group existed reads as false (the rule
// its recorded decisions followed) and a new one keeps true; catches the field's absence read as
// the new rule, which would refuse every older journal holding such an update.
TEST(Codec, AFleetUpdateWithoutTheStallRuleReadsAsTheOldRule) {
  FleetUpdateRequested u{"u1", FleetUpdateMode::kRolling, 1, 1, "rc-1", SampleIdentity(), "", ""};
  ASSERT_TRUE(u.stall_judged_per_group);
  Result<Record> now = DecodeRecord(EncodeRecord(SampleRecord(u)));
  ASSERT_TRUE(now.ok()) << now.status().ToString();
  EXPECT_TRUE(std::get<FleetUpdateRequested>(now->event).stall_judged_per_group);
  const std::string current = EncodeRecord(SampleRecord(u));
  u.stall_judged_per_group = false;
  const std::string older = EncodeRecord(SampleRecord(u));
  EXPECT_LT(older.size(), current.size()) << "false is what an older build wrote: no field";
  Result<Record> old = DecodeRecord(older);
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_FALSE(std::get<FleetUpdateRequested>(old->event).stall_judged_per_group);
}

// Proves a RecoveryStarted written before it recorded the journal's open (executor_id alone, as
// v8 wrote it) decodes as kNotRecorded, that one recording nothing still encodes to those bytes,
// and that every ending round trips; catches an old record read as a clean close, and every old
// journal's hashes changing.
TEST(Codec, ARecoveryStartedFromBeforeTheJournalEndingReadsAsNotRecorded) {
  flatbuffers::FlatBufferBuilder b;
  auto executor = b.CreateString("exec-1");
  fb::RecoveryStartedBuilder older(b);  // v8's table: the executor id, nothing more
  older.add_executor_id(executor);
  auto payload = older.Finish();
  std::vector<std::uint8_t> zeros(32, 0);
  auto prev = b.CreateVector(zeros);
  fb::FinishSizePrefixedRecordBuffer(
      b, fb::CreateRecord(b, 3, 0, 0, prev, fb::Payload::RecoveryStarted, payload.Union()));
  const std::string v8(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
  Result<Record> old = DecodeRecord(v8);
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  const RecoveryStarted& read = std::get<RecoveryStarted>(old->event);
  EXPECT_EQ(read.journal_ending, JournalEnding::kNotRecorded) << "an old record claims nothing";
  EXPECT_EQ(read.journal_bytes_unread, 0u);
  EXPECT_EQ(read.journal_torn_tail, "");
  EXPECT_EQ(EncodeRecord(*old), v8) << "a record that recorded nothing keeps its v8 bytes";
  for (const JournalEnding ending :
       {JournalEnding::kNewJournal, JournalEnding::kCleanClose, JournalEnding::kCrash}) {
    Result<Record> out = DecodeRecord(EncodeRecord(SampleRecord(RecoveryStarted{"e", ending})));
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(std::get<RecoveryStarted>(out->event).journal_ending, ending);
  }
}

// Whether the BootstrapRequested in `record` stores a fold_rules field at all.
bool StoresFoldRules(const std::string& record) {
  const fb::Record* r = fb::GetSizePrefixedRecord(record.data());
  // Every generated table is a flatbuffers::Table (privately): the field's vtable slot is read
  // through it.
  const auto* table = reinterpret_cast<const flatbuffers::Table*>(r->payload());
  return table->CheckField(fb::BootstrapRequested::VT_FOLD_RULES);
}

// Proves a BootstrapRequested without a fold_rules field (as every build before the field wrote
// it: rules 0 are written as no field) decodes as rules 0 and re-encodes to exactly its bytes (its
// hash, and every hash chained on it, unchanged), that a new bootstrap carries the current rules
// through the codec, and that rules newer than this build's are Corruption naming the field and a
// newer RolloutCore; catches an old journal read under the new rules, a codec that drops the
// field (a new journal read back under rules 0), and a journal from a newer build folded by rules
// this one does not know.
TEST(Codec, ABootstrapCarriesItsFoldRulesAndOneWithoutThemReadsZero) {
  BootstrapRequested e{"rc-0", SampleIdentity(), /*adopt=*/true};
  ASSERT_EQ(e.fold_rules, kFoldRulesCurrent) << "a new bootstrap records the current rules";
  const std::string current = EncodeRecord(SampleRecord(e));
  EXPECT_TRUE(StoresFoldRules(current));
  Result<Record> read = DecodeRecord(current);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(std::get<BootstrapRequested>(read->event), e);

  e.fold_rules = 0;
  const std::string older = EncodeRecord(SampleRecord(e));
  ASSERT_FALSE(StoresFoldRules(older)) << "rules 0 are the bytes an older build wrote";
  Result<Record> old = DecodeRecord(older);
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(std::get<BootstrapRequested>(old->event).fold_rules, 0u);
  EXPECT_EQ(EncodeRecord(*old), older) << "a record from before the rules keeps its bytes";

  e.fold_rules = kFoldRulesCurrent + 1;
  Result<Record> refused = DecodeRecord(EncodeRecord(SampleRecord(e)));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kCorruption);
  EXPECT_NE(refused.status().message().find("BootstrapRequested.fold_rules " +
                                            std::to_string(kFoldRulesCurrent + 1)),
            std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("newer RolloutCore"), std::string::npos);
}

// Proves a recorded torn tail is read back only as the fold would have taken it: an ending past
// the enum, a sentence over kTextBytesMax and one that is not UTF-8 are Corruption naming the
// field; catches a forged record's text reaching replay and audit unchecked.
TEST(Codec, RefusesARecordedTornTailNoWriterCouldHaveWritten) {
  auto encoded = [](std::uint8_t ending, const std::string& sentence) {
    flatbuffers::FlatBufferBuilder b;
    auto payload = fb::CreateRecoveryStarted(b, b.CreateString("exec-1"),
                                             static_cast<fb::JournalEnding>(ending), 9,
                                             b.CreateString(sentence));
    std::vector<std::uint8_t> zeros(32, 0);
    auto prev = b.CreateVector(zeros);
    fb::FinishSizePrefixedRecordBuffer(
        b, fb::CreateRecord(b, 3, 0, 0, prev, fb::Payload::RecoveryStarted, payload.Union()));
    return std::string(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
  };
  const auto torn = static_cast<std::uint8_t>(JournalEnding::kTornTail);
  ASSERT_TRUE(DecodeRecord(encoded(torn, std::string(kTextBytesMax, 't'))).ok());
  const std::vector<std::pair<std::string, std::string>> forged = {
      {encoded(kJournalEndingMax + 1, "t"), "RecoveryStarted.journal_ending value 5 out of range"},
      {encoded(torn, std::string(kTextBytesMax + 1, 't')), "RecoveryStarted.journal_torn_tail"},
      {encoded(torn, "torn \xc3\x28 tail"), "RecoveryStarted.journal_torn_tail"}};
  for (const auto& [bytes, named] : forged) {
    Result<Record> r = DecodeRecord(bytes);
    ASSERT_FALSE(r.ok()) << named;
    EXPECT_EQ(r.status().code(), Code::kCorruption);
    EXPECT_NE(r.status().message().find(named), std::string::npos) << r.status().message();
  }
}

// Proves Sha256 is standard SHA-256 (FIPS 180-2 vectors, including a two-block message); catches a
// hashing rewrite (low-level SHA256_* instead of EVP) that changes the chain's digests.
TEST(Codec, Sha256MatchesKnownAnswers) {
  EXPECT_EQ(HashHex(Sha256("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(HashHex(Sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(HashHex(Sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

// Proves a record decodes to the same fields and hash at every byte alignment of its storage;
// catches the in-place fast path (8-aligned values) or the reused per-thread copy (unaligned
// values) reading the wrong bytes, or a stale buffer leaking into the next decode.
TEST(Codec, DecodesIdenticallyAtEveryAlignment) {
  const auto events = SampleEvents();
  for (std::size_t k = 0; k < events.size(); ++k) {
    const std::string bytes = EncodeRecord(SampleRecord(events[k]));
    alignas(8) char storage[4096 + 8];
    ASSERT_LE(bytes.size(), 4096u);
    for (std::size_t offset = 0; offset < 8; ++offset) {
      std::memcpy(storage + offset, bytes.data(), bytes.size());
      Result<Record> out = DecodeRecord(std::string_view(storage + offset, bytes.size()));
      ASSERT_TRUE(out.ok()) << "event " << k << " offset " << offset << ": "
                            << out.status().ToString();
      EXPECT_TRUE(out->event == events[k]) << "event " << k << " offset " << offset;
      EXPECT_EQ(out->seq, 42u);
      EXPECT_EQ(out->hash, Sha256(bytes));
    }
  }
}

// Proves truncated or extended bytes are refused with Corruption (the size prefix must match);
// catches a decoder that reads past the end or ignores a torn/padded value.
TEST(Codec, RejectsTruncatedRecords) {
  const std::string bytes = EncodeRecord(SampleRecord(SampleEvents()[1]));
  for (std::size_t len :
       {std::size_t{0}, std::size_t{3}, std::size_t{7}, bytes.size() / 2, bytes.size() - 1}) {
    Result<Record> r = DecodeRecord(std::string_view(bytes).substr(0, len));
    ASSERT_FALSE(r.ok()) << "length " << len;
    EXPECT_EQ(r.status().code(), Code::kCorruption);
  }
  EXPECT_NE(DecodeRecord(bytes.substr(0, 5)).status().message().find("truncated"),
            std::string::npos);
  EXPECT_EQ(DecodeRecord(bytes + "xx").status().code(), Code::kCorruption);
}

// Proves the size bound is checked first; catches an oversized value reaching the Verifier.
TEST(Codec, RejectsOversizedRecords) {
  const std::string big(kRecordBytesMax + 1, 'x');
  Result<Record> r = DecodeRecord(big);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exceeds the bound of 65536"), std::string::npos)
      << r.status().message();
}

// Proves a wrong file identifier is named; catches decoding foreign FlatBuffers as records.
TEST(Codec, RejectsBadIdentifier) {
  std::string bytes = EncodeRecord(SampleRecord(SampleEvents()[0]));
  bytes[8] = 'X';
  Result<Record> r = DecodeRecord(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("file identifier RCJ1"), std::string::npos)
      << r.status().message();
}

// Proves an unknown union member (which the generated verifier accepts) is rejected by tag;
// catches a v1 reader silently skipping a v2 event type.
TEST(Codec, RejectsUnknownUnionType) {
  flatbuffers::FlatBufferBuilder b;
  auto payload = fb::CreateRecoveryStarted(b, b.CreateString("x"));
  std::vector<std::uint8_t> zeros(32, 0);
  auto prev = b.CreateVector(zeros);
  // One past the last known member (a record from a newer schema this build does not know).
  const auto unknown = static_cast<fb::Payload>(kPayloadTagMax + 1);
  auto root = fb::CreateRecord(b, 1, 0, 0, prev, unknown, payload.Union());
  fb::FinishSizePrefixedRecordBuffer(b, root);
  const std::string bytes(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
  Result<Record> r = DecodeRecord(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorruption);
  EXPECT_NE(r.status().message().find("unknown event type " + std::to_string(kPayloadTagMax + 1)),
            std::string::npos)
      << r.status().message();
}

// Proves out-of-range enum values are rejected and named; catches a cast of 10 into Lifecycle.
TEST(Codec, RejectsOutOfRangeEnums) {
  flatbuffers::FlatBufferBuilder b;
  auto payload = fb::CreateStateChanged(b, fb::Lifecycle::Ready, static_cast<fb::Lifecycle>(10),
                                        fb::Cause::Resumed, b.CreateString("d"));
  std::vector<std::uint8_t> zeros(32, 0);
  auto prev = b.CreateVector(zeros);
  fb::FinishSizePrefixedRecordBuffer(
      b, fb::CreateRecord(b, 5, 0, 4, prev, fb::Payload::StateChanged, payload.Union()));
  const std::string bytes(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
  Result<Record> r = DecodeRecord(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("StateChanged.to value 10 out of range"), std::string::npos)
      << r.status().message();

  flatbuffers::FlatBufferBuilder b2;
  auto http = fb::CreateHttpEvidence(b2, static_cast<fb::Transport>(200), 200);
  auto probe = fb::CreateEngineProbed(b2, http);
  auto prev2 = b2.CreateVector(zeros);
  fb::FinishSizePrefixedRecordBuffer(
      b2, fb::CreateRecord(b2, 5, 0, 0, prev2, fb::Payload::EngineProbed, probe.Union()));
  const std::string bytes2(reinterpret_cast<const char*>(b2.GetBufferPointer()), b2.GetSize());
  Result<Record> r2 = DecodeRecord(bytes2);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("http.transport value 200"), std::string::npos);
}

// Proves every single-bit flip is either refused by the decoder or changes the record hash (so
// the chain check catches it); catches crashes on hostile bytes and flips that go unnoticed.
TEST(Codec, BitFlipsAreRefusedOrChangeTheHash) {
  const Record in = SampleRecord(SampleEvents()[8]);
  const std::string bytes = EncodeRecord(in);
  const Hash original = Sha256(bytes);
  std::size_t refused = 0;
  std::size_t decoded = 0;
  for (std::size_t bit = 0; bit < bytes.size() * 8; ++bit) {
    std::string flipped = bytes;
    flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1 << (bit % 8)));
    Result<Record> r = DecodeRecord(flipped);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kCorruption);
      ++refused;
      continue;
    }
    ++decoded;
    EXPECT_NE(r->hash, original) << "bit " << bit;
  }
  EXPECT_GT(refused, 0u);
  std::printf("bit flips: %zu refused by the decoder, %zu left to the hash chain\n", refused,
              decoded);
}

// Proves a State with every field set survives the snapshot codec; catches a field left out.
TEST(Codec, RoundTripsState) {
  State s;
  s.lifecycle = Lifecycle::kInvalidating;
  s.committed = WeightVersion{3, "rc-3"};
  s.committed_identity = SampleIdentity();
  s.bootstrap = BootstrapRequested{"rc-0", SampleIdentity()};
  s.attempts = 2;
  s.in_flight = Effect{EffectKind::kWake, CacheKind::kEncoder, WakeTag::kKvCache};
  s.sleep_level = 2;
  s.active["r1"] = ActiveRollout{WeightVersion{3, "rc-3"}};
  s.active["r2"] = ActiveRollout{WeightVersion{2, "rc-2"}};
  UpdatePlan u;
  u.update_id = "u4";
  u.target = WeightVersion{4, "rc-4"};
  u.identity = SampleIdentity();
  u.source_uri = "ipc:x";
  u.drain_seen = u.transfer_started = u.validated = u.aborting = true;
  u.caches_reset_mask = 5;
  u.abort_reason = "why";
  u.sleep_level = 1;
  u.wake_only = u.from_sleep = u.weights_awake = u.wake_first = u.kv_awake = true;
  u.sleep_memory = DeviceMemory{true, 3, 4, 5};
  s.update = u;
  s.taint = TaintRecord{Lifecycle::kValidating, Cause::kValidationFailed, "u3",
                        WeightVersion{3, "x"}, "d"};
  s.counters = Counters{1, 2, 3, 4, 5, 6, 7, 8, 9};
  s.counters.sleeps_requested = 10;
  s.counters.sleeps_committed = 11;
  s.counters.wakes_requested = 12;
  s.counters.wakes_committed = 13;
  const std::string bytes = EncodeState(s);
  Result<State> out = DecodeState(bytes);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, s);
  EXPECT_EQ(*DecodeState(EncodeState(State{})), State{});

  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 1;
  Result<State> bad = DecodeState(flipped);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("snapshot hash mismatch"), std::string::npos);
}

// A READY engine as the fold leaves it: bootstrapped at rc-0 (instance i-0), rollout "r1" bound.
State ReadyState() {
  State s;
  s.lifecycle = Lifecycle::kReady;
  s.committed = WeightVersion{0, "rc-0"};
  s.committed_identity = SampleIdentity();
  s.labels["rc-0"] = SampleIdentity();
  s.engine_instance = "i-0";
  s.active["r1"] = ActiveRollout{s.committed, 30000};
  return s;
}

// The engine of `s` before its bootstrap probe: nothing committed, the request pending.
void Bootstrapping(State& s) {
  s = State{};
  s.bootstrap = BootstrapRequested{"rc-0", SampleIdentity()};
}

// The engine of `s` draining, with no rollout left, for update u1 to rc-1.
void Draining(State& s) {
  s.lifecycle = Lifecycle::kDraining;
  s.active.clear();
  UpdatePlan u;
  u.update_id = "u1";
  u.target = WeightVersion{1, "rc-1"};
  u.identity = SampleIdentity();
  u.source_uri = "safetensors:/ckpt/m.safetensors";
  s.update = u;
}

// The engine of `s` TAINTED by its own replacement: no plan, so no update id.
void Tainted(State& s) {
  s.lifecycle = Lifecycle::kTainted;
  s.active.clear();
  s.taint = TaintRecord{Lifecycle::kReady, Cause::kEngineReplaced, "", s.committed, "replaced"};
}

// DecodeState's refusal of the snapshot of `s` (Corruption), or "decoded".
std::string SnapshotError(const State& s) {
  Result<State> r = DecodeState(EncodeState(s));
  if (r.ok()) return "decoded";
  EXPECT_EQ(r.status().code(), Code::kCorruption) << r.status().ToString();
  return r.status().message();
}

// A READY engine bootstrapped by `fold_rules` on an engine whose digest was 111, its executor
// restarted: the re-verification probe is in flight.
rc::test::Driver RestartedAwaitingItsProbe(std::uint32_t fold_rules) {
  rc::test::Driver d;
  BootstrapRequested b{"rc-0", rc::test::identity('a')};
  b.fold_rules = fold_rules;
  d.ok(b);
  d.effect(EffectKind::kProbeEngine);
  EngineProbed boot{rc::test::ok_http(), "0.25.1", "rc-0", true, false, "i-0"};
  boot.digest = rc::test::digest_of("111");
  d.ok(boot);
  d.ok(RecoveryStarted{"exec-2"});
  d.effect(EffectKind::kProbeEngine);
  return d;
}

// Proves a snapshot keeps the engine's fold rules (after its bootstrap, and of a bootstrap still
// pending), so that a state loaded from it folds a digest-less re-verification probe as the live
// one does (pending); that a snapshot written before the field reads 0, as its journal's
// bootstrap does; and that rules newer than this build's are refused; catches a snapshot-based
// open folding a new journal by the old rules (the probe would clear the recheck), or an old one
// by the new.
TEST(Codec, SnapshotsKeepTheFoldRules) {
  rc::test::Driver live = RestartedAwaitingItsProbe(kFoldRulesCurrent);
  ASSERT_EQ(live.s.fold_rules, kFoldRulesCurrent);
  Result<State> loaded = DecodeState(EncodeState(live.s));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded, live.s);
  EngineProbed unread{rc::test::ok_http(), "0.25.1", "rc-0", true, false, "i-0"};
  unread.digest.error = "rc_weight_digest timed out";
  State from_snapshot = *loaded;
  ASSERT_TRUE(rc::step(from_snapshot, unread).ok());
  live.ok(unread);
  EXPECT_TRUE(from_snapshot.engine_recheck) << "the loaded state folds by the journal's rules";
  EXPECT_EQ(from_snapshot, live.s);

  State pending;
  pending.bootstrap = BootstrapRequested{"rc-0", SampleIdentity()};
  pending.fold_rules = kFoldRulesCurrent;
  Result<State> pending_out = DecodeState(EncodeState(pending));
  ASSERT_TRUE(pending_out.ok()) << pending_out.status().ToString();
  EXPECT_EQ(pending_out->bootstrap->fold_rules, kFoldRulesCurrent);
  EXPECT_EQ(*pending_out, pending);

  // A journal bootstrapped before the rules: its state holds 0, which a snapshot writes as no
  // field at all (what an older build wrote), and reads back as 0.
  rc::test::Driver old = RestartedAwaitingItsProbe(0);
  const std::string old_bytes = EncodeState(old.s);
  State as_current = old.s;
  as_current.fold_rules = kFoldRulesCurrent;
  EXPECT_LT(old_bytes.size(), EncodeState(as_current).size()) << "no field for rules 0";
  Result<State> old_out = DecodeState(old_bytes);
  ASSERT_TRUE(old_out.ok()) << old_out.status().ToString();
  EXPECT_EQ(old_out->fold_rules, 0u);
  EXPECT_EQ(*old_out, old.s);

  // A fleet snapshot holds each member's State: members bootstrapped under different rules (one
  // before they were recorded, one after) keep their own.
  rc::test::FleetDriver fleet;
  fleet.join("a");
  fleet.bootstrap("a");
  fleet.join("b");
  BootstrapRequested b_boot{"rc-0", rc::test::identity('a')};
  b_boot.fold_rules = 0;
  fleet.ok("b", b_boot);
  Result<FleetSnapshot> fleet_out = DecodeFleetState(EncodeFleetState(fleet.f, fleet.f.events));
  ASSERT_TRUE(fleet_out.ok()) << fleet_out.status().ToString();
  EXPECT_EQ(fleet_out->fleet.engines.at("a").fold_rules, kFoldRulesCurrent);
  EXPECT_EQ(fleet_out->fleet.engines.at("b").fold_rules, 0u);
  EXPECT_EQ(fleet_out->fleet, fleet.f);

  State newer = live.s;
  newer.fold_rules = kFoldRulesCurrent + 1;
  EXPECT_NE(SnapshotError(newer).find("State.fold_rules"), std::string::npos);
  pending.bootstrap->fold_rules = kFoldRulesCurrent + 1;
  EXPECT_NE(SnapshotError(pending).find("newer RolloutCore"), std::string::npos);
}

// Proves a snapshot (valid hash, encoded by EncodeState) whose active rollout id holds '\n', or
// is 200 bytes (over kIdBytesMax), is refused as Corruption naming the id escaped on one line;
// catches a decoder that loads an id the fold never admitted, whose RolloutFinished{abandoned}
// derived on RecoveryStarted then fails check_id and aborts serve at every start.
TEST(Codec, SnapshotRefusesRolloutIdsTheFoldNeverAdmitted) {
  ASSERT_EQ(SnapshotError(ReadyState()), "decoded");
  State newline = ReadyState();
  newline.active["a\nb"] = ActiveRollout{newline.committed};
  const std::string error = SnapshotError(newline);
  EXPECT_NE(error.find("snapshot: active rollout 'a\\nb': rollout_id must be UTF-8 without "
                       "control characters"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << "the stored id is escaped";

  State long_id = ReadyState();
  long_id.active[std::string(200, 'x')] = ActiveRollout{long_id.committed};
  const std::string too_long = SnapshotError(long_id);
  EXPECT_NE(too_long.find("rollout_id exceeds 128 bytes"), std::string::npos) << too_long;
  EXPECT_NE(too_long.find("'" + std::string(kIdBytesMax, 'x') + "...'"), std::string::npos)
      << "the quoted id is cut: " << too_long;
}

// Proves every other string (and bound) of a snapshot's State is checked as the fold checked the
// event that carried it: committed version, identity and digest, engine instance, label registry
// and digests, bootstrap request, binding version and lease, update plan, taint; catches a field
// the decoder trusts, which a decision derived from it would carry into an event the fold refuses
// (the first four cases decode: each refusal is its one change's).
TEST(Codec, SnapshotRefusesEveryStringTheFoldWouldRefuse) {
  struct Case {
    const char* why;
    void (*edit)(State&);
  };
  const Case cases[] = {
      {"decoded", [](State&) {}},
      {"decoded", Bootstrapping},
      {"decoded", Draining},
      {"decoded", Tainted},
      {"committed: label must be UTF-8 without control characters",
       [](State& s) { s.committed.label = "rc-0\x1b"; }},
      {"committed: identity.manifest_digest must be lowercase hex",
       [](State& s) { s.committed_identity.manifest_digest = "ABC"; }},
      {"committed: digest combined must be lowercase hex",
       [](State& s) { s.committed_digest.combined = "not hex"; }},
      {"engine: engine_instance exceeds 4096 bytes",
       [](State& s) { s.engine_instance.assign(kTextBytesMax + 1, 'i'); }},
      {"label 'rc-1\\n': label must be UTF-8 without control characters",
       [](State& s) { s.labels["rc-1\n"] = SampleIdentity(); }},
      {"label 'rc-0': identity.run must be UTF-8 without control characters",
       [](State& s) { s.labels["rc-0"].run = "run\t1"; }},
      {"label digest 'rc-0': combined digest is empty",
       [](State& s) { s.label_digests["rc-0"] = ""; }},
      {"bootstrap: expected_digest must be lowercase hex",
       [](State& s) {
         Bootstrapping(s);
         s.bootstrap->expected_digest = "xyz";
       }},
      {"active rollout 'r1': version label is empty",
       [](State& s) { s.active["r1"].version.label.clear(); }},
      {"active rollout 'r1': lease_ms exceeds 3600000",
       [](State& s) { s.active["r1"].lease_ms = kLeaseMsMax + 1; }},
      {"update plan: update_id exceeds 128 bytes",
       [](State& s) {
         Draining(s);
         s.update->update_id.assign(kIdBytesMax + 1, 'u');
       }},
      {"update plan: target label is empty",
       [](State& s) {
         Draining(s);
         s.update->target.label.clear();
       }},
      {"update plan: source_uri must be UTF-8 without control characters",
       [](State& s) {
         Draining(s);
         s.update->source_uri += '\r';
       }},
      {"update plan: digest tensors not sorted by name or not unique",
       [](State& s) {
         Draining(s);
         s.update->observed_digest = WeightDigest{"rcd1", "ab", {{"b", "cd"}, {"a", "cd"}}};
       }},
      {"update plan: abort_reason exceeds 4096 bytes",
       [](State& s) {
         Draining(s);
         s.update->abort_reason.assign(kTextBytesMax + 1, 'r');
       }},
      {"update plan: caches_reset_mask 8 has a bit of no cache kind",
       [](State& s) {
         Draining(s);
         s.update->caches_reset_mask = 8;
       }},
      {"update plan: device free memory above its total",
       [](State& s) {
         Draining(s);
         s.update->sleep_memory = DeviceMemory{true, 6, 0, 5};
       }},
      {"taint: update_id must be UTF-8 without control characters",
       [](State& s) {
         Tainted(s);
         s.taint->update_id = "u\x7f";
       }},
      {"taint: detail exceeds 4096 bytes",
       [](State& s) {
         Tainted(s);
         s.taint->detail.assign(kTextBytesMax + 1, 'd');
       }},
  };
  for (const Case& c : cases) {
    State s = ReadyState();
    c.edit(s);
    const std::string error = SnapshotError(s);
    EXPECT_NE(error.find(c.why), std::string::npos) << c.why << " <- " << error;
  }
}

// Proves the JSON view names the type, family and enum values by name; catches numeric enums
// or a missing field in `replay --json`.
TEST(Json, NamesTypesAndEnums) {
  for (const Event& e : SampleEvents()) {
    nlohmann::json j = EventToJson(e);
    EXPECT_EQ(j["type"], event_name(e));
    EXPECT_TRUE(j.contains("family"));
  }
  nlohmann::json sc = EventToJson(SampleEvents()[14]);
  EXPECT_EQ(sc["to"], "TAINTED");
  EXPECT_EQ(sc["from"], "UPDATING");
  EXPECT_EQ(sc["cause"], cause_name(Cause::kTransferAmbiguous));
  nlohmann::json tr = EventToJson(SampleEvents()[8]);
  EXPECT_EQ(tr["mutation"], "possible");
  EXPECT_EQ(tr["bytes_sent"], 1 << 20);
  Record r = SampleRecord(SampleEvents()[2]);
  nlohmann::json rj = RecordToJson(r);
  EXPECT_EQ(rj["seq"], 42);
  EXPECT_EQ(rj["prev_hash"].get<std::string>().size(), 64u);
  State s;
  s.active["r1"] = ActiveRollout{WeightVersion{0, "rc-0"}};
  nlohmann::json sj = StateToJson(s);
  EXPECT_EQ(sj["lifecycle"], "UNINITIALIZED");
  EXPECT_EQ(sj["active"]["r1"]["version"]["label"], "rc-0");
  EXPECT_TRUE(sj["update"].is_null());
}

// ---- fleet snapshots ----

using rc::test::FleetDriver;

// Engines a..e on rc-0, then: g joined and never bootstrapped (UNINITIALIZED), h removed after a
// completed rollout (its counters in `removed`), e leaving with a rollout, u0 refused whole, and u1
// (`all`, rc-1) cancelled with a committed on rc-1, b TAINTED by an ambiguous transfer, c draining
// for its rollout (still updating) and d skipped.
FleetDriver BusyFleet() {
  FleetDriver d;
  const std::vector<std::string> ids = {"a", "b", "c", "d", "e"};
  for (const std::string& id : ids) d.join(id);
  for (const std::string& id : ids) d.bootstrap(id);
  d.join("g");
  d.ok(FleetEvent{"", FleetConfigured{1, 0}});
  d.admit("c");
  d.admit("d");
  d.admit("e");
  d.join("h");
  d.bootstrap("h");
  const std::string rh = d.admit("h");
  d.ok("h", RolloutFinished{rh, RolloutOutcome::kCompleted, 1, 1});
  d.ok(FleetEvent{"", EngineRemovalRequested{"h"}});  // idle: removed in this group
  d.ok(FleetEvent{"", EngineRemovalRequested{"e"}});
  d.ok(FleetEvent{"", d.fleet_update("u0", FleetUpdateMode::kAll, "rc-1", 1, 10)});
  const FleetUpdateRequested u = d.fleet_update("u1", FleetUpdateMode::kAll, "rc-1");
  d.ok(FleetEvent{"", u});
  for (const std::string id : {"a", "b", "c"}) d.ok(id, d.member_update(u));
  d.run_update("a");
  d.run_update("b", /*ambiguous=*/true);
  d.run_update("c");  // waits for its rollout
  d.ok(FleetEvent{"", FleetUpdateCancelled{"u1", "operator: rollback window"}});
  return d;
}

// Proves an empty fleet and a journal's one unnamed engine survive the fleet snapshot codec with
// their event count; catches a default-valued field, or the unnamed engine's "" name, lost.
TEST(FleetCodec, RoundTripsAnEmptyFleetAndTheUnnamedEngine) {
  Result<FleetSnapshot> empty = DecodeFleetState(EncodeFleetState(FleetState{}, 0));
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(empty->fleet, FleetState{});
  EXPECT_EQ(empty->events, 0u);

  FleetDriver one;
  one.bootstrap("");
  one.admit("");
  ASSERT_EQ(one.f.engines.count(""), 1u);
  Result<FleetSnapshot> out = DecodeFleetState(EncodeFleetState(one.f, one.f.events));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->fleet, one.f);
  EXPECT_EQ(out->events, one.accepted.size());
}

// Proves a fleet with engines in four lifecycles, rollouts, a leaving engine, two generations, an
// ended and an open cancelled fleet update and a removed engine's counters survive the codec,
// re-encodes to the same bytes and folds on exactly as the original; catches any FleetState or
// member field the codec drops.
TEST(FleetCodec, RoundTripsABusyFleet) {
  FleetDriver d = BusyFleet();
  ASSERT_TRUE(d.f.update.has_value());
  const std::map<std::string, MemberStatus> members = {{"a", MemberStatus::kCommitted},
                                                       {"b", MemberStatus::kTainted},
                                                       {"c", MemberStatus::kUpdating},
                                                       {"d", MemberStatus::kSkipped}};
  ASSERT_EQ(d.f.update->members, members);
  ASSERT_EQ(d.f.update->cancelled, "operator: rollback window");
  ASSERT_EQ(d.engine("a").lifecycle, Lifecycle::kReady);
  ASSERT_EQ(d.engine("b").lifecycle, Lifecycle::kTainted);
  ASSERT_EQ(d.engine("c").lifecycle, Lifecycle::kDraining);
  ASSERT_EQ(d.engine("c").active.size(), 1u);
  ASSERT_EQ(d.engine("g").lifecycle, Lifecycle::kUninitialized);
  ASSERT_EQ(d.f.leaving, std::set<std::string>{"e"});
  ASSERT_EQ(d.f.label_generation.size(), 2u);
  ASSERT_EQ(d.f.fleet_updates_ended, 1u);
  ASSERT_EQ(d.f.engines.count("h"), 0u);
  ASSERT_EQ(d.f.removed.rollouts_completed, 1u);
  EXPECT_EQ(FleetStateToJson(d.f)["removed"]["rollouts_completed"], 1) << "replay --json shows it";

  const std::string bytes = EncodeFleetState(d.f, d.f.events);
  Result<FleetSnapshot> out = DecodeFleetState(bytes);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->events, d.accepted.size());
  EXPECT_EQ(out->fleet, d.f);
  EXPECT_EQ(out->fleet, d.refold());
  EXPECT_EQ(EncodeFleetState(out->fleet, out->events), bytes);

  FleetDriver again = d;
  again.f = out->fleet;
  for (FleetDriver* x : {&d, &again}) {
    x->ok("c", RolloutFinished{"r1", RolloutOutcome::kCompleted, 1, 1});
    x->run_update("c");
  }
  EXPECT_FALSE(again.f.update.has_value());
  EXPECT_EQ(again.f, d.f);
}

// Proves every single-byte change of a fleet snapshot, its truncations and an extension are
// refused as Corruption by the hash; catches a decoder that trusts altered bytes or crashes.
TEST(FleetCodec, RefusesEveryByteFlipAndTruncation) {
  const FleetDriver d = BusyFleet();
  const std::string bytes = EncodeFleetState(d.f, d.f.events);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    Result<FleetSnapshot> r = DecodeFleetState(flipped);
    ASSERT_FALSE(r.ok()) << "byte " << i;
    ASSERT_EQ(r.status().code(), Code::kCorruption) << "byte " << i;
    ASSERT_NE(r.status().message().find("fleet snapshot hash mismatch"), std::string::npos)
        << "byte " << i << ": " << r.status().message();
  }
  for (std::size_t len :
       {std::size_t{0}, std::size_t{39}, std::size_t{40}, bytes.size() / 2, bytes.size() - 1}) {
    Result<FleetSnapshot> r = DecodeFleetState(std::string_view(bytes).substr(0, len));
    ASSERT_FALSE(r.ok()) << "length " << len;
    EXPECT_EQ(r.status().code(), Code::kCorruption);
  }
  EXPECT_EQ(DecodeFleetState(bytes + "x").status().code(), Code::kCorruption);
}

// A hand-built fleet snapshot with a valid hash (what a buggy writer could store). Its defaults
// decode: engine "a" (UNINITIALIZED), named, and an open update whose member "a" is skipped.
struct ForgedFleet {
  std::vector<std::string> engines = {"a"};
  std::vector<std::string> leaving;
  std::uint8_t member_status = static_cast<std::uint8_t>(MemberStatus::kSkipped);
  bool named = true;
  bool engine_altered = false;            // one byte of engine "a"'s own snapshot changed
  std::optional<std::string> chain_hash;  // the chain hash field's bytes, when present

  std::string Bytes() const {
    flatbuffers::FlatBufferBuilder b;
    std::vector<flatbuffers::Offset<fb::FleetEngineState>> list;
    for (const std::string& name : engines) {
      std::string state = EncodeState(State{});
      if (engine_altered) state[4] = static_cast<char>(state[4] ^ 1);
      auto n = b.CreateString(name);
      auto s = b.CreateVector(reinterpret_cast<const std::uint8_t*>(state.data()), state.size());
      list.push_back(fb::CreateFleetEngineState(b, n, s));
    }
    auto engines_vec = b.CreateVector(list);
    auto leaving_vec = b.CreateVectorOfStrings(leaving);
    const std::string digest(64, 'b');
    auto id = fb::CreateWeightIdentityDirect(b, digest.c_str(), "", "/ckpt/b", "run-1", 1);
    auto request =
        fb::CreateFleetUpdateRequestedDirect(b, "u1", fb::FleetUpdateMode::All, 1, 1, "rc-1", id);
    std::vector<flatbuffers::Offset<fb::FleetMember>> members = {
        fb::CreateFleetMemberDirect(b, "a", member_status)};
    auto update = fb::CreateFleetUpdateStateDirect(b, request, &members);
    auto chain = chain_hash.has_value()
                     ? b.CreateVector(reinterpret_cast<const std::uint8_t*>(chain_hash->data()),
                                      chain_hash->size())
                     : flatbuffers::Offset<flatbuffers::Vector<std::uint8_t>>();
    b.Finish(fb::CreateFleetSnapshotState(b, 3, engines_vec, leaving_vec, 0, 0, 0, 0, named, update,
                                          0, 0, chain));
    std::string out(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
    const Hash h = Sha256(out);
    return out.append(reinterpret_cast<const char*>(h.data()), h.size());
  }
};

std::string ForgedError(const ForgedFleet& forged) {
  Result<FleetSnapshot> r = DecodeFleetState(forged.Bytes());
  if (r.ok()) return "decoded";
  EXPECT_EQ(r.status().code(), Code::kCorruption);
  return r.status().message();
}

// Proves a forged snapshot whose hash is valid is still refused, naming why, when it holds two
// engines of one name, a member status out of range or stalled without a plan, too many engines, an
// altered engine snapshot, a leaving engine outside the fleet or a named engine in an unnamed
// fleet; catches a decoder that trusts the hash alone (the forgery's defaults decode, so each
// refusal is the one change's).
TEST(FleetCodec, RefusesForgedFleetsWithAValidHash) {
  Result<FleetSnapshot> valid = DecodeFleetState(ForgedFleet{}.Bytes());
  ASSERT_TRUE(valid.ok()) << valid.status().ToString();
  EXPECT_EQ(valid->fleet.update->members.at("a"), MemberStatus::kSkipped);
  EXPECT_EQ(valid->events, 3u);
  EXPECT_EQ(valid->fleet.events, 3u);

  const auto expect_refused = [](const ForgedFleet& forged, const std::string& why) {
    const std::string error = ForgedError(forged);
    EXPECT_NE(error.find(why), std::string::npos) << error;
  };
  expect_refused(ForgedFleet{.engines = {"a", "a"}}, "duplicate engine 'a'");
  expect_refused(ForgedFleet{.member_status = 7}, "FleetMember.status value 7 out of range");
  // Stalled names a member whose own plan is open: 'a' has none.
  expect_refused(ForgedFleet{.member_status = 6}, "'a''s member status is wrong");
  std::vector<std::string> many;
  for (std::size_t i = 0; i <= kFleetEnginesMax; ++i) many.push_back("e" + std::to_string(i));
  expect_refused(ForgedFleet{.engines = many}, "more than 256 engines");
  expect_refused(ForgedFleet{.engine_altered = true}, "engine 'a': snapshot hash mismatch");
  expect_refused(ForgedFleet{.leaving = {"z"}},
                 "fleet invariant broken: a leaving engine is not in the fleet");
  expect_refused(ForgedFleet{.named = false}, "a named engine in a fleet nobody joined");
}

// Proves a fleet snapshot carries the chain hash it was encoded with, one in the older encoding
// decodes without it, and a chain hash of any size but 32 bytes is refused under a valid hash;
// catches a hash the journal could not compare (dropped, or truncated and read past its end).
TEST(FleetCodec, CarriesTheChainHashAndReadsSnapshotsWithout) {
  const FleetDriver d = BusyFleet();
  Hash chain{};
  for (std::size_t i = 0; i < chain.size(); ++i) chain[i] = static_cast<std::uint8_t>(i + 1);
  Result<FleetSnapshot> with = DecodeFleetState(EncodeFleetState(d.f, d.f.events, chain));
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  EXPECT_EQ(with->chain_hash, std::optional<Hash>(chain));
  EXPECT_EQ(with->fleet, d.f);
  Result<FleetSnapshot> without = DecodeFleetState(EncodeFleetState(d.f, d.f.events));
  ASSERT_TRUE(without.ok()) << without.status().ToString();
  EXPECT_FALSE(without->chain_hash.has_value());
  EXPECT_EQ(without->fleet, d.f);

  Result<FleetSnapshot> forged =
      DecodeFleetState(ForgedFleet{.chain_hash = std::string(32, 'h')}.Bytes());
  ASSERT_TRUE(forged.ok()) << forged.status().ToString();
  EXPECT_EQ(forged->chain_hash->at(0), static_cast<std::uint8_t>('h'));
  for (std::size_t bytes : {std::size_t{0}, std::size_t{31}, std::size_t{33}}) {
    const std::string error = ForgedError(ForgedFleet{.chain_hash = std::string(bytes, 'h')});
    EXPECT_NE(error.find("chain hash of " + std::to_string(bytes) + " bytes, not 32"),
              std::string::npos)
        << error;
  }
}

// Proves a fleet snapshot whose engine holds a rollout id with '\n' is refused as Corruption
// naming the engine and the escaped id; catches the fleet path (the one a journal loads) trusting
// an engine's strings, which the fleet invariants alone would pass.
TEST(FleetCodec, RefusesAnEngineRolloutIdTheFoldNeverAdmitted) {
  FleetDriver d;
  d.join("a");
  d.bootstrap("a");
  const std::string r = d.admit("a");
  FleetState forged = d.f;
  State& a = forged.engines.at("a");
  a.active.emplace("r\n1", a.active.at(r));
  a.active.erase(r);
  ASSERT_TRUE(check_fleet_invariants(forged).empty());
  Result<FleetSnapshot> out = DecodeFleetState(EncodeFleetState(forged, forged.events));
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), Code::kCorruption);
  EXPECT_NE(out.status().message().find("engine 'a': snapshot: active rollout 'r\\n1'"),
            std::string::npos)
      << out.status().message();
}

// Proves a journal whose newest snapshot (valid hash) binds a rollout id holding '\n' does not
// open, Corruption naming the id; catches a journal that loads it and then aborts serve at every
// start, when RecoveryStarted abandons the rollout by an id the fold refuses.
TEST(Codec, AJournalWhoseSnapshotBindsAForgedRolloutIdDoesNotOpen) {
  testing::TempDir dir;
  Options o;
  o.snapshot_every = 1000;
  std::uint64_t head = 0;
  FleetState forged;
  {
    Result<std::unique_ptr<Journal>> j = Journal::Open(dir.path(), o);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (const std::vector<Event>& g : testing::BootstrapGroups()) {
      ASSERT_TRUE((*j)->Append(testing::Group(g)).ok());
    }
    ASSERT_TRUE((*j)->Append(testing::Group({make_admission((*j)->state(), "one")})).ok());
    head = (*j)->head_seq();
    forged = (*j)->fleet_state();
  }
  State& engine = forged.engines.at("");
  engine.active.emplace("a\nb", engine.active.at("one"));
  engine.active.erase("one");
  testing::EditRaw(dir.path(), [&](rocksdb::DB& db,
                                   const std::vector<rocksdb::ColumnFamilyHandle*>& cf) {
    const std::string key = testing::SeqKey(head) + "f";  // the fleet snapshot at the head
    ASSERT_TRUE(db.Put(rocksdb::WriteOptions(), cf[4], key, EncodeFleetState(forged, head)).ok());
    ASSERT_TRUE(db.Flush(rocksdb::FlushOptions(), cf).ok());  // survives however the WAL is read
  });
  Result<std::unique_ptr<Journal>> reopened = Journal::Open(dir.path(), o);
  ASSERT_FALSE(reopened.ok()) << "opened with rollout 'a\\nb' bound";
  EXPECT_EQ(reopened.status().code(), Code::kCorruption);
  EXPECT_NE(reopened.status().message().find("active rollout 'a\\nb'"), std::string::npos)
      << reopened.status().message();
}

// Proves a snapshot's removed engines' counters are checked like its engines': none in a fleet
// nobody joined (its one engine never leaves), and no more events than the snapshot folded;
// catches a forged snapshot that inflates the fleet's totals past its own history.
TEST(FleetCodec, RefusesRemovedCountersTheHistoryCannotHold) {
  FleetState unnamed;
  unnamed.removed.rollouts_admitted = 1;
  Result<FleetSnapshot> a = DecodeFleetState(EncodeFleetState(unnamed, 0));
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), Code::kCorruption);
  EXPECT_NE(a.status().message().find("in a fleet nobody joined"), std::string::npos)
      << a.status().ToString();

  FleetDriver d = BusyFleet();
  FleetState inflated = d.f;
  inflated.removed.events = inflated.events + 1;
  Result<FleetSnapshot> b = DecodeFleetState(EncodeFleetState(inflated, inflated.events));
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("removed engines applied more events"), std::string::npos)
      << b.status().ToString();
}

}  // namespace
}  // namespace rc::journal
