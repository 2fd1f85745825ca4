// Reading the engine's weight digest: the collective_rpc reply of one or several workers becomes
// the journal's WeightDigest, malformed replies become an absent digest with a reason, and the
// vLLM double answers rc_weight_digest like the worker extension.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "effects/http/sequence_transfer.h"
#include "effects/http/weight_digest.h"
#include "fixtures/vllm_double.h"
#include "statemachine/state.h"

namespace rc::effects {
namespace {

using nlohmann::json;

json Worker(int rank, const std::string& combined, json tensors) {
  return json{{"algorithm", "rcd1"}, {"combined", combined}, {"tensors", std::move(tensors)},
              {"bytes", 100},        {"rank", rank},         {"instance", "x"}};
}

std::string H(char c) { return std::string(32, c); }

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
