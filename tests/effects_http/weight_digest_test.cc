// Reading the engine's weight digest: the collective_rpc reply of one or several workers becomes
// the journal's WeightDigest, malformed replies become an absent digest with a reason, and the
// vLLM double answers rc_weight_digest like the worker extension.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "effects/http/sequence_transfer.h"
#include "effects/http/weight_digest.h"
#include "fixtures/vllm_double.h"
#include "journal/codec.h"
#include "statemachine/state.h"

namespace rc::effects {
namespace {

using nlohmann::json;

json Worker(int rank, const std::string& combined, json tensors) {
  return json{{"algorithm", "rcd1"}, {"combined", combined}, {"tensors", std::move(tensors)},
              {"bytes", 100},        {"rank", rank},         {"instance", "x"}};
}

std::string H(char c) { return std::string(32, c); }

// One worker's tensors whose names, 128-hex digests and entry overheads add up to exactly
// `bytes`, name lengths multiples of 4 where `bytes` allows: no entry then encodes with less
// padding than kTensorDigestEntryOverheadBytes assumes.
json TensorsOfEncodedBytes(std::size_t bytes) {
  const std::size_t fixed = 128 + kTensorDigestEntryOverheadBytes;
  const std::size_t n =
      (bytes + rc::kTensorNameBytesMax + fixed - 1) / (rc::kTensorNameBytesMax + fixed);
  const std::size_t quarters = (bytes - n * fixed) / 4;
  json tensors = json::object();
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t size = 4 * (quarters / n + (i < quarters % n ? 1 : 0));
    if (i + 1 == n) size += (bytes - n * fixed) % 4;
    std::string name = std::to_string(100000 + i);  // unique: every name is longer than this
    name.resize(size, '.');
    tensors[name] = std::string(128, 'e');
  }
  return tensors;
}

// 1024 tensors "t0000".."t1023" with 32-hex digests, dealt to `workers` workers.
std::vector<json> ShortNamedTensors(int workers) {
  std::vector<json> out(workers, json::object());
  for (int i = 0; i < static_cast<int>(kTensorDigestsMax); ++i) {
    out[i % workers]["t" + std::to_string(10000 + i).substr(1)] = H('1');
  }
  return out;
}

// Evidence at its largest: a text of kTextBytesMax, scalars off the defaults FlatBuffers omits.
HttpEvidence LargestHttp() {
  HttpEvidence h;
  h.transport = Transport::kBroken;
  h.http_status = 999;
  h.body_parsed = true;
  h.latency_us = ~std::uint64_t{0};
  h.error = std::string(kTextBytesMax, 'x');
  return h;
}

// The largest record that journals `digest`: each event that carries one, every other field (the
// digest's error too) at the fold's bound, in a fleet's record (a named engine).
std::size_t LargestRecordBytes(WeightDigest digest) {
  const std::string text(kTextBytesMax, 'x');
  digest.error = text;
  EXPECT_TRUE(check_weight_digest(digest).ok()) << check_weight_digest(digest).ToString();
  const EngineProbed probed{.http = LargestHttp(),
                            .engine_version = text,
                            .reported_label = text,
                            .is_paused_known = true,
                            .is_paused = true,
                            .engine_instance = text,
                            .label_before = text,
                            .resumed_before = true,
                            .digest = digest};
  const ValidationObserved validated{.http = LargestHttp(),
                                     .reported_label = text,
                                     .checks_passed = false,
                                     .detail = text,
                                     .engine_instance = text,
                                     .digest = digest,
                                     .is_paused_known = true,
                                     .is_paused = false};
  const EngineMonitored monitored{.http = LargestHttp(),
                                  .reported_label = text,
                                  .is_paused_known = true,
                                  .is_paused = true,
                                  .engine_instance = text,
                                  .last_ok_wall_ms = -1,
                                  .updates_seen = ~std::uint64_t{0},
                                  .digest = digest};
  std::size_t largest = 0;
  for (const Event& e : std::vector<Event>{probed, validated, monitored}) {
    journal::Record r;
    r.seq = r.cause_seq = ~std::uint64_t{0};
    r.wall_time_ms = -1;
    r.engine = std::string(kIdBytesMax, 'n');
    r.event = e;
    largest = std::max(largest, journal::EncodeRecord(r).size());
  }
  return largest;
}

// One worker's tensors and combined digest are taken as they are, sorted by name; catches a
// parser that reorders, renames or recombines a single worker's answer.
TEST(WeightDigest, OneWorkerIsTakenAsIs) {
  const WeightDigest d = ParseWeightDigestReply(
      json{{"results", json::array({Worker(0, H('c'), json{{"b", H('2')}, {"a", H('1')}})})}});
  ASSERT_TRUE(d.present()) << d.error;
  EXPECT_EQ(d.algorithm, "rcd1");
  EXPECT_EQ(d.combined, H('c'));
  EXPECT_EQ(d.bytes, 100u);
  ASSERT_EQ(d.tensors.size(), 2u);
  EXPECT_EQ(d.tensors[0], (TensorDigest{"a", H('1')}));
  EXPECT_EQ(d.tensors[1], (TensorDigest{"b", H('2')}));
}

// Several workers: names carry the rank, the combined digest covers every worker in rank order
// whatever order they answered in; catches a combined digest that ignores a worker's shard.
TEST(WeightDigest, SeveralWorkersAreCombinedInRankOrder) {
  const json w0 = Worker(0, H('a'), json{{"w", H('1')}});
  const json w1 = Worker(1, H('b'), json{{"w", H('2')}});
  const WeightDigest d01 = ParseWeightDigestReply(json{{"results", json::array({w0, w1})}});
  const WeightDigest d10 = ParseWeightDigestReply(json{{"results", json::array({w1, w0})}});
  ASSERT_TRUE(d01.present()) << d01.error;
  EXPECT_EQ(d01.combined, d10.combined);
  EXPECT_EQ(d01.combined.size(), 64u);
  ASSERT_EQ(d01.tensors.size(), 2u);
  EXPECT_EQ(d01.tensors[0].name, "r0/w");
  EXPECT_EQ(d01.tensors[1].name, "r1/w");
  EXPECT_EQ(d01.bytes, 200u);
  const json w1_changed = Worker(1, H('d'), json{{"w", H('3')}});
  EXPECT_NE(ParseWeightDigestReply(json{{"results", json::array({w0, w1_changed})}}).combined,
            d01.combined);
}

// Tensors too many for one journal record are replaced by one entry per worker; catches a digest
// that would make the validation record exceed the journal's record bound.
TEST(WeightDigest, TooManyTensorsFallBackToWorkers) {
  json many = json::object();
  for (int i = 0; i < 800; ++i) many["model.layers." + std::to_string(i) + ".mlp.weight"] = H('1');
  const WeightDigest d = ParseWeightDigestReply(
      json{{"results", json::array({Worker(0, H('a'), many), Worker(1, H('b'), many)})}});
  ASSERT_TRUE(d.present()) << d.error;
  ASSERT_EQ(d.tensors.size(), 2u);
  EXPECT_EQ(d.tensors[0], (TensorDigest{"r0", H('a')}));
  const WeightDigest one =
      ParseWeightDigestReply(json{{"results", json::array({Worker(0, H('a'), many)})}});
  EXPECT_TRUE(one.present());
  EXPECT_TRUE(one.tensors.empty());
}

// Malformed replies give an absent digest with a reason, never an exception or a partial digest;
// catches engine bytes (control characters, upper-case or non-hex digests) reaching the journal.
TEST(WeightDigest, MalformedRepliesAreAbsentWithAReason) {
  const std::vector<json> bad = {
      json::array(),
      json{{"results", json::array()}},
      json{{"results", json::array({42})}},
      json{{"results", json::array({Worker(0, "XYZ", json::object())})}},
      json{{"results", json::array({Worker(0, H('A'), json::object())})}},
      json{{"results", json::array({Worker(0, H('a'), json{{"a\nb", H('1')}})})}},
      json{{"results", json::array({Worker(0, H('a'), json{{"a", "nothex"}})})}},
      json{{"results", json::array({Worker(-1, H('a'), json::object())})}},
  };
  for (const json& body : bad) {
    const WeightDigest d = ParseWeightDigestReply(body);
    EXPECT_FALSE(d.present()) << body.dump();
    EXPECT_FALSE(d.error.empty()) << body.dump();
    EXPECT_TRUE(d.tensors.empty());
  }
}

// Whatever an engine answers, the digest is one the fold accepts in a record (or absent with a
// reason): more workers than digest entries, two workers of one rank, a name that the rank
// prefix makes too long. Catches an abort in the executor (more workers than entries tripped an
// assertion) and a digest the fold refuses, which failed the update and blinded the monitor.
TEST(WeightDigest, EveryAnswerIsOneTheFoldAccepts) {
  json many_workers = json::array();
  for (int i = 0; i < static_cast<int>(kTensorDigestsMax) + 1; ++i) {
    many_workers.push_back(Worker(i, H('a'), json{{"w", H('1')}}));
  }
  const WeightDigest wide = ParseWeightDigestReply(json{{"results", many_workers}});
  ASSERT_TRUE(wide.present()) << wide.error;
  EXPECT_TRUE(wide.tensors.empty());
  EXPECT_TRUE(check_weight_digest(wide).ok());
  json unranked = Worker(0, H('a'), json{{"w", H('1')}});
  unranked.erase("rank");
  const std::vector<json> refused = {
      json{{"results", json::array({unranked, unranked})}},
      json{{"results", json::array({Worker(3, H('a'), json{{"w", H('1')}}),
                                    Worker(3, H('b'), json{{"v", H('2')}})})}},
      json{{"results", json::array({Worker(0, H('a'), json{{std::string(256, 'n'), H('1')}}),
                                    Worker(1, H('b'), json{{"w", H('2')}})})}},
  };
  for (const json& body : refused) {
    const WeightDigest d = ParseWeightDigestReply(body);
    EXPECT_FALSE(d.present()) << body.dump().substr(0, 200);
    EXPECT_FALSE(d.error.empty());
    EXPECT_TRUE(check_weight_digest(d).ok()) << check_weight_digest(d).ToString();
  }
}

// A digest at the encoded bound keeps its tensors and journals within kRecordBytesMax beside
// every other field of its event at its bound; catches a bound on content bytes alone, whose
// digests encoded past a record, failed the update outcome_unknown and blinded the monitor.
TEST(WeightDigest, ADigestAtTheBoundFitsAJournalRecord) {
  json at_bound =
      Worker(0, std::string(kDigestBytesMax, 'c'), TensorsOfEncodedBytes(kDigestTensorBytesMax));
  at_bound["algorithm"] = std::string(kIdBytesMax, 'a');
  const WeightDigest d = ParseWeightDigestReply(json{{"results", json::array({at_bound})}});
  ASSERT_TRUE(d.present()) << d.error;
  EXPECT_EQ(d.tensors.size(), at_bound["tensors"].size());
  EXPECT_LE(LargestRecordBytes(d), journal::kRecordBytesMax);
}

// Past the encoded bound a digest falls back as before (worker entries, else no tensors; the
// combined digest kept) and journals; catches 1024 short names whose content fits the bytes but
// encode to ~70 KB, and worker entries that were never held to the bytes at all.
TEST(WeightDigest, ADigestPastTheBoundFallsBackAndFitsAJournalRecord) {
  const json past = TensorsOfEncodedBytes(kDigestTensorBytesMax + 1);
  const WeightDigest one_past =
      ParseWeightDigestReply(json{{"results", json::array({Worker(0, H('a'), past)})}});
  ASSERT_TRUE(one_past.present()) << one_past.error;
  EXPECT_TRUE(one_past.tensors.empty());
  EXPECT_EQ(one_past.combined, H('a'));

  const std::vector<json> all = ShortNamedTensors(1);
  const WeightDigest one =
      ParseWeightDigestReply(json{{"results", json::array({Worker(0, H('a'), all[0])})}});
  ASSERT_TRUE(one.present()) << one.error;
  EXPECT_TRUE(one.tensors.empty());
  EXPECT_LE(LargestRecordBytes(one), journal::kRecordBytesMax);
  const std::vector<json> halves = ShortNamedTensors(2);
  const WeightDigest two = ParseWeightDigestReply(
      json{{"results", json::array({Worker(0, H('a'), halves[0]), Worker(1, H('b'), halves[1])})}});
  ASSERT_TRUE(two.present()) << two.error;
  ASSERT_EQ(two.tensors.size(), 2u);
  EXPECT_EQ(two.tensors[1], (TensorDigest{"r1", H('b')}));
  EXPECT_LE(LargestRecordBytes(two), journal::kRecordBytesMax);

  // As many workers as entries, with long ranks and digests: their entries do not fit either.
  json wide = json::array();
  for (int i = 0; i < static_cast<int>(kTensorDigestsMax); ++i) {
    wide.push_back(Worker(0, std::string(kDigestBytesMax, 'f'), json{{"w", H('1')}}));
    wide.back()["rank"] = std::int64_t{1000000000000000000} + i;
  }
  const WeightDigest workers = ParseWeightDigestReply(json{{"results", wide}});
  ASSERT_TRUE(workers.present()) << workers.error;
  EXPECT_TRUE(workers.tensors.empty());
  EXPECT_LE(LargestRecordBytes(workers), journal::kRecordBytesMax);
}

// Against the double over loopback: the extension answers a digest that changes with a completed
// update and not otherwise; without the extension the digest is absent and says why. Catches a
// double whose digest would let every validation pass.
TEST(WeightDigest, TheDoubleAnswersLikeTheExtension) {
  fixtures::VllmDoubleOptions o;
  o.worker_extension_cls = kWorkerExtensionClass;
  fixtures::VllmDouble engine(o);
  ASSERT_GT(engine.Start(), 0);
  EngineClient client(engine.base_url());
  const WeightDigest before = ReadWeightDigest(client);
  ASSERT_TRUE(before.present()) << before.error;
  EXPECT_EQ(before.tensors.size(), 4u);
  EXPECT_EQ(ReadWeightDigest(client), before);

  TransferTarget target;
  target.update_id = "u1";
  target.target = WeightVersion{1, "rc-1"};
  target.source_uri = "synthetic:4x32:1";
  HttpSequenceTransfer transfer(client, detect_protocol("0.25.1"));
  // An update the receiver acknowledges but drops leaves the digest unchanged...
  engine.SetWeightsFault(fixtures::WeightsFault::kIgnore);
  ASSERT_TRUE(transfer.Transfer(target, 10000).acknowledged);
  EXPECT_EQ(ReadWeightDigest(client).combined, before.combined);
  // ... one that lands changes every tensor it named.
  engine.SetWeightsFault(fixtures::WeightsFault::kApply);
  ASSERT_TRUE(transfer.Transfer(target, 10000).acknowledged);
  const WeightDigest after = ReadWeightDigest(client);
  ASSERT_TRUE(after.present());
  EXPECT_NE(after.combined, before.combined);
  EXPECT_EQ(digest_difference(before, after).find("; 4 of 4 tensors differ"), 0u)
      << digest_difference(before, after);

  fixtures::VllmDoubleOptions plain;
  fixtures::VllmDouble no_ext(plain);
  ASSERT_GT(no_ext.Start(), 0);
  EngineClient other(no_ext.base_url());
  const WeightDigest none = ReadWeightDigest(other);
  EXPECT_FALSE(none.present());
  EXPECT_NE(none.error.find("computes no weight digest"), std::string::npos) << none.error;
}

}  // namespace
}  // namespace rc::effects
