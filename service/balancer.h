// Which engine of a fleet a new rollout goes to: the proxy's choice among the engines the fleet
// admits to now (statemachine/fleet.h, admitting_engines), by load or by affinity.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rc::service {

struct EngineLoad {
  std::string engine;
  std::uint64_t generation = 0;   // the fleet generation it holds
  std::uint32_t outstanding = 0;  // proxied requests in flight to it
};

// Without a key: the engine with the fewest outstanding requests (ties: the lower id). With an
// affinity key (e.g. a hash of the prompt's prefix, so repeated prefixes meet their cached KV):
// the engine the key hashes to by rendezvous hashing among the engines of the newest generation
// present (an engine leaving moves only the keys it held; caches of one weight state are never
// mixed with another's), unless it has more than `affinity_slack` requests above the least
// loaded engine, which then takes it. nullopt when no engine admits.
std::optional<std::string> PickEngine(const std::vector<EngineLoad>& admitting,
                                      std::optional<std::uint64_t> affinity_key,
                                      std::uint32_t affinity_slack);

// A 64-bit key of the first `prefix_bytes` bytes of `text` (FNV-1a), for PickEngine's affinity.
std::uint64_t AffinityKey(const std::string& text, std::size_t prefix_bytes);

}  // namespace rc::service
