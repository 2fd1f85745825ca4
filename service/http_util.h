// Small helpers shared by the service's route handlers: JSON errors, strict field checks.
//
// Every serialisation here is non-throwing: strings in a reply come from outside (engine bodies
// cut inside a UTF-8 character, client fields, file paths), and nlohmann's default dump() throws
// type_error 316 on invalid UTF-8 — inside an event-loop handler or a streaming callback that
// is a failed request at best. Use DumpSafe() for every JSON that holds outside text.
#pragma once

#include <charconv>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "effects/http/response_parsers.h"
#include "service/http_server.h"
#include "statemachine/status.h"
#include "statemachine/text.h"

namespace rc::service {

// `j` serialised without ever throwing on its strings: ill-formed UTF-8 becomes U+FFFD
// (error_handler_t::replace). indent < 0: one line. Only bad_alloc can escape.
inline std::string DumpSafe(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

// {"error": {"message", "type", "code"}} (the OpenAI/vLLM error shape).
inline std::string ErrorBody(int status, const std::string& type, const std::string& message) {
  nlohmann::json j = {{"error", {{"message", message}, {"type", type}, {"code", status}}}};
  return DumpSafe(j);
}

inline HttpResponse ErrorResponse(int status, const std::string& type, const std::string& message) {
  return MakeResponse(status, ErrorBody(status, type, message), "application/json");
}

// Sets status and body, keeping the headers already set on `res`.
inline void SendError(HttpResponse& res, int status, const std::string& type,
                      const std::string& message) {
  SetBody(res, status, ErrorBody(status, type, message), "application/json");
}

inline void SendJson(HttpResponse& res, int status, const nlohmann::json& j) {
  SetBody(res, status, DumpSafe(j), "application/json");
}

inline void SetHeader(HttpResponse& res, std::string_view name, std::string_view value) {
  res.set(boost::beast::string_view(name.data(), name.size()),
          boost::beast::string_view(value.data(), value.size()));
}

// An upper bound on the bytes a body takes once parsed by nlohmann::json and dumped again for the
// engine: its text twice (string contents, the dumped copy) and, per structural byte outside
// strings, the nodes it makes (an array or object with its container, an element's slot with the
// vector's growth, a member's map node and key, a string's heap object). "[]," is 3 bytes of text
// and ~70 in memory.
inline std::uint64_t ParsedBytesBound(std::string_view body) {
  return effects::json_tree_bytes_bound(body) + body.size();  // the tree, and the dumped copy
}

// Parses a request body as a JSON object ("" allowed when empty_ok: yields {}).
inline Result<nlohmann::json> ParseObject(const std::string& body, bool empty_ok) {
  if (body.empty() && empty_ok) return nlohmann::json::object();
  if (!text::json_depth_within(body)) {
    return Status::InvalidArgument("body nests arrays and objects deeper than " +
                                   std::to_string(text::kJsonDepthMax));
  }
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument("body is not valid JSON");
  if (!j.is_object()) return Status::InvalidArgument("body must be a JSON object");
  return j;
}

inline Status OnlyFields(const nlohmann::json& obj, std::initializer_list<const char*> allowed,
                         const std::string& where) {
  for (const auto& [key, value] : obj.items()) {
    bool ok = false;
    for (const char* a : allowed) ok = ok || key == a;
    if (!ok) return Status::InvalidArgument("unknown field '" + where + key + "'");
  }
  return Status::OK();
}

inline Result<std::string> GetString(const nlohmann::json& obj, const char* key, bool required,
                                     const std::string& where = "") {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (required) return Status::InvalidArgument("missing field '" + where + key + "'");
    return std::string();
  }
  if (!it->is_string()) return Status::InvalidArgument("'" + where + key + "' must be a string");
  return it->get<std::string>();
}

inline Result<std::int64_t> GetInt(const nlohmann::json& obj, const char* key,
                                   std::int64_t fallback, std::int64_t lo, std::int64_t hi,
                                   const std::string& where = "") {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) {
    return Status::InvalidArgument("'" + where + key + "' must be an integer");
  }
  const auto range_error = [&] {
    return Status::InvalidArgument("'" + where + key + "' must be in " + std::to_string(lo) + ".." +
                                   std::to_string(hi));
  };
  // An unsigned above INT64_MAX would wrap to a negative through get<int64_t>().
  if (it->is_number_unsigned() &&
      it->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    return range_error();
  }
  const std::int64_t v = it->get<std::int64_t>();
  if (v < lo || v > hi) return range_error();
  return v;
}

// Decimal digits only (no sign, no space, no "0x"), parsed without exceptions; nullopt when the
// text is empty, holds anything else or does not fit in 64 bits.
inline std::optional<std::uint64_t> parse_u64(std::string_view text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    return std::nullopt;
  }
  std::uint64_t n = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return n;
}

// Query parameter as an unsigned integer within [lo, hi]; fallback when absent. Anything that is
// not a decimal integer in range (including one beyond 64 bits) is InvalidArgument (400).
inline Result<std::uint64_t> QueryU64(const ApiRequest& req, const char* key,
                                      std::uint64_t fallback, std::uint64_t lo, std::uint64_t hi) {
  const std::optional<std::string> text = req.query(key);
  if (!text) return fallback;
  const std::optional<std::uint64_t> n = parse_u64(*text);
  if (!n || *n < lo || *n > hi) {
    return Status::InvalidArgument("query parameter '" + std::string(key) +
                                   "' must be an integer in " + std::to_string(lo) + ".." +
                                   std::to_string(hi));
  }
  return *n;
}

inline int HttpStatusFor(const Status& st) {
  switch (st.code()) {
    case Code::kInvalidArgument:
      return 400;
    case Code::kNotFound:
      return 404;
    case Code::kRejected:
    case Code::kConflict:
      return 409;
    case Code::kBusy:
    case Code::kUnavailable:
    case Code::kTimeout:
      return 503;
    default:
      return 500;
  }
}

inline void SendStatus(HttpResponse& res, const Status& st) {
  SendError(res, HttpStatusFor(st), code_name(st.code()), st.message());
}

}  // namespace rc::service
