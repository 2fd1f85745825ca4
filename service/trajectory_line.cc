#include "service/trajectory_line.h"

#include <charconv>
#include <optional>

#include "journal/json.h"
#include "statemachine/status.h"

namespace rc::service {
namespace {

using json = nlohmann::json;

// ASCII only: U+2028, U+2029 and U+0085 from an engine would otherwise end a line for readers
// that split on them (Python's str.splitlines), and one record is one line.
std::string Dump(const json& j) { return j.dump(-1, ' ', true, json::error_handler_t::replace); }

// Printable ASCII other than '"' and '\\' is written as is by nlohmann; anything else goes
// through its escaping (control characters, non-ASCII, invalid UTF-8), so the text is identical.
void AppendString(std::string& out, std::string_view s) {
  for (const char c : s) {
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') {
      out += Dump(json(std::string(s)));
      return;
    }
  }
  out += '"';
  out += s;
  out += '"';
}

template <typename Int>
void AppendInt(std::string& out, Int v) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  RC_CHECK(ec == std::errc());
  out.append(buf, end);
}

void AppendKey(std::string& out, std::string_view key) {
  out += out.back() == '{' ? "\"" : ",\"";
  out += key;
  out += "\":";
}

void AppendTokenIds(std::string& out, const std::vector<std::int64_t>& ids) {
  out += '[';
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out += ',';
    AppendInt(out, ids[i]);
  }
  out += ']';
}

void AppendOutputs(std::string& out, const Trajectory& trace) {
  out += '[';
  for (const auto& [index, ch] : trace.choices) {
    if (out.back() != '[') out += ',';
    out += '{';
    AppendKey(out, "finish_reason");
    AppendString(out, ch.finish_reason);
    AppendKey(out, "index");
    AppendInt(out, index);
    AppendKey(out, "logprobs");
    out += Dump(ch.logprobs);
    AppendKey(out, "token_ids");
    AppendTokenIds(out, ch.token_ids);
    out += '}';
  }
  out += ']';
}

// The binding's identity and version as the line holds them. Every rollout of one version has
// the same, so each event loop keeps the last text it built (dumping them cost a fifth of the
// line).
struct BindingText {
  WeightIdentity identity;
  WeightVersion version;
  std::string identity_text = Dump(journal::WeightIdentityToJson(identity));
  std::string version_text = Dump(journal::WeightVersionToJson(version));
};

const BindingText& BindingTextOf(const RolloutAdmitted& binding) {
  thread_local std::optional<BindingText> last;
  if (!last || last->identity != binding.identity || last->version != binding.version) {
    last.emplace(BindingText{binding.identity, binding.version});
  }
  return *last;
}

}  // namespace

// Keys in nlohmann's (std::map) order.
std::string TrajectoryLineText(const TrajectoryLineFields& f) {
  std::string out = "{";
  AppendKey(out, "admission_seq");
  AppendInt(out, f.admission_seq);
  AppendKey(out, "cache_salt");
  AppendString(out, f.cache_salt);
  AppendKey(out, "completion_tokens");
  AppendInt(out, f.trace.completion_count());
  if (!f.engine.empty()) {
    AppendKey(out, "engine");
    AppendString(out, f.engine);
    AppendKey(out, "fleet_generation");
    AppendInt(out, f.fleet_generation);
  }
  const BindingText& binding = BindingTextOf(f.binding);
  AppendKey(out, "identity");
  out += binding.identity_text;
  AppendKey(out, "note");
  AppendString(out, f.note);
  AppendKey(out, "outcome");
  AppendString(out, f.outcome);
  AppendKey(out, "outputs");
  AppendOutputs(out, f.trace);
  AppendKey(out, "prompt_token_ids");
  out += Dump(f.trace.prompt_token_ids);
  AppendKey(out, "prompt_tokens");
  AppendInt(out, f.trace.prompt_count());
  AppendKey(out, "rollout_id");
  AppendString(out, f.binding.rollout_id);
  AppendKey(out, "route");
  AppendString(out, f.route);
  AppendKey(out, "stream");
  out += f.stream ? "true" : "false";
  AppendKey(out, "truncated");
  out += f.trace.Truncated() ? "true" : "false";
  AppendKey(out, "version");
  out += binding.version_text;
  out += '}';
  return out;
}

}  // namespace rc::service
