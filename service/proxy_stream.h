// The proxy's reading of engine responses: what a completion (or each streamed chunk) tells about
// the rollout's trajectory and token counts, the journal parts it becomes, and the client event a
// streamed engine chunk is turned into (the fields the proxy added removed). Pure functions of the
// engine's JSON, moved out of proxy.cc so that tests and fuzz targets run the same code.
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
// Journal records per trajectory: 1 Mi entries / 4096 tokens per record.
inline constexpr std::size_t kTrajectoryPartsMax = kTrajectoryEntriesMax / 4096 + 1;

struct ChoiceTrace {
  std::vector<std::int64_t> token_ids;
  json logprobs = json::array();  // one number (or null) per output token
  std::string finish_reason;
};

struct Trajectory {
  json prompt_token_ids;  // null until seen
  std::map<std::int64_t, ChoiceTrace> choices;
  std::optional<std::uint64_t> usage_prompt, usage_completion;
  std::size_t entries = 0;
  bool truncated = false;

  void absorb(const json& doc) {
    if (!doc.is_object()) return;
    take_prompt(doc);
    auto u = doc.find("usage");
    if (u != doc.end() && u->is_object()) {
      if (u->value("prompt_tokens", json()).is_number_unsigned()) {
        usage_prompt = (*u)["prompt_tokens"].get<std::uint64_t>();
      }
      if (u->value("completion_tokens", json()).is_number_unsigned()) {
        usage_completion = (*u)["completion_tokens"].get<std::uint64_t>();
      }
    }
    auto cs = doc.find("choices");
    if (cs == doc.end() || !cs->is_array()) return;
    for (const json& c : *cs) {
      if (!c.is_object()) continue;
      take_prompt(c);
      // An engine chunk is outside text: a missing or non-integer "index" is choice 0.
      const auto at = c.find("index");
      const std::int64_t index =
          at != c.end() && at->is_number_integer() ? at->get<std::int64_t>() : 0;
      ChoiceTrace& t = choices[index];
      const json* ids = nullptr;
      if (auto it = c.find("token_ids"); it != c.end() && it->is_array()) {
        ids = &*it;
      } else if (auto d = c.find("delta"); d != c.end() && d->is_object()) {
        // chat streams carry them in the delta
        if (auto dt = d->find("token_ids"); dt != d->end() && dt->is_array()) ids = &*dt;
      }
      if (ids != nullptr) {
        for (const json& id : *ids) {
          if (!take_entry()) break;
          if (id.is_number_integer()) t.token_ids.push_back(id.get<std::int64_t>());
        }
      }
      auto lp = c.find("logprobs");
      if (lp != c.end() && lp->is_object()) {
        if (auto tl = lp->find("token_logprobs"); tl != lp->end() && tl->is_array()) {
          for (const json& v : *tl) {
            if (!take_entry()) break;
            t.logprobs.push_back(v);
          }
        } else if (auto ct = lp->find("content"); ct != lp->end() && ct->is_array()) {
          for (const json& item : *ct) {
            if (!take_entry()) break;
            t.logprobs.push_back(item.is_object() ? item.value("logprob", json()) : json());
          }
        }
      }
      if (c.value("finish_reason", json()).is_string()) t.finish_reason = c["finish_reason"];
    }
  }
  void take_prompt(const json& obj) {
    auto p = obj.find("prompt_token_ids");
    if (p != obj.end() && p->is_array() && prompt_token_ids.is_null()) {
      if (p->size() <= kTrajectoryEntriesMax)
        prompt_token_ids = *p;
      else
        truncated = true;
    }
  }
  // Counts one more entry against kTrajectoryEntriesMax; false (and `truncated`) once it is spent.
  bool take_entry() {
    if (entries >= kTrajectoryEntriesMax) {
      truncated = true;
      return false;
    }
    ++entries;
    return true;
  }
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
};

// Splits choice 0 of a trace into TrajectoryRecorded parts of at most
// kTrajectoryTokensPerRecordMax tokens: prompt tokens first, then output tokens with their
// logprobs (NaN where the engine reported none). A truncated trace records what was kept.
std::vector<TrajectoryRecorded> JournalTrajectoryParts(const std::string& rollout_id,
                                                       const Trajectory& trace);

// Removes what the proxy added and the client did not ask for.
void strip_added(json& doc, bool strip_token_ids, bool strip_usage);

// One streamed engine chunk: absorbed into the trace, then the SSE event the client receives
// ("data: <json>\n\n"), or nullopt for the usage-only chunk the client did not ask for.
std::optional<std::string> pass_chunk(Trajectory& trace, const json& chunk, bool strip_token_ids,
                                      bool strip_usage);

}  // namespace rc::service
