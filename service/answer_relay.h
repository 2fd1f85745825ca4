// The engine's non-streamed answer on the proxy's hot path, read with simdjson instead of
// nlohmann::json: on a completion of a few tokens, nlohmann's parse, strip and dump cost about
// 15 us of the event loop per request, simdjson's parse under 1 us (bench/proxy/RESULTS.md).
//
// The trace takes exactly what Trajectory::Absorb takes from the nlohmann document (the fields it
// reads are copied into a small nlohmann object and absorbed there, so the rules live in one
// place), and the client gets the engine's document with the proxy's added fields removed as
// StripAdded removes them, in the engine's key order and minified.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "service/proxy_stream.h"

namespace rc::service {

// Larger answers take the nlohmann path: simdjson's document costs about 15 times its text, none
// of it held against the body budget, so only answers this small are read by it, each event
// loop's parser staying within about 15 MiB.
inline constexpr std::size_t kRelayAnswerBytesMax = std::size_t{1} << 20;

// The client's body for the engine's answer `text`, after `trace` absorbed it; nullopt when the
// answer is above kRelayAnswerBytesMax or simdjson does not read it as a JSON object (nothing
// absorbed: the caller reads it the slower way, which decides what is and is not JSON as before).
std::optional<std::string> RelayAnswer(std::string_view text, Trajectory& trace,
                                       const AddedFields& added);

}  // namespace rc::service
