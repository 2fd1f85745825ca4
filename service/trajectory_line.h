// The trajectories file's line for one proxied rollout: what it was bound to and what it saw.
// Written straight to text, since building the equivalent JSON object for every request was the
// costliest part of a rollout's finish; the text is byte for byte what nlohmann's dump of that
// object prints (sorted keys, invalid UTF-8 as U+FFFD); the test builds that object and compares.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "service/proxy_stream.h"
#include "statemachine/events.h"

namespace rc::service {

struct TrajectoryLineFields {
  const RolloutAdmitted& binding;
  std::uint64_t admission_seq = 0;
  std::string_view route;
  bool stream = false;
  std::string_view cache_salt;
  std::string_view outcome;
  std::string_view note;
  const Trajectory& trace;
  // A fleet's rollout: the engine it was admitted to and that engine's fleet generation (both
  // left out of the line when `engine` is empty: one engine).
  std::string_view engine = {};
  std::uint64_t fleet_generation = 0;
};

// One line of JSON, without its newline.
std::string TrajectoryLineText(const TrajectoryLineFields& f);

}  // namespace rc::service
