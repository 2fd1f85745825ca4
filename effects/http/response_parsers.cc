// The pure parsers of EngineClient (see response_parsers.h): moved verbatim out of
// engine_client.cc so that they can be exercised without libcurl.
#include "effects/http/response_parsers.h"

#include <algorithm>
#include <utility>

#include "statemachine/status.h"
#include "statemachine/text.h"

namespace rc::effects {

nlohmann::json parse_outside_json(std::string_view text) {
  if (!text::json_depth_within(text)) return nlohmann::json(nlohmann::json::value_t::discarded);
  return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
}

std::uint64_t json_tree_bytes_bound(std::string_view text) {
  constexpr std::uint64_t kContainerBytes = 64, kSlotBytes = 32, kMemberBytes = 96;
  constexpr std::uint64_t kStringBytes = 48;
  std::uint64_t bound = static_cast<std::uint64_t>(text.size()) + kContainerBytes;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped byte is content
      in_string = c != '"';
      continue;
    }
    in_string = c == '"';
    bound += c == '[' || c == '{' ? kContainerBytes
             : c == ','           ? kSlotBytes
             : c == ':'           ? kMemberBytes
             : in_string          ? kStringBytes
                                  : 0;
  }
  return bound;
}

Status check_file_json_tree(std::string_view text, const std::string& what) {
  if (json_tree_bytes_bound(text) <= kFileJsonTreeBytesMax) return Status::OK();
  return Status::InvalidArgument(what + " would take more than " +
                                 std::to_string(kFileJsonTreeBytesMax) +
                                 " bytes once parsed (the bound on a file's parsed JSON)");
}

using nlohmann::json;

bool is_blank(const std::string& s) {
  for (char c : s) {
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return false;
  }
  return true;
}

namespace {
bool short_string(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() &&
         it->get_ref<const std::string&>().size() <= kIdBytesMax;
}
}  // namespace

bool check_version(const json& j) { return short_string(j, "version"); }
bool check_weight_info(const json& j) { return short_string(j, "weight_version"); }
bool check_status(const json& j) { return short_string(j, "status"); }
bool check_is_paused(const json& j) {
  auto it = j.find("is_paused");
  return it != j.end() && it->is_boolean();
}
// A route that answers whether it did what it was asked did it only when it says so: a 200 with
// {"success": false} is a failure, never a success with an odd body.
bool check_success(const json& j) {
  auto it = j.find("success");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}
bool check_is_sleeping(const json& j) {
  auto it = j.find("is_sleeping");
  return it != j.end() && it->is_boolean();
}

namespace {
bool byte_count(const json& j, const char* key, std::uint64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) return false;
  *out = it->get<std::uint64_t>();
  return true;
}
bool printable_id(const std::string& s) {
  if (s.empty() || s.size() > kIdBytesMax) return false;
  for (unsigned char c : s) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}
Result<WorkerDevice> parse_worker_device(const json& j) {
  WorkerDevice d;
  auto uuid = j.is_object() ? j.find("gpu_uuid") : j.end();
  if (!j.is_object() || uuid == j.end() || !uuid->is_string() ||
      !printable_id(uuid->get_ref<const std::string&>())) {
    return Status::InvalidArgument("a worker without a printable gpu_uuid");
  }
  d.gpu_uuid = uuid->get<std::string>();
  if (!byte_count(j, "free_bytes", &d.free_bytes) ||
      !byte_count(j, "total_bytes", &d.total_bytes) || d.free_bytes > d.total_bytes) {
    return Status::InvalidArgument("worker on " + d.gpu_uuid +
                                   ": free_bytes/total_bytes missing or inconsistent");
  }
  return d;
}
}  // namespace

Result<std::vector<WorkerDevice>> parse_device_info(const json& body) {
  auto results = body.is_object() ? body.find("results") : body.end();
  if (!body.is_object() || results == body.end() || !results->is_array() || results->empty() ||
      results->size() > kDeviceWorkersMax) {
    return Status::InvalidArgument("rc_device_info: expected {\"results\": [one per worker]}");
  }
  std::vector<WorkerDevice> out;
  out.reserve(results->size());
  for (const json& w : *results) {
    Result<WorkerDevice> d = parse_worker_device(w);
    if (!d.ok()) return Status::InvalidArgument("rc_device_info: " + d.status().message());
    out.push_back(std::move(d).value());
  }
  return out;
}
// {"results": [{"weight_version": s, ...}, ...]}: at least one worker, all reporting one label.
bool check_rpc_label(const json& j) {
  auto it = j.find("results");
  if (it == j.end() || !it->is_array() || it->empty() || it->size() > kRpcWorkersMax) return false;
  for (const json& w : *it) {
    if (!w.is_object() || !short_string(w, "weight_version")) return false;
    if (w["weight_version"] != (*it)[0]["weight_version"]) return false;
  }
  return true;
}
bool check_world_size(const json& j) {
  auto it = j.find("world_size");
  return it != j.end() && it->is_number_integer() && it->get<std::int64_t>() > 0 &&
         it->get<std::int64_t>() <= static_cast<std::int64_t>(kRpcWorkersMax);
}

namespace {

// Sets reply.body (null unless it parsed) and http.body_parsed by the route's shape and check.
void interpret_by_shape(EngineClient::Shape shape, bool (*check)(const json&), HttpReply& reply) {
  using Shape = EngineClient::Shape;
  HttpEvidence& ev = reply.http;
  switch (shape) {
    case Shape::kText:
      ev.body_parsed = true;
      return;
    case Shape::kEmptyOrJson:
      if (is_blank(reply.raw)) {
        ev.body_parsed = true;
        return;
      }
      reply.body = parse_outside_json(reply.raw);
      ev.body_parsed = !reply.body.is_discarded();
      break;
    case Shape::kJsonObject:
      reply.body = parse_outside_json(reply.raw);
      ev.body_parsed = !reply.body.is_discarded() && reply.body.is_object() &&
                       (check == nullptr || check(reply.body));
      break;
  }
  if (reply.body.is_discarded()) reply.body = nullptr;
}

}  // namespace

void interpret_body(EngineClient::Shape shape, bool (*check)(const json&), const std::string& path,
                    HttpReply& reply) {
  HttpEvidence& ev = reply.http;
  RC_CHECK(ev.transport == Transport::kOk && ev.http_status >= 200 && ev.http_status < 300);
  RC_CHECK(ev.error.empty());
  interpret_by_shape(shape, check, reply);
  if (!ev.body_parsed) {
    ev.error = bound_error("2xx body is not what " + path.substr(0, 64) +
                           " promises: " + reply.raw.substr(0, 300));
  }
  RC_CHECK(ev.body_parsed == ev.error.empty() && !reply.body.is_discarded());
}

namespace {

// Where the first complete event in `pending` ends and the length of the blank line that ends
// it ("\n\n" or "\r\n\r\n"); npos when none is complete.
// The first blank line ("\n\n" or "\r\n\r\n") beginning at or after `from`: its start and
// length ({npos, 0} if none). One pass: each '\n' is looked at once, so a look costs what it scans.
std::pair<std::size_t, std::size_t> first_event_end(std::string_view pending, std::size_t from) {
  for (std::size_t nl = pending.find('\n', from); nl != std::string_view::npos;
       nl = pending.find('\n', nl + 1)) {
    // "\r\n\r\n" beginning at nl - 1 (when nl - 1 >= from) ends at nl + 2.
    if (nl >= from + 1 && pending.substr(nl - 1, 4) == "\r\n\r\n") return {nl - 1, 4};
    if (pending.substr(nl, 2) == "\n\n") return {nl, 2};
  }
  return {std::string_view::npos, 0};
}

// The event's `data:` lines joined by '\n' ("" for a comment or keep-alive).
std::string event_data(const std::string& event) {
  std::string data;
  std::size_t pos = 0;
  while (pos <= event.size()) {
    std::size_t nl = event.find('\n', pos);
    if (nl == std::string::npos) nl = event.size();
    std::string line = event.substr(pos, nl - pos);
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.rfind("data:", 0) == 0) {
      std::string v = line.substr(5);
      if (!v.empty() && v[0] == ' ') v.erase(0, 1);
      if (!data.empty()) data += '\n';
      data += v;
    }
  }
  return data;
}

}  // namespace

// Linear in the bytes fed: each byte is searched for a blank line about once (`scanned`), and the
// dispatched events leave the buffer in one erase.
bool SseState::Feed(const char* p, std::size_t n) {
  if (done) return true;  // nothing after [DONE] is the stream's: dropped unread
  pending.append(p, n);
  std::size_t start = 0;
  bool go_on = true;
  while (go_on && !done) {
    // A blank line split across reads begins at most 3 bytes before what was scanned.
    const std::size_t from = std::max(start, scanned > 3 ? scanned - 3 : 0);
    const auto [end, sep] = first_event_end(pending, from);
    if (end == std::string::npos) break;
    go_on = Dispatch(pending.substr(start, end - start));
    start = end + sep;
    scanned = start;
  }
  if (done) {
    pending.clear();
    scanned = 0;
    return true;
  }
  pending.erase(0, start);
  scanned = go_on ? pending.size() : 0;  // stopped: what is left was never searched
  if (!go_on) return false;
  if (pending.size() > kSseEventBytesMax) {
    too_big = true;
    return false;
  }
  return true;
}

bool SseState::Dispatch(const std::string& event) {
  RC_CHECK(on_chunk != nullptr);
  if (done) return true;  // the stream ended at [DONE]: later events are neither passed nor judged
  const std::string data = event_data(event);
  if (data.empty()) return true;  // comment or keep-alive
  if (data == "[DONE]") {
    done = true;
    return true;
  }
  ++events;
  if (before_parse != nullptr && !(*before_parse)(data)) {
    stopped = true;
    return false;
  }
  json j = parse_outside_json(data);
  if (j.is_discarded()) {
    bad_event = true;
    return true;
  }
  if (!(*on_chunk)(j)) {
    stopped = true;
    return false;
  }
  return true;
}

// Only the engine's [DONE] completes a stream: one the caller stopped (its consumer could not
// take an event) is as cut short as one that ended without it.
void SseState::Finish(HttpEvidence& ev) {
  if (!stopped && !is_blank(pending)) Dispatch(pending);
  ev.body_parsed = done && !stopped && !bad_event && ev.error.empty();
  if (stopped)
    ev.error = "stream stopped by the caller";
  else if (bad_event)
    ev.error = "an SSE event was not JSON";
  else if (!done)
    ev.error = "stream ended without [DONE]";
  RC_CHECK(ev.body_parsed == ev.error.empty());
}

const char* cache_path(CacheKind c) {
  switch (c) {
    case CacheKind::kPrefix:
      return "/reset_prefix_cache";
    case CacheKind::kEncoder:
      return "/reset_encoder_cache";
    case CacheKind::kMultimodal:
      return "/reset_mm_cache";
  }
  return "/reset_prefix_cache";
}

namespace {

// label_from_rpc's work; the function itself checks the contract.
HttpReply normalise_rpc_label(HttpReply r, const std::string& method, const std::string* want) {
  if (!r.http.ok_2xx()) {
    r.http.error =
        bound_error("/collective_rpc " + method + " failed (is vLLM started with " +
                    "--worker-extension-cls " + kWorkerExtensionClass + "?): " + r.http.error +
                    (r.http.error.empty() ? r.raw.substr(0, 200) : ""));
    return r;
  }
  if (!check_rpc_label(r.body) || (want && r.body["results"][0]["weight_version"] != *want)) {
    r.http.body_parsed = false;
    r.http.error = bound_error("/collective_rpc " + method + " did not report " +
                               (want ? "'" + *want + "'" : std::string("one label")) +
                               " on every worker: " + r.raw.substr(0, 300));
    return r;
  }
  const std::size_t workers = r.body["results"].size();
  json label = r.body["results"][0]["weight_version"];
  std::string instance = rpc_instances(r.body["results"]);
  r.body = json{{"weight_version", label}, {"workers", workers}};
  if (!instance.empty()) r.body["instance"] = instance;
  return r;
}

}  // namespace

HttpReply label_from_rpc(HttpReply r, const std::string& method, const std::string* want) {
  RC_CHECK(!method.empty());
  r = normalise_rpc_label(std::move(r), method, want);
  // A label reply that passed is {"weight_version": string (== *want when set), ...}.
  RC_CHECK(!r.http.ok_2xx() || (r.body["weight_version"].is_string() &&
                                (want == nullptr || r.body["weight_version"] == *want)));
  RC_CHECK(r.http.error.size() <= kHttpErrorBytesMax);
  return r;
}

namespace {

// An instance an engine names: 1..bytes_max printable bytes, so the record that carries it is
// one the fold accepts and one line wherever it is printed.
bool IsInstanceText(const json& v, std::size_t bytes_max) {
  if (!v.is_string()) return false;
  const std::string& s = v.get_ref<const std::string&>();
  return !s.empty() && s.size() <= bytes_max && text::printable_utf8(s);
}

}  // namespace

// The worker extension's per-process nonces, one per worker in answer order ("" when the
// extension predates them). A restarted engine has new workers, hence new nonces.
std::string rpc_instances(const json& results) {
  std::string out;
  for (const json& w : results) {
    auto it = w.find("instance");
    if (it == w.end() || !IsInstanceText(*it, 64)) return {};
    if (!out.empty()) out += ',';
    out += it->get<std::string>();
    if (out.size() > kTextBytesMax / 2) return {};
  }
  RC_CHECK(out.size() <= kTextBytesMax / 2);
  return out;
}

// The engine's process start time from its Prometheus text ("" when absent): the instance of an
// engine without the worker extension.
std::string start_time_instance(const std::string& metrics_text) {
  static const std::string kName = "process_start_time_seconds ";
  std::size_t at = metrics_text.rfind("\n" + kName);
  at = at == std::string::npos ? (metrics_text.rfind(kName, 0) == 0 ? 0 : at) : at + 1;
  if (at == std::string::npos) return {};
  const std::size_t begin = at + kName.size();
  const std::size_t end = metrics_text.find_first_of("\r\n ", begin);
  std::string value = metrics_text.substr(begin, std::min<std::size_t>(end - begin, 32));
  if (value.empty() || value.find_first_not_of("0123456789.e+") != std::string::npos) return {};
  RC_CHECK(value.size() <= 32);
  return "start:" + value;
}

// Engine bodies are outside text: a field of another type is absent, never a throw.
std::optional<std::string> instance_in_label_body(const json& body) {
  if (!body.is_object()) return std::nullopt;
  auto it = body.find("instance");
  if (it == body.end() || !IsInstanceText(*it, kTextBytesMax / 2)) return std::nullopt;
  return it->get<std::string>();
}

std::string label_detail(const json& body) {
  if (!body.is_object()) return {};
  auto it = body.find("workers");
  if (it == body.end() || !it->is_number_unsigned()) return {};
  return "label from /collective_rpc rc_weight_info on " +
         std::to_string(it->get<std::uint64_t>()) + " worker(s)";
}

CacheResetObserved reset_observed(CacheKind cache, const HttpReply& r) {
  CacheResetObserved c;
  c.cache = cache;
  c.http = r.http;
  if (!r.http.ok_2xx()) return c;
  if (r.body.is_object() && r.body.contains("success") && r.body["success"].is_boolean()) {
    c.reported_success = r.body["success"].get<bool>();
  } else if (r.body.is_null()) {
    // Empty 200: the engine did not say whether the reset happened (vLLM 0.25.x for every cache;
    // "we currently do not check if the ... cache is successfully reset in the API server").
    c.reported_success = true;
    c.success_unreported = true;
  } else {
    c.http.body_parsed = false;
    c.http.error =
        bound_error(std::string(cache_path(cache)) +
                    " answered JSON without a boolean \"success\": " + r.raw.substr(0, 200));
  }
  // An unreported outcome is counted as a success only on a 2xx.
  RC_CHECK(!c.success_unreported || (c.reported_success && c.http.ok_2xx()));
  return c;
}

}  // namespace rc::effects
