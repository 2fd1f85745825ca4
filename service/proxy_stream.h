// The proxy's reading of engine responses: what a completion (or each streamed chunk) tells about
// the rollout's trajectory and token counts, the journal parts it becomes, and the client event a
// streamed engine chunk is turned into (the fields the proxy added removed). Pure functions of the
// engine's JSON, apart from the proxy's sockets so that tests and fuzz targets run the same code.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "statemachine/events.h"

namespace rc::service {

using json = nlohmann::json;

inline constexpr std::size_t kTrajectoryEntriesMax = std::size_t{1} << 20;  // per rollout
// Journal records one trajectory becomes, at most.
inline constexpr std::size_t kTrajectoryPartsMax =
    kTrajectoryEntriesMax / kTrajectoryTokensPerRecordMax + 1;

struct ChoiceTrace {
  std::vector<std::int64_t> token_ids;
  json logprobs = json::array();  // one number (or null) per output token
  std::string finish_reason;
};

struct Trajectory {
  json prompt_token_ids;  // null until seen
  std::map<std::int64_t, ChoiceTrace> choices;
  std::optional<std::uint64_t> usage_prompt, usage_completion;
  std::size_t entries = 0;  // token ids and logprobs kept, at most kTrajectoryEntriesMax
  bool truncated = false;   // more were offered than kept

  // Takes what one engine document (a completion, or one streamed chunk) tells: the prompt's
  // token ids, the usage, and per choice its token ids, logprobs and finish reason. Outside
  // text: anything of another shape is ignored.
  void Absorb(const json& doc);
  std::uint64_t prompt_count() const {
    if (usage_prompt) return *usage_prompt;
    return prompt_token_ids.is_array() ? prompt_token_ids.size() : 0;
  }
  std::uint64_t completion_count() const {
    if (usage_completion) return *usage_completion;
    std::uint64_t n = 0;
    for (const auto& [i, c] : choices) n += c.token_ids.size();
    return n;
  }

 private:
  void TakePrompt(const json& obj);
  void TakeUsage(const json& doc);
  void TakeChoice(const json& choice);
  void TakeTokenIds(const json& ids, ChoiceTrace& trace);
  void TakeLogprobs(const json& choice, ChoiceTrace& trace);
  // Counts one more entry against kTrajectoryEntriesMax; false (and `truncated`) once it is spent.
  bool TakeEntry();
};

// Splits choice 0 of a trace into TrajectoryRecorded parts of at most
// kTrajectoryTokensPerRecordMax tokens: prompt tokens first, then output tokens with their
// logprobs (NaN where the engine reported none). A truncated trace records what was kept.
std::vector<TrajectoryRecorded> JournalTrajectoryParts(const std::string& rollout_id,
                                                       const Trajectory& trace);

// Removes what the proxy added and the client did not ask for.
void StripAdded(json& doc, bool strip_token_ids, bool strip_usage);

// One streamed engine chunk: absorbed into the trace, then the SSE event the client receives
// ("data: <json>\n\n"), or nullopt for the usage-only chunk the client did not ask for.
std::optional<std::string> PassChunk(Trajectory& trace, const json& chunk, bool strip_token_ids,
                                     bool strip_usage);

}  // namespace rc::service
