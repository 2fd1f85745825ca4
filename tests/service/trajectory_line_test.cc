// Property test (rapidcheck): the trajectories file's line written straight to text is byte for
// byte nlohmann's ASCII dump of the equivalent object, for random bindings and traces whose strings
// hold control characters, quotes, backslashes and invalid UTF-8 and whose engine-given arrays
// hold any JSON. Catches a hand-written line that drifts from what audit and earlier files read
// (a key out of order, an escape nlohmann writes differently, a number printed another way), and
// an engine's U+2028 splitting a record in two for readers that split lines on it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "journal/json.h"
#include "service/trajectory_line.h"

#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

namespace rc::service {
namespace {

using json = nlohmann::json;

// Bytes biased towards what needs escaping: controls (NUL included), '"', '\\', and bytes >= 0x80
// that may or may not form valid UTF-8.
std::string RandomText(std::mt19937_64& rng) {
  static const std::string kAlphabet = std::string("ab-_:/.0 \"\\\t\n\x01\x1f\x7f", 17) +
                                       "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xff\xc0\x80" +
                                       "\xe2\x80\xa8\xe2\x80\xa9\xc2\x85";  // line separators
  std::string s;
  const std::size_t n = rng() % 12;
  const bool plain = rng() % 2 == 0;
  for (std::size_t i = 0; i < n; ++i) {
    s += plain ? static_cast<char>('a' + rng() % 26) : kAlphabet[rng() % kAlphabet.size()];
  }
  return s;
}

json RandomScalar(std::mt19937_64& rng) {
  switch (rng() % 6) {
    case 0:
      return nullptr;
    case 1:
      return static_cast<std::int64_t>(rng() % 200000) - 100;
    case 2:
      return -std::ldexp(static_cast<double>(rng() % 1000000), -static_cast<int>(rng() % 40));
    case 3:
      return static_cast<double>(rng() % 7) - 3.0;
    case 4:
      return RandomText(rng);
    default:
      return rng() % 2 == 0;
  }
}

json RandomArray(std::mt19937_64& rng) {
  json a = json::array();
  const std::size_t n = rng() % 8;
  for (std::size_t i = 0; i < n; ++i) a.push_back(RandomScalar(rng));
  return a;
}

Trajectory RandomTrace(std::mt19937_64& rng) {
  Trajectory t;
  if (rng() % 4 != 0) t.prompt_token_ids = RandomArray(rng);
  const std::size_t choices = rng() % 3;
  for (std::size_t c = 0; c < choices; ++c) {
    ChoiceTrace& ch = t.choices[static_cast<std::int64_t>(rng() % 5) - 1];
    for (std::size_t i = rng() % 6; i > 0; --i) {
      ch.token_ids.push_back(static_cast<std::int64_t>(rng()));
    }
    ch.logprobs = RandomArray(rng);
    ch.finish_reason = RandomText(rng);
  }
  if (rng() % 2 == 0) t.usage_prompt = rng();
  if (rng() % 2 == 0) t.usage_completion = rng() % 5000;
  t.truncated = rng() % 2 == 0;
  return t;
}

RolloutAdmitted RandomBinding(std::mt19937_64& rng) {
  RolloutAdmitted b;
  b.rollout_id = RandomText(rng);
  b.version.generation = rng();
  b.version.label = RandomText(rng);
  b.identity.manifest_digest = RandomText(rng);
  b.identity.content_digest = RandomText(rng);
  b.identity.checkpoint = RandomText(rng);
  b.identity.run = RandomText(rng);
  b.identity.step = static_cast<std::int64_t>(rng() % 1000) - 1;
  return b;
}

// The line as the proxy built it before: an nlohmann object, the reference the text must match.
json TrajectoryLineJson(const TrajectoryLineFields& f) {
  json outputs = json::array();
  for (const auto& [index, ch] : f.trace.choices) {
    outputs.push_back({{"index", index},
                       {"token_ids", ch.token_ids},
                       {"logprobs", ch.logprobs},
                       {"finish_reason", ch.finish_reason}});
  }
  json line = {{"rollout_id", f.binding.rollout_id},
               {"admission_seq", f.admission_seq},
               {"route", f.route},
               {"stream", f.stream},
               {"version", journal::WeightVersionToJson(f.binding.version)},
               {"identity", journal::WeightIdentityToJson(f.binding.identity)},
               {"cache_salt", f.cache_salt},
               {"outcome", f.outcome},
               {"note", f.note},
               {"prompt_token_ids", f.trace.prompt_token_ids},
               {"outputs", std::move(outputs)},
               {"prompt_tokens", f.trace.prompt_count()},
               {"completion_tokens", f.trace.completion_count()},
               {"truncated", f.trace.Truncated()}};
  if (!f.engine.empty()) {
    line["engine"] = f.engine;
    line["fleet_generation"] = f.fleet_generation;
  }
  return line;
}

// Proves the text equals nlohmann's dump of the object for 200 random lines per case.
RC_GTEST_PROP(TrajectoryLine, TextIsTheDumpOfTheObject, (std::uint64_t seed)) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200; ++i) {
    const RolloutAdmitted binding = RandomBinding(rng);
    const Trajectory trace = RandomTrace(rng);
    const std::string salt = RandomText(rng), note = RandomText(rng), route = RandomText(rng);
    const std::string engine = rng() % 2 == 0 ? "" : "engine-" + std::to_string(rng() % 100);
    const TrajectoryLineFields f{binding,     rng(), route, rng() % 2 == 0, salt,
                                 "completed", note,  trace, engine,         rng()};
    const std::string expected =
        TrajectoryLineJson(f).dump(-1, ' ', true, json::error_handler_t::replace);
    const std::string text = TrajectoryLineText(f);
    RC_ASSERT(text == expected);
    // One line for every reader: ASCII only, so no U+2028, U+2029 or U+0085 either.
    const auto ascii_printable = [](char c) { return c >= 0x20 && c <= 0x7e; };
    RC_ASSERT(std::all_of(text.begin(), text.end(), ascii_printable));
  }
}

}  // namespace
}  // namespace rc::service
