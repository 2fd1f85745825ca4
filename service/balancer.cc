// The fleet balancer's choice (see balancer.h). The hashes are written here because they must be
// stable across builds and platforms (a key keeps its engine across restarts of serve).
#include "service/balancer.h"

#include <algorithm>

#include "statemachine/status.h"

namespace rc::service {
namespace {

std::uint64_t Fnv1a(const char* data, std::size_t n) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ULL;
  }
  return h;
}

// splitmix64's finaliser: spreads a combined key over all 64 bits.
std::uint64_t Mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

bool LessLoaded(const EngineLoad& a, const EngineLoad& b) {
  return a.outstanding != b.outstanding ? a.outstanding < b.outstanding : a.engine < b.engine;
}

// Rendezvous hashing: the engine whose (key, engine) score is highest (ties: the lower id).
const EngineLoad& Rendezvous(const std::vector<const EngineLoad*>& candidates, std::uint64_t key) {
  RC_CHECK(!candidates.empty());
  auto score = [key](const EngineLoad* e) {
    return Mix(key ^ Fnv1a(e->engine.data(), e->engine.size()));
  };
  auto lower = [&](const EngineLoad* a, const EngineLoad* b) {
    const std::uint64_t sa = score(a), sb = score(b);
    return sa != sb ? sa < sb : a->engine > b->engine;
  };
  return **std::max_element(candidates.begin(), candidates.end(), lower);
}

std::vector<const EngineLoad*> NewestGeneration(const std::vector<EngineLoad>& admitting) {
  std::uint64_t newest = 0;
  for (const EngineLoad& e : admitting) newest = std::max(newest, e.generation);
  std::vector<const EngineLoad*> out;
  for (const EngineLoad& e : admitting) {
    if (e.generation == newest) out.push_back(&e);
  }
  return out;
}

}  // namespace

std::optional<std::string> PickEngine(const std::vector<EngineLoad>& admitting,
                                      std::optional<std::uint64_t> affinity_key,
                                      std::uint32_t affinity_slack) {
  if (admitting.empty()) return std::nullopt;
  const EngineLoad& least = *std::min_element(admitting.begin(), admitting.end(), LessLoaded);
  if (!affinity_key) return least.engine;
  const EngineLoad& chosen = Rendezvous(NewestGeneration(admitting), *affinity_key);
  const bool overloaded = chosen.outstanding > least.outstanding + std::uint64_t{affinity_slack};
  return overloaded ? least.engine : chosen.engine;
}

std::uint64_t AffinityKey(const std::string& text, std::size_t prefix_bytes) {
  return Fnv1a(text.data(), std::min(prefix_bytes, text.size()));
}

}  // namespace rc::service
