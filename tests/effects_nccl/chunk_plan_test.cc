#include "effects/nccl/chunk_plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace rc::effects::nccl {
namespace {

// Reference: the rule spelled out independently (running sum, close when strictly greater).
std::vector<std::vector<std::size_t>> Reference(const std::vector<std::uint64_t>& sizes,
                                                std::uint64_t buf) {
  std::vector<std::vector<std::size_t>> chunks;
  std::vector<std::size_t> cur;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    cur.push_back(i);
    total += sizes[i];
    if (total > buf) {
      chunks.push_back(cur);
      cur.clear();
      total = 0;
    }
  }
  if (!cur.empty()) chunks.push_back(cur);
  return chunks;
}

// Proves a chunk whose total EQUALS the buffer size stays open (strictly greater closes); catches
// an off-by-one (>=) that would desynchronise sender and vLLM's consumer.
TEST(ChunkPlan, ExactBoundaryStaysOpen) {
  const auto plan = PlanPacked({40, 60, 10, 50}, 100);
  ASSERT_EQ(plan.ops.size(), 2u);
  EXPECT_EQ(plan.ops[0], (BroadcastOp{0, 3, 110, true}));  // 100 == buf: still open; +10 crosses
  EXPECT_EQ(plan.ops[1], (BroadcastOp{3, 1, 50, true}));
  EXPECT_EQ(plan.total_bytes, 160u);
  EXPECT_EQ(plan.max_op_bytes, 110u);
}

// Proves the crossing tensor is included and an oversize tensor gets its own chunk; catches a
// planner that splits tensors or closes before adding the crossing one.
TEST(ChunkPlan, CrossingAndOversize) {
  const auto plan = PlanPacked({30, 500, 30, 30, 50}, 100);
  ASSERT_EQ(plan.ops.size(), 2u);
  EXPECT_EQ(plan.ops[0], (BroadcastOp{0, 2, 530, true}));
  EXPECT_EQ(plan.ops[1], (BroadcastOp{2, 3, 110, true}));
  const auto big_first = PlanPacked({500, 1}, 100);
  ASSERT_EQ(big_first.ops.size(), 2u);
  EXPECT_EQ(big_first.ops[0], (BroadcastOp{0, 1, 500, true}));
  EXPECT_EQ(big_first.ops[1], (BroadcastOp{1, 1, 1, true}));
}

// Proves empty input makes no broadcast and zero-byte trailing tensors still flush one (empty)
// chunk, as vLLM flushes any non-empty tensor list; catches a sender that skips it and hangs the
// receiver waiting for a broadcast.
TEST(ChunkPlan, EmptyAndZeroSized) {
  EXPECT_TRUE(PlanPacked({}, 100).ops.empty());
  const auto plan = PlanPacked({101, 0}, 100);
  ASSERT_EQ(plan.ops.size(), 2u);
  EXPECT_EQ(plan.ops[1], (BroadcastOp{1, 1, 0, true}));
}

// Proves the planner equals the independently written reference on random inputs, with every
// tensor in exactly one chunk, in order; catches any divergence in the rule.
TEST(ChunkPlan, MatchesReferenceOnRandomInputs) {
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 500; ++trial) {
    const std::uint64_t buf = 1 + rng() % 1000;
    std::vector<std::uint64_t> sizes(rng() % 40);
    for (auto& s : sizes) s = rng() % 3 == 0 ? rng() % 3000 : rng() % 200;
    const auto plan = PlanPacked(sizes, buf);
    const auto ref = Reference(sizes, buf);
    ASSERT_EQ(plan.ops.size(), ref.size());
    std::size_t next = 0;
    for (std::size_t c = 0; c < ref.size(); ++c) {
      EXPECT_EQ(plan.ops[c].first_tensor, ref[c].front());
      EXPECT_EQ(plan.ops[c].tensor_count, ref[c].size());
      EXPECT_EQ(plan.ops[c].first_tensor, next);
      next += plan.ops[c].tensor_count;
      std::uint64_t bytes = 0;
      for (std::size_t i : ref[c]) bytes += sizes[i];
      EXPECT_EQ(plan.ops[c].bytes, bytes);
    }
    EXPECT_EQ(next, sizes.size());
    EXPECT_EQ(plan.total_bytes, std::accumulate(sizes.begin(), sizes.end(), std::uint64_t{0}));
  }
}

// Proves unpacked mode is one broadcast per tensor in order, typed (not packed); catches a
// sender that packs when the engine expects per-tensor dtype broadcasts.
TEST(ChunkPlan, UnpackedOnePerTensor) {
  Manifest m;
  m.tensors = {{"a", DType::kBFloat16, {3, 4}}, {"b", DType::kFloat32, {5}}};
  const auto plan = PlanFor(m, /*packed=*/false, 1);
  ASSERT_EQ(plan.ops.size(), 2u);
  EXPECT_EQ(plan.ops[0], (BroadcastOp{0, 1, 24, false}));
  EXPECT_EQ(plan.ops[1], (BroadcastOp{1, 1, 20, false}));
  const auto packed = PlanFor(m, /*packed=*/true, 1ull << 30);
  ASSERT_EQ(packed.ops.size(), 1u);
  EXPECT_EQ(packed.ops[0], (BroadcastOp{0, 2, 44, true}));
}

// Proves packed plans that vLLM's unpack cannot view are refused before anything is sent: a 0-d
// tensor, and a bf16 tensor at an odd byte offset after a 3-byte int8 tensor; the same manifests
// pass unpacked, and an aligned mixed manifest passes packed. Would catch a sender that
// broadcasts a chunk the engine then fails on with its layers mid-reload.
TEST(ChunkPlan, PackableOnlyWhenVllmCanViewEveryTensor) {
  auto spec = [](const char* n, DType d, std::vector<std::uint64_t> shape) {
    return TensorSpec{n, d, std::move(shape)};
  };
  Manifest scalar{{spec("a", DType::kFloat32, {4}), spec("s", DType::kFloat32, {})}};
  Manifest odd{{spec("q", DType::kInt8, {3}), spec("w", DType::kBFloat16, {2, 2})}};
  Manifest aligned{{spec("w", DType::kBFloat16, {3}), spec("x", DType::kBFloat16, {1}),
                    spec("f", DType::kFloat32, {5}), spec("q", DType::kInt8, {7})}};
  const Status s1 = CheckPackable(scalar, PlanFor(scalar, true, 1 << 20));
  EXPECT_FALSE(s1.ok());
  EXPECT_NE(s1.ToString().find("'s'"), std::string::npos) << s1.ToString();
  const Status s2 = CheckPackable(odd, PlanFor(odd, true, 1 << 20));
  EXPECT_FALSE(s2.ok());
  EXPECT_NE(s2.ToString().find("offset 3"), std::string::npos) << s2.ToString();
  EXPECT_TRUE(CheckPackable(scalar, PlanFor(scalar, false, 1 << 20)).ok());
  EXPECT_TRUE(CheckPackable(odd, PlanFor(odd, false, 1 << 20)).ok());
  EXPECT_TRUE(CheckPackable(aligned, PlanFor(aligned, true, 1 << 20)).ok());
  // Offsets restart in each chunk: with a 3-byte buffer the int8 tensor closes its own chunk.
  EXPECT_TRUE(CheckPackable(odd, PlanFor(odd, true, 2)).ok());
}

}  // namespace
}  // namespace rc::effects::nccl
