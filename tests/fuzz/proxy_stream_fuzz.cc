// Proves that the proxy's SSE pass-through turns any engine stream into well-framed client events
// (one "data: <json>\n\n" event per engine chunk, nothing the client did not ask for, JSON that
// re-parses to what was sent) and into bounded, consistent trajectory parts and token counts;
// catches an engine chunk that could inject a second event into the client's stream, leak the
// fields the proxy added, or make the journal parts exceed their size bounds.
//
// Input: one flags byte (strip token ids, strip usage, strip logprobs, chunking), then the
// engine's SSE bytes.
// The bytes go through the engine client's own SSE splitter (SseState), then PassChunk. The same
// bytes, and each event's JSON, are also read as a client's request body by CheckRequestChoices
// on every route: it never throws, and what it lets through asks for at most kRequestChoicesMax
// choices (`n` absent, null or read as an integer in 1..kRequestChoicesMax, and then forwarded as
// that JSON integer, nothing else in the body changed; a list of string prompts times it within
// the bound; `best_of` ignored). A chunk with a choice that has no "index" beside other choices
// leaves the trace untrusted.
//
// Regression: a chunk whose "choices" held an object without an "index" made Trajectory::Absorb
// read a missing key of a const json and abort (tests/fuzz/regressions/).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "effects/http/response_parsers.h"
#include "service/http_util.h"
#include "service/proxy_stream.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using nlohmann::json;
namespace svc = rc::service;

bool mentions_added(const json& doc, const svc::AddedFields& added) {
  if (!doc.is_object()) return false;
  if (added.usage && doc.contains("usage")) return true;
  if (added.token_ids && doc.contains("prompt_token_ids")) return true;
  auto cs = doc.find("choices");
  if (cs == doc.end() || !cs->is_array()) return false;
  for (const json& c : *cs) {
    if (!c.is_object()) continue;
    if (added.logprobs && c.contains("logprobs") && !c["logprobs"].is_null()) return true;
    if (!added.token_ids) continue;
    if (c.contains("prompt_token_ids") || c.contains("token_ids")) return true;
    auto d = c.find("delta");
    if (d != c.end() && d->is_object() && d->contains("token_ids")) return true;
  }
  return false;
}

// A chunk whose choices array holds an object without "index" beside another element: that
// choice is no choice the trace can name (it must not be filed as choice 0).
bool UnnumberedBesideOthers(const json& chunk) {
  if (!chunk.is_object()) return false;
  const auto cs = chunk.find("choices");
  if (cs == chunk.end() || !cs->is_array() || cs->size() < 2) return false;
  return std::any_of(cs->begin(), cs->end(),
                     [](const json& c) { return c.is_object() && !c.contains("index"); });
}

// What `n` in `params` asks for per prompt, where it is plain to read: absent or null 1; a JSON
// integer, a float with no fraction, true, or a string of ASCII digits only: its value when in
// 1..kRequestChoicesMax, else 0 (refused); false, a fractional or non-finite float, a list or an
// object 0; nullopt for any other string (CheckRequestChoices reads more of them than this
// does). Written out apart from the check under test.
std::optional<std::uint64_t> NOf(const json& params) {
  const auto it = params.find("n");
  if (it == params.end() || it->is_null()) return 1;
  const auto within = [](double v) -> std::uint64_t {
    const bool ok = v >= 1 && v <= static_cast<double>(svc::kRequestChoicesMax);
    return ok ? static_cast<std::uint64_t>(v) : 0;
  };
  if (it->is_number_unsigned()) return within(static_cast<double>(it->get<std::uint64_t>()));
  if (it->is_number_integer()) return within(static_cast<double>(it->get<std::int64_t>()));
  if (it->is_number_float()) {
    const double v = it->get<double>();
    return std::isfinite(v) && std::trunc(v) == v ? within(v) : 0;
  }
  if (it->is_boolean()) return it->get<bool>() ? 1 : 0;
  if (!it->is_string()) return 0;
  const std::optional<std::uint64_t> digits = rc::service::parse_u64(it->get<std::string>());
  if (!digits) return std::nullopt;
  return *digits <= svc::kRequestChoicesMax ? within(static_cast<double>(*digits)) : 0;
}

// `doc` without its `n` (in `sampling_params` on generate).
json WithoutN(json doc, svc::ProxyRoute route) {
  json* params = &doc;
  if (route == svc::ProxyRoute::kGenerate) {
    const auto sp = doc.find("sampling_params");
    if (sp == doc.end() || !sp->is_object()) return doc;
    params = &*sp;
  }
  params->erase("n");
  return doc;
}

// CheckRequestChoices on `body` as each route's request: never throws (an exception aborts the
// target), its refusal is one line, what it lets through asks for choices a trace records, and
// it changes nothing but `n`, which it forwards as the JSON integer it read.
void CheckChoicesOf(const json& body) {
  if (!body.is_object()) return;
  for (const svc::ProxyRoute route :
       {svc::ProxyRoute::kCompletions, svc::ProxyRoute::kChat, svc::ProxyRoute::kGenerate}) {
    json checked = body;
    const rc::Status st = svc::CheckRequestChoices(route, checked);
    FUZZ_CHECK(st.message().find_first_of("\r\n") == std::string::npos);
    const json* params = &body;
    const json* sent = &checked;
    if (route == svc::ProxyRoute::kGenerate) {
      const auto sp = body.find("sampling_params");
      if (sp == body.end() || !sp->is_object()) {
        FUZZ_CHECK(st.ok() && checked == body);
        continue;
      }
      params = &*sp;
      sent = &checked["sampling_params"];
    }
    const std::optional<std::uint64_t> per_prompt = NOf(*params);
    if (per_prompt == std::uint64_t{0}) FUZZ_CHECK(!st.ok());
    // Off completions nothing but `n` is refused.
    if (per_prompt.value_or(0) != 0 && route != svc::ProxyRoute::kCompletions) {
      FUZZ_CHECK(st.ok());
    }
    if (!st.ok()) continue;
    FUZZ_CHECK(WithoutN(checked, route) == WithoutN(body, route));
    const auto n = sent->find("n");
    std::uint64_t asked = 1;
    if (n != sent->end() && !n->is_null()) {
      FUZZ_CHECK(n->is_number_integer() && n->get<std::int64_t>() >= 1);
      asked = n->get<std::uint64_t>();
      FUZZ_CHECK(asked <= svc::kRequestChoicesMax);
      if (params->at("n").is_number_integer()) FUZZ_CHECK(*n == params->at("n"));
    }
    if (per_prompt) FUZZ_CHECK(asked == *per_prompt);
    if (route != svc::ProxyRoute::kCompletions) continue;
    const auto prompt = body.find("prompt");
    if (prompt == body.end() || !prompt->is_array() || prompt->empty()) continue;
    const bool strings =
        std::all_of(prompt->begin(), prompt->end(), [](const json& p) { return p.is_string(); });
    if (strings) FUZZ_CHECK(prompt->size() * asked <= svc::kRequestChoicesMax);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  svc::AddedFields added;
  added.token_ids = (data[0] & 1) != 0;
  added.usage = (data[0] & 2) != 0;
  added.logprobs = (data[0] & 4) != 0;
  const std::size_t step = 1 + 64 * (data[0] >> 3);  // 1 byte .. 2 KiB per network read
  const std::string raw(reinterpret_cast<const char*>(data + 1), size - 1);

  svc::Trajectory trace;
  std::string client;             // what the client receives
  std::vector<std::string> sent;  // each event's JSON text
  std::size_t skipped = 0;
  CheckChoicesOf(rc::effects::parse_outside_json(raw));
  rc::effects::EngineClient::ChunkFn on_chunk = [&](const json& chunk) {
    CheckChoicesOf(chunk);
    const std::optional<std::string> event = svc::PassChunk(trace, chunk, added);
    if (UnnumberedBesideOthers(chunk)) FUZZ_CHECK(trace.bad_index && !trace.Trusted());
    if (!event) {
      ++skipped;
      FUZZ_CHECK(added.usage && chunk.is_object() && chunk.contains("usage"));
      return true;
    }
    // Exactly one SSE event: "data: " + one line of JSON + the blank line.
    FUZZ_CHECK(event->rfind("data: ", 0) == 0);
    FUZZ_CHECK(event->size() >= 8 && event->compare(event->size() - 2, 2, "\n\n") == 0);
    const std::string payload = event->substr(6, event->size() - 8);
    FUZZ_CHECK(payload.find_first_of("\r\n") == std::string::npos);
    const json back = json::parse(payload, nullptr, false);
    FUZZ_CHECK(!back.is_discarded());
    FUZZ_CHECK(!mentions_added(back, added));
    client += *event;
    sent.push_back(payload);
    return true;
  };
  rc::effects::SseState sse;
  sse.on_chunk = &on_chunk;
  bool fed = true;
  for (std::size_t at = 0; at < raw.size() && fed; at += step) {
    fed = sse.Feed(raw.data() + at, std::min(step, raw.size() - at));
  }
  rc::HttpEvidence ev;
  if (fed) sse.Finish(ev);
  FUZZ_CHECK(sent.size() + skipped <= sse.events);

  // The client's stream, split by the same splitter, gives back exactly the events sent.
  std::vector<std::string> seen;
  rc::effects::EngineClient::ChunkFn collect = [&](const json& chunk) {
    seen.push_back(svc::DumpSafe(chunk));
    return true;
  };
  rc::effects::SseState again;
  again.on_chunk = &collect;
  FUZZ_CHECK(again.Feed(client.data(), client.size()));
  FUZZ_CHECK(again.pending.empty() && !again.bad_event && !again.done);
  FUZZ_CHECK(seen.size() == sent.size());
  for (std::size_t k = 0; k < seen.size(); ++k) {
    FUZZ_CHECK(seen[k] == svc::DumpSafe(json::parse(sent[k])));
  }

  // The trajectory: bounded, and its journal parts are the trace cut in order.
  FUZZ_CHECK(trace.entries <= svc::kTrajectoryEntriesMax);
  const std::vector<rc::TrajectoryRecorded> parts = svc::JournalTrajectoryParts("r1", trace);
  FUZZ_CHECK(parts.size() <= svc::kTrajectoryPartsMax);
  std::size_t prompt = 0, output = 0;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const rc::TrajectoryRecorded& p = parts[k];
    FUZZ_CHECK(p.part == k && p.rollout_id == "r1");
    FUZZ_CHECK(p.prompt_token_ids.size() + p.output_token_ids.size() <=
               rc::kTrajectoryTokensPerRecordMax);
    FUZZ_CHECK(!p.prompt_token_ids.empty() || !p.output_token_ids.empty());
    FUZZ_CHECK(p.output_logprobs.empty() || p.output_logprobs.size() == p.output_token_ids.size());
    prompt += p.prompt_token_ids.size();
    output += p.output_token_ids.size();
  }
  std::size_t int_prompt = 0;
  if (trace.prompt_token_ids.is_array()) {
    for (const json& id : trace.prompt_token_ids) int_prompt += id.is_number_integer() ? 1 : 0;
  }
  // Parts hold choice 0's trajectory whole or not at all (a cut prompt or choice 0, ids the
  // journal cannot hold exactly, or one past the parts' bound journal none); another choice's
  // cut does not matter to them.
  auto c0 = trace.choices.find(0);
  if (!parts.empty()) {
    FUZZ_CHECK(!trace.prompt_cut);
    FUZZ_CHECK(c0 == trace.choices.end() || !c0->second.cut);
    FUZZ_CHECK(prompt == int_prompt);
    FUZZ_CHECK(output == (c0 == trace.choices.end() ? 0 : c0->second.token_ids.size()));
  }
  if (!trace.usage_completion) {
    std::uint64_t n = 0;
    for (const auto& [idx, c] : trace.choices) n += c.token_ids.size();
    FUZZ_CHECK(trace.completion_count() == n);
  }
  (void)trace.prompt_count();
  return 0;
}
