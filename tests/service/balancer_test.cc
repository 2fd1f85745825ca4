// The fleet balancer's choice: least outstanding, rendezvous affinity within the newest
// generation, the slack that overrides affinity, and stability when an engine leaves.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "service/balancer.h"

namespace rc::service {
namespace {

std::vector<EngineLoad> Fleet(int n, std::uint64_t generation = 1) {
  std::vector<EngineLoad> out;
  for (int i = 0; i < n; ++i) out.push_back({"e" + std::to_string(i), generation, 0});
  return out;
}

// Without a key the least loaded engine takes the rollout (the lower id on a tie); catches a
// balancer that piles rollouts on one replica.
TEST(Balancer, LeastOutstandingWithoutAKey) {
  std::vector<EngineLoad> f = Fleet(3);
  f[0].outstanding = 5;
  f[1].outstanding = 2;
  f[2].outstanding = 2;
  EXPECT_EQ(PickEngine(f, std::nullopt, 0), "e1");
  f[2].outstanding = 1;
  EXPECT_EQ(PickEngine(f, std::nullopt, 0), "e2");
  EXPECT_EQ(PickEngine({}, std::nullopt, 0), std::nullopt);
}

// A key keeps its engine; keys spread over every engine; when one engine leaves only the keys it
// held move; catches an affinity that reshuffles every prefix cache when the fleet changes.
TEST(Balancer, AffinityIsStableAndMovesOnlyTheLeaversKeys) {
  const std::vector<EngineLoad> four = Fleet(4);
  std::vector<EngineLoad> three = four;
  three.erase(three.begin() + 2);  // e2 leaves
  std::map<std::string, int> spread;
  int moved_from_others = 0;
  for (std::uint64_t k = 0; k < 4000; ++k) {
    const std::uint64_t key = AffinityKey("prompt " + std::to_string(k), 64);
    const std::string before = *PickEngine(four, key, 1000);
    EXPECT_EQ(PickEngine(four, key, 1000), before);
    spread[before]++;
    const std::string after = *PickEngine(three, key, 1000);
    if (before != "e2" && after != before) ++moved_from_others;
  }
  EXPECT_EQ(moved_from_others, 0);
  ASSERT_EQ(spread.size(), 4u);
  for (const auto& [engine, n] : spread) EXPECT_GT(n, 800) << engine;  // ~1000 each
}

// Affinity stays within the newest generation present, and an engine more than the slack above
// the least loaded gives the rollout away; catches prefixes pinned to an older weight state, or
// affinity that overloads one replica.
TEST(Balancer, AffinityWithinTheNewestGenerationAndBoundedBySlack) {
  std::vector<EngineLoad> f = Fleet(4);
  f[0].generation = f[1].generation = 2;  // e0, e1 updated; e2, e3 still serve generation 1
  for (std::uint64_t k = 0; k < 500; ++k) {
    const std::string e = *PickEngine(f, AffinityKey(std::to_string(k), 16), 1000);
    EXPECT_TRUE(e == "e0" || e == "e1") << e;
  }
  const std::uint64_t key = AffinityKey("a fixed prompt", 64);
  const std::string home = *PickEngine(f, key, 4);
  for (EngineLoad& e : f) e.outstanding = e.engine == home ? 10 : 6;
  EXPECT_EQ(PickEngine(f, key, 4), home);  // 10 <= 6 + 4
  for (EngineLoad& e : f) e.outstanding = e.engine == home ? 11 : (e.engine == "e3" ? 6 : 7);
  EXPECT_EQ(PickEngine(f, key, 4), "e3");  // 11 > 6 + 4: the least loaded takes it
}

}  // namespace
}  // namespace rc::service
