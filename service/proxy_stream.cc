// The proxy's stream and trajectory handling (see proxy_stream.h), moved verbatim from proxy.cc.
#include "service/proxy_stream.h"

#include <cmath>

#include "service/http_util.h"

namespace rc::service {

std::vector<TrajectoryRecorded> JournalTrajectoryParts(const std::string& rollout_id,
                                                       const Trajectory& trace) {
  std::vector<std::int32_t> prompt;
  if (trace.prompt_token_ids.is_array()) {
    for (const json& id : trace.prompt_token_ids) {
      if (id.is_number_integer()) prompt.push_back(id.get<std::int32_t>());
    }
  }
  std::vector<std::int32_t> output;
  std::vector<float> logprobs;
  bool any_logprob = false;
  if (auto it = trace.choices.find(0); it != trace.choices.end()) {
    for (std::size_t i = 0; i < it->second.token_ids.size(); ++i) {
      output.push_back(static_cast<std::int32_t>(it->second.token_ids[i]));
      const json lp = i < it->second.logprobs.size() ? it->second.logprobs[i] : json();
      any_logprob = any_logprob || lp.is_number();
      logprobs.push_back(lp.is_number() ? lp.get<float>() : std::nanf(""));
    }
  }
  std::vector<TrajectoryRecorded> parts;
  std::size_t p = 0, o = 0;
  while ((p < prompt.size() || o < output.size()) && parts.size() < kTrajectoryPartsMax) {
    TrajectoryRecorded part;
    part.rollout_id = rollout_id;
    part.part = static_cast<std::uint32_t>(parts.size());
    std::size_t room = kTrajectoryTokensPerRecordMax;
    const std::size_t np = std::min(room, prompt.size() - p);
    part.prompt_token_ids.assign(prompt.begin() + p, prompt.begin() + p + np);
    p += np;
    room -= np;
    const std::size_t no = std::min(room, output.size() - o);
    part.output_token_ids.assign(output.begin() + o, output.begin() + o + no);
    if (any_logprob) part.output_logprobs.assign(logprobs.begin() + o, logprobs.begin() + o + no);
    o += no;
    parts.push_back(std::move(part));
  }
  return parts;
}

void strip_added(json& doc, bool strip_token_ids, bool strip_usage) {
  if (!doc.is_object()) return;
  if (strip_usage) doc.erase("usage");
  if (!strip_token_ids) return;
  doc.erase("prompt_token_ids");
  auto cs = doc.find("choices");
  if (cs == doc.end() || !cs->is_array()) return;
  for (json& c : *cs) {
    if (!c.is_object()) continue;
    c.erase("prompt_token_ids");
    c.erase("token_ids");
    if (auto d = c.find("delta"); d != c.end() && d->is_object()) d->erase("token_ids");
  }
}

std::optional<std::string> pass_chunk(Trajectory& trace, const json& chunk, bool strip_token_ids,
                                      bool strip_usage) {
  trace.absorb(chunk);
  if (strip_usage && chunk.is_object() && chunk.contains("usage") &&
      chunk.value("choices", json::array()).empty()) {
    return std::nullopt;  // the usage-only chunk the client did not ask for
  }
  json out = chunk;
  strip_added(out, strip_token_ids, strip_usage);
  return "data: " + dump_safe(out) + "\n\n";
}

}  // namespace rc::service
