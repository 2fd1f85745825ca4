// The engine's non-streamed answer read with simdjson (see answer_relay.h).
#include "service/answer_relay.h"

#include <cstdint>
#include <initializer_list>

// Only the DOM's noexcept calls are used here; the library's throwing overloads stay out.
#define SIMDJSON_EXCEPTIONS 0  // NOLINT(cppcoreguidelines-macro-usage)
#include <simdjson.h>

#include "statemachine/status.h"
#include "statemachine/text.h"

namespace rc::service {
namespace {

namespace dom = simdjson::dom;

bool OneOf(std::string_view key, std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys) {
    if (key == k) return true;
  }
  return false;
}

json ToJson(dom::element e);

json ArrayToJson(dom::array a) {
  json out = json::array();
  for (dom::element x : a) out.push_back(ToJson(x));
  return out;
}

// A key given twice keeps its last value, as in nlohmann's parse.
json ObjectToJson(dom::object o) {
  json out = json::object();
  for (dom::key_value_pair kv : o) out[std::string(kv.key)] = ToJson(kv.value);
  return out;
}

// A simdjson value as nlohmann's parse of the same text holds it: a non-negative integer is
// unsigned there (usage counts are taken only when unsigned).
json ToJson(dom::element e) {
  switch (e.type()) {
    case dom::element_type::ARRAY:
      return ArrayToJson(e.get_array().value_unsafe());
    case dom::element_type::OBJECT:
      return ObjectToJson(e.get_object().value_unsafe());
    case dom::element_type::INT64: {
      const std::int64_t v = e.get_int64().value_unsafe();
      return v >= 0 ? json(static_cast<std::uint64_t>(v)) : json(v);
    }
    case dom::element_type::UINT64:
      return json(e.get_uint64().value_unsafe());
    case dom::element_type::DOUBLE:
      return json(e.get_double().value_unsafe());
    case dom::element_type::STRING:
      return json(std::string(e.get_string().value_unsafe()));
    case dom::element_type::BOOL:
      return json(e.get_bool().value_unsafe());
    case dom::element_type::NULL_VALUE:
      return json();
  }
  return json();
}

// The fields Trajectory::Absorb reads of a document and of each of its choices; the rest of the
// answer never becomes an nlohmann value.
json ChoiceForTrace(dom::object choice) {
  json out = json::object();
  for (dom::key_value_pair kv : choice) {
    if (OneOf(kv.key,
              {"index", "token_ids", "prompt_token_ids", "delta", "logprobs", "finish_reason"})) {
      out[std::string(kv.key)] = ToJson(kv.value);
    }
  }
  return out;
}

// One element for each of the answer's, objects or not: Absorb lets a choice leave its index out
// only when the array holds exactly one element.
json ChoicesForTrace(dom::array choices) {
  json out = json::array();
  for (dom::element c : choices) {
    dom::object choice;
    out.push_back(c.get(choice) == simdjson::SUCCESS ? ChoiceForTrace(choice) : json());
  }
  return out;
}

json DocumentForTrace(dom::object root) {
  json out = json::object();
  for (dom::key_value_pair kv : root) {
    dom::array choices;
    if (kv.key == "choices" && kv.value.get(choices) == simdjson::SUCCESS) {
      out["choices"] = ChoicesForTrace(choices);
    } else if (OneOf(kv.key, {"choices", "prompt_token_ids", "usage"})) {
      out[std::string(kv.key)] = ToJson(kv.value);
    }
  }
  return out;
}

// ---- the client's body: StripAdded's removals, written from the DOM ----

void Comma(std::string& out) {
  if (out.back() != '{' && out.back() != '[') out += ',';
}

void WriteDelta(std::string& out, dom::object delta, const AddedFields& added) {
  out += '{';
  for (dom::key_value_pair kv : delta) {
    if (added.token_ids && kv.key == "token_ids") continue;
    Comma(out);
    out += simdjson::to_string(kv);
  }
  out += '}';
}

void WriteChoice(std::string& out, dom::object choice, const AddedFields& added) {
  out += '{';
  for (dom::key_value_pair kv : choice) {
    if (added.token_ids && OneOf(kv.key, {"token_ids", "prompt_token_ids"})) continue;
    Comma(out);
    dom::object delta;
    if (added.logprobs && kv.key == "logprobs") {
      out += "\"logprobs\":null";
    } else if (kv.key == "delta" && kv.value.get(delta) == simdjson::SUCCESS) {
      out += "\"delta\":";
      WriteDelta(out, delta, added);
    } else {
      out += simdjson::to_string(kv);
    }
  }
  out += '}';
}

void WriteChoices(std::string& out, dom::array choices, const AddedFields& added) {
  out += '[';
  for (dom::element c : choices) {
    Comma(out);
    dom::object choice;
    if (c.get(choice) == simdjson::SUCCESS) {
      WriteChoice(out, choice, added);
    } else {
      out += simdjson::to_string(c);
    }
  }
  out += ']';
}

std::string ClientText(dom::object root, const AddedFields& added) {
  std::string out = "{";
  for (dom::key_value_pair kv : root) {
    if ((added.usage && kv.key == "usage") || (added.token_ids && kv.key == "prompt_token_ids")) {
      continue;
    }
    Comma(out);
    dom::array choices;
    if (kv.key == "choices" && kv.value.get(choices) == simdjson::SUCCESS) {
      out += "\"choices\":";
      WriteChoices(out, choices, added);
    } else {
      out += simdjson::to_string(kv);
    }
  }
  out += '}';
  return out;
}

// "-0" is a signed integer to nlohmann (so no usage count) and the same 0 as "0" in simdjson's
// DOM: such documents are left to nlohmann. One in a string costs only the slower path.
bool HasIntegerMinusZero(std::string_view text) {
  for (std::size_t at = text.find("-0"); at != std::string_view::npos;
       at = text.find("-0", at + 2)) {
    const std::size_t next = at + 2;
    if (next == text.size()) return true;
    const char c = text[next];
    if (!(c == '.' || c == 'e' || c == 'E' || (c >= '0' && c <= '9'))) return true;
  }
  return false;
}

std::optional<std::string> Relay(dom::parser& parser, std::string_view text, Trajectory& trace,
                                 const AddedFields& added) {
  dom::element doc;
  dom::object root;
  if (parser.parse(text.data(), text.size()).get(doc) != simdjson::SUCCESS ||
      doc.get(root) != simdjson::SUCCESS) {
    return std::nullopt;
  }
  trace.Absorb(DocumentForTrace(root));
  return ClientText(root, added);
}

}  // namespace

std::optional<std::string> RelayAnswer(std::string_view text, Trajectory& trace,
                                       const AddedFields& added) {
  // The same depth bound as every other parse of outside text; it also bounds ToJson's recursion.
  if (text.size() > kRelayAnswerBytesMax || !text::json_depth_within(text) ||
      HasIntegerMinusZero(text)) {
    return std::nullopt;
  }
  thread_local dom::parser parser;
  return Relay(parser, text, trace, added);
}

}  // namespace rc::service
