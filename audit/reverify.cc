// Re-verification of recorded trajectories on an engine (see audit.h): the scoring request, the
// per-token comparison, the totals and their text and JSON.
#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <utility>

#include "audit/audit.h"
#include "statemachine/describe.h"
#include "statemachine/text.h"

namespace rc::audit {
namespace {

using nlohmann::json;

std::string E(const std::string& s) { return text::escape_line(s); }

// The scoring request: the whole sequence as a prompt, one position scored per token.
json ScoringRequest(const Trajectory& t) {
  json prompt = json::array();
  for (std::int32_t id : t.prompt) prompt.push_back(id);
  for (std::int32_t id : t.output) prompt.push_back(id);
  return {{"prompt", std::move(prompt)},
          {"max_tokens", 1},
          {"temperature", 0},
          {"prompt_logprobs", 0},
          {"cache_salt", "rolloutcore-audit"}};
}

// choices[0].prompt_logprobs of a completion, when it is a list of `n` entries; else nullptr.
const json* PromptLogprobsOf(const json& body, std::size_t n) {
  if (!body.is_object()) return nullptr;
  const auto cs = body.find("choices");
  if (cs == body.end() || !cs->is_array() || cs->empty() || !cs->front().is_object()) {
    return nullptr;
  }
  const auto plp = cs->front().find("prompt_logprobs");
  if (plp == cs->front().end() || !plp->is_array() || plp->size() != n) return nullptr;
  return &*plp;
}

struct Score {
  double logprob = 0;
  bool top1 = false;
};

// The engine's score of `token` at one position ({"<id>": {"logprob", "rank"}}), if it gave one.
std::optional<Score> ScoreOf(const json& entry, std::int32_t token) {
  if (!entry.is_object()) return std::nullopt;
  const auto it = entry.find(std::to_string(token));
  if (it == entry.end() || !it->is_object()) return std::nullopt;
  const auto lp = it->find("logprob");
  if (lp == it->end() || !lp->is_number()) return std::nullopt;
  const auto rank = it->find("rank");
  const bool top1 =
      rank != it->end() && rank->is_number_integer() && rank->get<std::int64_t>() == 1;
  return Score{lp->get<double>(), top1};
}

// Counts one output token's comparison into `out`; `recorded` is NaN where none was recorded.
void CompareToken(const std::optional<Score>& score, double recorded, ReverifyResult& out) {
  if (!score) {
    out.unscored++;
    return;
  }
  out.tokens++;
  if (score->top1) {
    out.top1++;
  } else {
    out.not_top1++;
  }
  if (!std::isfinite(recorded)) {
    out.unrecorded++;
    return;
  }
  const double diff = std::fabs(score->logprob - recorded);
  out.compared++;
  out.sum_abs_diff += diff;
  out.max_abs_diff = std::max(out.max_abs_diff, diff);
  if (!(diff <= out.tolerance)) out.logprob_mismatches++;
}

void Compare(const Trajectory& t, const json& plp, ReverifyResult& out) {
  for (std::size_t k = 0; k < t.output.size(); ++k) {
    const double recorded =
        k < t.logprobs.size() && t.logprobs[k].has_value() ? *t.logprobs[k] : std::nan("");
    CompareToken(ScoreOf(plp[t.prompt.size() + k], t.output[k]), recorded, out);
  }
  RC_CHECK(out.tokens + out.unscored == t.output.size());
  RC_CHECK(out.compared + out.unrecorded == out.tokens && out.top1 + out.not_top1 == out.tokens);
}

bool Passes(const ReverifyResult& r) {
  return r.checked && r.unscored == 0 && r.logprob_mismatches == 0 &&
         (r.greedy ? r.not_top1 == 0 : r.unrecorded == 0);
}

// "12 tokens compared, top-1 12 of 12 (required), max |diff| 0, mean |diff| 0 (tolerance 0.001)"
std::string Figures(std::size_t compared, std::size_t top1, std::size_t tokens, bool greedy,
                    double max_diff, double mean_diff, double tolerance) {
  std::ostringstream o;
  o << compared << " tokens compared, top-1 " << top1 << " of " << tokens
    << (greedy ? " (required)" : " (not required)") << ", max |diff| " << max_diff
    << ", mean |diff| " << mean_diff << " (tolerance " << tolerance << ")";
  return o.str();
}

// What counts against a checked rollout, e.g. "; 1 over tolerance, 2 not top-1".
std::string Against(const ReverifyResult& r) {
  std::ostringstream o;
  const std::pair<std::size_t, const char*> counts[] = {
      {r.logprob_mismatches, "over tolerance"},
      {r.greedy ? r.not_top1 : 0, "not top-1"},
      {r.unscored, "not scored by the engine"},
      {r.greedy ? 0 : r.unrecorded, "without a recorded logprob"}};
  const char* sep = "; ";
  for (const auto& [n, what] : counts) {
    if (n == 0) continue;
    o << sep << n << " " << what;
    sep = ", ";
  }
  return o.str();
}

// "; PARTIAL: ..." when the source held more trajectories than were offered, else "".
std::string Partial(const ReverifySummary& s) {
  if (!s.partial()) return "";
  std::ostringstream o;
  o << "; PARTIAL: " << s.checked << " of " << s.available
    << " trajectories re-verified (only the most recent " << s.trajectories << " were offered; the "
    << (s.available - s.trajectories) << " older ones were not)";
  return o.str();
}

}  // namespace

ReverifyResult Reverify(effects::EngineClient& engine, const Trajectory& t, double tolerance,
                        bool greedy) {
  ReverifyResult out;
  out.rollout_id = t.rollout_id;
  out.tolerance = tolerance;
  out.greedy = greedy;
  // The scoring request and its answer grow with every token: none is built past the bound.
  const std::size_t tokens = t.prompt.size() + t.output.size();
  if (tokens > kTrajectoryTokensPerRolloutMax) {
    out.detail = std::to_string(tokens) + " tokens (prompt and output), more than the " +
                 std::to_string(kTrajectoryTokensPerRolloutMax) +
                 " one rollout's trajectory may hold: not sent for scoring";
    return out;
  }
  ValidationObserved served = engine.WeightInfo();
  if (!served.http.ok_2xx()) {
    out.detail = "engine unreachable: " + describe(served.http);
    return out;
  }
  if (served.reported_label != t.version.label) {
    out.detail = "engine serves " + Quoted(served.reported_label) + ", trajectory ran under " +
                 Quoted(t.version.label);
    return out;
  }
  if (t.output.empty() || t.prompt.empty()) {
    out.detail = "nothing to compare";
    return out;
  }
  const effects::HttpReply reply = engine.Completions(ScoringRequest(t));
  const json* plp = reply.http.ok_2xx()
                        ? PromptLogprobsOf(reply.body, t.prompt.size() + t.output.size())
                        : nullptr;
  if (plp == nullptr) {
    out.detail = reply.http.ok_2xx() ? "engine returned no prompt_logprobs of the expected length"
                                     : "scoring request failed: " + describe(reply.http);
    return out;
  }
  out.checked = true;
  Compare(t, *plp, out);
  out.ok = Passes(out);
  out.detail = Figures(out.compared, out.top1, out.tokens, greedy, out.max_abs_diff,
                       out.mean_abs_diff(), tolerance) +
               Against(out);
  return out;
}

ReverifySummary ReverifyAll(effects::EngineClient& engine,
                            const std::vector<Trajectory>& trajectories, double tolerance,
                            bool greedy) {
  RC_CHECK(trajectories.size() <= kTrajectoriesMax);
  ReverifySummary s;
  s.tolerance = tolerance;
  s.greedy = greedy;
  s.trajectories = trajectories.size();
  s.available = trajectories.size();
  for (const Trajectory& t : trajectories) {
    ReverifyResult r = Reverify(engine, t, tolerance, greedy);
    if (r.checked) {
      s.checked++;
      s.failed += r.ok ? 0 : 1;
      s.over_tolerance += r.logprob_mismatches > 0 ? 1 : 0;
      s.tokens += r.tokens;
      s.compared += r.compared;
      s.top1 += r.top1;
      s.sum_abs_diff += r.sum_abs_diff;
      s.max_abs_diff = std::max(s.max_abs_diff, r.max_abs_diff);
    }
    s.rollouts.push_back(std::move(r));
  }
  RC_CHECK(s.rollouts.size() == s.trajectories && s.failed <= s.checked);
  return s;
}

ReverifySummary ReverifyFromJournal(effects::EngineClient& engine, const JournalTrajectories& from,
                                    double tolerance, bool greedy) {
  RC_CHECK(from.trajectories.size() <= from.total);
  ReverifySummary s = ReverifyAll(engine, from.trajectories, tolerance, greedy);
  s.available = from.total;
  return s;
}

std::string FormatReverify(const ReverifyResult& r) {
  const char* verdict = !r.checked ? "SKIPPED" : r.ok ? "OK" : "FAILED";
  return "REVERIFY " + Quoted(E(r.rollout_id)) + ": " + verdict + ": " + E(r.detail);
}

std::string FormatReverifySummary(const ReverifySummary& s, const std::string& engine_url) {
  std::ostringstream o;
  o << "re-verification against " << E(engine_url) << ": " << s.checked << " of " << s.trajectories
    << " rollouts checked";
  if (s.checked == 0) {
    o << ": NOTHING VERIFIED" << Partial(s);
    return o.str();
  }
  o << " (" << (s.trajectories - s.checked) << " skipped), "
    << Figures(s.compared, s.top1, s.tokens, s.greedy, s.max_abs_diff, s.mean_abs_diff(),
               s.tolerance)
    << ": " << s.over_tolerance << " rollouts over tolerance, " << s.failed
    << " failed: " << (s.verified() ? "OK" : "FAILED") << Partial(s);
  return o.str();
}

std::string FormatJournalTrajectories(const JournalTrajectories& t) {
  std::string out = "trajectories in the journal: " + std::to_string(t.total);
  if (t.partial()) {
    out += ", the most recent " + std::to_string(t.trajectories.size()) +
           " offered for re-verification";
  }
  return out;
}

std::vector<std::string> ReverifyFindings(const ReverifySummary& s) {
  std::vector<std::string> findings;
  for (const ReverifyResult& r : s.rollouts) {
    if (r.checked && !r.ok) {
      findings.push_back("re-verification of rollout " + Quoted(r.rollout_id) +
                         " failed: " + r.detail);
    }
  }
  if (s.trajectories > 0 && s.checked == 0) {
    findings.push_back("re-verification checked 0 of " + std::to_string(s.trajectories) +
                       " trajectories (does the engine serve their version?)");
  }
  return findings;
}

json ReverifyJson(const ReverifySummary& s) {
  json rollouts = json::array();
  for (const ReverifyResult& r : s.rollouts) {
    rollouts.push_back({{"rollout_id", r.rollout_id},
                        {"checked", r.checked},
                        {"ok", r.ok},
                        {"tokens", r.tokens},
                        {"compared", r.compared},
                        {"top1", r.top1},
                        {"over_tolerance", r.logprob_mismatches},
                        {"unscored", r.unscored},
                        {"unrecorded", r.unrecorded},
                        {"max_abs_diff", r.max_abs_diff},
                        {"mean_abs_diff", r.mean_abs_diff()},
                        {"detail", r.detail}});
  }
  return {{"tolerance", s.tolerance},
          {"greedy", s.greedy},
          {"trajectories", s.trajectories},
          {"available", s.available},
          {"partial", s.partial()},
          {"checked", s.checked},
          {"failed", s.failed},
          {"over_tolerance", s.over_tolerance},
          {"tokens", s.tokens},
          {"compared", s.compared},
          {"top1", s.top1},
          {"max_abs_diff", s.max_abs_diff},
          {"mean_abs_diff", s.mean_abs_diff()},
          {"verified", s.verified()},
          {"rollouts", std::move(rollouts)}};
}

}  // namespace rc::audit
