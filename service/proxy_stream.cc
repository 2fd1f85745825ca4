// The proxy's stream and trajectory handling (see proxy_stream.h).
#include "service/proxy_stream.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "service/http_util.h"
#include "statemachine/status.h"

namespace rc::service {
namespace {

// A choice's index: absent, choice 0 when it is the document's only choice (`choices` its
// choices array's length); present, an integer in [0, kRequestChoicesMax), else nullopt. Any
// mapping of another value files tokens under a choice the engine did not send (2^64-1 read as
// int64 was choice -1, "x" was choice 0, an unnumbered second choice was appended to choice 0).
std::optional<std::int64_t> ChoiceIndex(const json& choice, std::size_t choices) {
  const auto at = choice.find("index");
  if (at == choice.end()) return choices == 1 ? std::optional<std::int64_t>(0) : std::nullopt;
  if (!at->is_number_integer()) return std::nullopt;
  const bool in_range =
      at->is_number_unsigned()
          ? at->get<std::uint64_t>() < kRequestChoicesMax
          : at->get<std::int64_t>() >= 0 &&
                static_cast<std::uint64_t>(at->get<std::int64_t>()) < kRequestChoicesMax;
  if (!in_range) return std::nullopt;
  return at->get<std::int64_t>();
}

// A token id as the journal's 32-bit fields hold it exactly; nullopt for anything else.
std::optional<std::int32_t> ExactTokenId(std::int64_t id) {
  if (id < std::numeric_limits<std::int32_t>::min() ||
      id > std::numeric_limits<std::int32_t>::max()) {
    return std::nullopt;
  }
  return static_cast<std::int32_t>(id);
}

std::optional<std::int32_t> ExactTokenId(const json& id) {
  if (id.is_number_unsigned()) {
    const std::uint64_t v = id.get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) return {};
    return static_cast<std::int32_t>(v);
  }
  if (!id.is_number_integer()) return std::nullopt;
  return ExactTokenId(id.get<std::int64_t>());
}

// A logprob the journal's float can hold (a plain conversion past float's range would be
// undefined, a clamped one an infinity in the journal only).
bool WithinFloat(double v) {
  return std::isfinite(v) && std::fabs(v) <= std::numeric_limits<float>::max();
}

// The choice indexes one document (a completion, or one streamed chunk) has named. Within one
// document each choice comes once: a repeated index would append another choice's tokens to the
// first's. Across a stream's chunks an index comes again and again; each chunk is its own
// document. Valid indexes are below kRequestChoicesMax, so the set is a bitmap of that many bits,
// made only for a document of more than one choice.
class IndexesSeen {
 public:
  explicit IndexesSeen(std::size_t choices) {
    if (choices > 1) seen_.resize(kRequestChoicesMax);
  }
  // False when `index` came before in this document.
  bool First(std::int64_t index) {
    RC_CHECK(index >= 0 && static_cast<std::uint64_t>(index) < kRequestChoicesMax);
    if (seen_.empty()) return true;  // the document's only choice
    const auto at = static_cast<std::size_t>(index);
    if (seen_[at]) return false;
    seen_[at] = true;
    return true;
  }

 private:
  std::vector<bool> seen_;
};

// `choice`'s index within its document of `choices` choices: nullopt when it is no choice
// (ChoiceIndex) or one the document named before.
std::optional<std::int64_t> DocumentIndex(const json& choice, std::size_t choices,
                                          IndexesSeen& seen) {
  const std::optional<std::int64_t> index = ChoiceIndex(choice, choices);
  if (!index || !seen.First(*index)) return std::nullopt;
  return index;
}

// A logprob as the journal's float holds it, so that the trajectory line prints the very figure
// the journal records (the engine's -0.1 is -0.10000000149011612 in both, 1e-50 is 0 in both).
// Within float's range (WithinFloat), the conversion rounds to the nearest float.
json AsJournaled(const json& logprob) {
  if (!logprob.is_number()) return logprob;
  const double v = logprob.get<double>();
  RC_CHECK(WithinFloat(v));
  return json(static_cast<double>(static_cast<float>(v)));
}

// A choice's output token ids: its own, or (chat streams) those of its delta; nullptr if none.
const json* TokenIdsOf(const json& choice) {
  if (auto it = choice.find("token_ids"); it != choice.end() && it->is_array()) return &*it;
  auto d = choice.find("delta");
  if (d == choice.end() || !d->is_object()) return nullptr;
  auto dt = d->find("token_ids");
  return dt != d->end() && dt->is_array() ? &*dt : nullptr;
}

// One item of chat's logprobs.content: its "logprob", or null.
// A logprob is a number; anything else an engine sends in its place is kept as null, so that an
// entry costs a few bytes whatever the engine sends.
json NumberOrNull(const json& v) { return v.is_number() ? v : json(); }

json ContentLogprob(const json& item) {
  return item.is_object() ? NumberOrNull(item.value("logprob", json())) : json();
}

}  // namespace

void Trajectory::Absorb(const json& doc) {
  if (!doc.is_object()) return;
  TakePrompt(doc);
  TakeUsage(doc);
  auto cs = doc.find("choices");
  if (cs == doc.end() || !cs->is_array()) return;
  IndexesSeen seen(cs->size());
  for (const json& c : *cs) {
    if (c.is_object()) TakeChoice(c, DocumentIndex(c, cs->size(), seen));
  }
  RC_CHECK(entries <= kTrajectoryEntriesMax);
}

void Trajectory::TakePrompt(const json& obj) {
  auto p = obj.find("prompt_token_ids");
  if (p == obj.end() || !p->is_array() || !prompt_token_ids.is_null()) return;
  // Token ids are integers the journal holds (int32); an array of anything else is a prompt the
  // trace cannot hold exactly (journaling choice 0 without it would record another trajectory
  // than the engine's, and the line would hold ids the journal does not).
  const auto is_id = [](const json& id) { return ExactTokenId(id).has_value(); };
  if (p->size() <= kTrajectoryEntriesMax && std::all_of(p->begin(), p->end(), is_id)) {
    prompt_token_ids = *p;
  } else {
    truncated = prompt_cut = true;
  }
}

void Trajectory::TakeUsage(const json& doc) {
  auto u = doc.find("usage");
  if (u == doc.end() || !u->is_object()) return;
  if (u->value("prompt_tokens", json()).is_number_unsigned()) {
    usage_prompt = (*u)["prompt_tokens"].get<std::uint64_t>();
  }
  if (u->value("completion_tokens", json()).is_number_unsigned()) {
    usage_completion = (*u)["completion_tokens"].get<std::uint64_t>();
  }
}

std::uint64_t Trajectory::prompt_ids() const {
  return prompt_token_ids.is_array() ? prompt_token_ids.size() : 0;
}

std::uint64_t Trajectory::output_ids() const {
  std::uint64_t n = 0;
  for (const auto& [i, c] : choices) n += c.token_ids.size();
  return n;
}

bool Trajectory::UsageBelievable() const {
  const auto believable = [](const std::optional<std::uint64_t>& usage, std::uint64_t ids) {
    return !usage || (*usage <= std::numeric_limits<std::uint32_t>::max() && *usage >= ids);
  };
  return believable(usage_prompt, prompt_ids()) && believable(usage_completion, output_ids());
}

bool Trajectory::Trusted() const {
  const bool has_choice0 = choices.empty() || choices.contains(0);
  return !bad_index && has_choice0 && UsageBelievable();
}

// Kept ids number at most kTrajectoryEntriesMax, a believable usage at most uint32's maximum.
std::uint32_t Trajectory::prompt_count() const {
  const std::uint64_t n = usage_prompt && UsageBelievable() ? *usage_prompt : prompt_ids();
  RC_CHECK(n <= std::numeric_limits<std::uint32_t>::max());
  return static_cast<std::uint32_t>(n);
}

std::uint32_t Trajectory::completion_count() const {
  const std::uint64_t n = usage_completion && UsageBelievable() ? *usage_completion : output_ids();
  RC_CHECK(n <= std::numeric_limits<std::uint32_t>::max());
  return static_cast<std::uint32_t>(n);
}

// A choice whose index is no choice (or repeats one of its document) is not kept: its tokens
// belong to no choice of the answer that the trace could name.
void Trajectory::TakeChoice(const json& choice, std::optional<std::int64_t> index) {
  RC_CHECK(choice.is_object());
  TakePrompt(choice);
  if (!index) {
    truncated = bad_index = true;
    return;
  }
  ChoiceTrace* t = ChoiceOf(*index);
  if (t == nullptr) return;
  if (const json* ids = TokenIdsOf(choice)) TakeTokenIds(*ids, *t);
  TakeLogprobs(choice, *t);
  const json reason = choice.value("finish_reason", json());
  if (reason.is_string() && reason.get_ref<const std::string&>().size() <= kFinishReasonBytesMax) {
    t->finish_reason = reason.get<std::string>();
  }
}

// At most kTrajectoryChoicesMax choice indexes are kept: each costs a map node whatever it holds.
// Choice 0, the one journaled, always has its place.
ChoiceTrace* Trajectory::ChoiceOf(std::int64_t index) {
  auto it = choices.find(index);
  if (it != choices.end()) return &it->second;
  if (choices.size() >= kTrajectoryChoicesMax && index != 0) {
    truncated = true;
    return nullptr;
  }
  return &choices[index];
}

// An id that is no integer within int32 (the journal's field) is no token the journal can hold:
// skipping it would pair the logprobs that follow with other tokens, narrowing it would record
// another token, and keeping it would put in the line an id the journal lacks, so the trace is
// cut.
void Trajectory::TakeTokenIds(const json& ids, ChoiceTrace& trace) {
  for (const json& id : ids) {
    if (!TakeEntry()) {
      trace.cut = true;
      break;
    }
    const std::optional<std::int32_t> exact = ExactTokenId(id);
    if (!exact) {
      truncated = trace.cut = true;
      break;
    }
    trace.token_ids.push_back(*exact);
  }
}

// Completions carry logprobs.token_logprobs (numbers), chat and generate logprobs.content
// (objects). A completion with echo scores the prompt first, in the same list: the output's
// logprobs are its last ones, one per output token id the choice carries.
void Trajectory::TakeLogprobs(const json& choice, ChoiceTrace& trace) {
  auto lp = choice.find("logprobs");
  if (lp == choice.end() || !lp->is_object()) return;
  if (auto tl = lp->find("token_logprobs"); tl != lp->end() && tl->is_array()) {
    const json* ids = TokenIdsOf(choice);
    const std::size_t echoed =
        ids != nullptr && ids->size() < tl->size() ? tl->size() - ids->size() : 0;
    for (auto v = tl->begin() + static_cast<std::ptrdiff_t>(echoed); v != tl->end(); ++v) {
      if (!TakeLogprob(NumberOrNull(*v), trace)) break;
    }
  } else if (auto ct = lp->find("content"); ct != lp->end() && ct->is_array()) {
    for (const json& item : *ct) {
      if (!TakeLogprob(ContentLogprob(item), trace)) break;
    }
  }
}

// A number past float's range is cut like an id past int32: the journal would hold an infinity
// where the line holds the number. One within it is kept as the journal's float holds it
// (AsJournaled). False once the choice is cut.
bool Trajectory::TakeLogprob(const json& logprob, ChoiceTrace& trace) {
  RC_CHECK(logprob.is_null() || logprob.is_number());
  if (!TakeEntry()) {
    trace.cut = true;
    return false;
  }
  if (logprob.is_number() && !WithinFloat(logprob.get<double>())) {
    truncated = trace.cut = true;
    return false;
  }
  trace.logprobs.push_back(AsJournaled(logprob));
  return true;
}

bool Trajectory::TakeEntry() {
  if (entries >= kTrajectoryEntriesMax) {
    truncated = true;
    return false;
  }
  ++entries;
  return true;
}

namespace {

// Choice 0 of a trace as the flat arrays its journal parts are cut from.
struct FlatTrace {
  std::vector<std::int32_t> prompt;
  std::vector<std::int32_t> output;
  std::vector<float> logprobs;  // one per output token (NaN: none reported)
  bool any_logprob = false;
};

// A logprob as the journal's float holds it: past float's range it is the infinity of its sign
// (a plain conversion of such a double is undefined behaviour).
float ToFloat(double v) {
  if (v < -std::numeric_limits<float>::max()) return -std::numeric_limits<float>::infinity();
  if (v > std::numeric_limits<float>::max()) return std::numeric_limits<float>::infinity();
  return static_cast<float>(v);
}

// nullopt when the trace is untrusted, the prompt or choice 0 is not whole, or an id does not fit
// the journal's fields (only a trace built by hand has one: Absorb cuts there): the parts would
// record another trajectory than the engine's (the trajectory line keeps what it could, and says
// truncated), so none are journaled.
std::optional<FlatTrace> Flatten(const Trajectory& trace) {
  if (trace.prompt_cut || !trace.Trusted()) return std::nullopt;
  FlatTrace flat;
  if (trace.prompt_token_ids.is_array()) {
    for (const json& id : trace.prompt_token_ids) {
      const std::optional<std::int32_t> exact = ExactTokenId(id);
      if (!exact) return std::nullopt;
      flat.prompt.push_back(*exact);
    }
  }
  auto it = trace.choices.find(0);
  if (it == trace.choices.end()) return flat;
  const ChoiceTrace& c = it->second;
  if (c.cut) return std::nullopt;
  for (std::size_t i = 0; i < c.token_ids.size(); ++i) {
    const std::optional<std::int32_t> exact = ExactTokenId(c.token_ids[i]);
    if (!exact) return std::nullopt;
    flat.output.push_back(*exact);
    const json lp = i < c.logprobs.size() ? c.logprobs[i] : json();
    flat.any_logprob = flat.any_logprob || lp.is_number();
    flat.logprobs.push_back(lp.is_number() ? ToFloat(lp.get<double>()) : std::nanf(""));
  }
  RC_CHECK(flat.logprobs.size() == flat.output.size());
  return flat;
}

// The next part: prompt tokens from `p` first, then output tokens from `o`, together at most
// kTrajectoryTokensPerRecordMax; `p` and `o` advance past what it took.
TrajectoryRecorded NextPart(const std::string& rollout_id, std::uint32_t index,
                            const FlatTrace& flat, std::size_t& p, std::size_t& o) {
  RC_CHECK(p <= flat.prompt.size() && o <= flat.output.size());
  TrajectoryRecorded part;
  part.rollout_id = rollout_id;
  part.part = index;
  std::size_t room = kTrajectoryTokensPerRecordMax;
  const std::size_t np = std::min(room, flat.prompt.size() - p);
  part.prompt_token_ids.assign(flat.prompt.begin() + p, flat.prompt.begin() + p + np);
  p += np;
  room -= np;
  const std::size_t no = std::min(room, flat.output.size() - o);
  part.output_token_ids.assign(flat.output.begin() + o, flat.output.begin() + o + no);
  if (flat.any_logprob) {
    part.output_logprobs.assign(flat.logprobs.begin() + o, flat.logprobs.begin() + o + no);
  }
  o += no;
  RC_CHECK(np + no > 0 && np + no <= kTrajectoryTokensPerRecordMax);
  return part;
}

}  // namespace

std::vector<TrajectoryRecorded> JournalTrajectoryParts(const std::string& rollout_id,
                                                       const Trajectory& trace) {
  const std::optional<FlatTrace> flattened = Flatten(trace);
  if (!flattened) return {};
  const FlatTrace& flat = *flattened;
  // Parts hold a trajectory whole or not at all: the journal has no mark for a cut one, and the
  // audit would re-verify a prefix as the whole.
  const std::size_t tokens = flat.prompt.size() + flat.output.size();
  if (tokens > kTrajectoryPartsMax * kTrajectoryTokensPerRecordMax) return {};
  std::vector<TrajectoryRecorded> parts;
  std::size_t p = 0, o = 0;
  while ((p < flat.prompt.size() || o < flat.output.size()) && parts.size() < kTrajectoryPartsMax) {
    parts.push_back(NextPart(rollout_id, static_cast<std::uint32_t>(parts.size()), flat, p, o));
  }
  RC_CHECK(parts.size() <= kTrajectoryPartsMax && p == flat.prompt.size() &&
           o == flat.output.size());
  return parts;
}

namespace {

// The request field `key` is absent or null: the client left it to the engine's default.
bool Unset(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null();
}

// The request field `key` is absent, null, or exactly `none` (what says "no" in vLLM's reading).
bool UnsetOr(const json& obj, const char* key, const json& none) {
  return Unset(obj, key) || obj.at(key) == none;
}

// Adds the sampled tokens' logprobs where the client asked for none (see AddTraceFields).
bool AddLogprobs(ProxyRoute route, json& body) {
  switch (route) {
    case ProxyRoute::kCompletions:
      if (!Unset(body, "logprobs") || !UnsetOr(body, "echo", false)) return false;
      body["logprobs"] = 0;
      return true;
    case ProxyRoute::kChat:
      if (!UnsetOr(body, "logprobs", false) || !UnsetOr(body, "top_logprobs", 0) ||
          !UnsetOr(body, "echo", false)) {
        return false;
      }
      body["logprobs"] = true;
      body["top_logprobs"] = 0;
      return true;
    case ProxyRoute::kGenerate: {
      json& sp = body["sampling_params"];
      if (sp.is_null()) sp = json::object();
      if (!sp.is_object() || !Unset(sp, "logprobs")) return false;
      sp["logprobs"] = 0;
      return true;
    }
  }
  return false;
}

void StripChoice(json& choice, const AddedFields& added) {
  if (added.logprobs && choice.contains("logprobs")) choice["logprobs"] = nullptr;
  if (!added.token_ids) return;
  choice.erase("prompt_token_ids");
  choice.erase("token_ids");
  if (auto d = choice.find("delta"); d != choice.end() && d->is_object()) d->erase("token_ids");
}

}  // namespace

AddedFields AddTraceFields(ProxyRoute route, bool stream, json& body) {
  RC_CHECK(body.is_object());
  AddedFields added;
  if (route != ProxyRoute::kGenerate) {
    added.token_ids = !(body.value("return_token_ids", json(false)) == json(true));
    body["return_token_ids"] = true;
    if (stream) {
      json& so = body["stream_options"];
      // As vLLM reads it: with stream_options given, include_usage defaults to true.
      const bool asked =
          so.is_object() && (!so.contains("include_usage") || so["include_usage"] == json(true));
      if (!so.is_object()) so = json::object();
      added.usage = !asked;
      so["include_usage"] = true;
    }
  }
  added.logprobs = AddLogprobs(route, body);
  RC_CHECK(route == ProxyRoute::kGenerate || body["return_token_ids"] == json(true));
  return added;
}

void StripAdded(json& doc, const AddedFields& added) {
  if (!doc.is_object()) return;
  if (added.usage) doc.erase("usage");
  if (added.token_ids) doc.erase("prompt_token_ids");
  auto cs = doc.find("choices");
  if (cs == doc.end() || !cs->is_array()) return;
  for (json& c : *cs) {
    if (c.is_object()) StripChoice(c, added);
  }
}

std::optional<std::string> PassChunk(Trajectory& trace, const json& chunk,
                                     const AddedFields& added) {
  trace.Absorb(chunk);
  if (added.usage && chunk.is_object() && chunk.contains("usage") &&
      chunk.value("choices", json::array()).empty()) {
    return std::nullopt;  // the usage-only chunk the client did not ask for
  }
  json out = chunk;
  StripAdded(out, added);
  return "data: " + DumpSafe(out) + "\n\n";
}

std::uint64_t StreamEventBytesBound(std::string_view data) { return 2 * ParsedBytesBound(data); }

bool StreamEventHold::Take(std::string_view data) {
  hold_.Release();
  if (data.size() <= kStreamEventUnheldBytesMax) return true;
  if (hold_.Grow(StreamEventBytesBound(data))) return true;
  refused_ = true;
  return false;
}

void TrimSsePending(std::string& pending) {
  if (pending.capacity() > kSsePendingKeptBytesMax && pending.size() < pending.capacity() / 4) {
    std::string(pending).swap(pending);  // a copy takes what its bytes need
  }
}

bool StreamBufferHold::HoldFor(std::uint64_t bytes) {
  if (bytes <= kStreamBufferUnheldBytesMax) {
    hold_.Release();  // no operation when nothing is held
    return true;
  }
  return hold_.ResizeTo(bytes);
}

namespace {

// The prompts a completion's `key` (`prompt` or `prompt_embeds`) holds as vLLM counts them: a
// list of integers is one prompt of token ids, any other list as many prompts as it has items
// (strings, token-id lists, embeddings; a mixed list, which vLLM refuses, counts high), anything
// else one, absent or null none.
std::uint64_t PromptsIn(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return 0;
  if (!it->is_array()) return 1;
  const bool token_ids =
      std::all_of(it->begin(), it->end(), [](const json& x) { return x.is_number_integer(); });
  return token_ids ? 1 : it->size();
}

// Unicode White_Space: what pydantic trims off a string before reading an integer in it (Rust's
// str::trim).
bool IsWhiteSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The code point a UTF-8 sequence of exactly `bytes` encodes, nullopt when it is none.
std::optional<char32_t> DecodeUtf8(std::string_view bytes) {
  if (bytes.empty() || bytes.size() > 4) return std::nullopt;
  const auto lead = static_cast<unsigned char>(bytes[0]);
  const std::size_t want = lead < 0x80 ? 1 : lead >> 5 == 0x6 ? 2 : lead >> 4 == 0xE ? 3 : 4;
  if (want != bytes.size() || (want == 4 && lead >> 3 != 0x1E)) return std::nullopt;
  char32_t c = want == 1 ? lead : lead & (0x7F >> want);
  for (std::size_t i = 1; i < want; ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    if (b >> 6 != 0x2) return std::nullopt;
    c = (c << 6) | (b & 0x3F);
  }
  return c;
}

bool Utf8Continuation(char b) { return (static_cast<unsigned char>(b) & 0xC0) == 0x80; }

// `text` without the White_Space code points at either end.
std::string_view TrimWhiteSpace(std::string_view text) {
  while (!text.empty()) {
    std::size_t n = 1;  // the first code point's bytes
    while (n < text.size() && n < 4 && Utf8Continuation(text[n])) ++n;
    const std::optional<char32_t> c = DecodeUtf8(text.substr(0, n));
    if (!c || !IsWhiteSpace(*c)) break;
    text.remove_prefix(n);
  }
  while (!text.empty()) {
    std::size_t n = 1;  // the last code point's bytes
    while (n < text.size() && n < 4 && Utf8Continuation(text[text.size() - n])) ++n;
    const std::optional<char32_t> c = DecodeUtf8(text.substr(text.size() - n));
    if (!c || !IsWhiteSpace(*c)) break;
    text.remove_suffix(n);
  }
  return text;
}

// A JSON integer's text: an optional minus, then 0 or digits without a leading zero.
bool IsIntegerText(std::string_view text) {
  if (!text.empty() && text.front() == '-') text.remove_prefix(1);
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) return false;
  return text.size() == 1 || text.front() != '0';
}

// `s`, a number's text after its sign, without its leading zeros and the underscores among them;
// one stays where nothing else follows them (its last character) or a '.' does (the one before
// it). What follows them is kept as it is when it is a digit or '-' (pydantic reads "0-5" as -5).
// nullopt when `s` starts with no digit, or its zeros are followed by anything else.
std::optional<std::string_view> WithoutLeadingZeros(std::string_view s) {
  if (s.empty() || s.front() < '0' || s.front() > '9') return std::nullopt;
  if (s.front() != '0') return s;
  std::size_t i = 1;
  while (i < s.size() && (s[i] == '0' || s[i] == '_')) ++i;
  if (i == s.size()) return s.substr(s.size() - 1);
  if ((s[i] >= '1' && s[i] <= '9') || s[i] == '-') return s.substr(i);
  if (s[i] == '.') return s.substr(i - 1);
  return std::nullopt;
}

// The integer pydantic's lax mode reads in a string, as JSON integer text; nullopt when it reads
// none (pydantic-core's str_as_int): White_Space trimmed, one sign ("+-", "-+", "--" are none),
// leading zeros dropped, a '.' followed by zeros only dropped with them, and underscores dropped
// where each stands alone between other characters ("1_000"; not "_1", "1_", "1__0"). What is
// left must be a JSON integer: "2.", "2.5", "1e3", "0x10" are none.
std::optional<std::string> LaxIntegerText(std::string_view raw) {
  std::string_view s = TrimWhiteSpace(raw);
  bool negative = false;
  if (!s.empty() && s.front() == '+') {
    s.remove_prefix(1);
    if (!s.empty() && s.front() == '-') return std::nullopt;
  }
  if (!s.empty() && s.front() == '-') {
    s.remove_prefix(1);
    if (!s.empty() && (s.front() == '-' || s.front() == '+')) return std::nullopt;
    negative = true;
  }
  const std::optional<std::string_view> digits = WithoutLeadingZeros(s);
  if (!digits) return std::nullopt;
  s = *digits;
  if (const std::size_t dot = s.find('.'); dot != std::string_view::npos) {
    const std::string_view fraction = s.substr(dot + 1);
    if (!fraction.empty() && fraction.find_first_not_of('0') == std::string_view::npos) {
      s = s.substr(0, dot);
    }
  }
  std::string text = negative ? "-" : "";
  const bool lone_underscores = s.find('_') != std::string_view::npos && s.front() != '_' &&
                                s.back() != '_' && s.find("__") == std::string_view::npos;
  for (const char c : s) {
    if (!lone_underscores || c != '_') text += c;
  }
  if (!IsIntegerText(text)) return std::nullopt;
  return text;
}

// JSON integer text as an int64, saturated at its bounds.
std::int64_t SaturatedInt(std::string_view text) {
  RC_CHECK(IsIntegerText(text));
  const bool negative = text.front() == '-';
  if (negative) text.remove_prefix(1);
  std::uint64_t magnitude = 0;
  for (const char c : text) {
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (magnitude > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) {
      magnitude = std::numeric_limits<std::uint64_t>::max();
      break;
    }
    magnitude = magnitude * 10 + digit;
  }
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  if (!negative) return static_cast<std::int64_t>(std::min(magnitude, kMax));
  if (magnitude > kMax) return std::numeric_limits<std::int64_t>::min();
  return -static_cast<std::int64_t>(magnitude);
}

// A whole double as an int64, saturated at its bounds.
std::int64_t SaturatedInt(double whole) {
  RC_CHECK(std::isfinite(whole) && std::trunc(whole) == whole);
  constexpr double kTwoTo63 = 9223372036854775808.0;
  if (whole >= kTwoTo63) return std::numeric_limits<std::int64_t>::max();
  if (whole < -kTwoTo63) return std::numeric_limits<std::int64_t>::min();
  return static_cast<std::int64_t>(whole);
}

// The integer vLLM reads in `v` for an `int` field of its request models, which are pydantic
// models in lax mode validating the body as Python's json module parsed it: an integer; a float
// with no fractional part (2.0, 2e0, -0.0 as 0; not 2.5, not an infinity); a boolean (true 1,
// false 0); a string LaxIntegerText reads. Saturated at int64's bounds (a larger one is out of
// every range the proxy checks); nullopt for anything else.
std::optional<std::int64_t> LaxInt(const json& v) {
  if (v.is_number_unsigned()) {
    constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    return static_cast<std::int64_t>(std::min(v.get<std::uint64_t>(), kMax));
  }
  if (v.is_number_integer()) return v.get<std::int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::trunc(d) != d) return std::nullopt;
    return SaturatedInt(d);
  }
  if (v.is_boolean()) return v.get<bool>() ? 1 : 0;
  if (!v.is_string()) return std::nullopt;
  const std::optional<std::string> text = LaxIntegerText(v.get_ref<const std::string&>());
  if (!text) return std::nullopt;
  return SaturatedInt(*text);
}

// The choices vLLM may number for one prompt: `n` in `params`, absent (1), null where the
// route's model declares it optional (`null_is_one`: chat's; 1), or what LaxInt reads in it, in
// 1..kRequestChoicesMax; an accepted value of another form is rewritten as that JSON integer, so
// that the engine counts what the trace counts. `where` prefixes the field's name. vLLM's
// request models have no `best_of` (it went with vLLM's V0 engine): an extra field they ignore,
// as this does.
Result<std::uint64_t> ChoicesPerPrompt(json& params, const std::string& where, bool null_is_one) {
  const auto it = params.find("n");
  if (it == params.end() || (null_is_one && it->is_null())) return std::uint64_t{1};
  const std::optional<std::int64_t> n = LaxInt(*it);
  if (!n) return Status::InvalidArgument("'" + where + "n' must be an integer");
  if (*n < 1 || static_cast<std::uint64_t>(*n) > kRequestChoicesMax) {
    return Status::InvalidArgument("'" + where + "n' must be in 1.." +
                                   std::to_string(kRequestChoicesMax));
  }
  if (!it->is_number_integer()) *it = *n;
  return static_cast<std::uint64_t>(*n);
}

}  // namespace

Status CheckRequestChoices(ProxyRoute route, json& body) {
  RC_CHECK(body.is_object());
  if (route == ProxyRoute::kGenerate) {
    const auto sp = body.find("sampling_params");
    if (sp == body.end() || !sp->is_object()) return Status::OK();  // no n: one choice
    return ChoicesPerPrompt(*sp, "sampling_params.", /*null_is_one=*/false).status();
  }
  const Result<std::uint64_t> per_prompt =
      ChoicesPerPrompt(body, "", /*null_is_one=*/route == ProxyRoute::kChat);
  if (!per_prompt.ok() || route != ProxyRoute::kCompletions) return per_prompt.status();
  RC_CHECK(*per_prompt >= 1 && *per_prompt <= kRequestChoicesMax);
  const std::uint64_t prompts =
      std::max<std::uint64_t>(1, PromptsIn(body, "prompt") + PromptsIn(body, "prompt_embeds"));
  if (prompts <= kRequestChoicesMax / *per_prompt) return Status::OK();  // no product overflows
  return Status::InvalidArgument(
      "the request asks for " + std::to_string(prompts) + " x " + std::to_string(*per_prompt) +
      " choices (its prompts times 'n'), more than the " + std::to_string(kRequestChoicesMax) +
      " a request's trace can record (vLLM numbers choice i of prompt p as p * n + i)");
}

}  // namespace rc::service
