// Codec unit tests: round trips of every event alternative and of State, and clear errors on
// malformed bytes (truncated, oversized, unknown union type, wrong identifier, bad enums, bit
// flips).
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "journal/codec.h"
#include "journal/events_generated.h"
#include "journal/json.h"
#include "tests/journal/test_util.h"

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

}  // namespace
}  // namespace rc::journal
