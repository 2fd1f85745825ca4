// Proves that every engine-response parser of the vLLM client turns hostile bytes into evidence
// (body_parsed false, a bounded error) and never into an exception, a sanitizer report or a typed
// read that throws later; catches a check that lets through a body the typed calls then misread.
//
// Input: one selector byte (which route's parser), then the response body as the engine sent it.
// Routes: /version, /weight_info, /collective_rpc rc_weight_info (with per-worker instances),
// /pause, /is_paused, /reset_*_cache, /get_world_size, /update_weight_version, /metrics
// (process_start_time_seconds, and the Prometheus text parser the tests use, tests/support/)
// and the SSE event splitter.
//
// Regressions: a /weight_info body with a non-string "instance" or a non-integer "workers" made
// the typed reads throw nlohmann::json::type_error (tests/fuzz/regressions/).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "effects/http/protocol.h"
#include "effects/http/response_parsers.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/support/prometheus.h"

namespace {

using nlohmann::json;
using rc::effects::EngineClient;
using rc::effects::HttpReply;

HttpReply reply_for(const std::string& raw) {
  HttpReply r;
  r.raw = raw;
  r.http.transport = rc::Transport::kOk;
  r.http.http_status = 200;
  return r;
}

// The common contract of a 2xx body interpretation.
void check_evidence(const HttpReply& r, EngineClient::Shape shape) {
  FUZZ_CHECK(r.http.error.size() <= rc::effects::kHttpErrorBytesMax);
  FUZZ_CHECK(r.http.body_parsed == r.http.error.empty());
  FUZZ_CHECK(!r.body.is_discarded());
  if (shape == EngineClient::Shape::kJsonObject) {
    FUZZ_CHECK(r.http.body_parsed ? r.body.is_object() : true);
  }
}

HttpReply interpret(const std::string& raw, EngineClient::Shape shape, bool (*check)(const json&),
                    const char* path) {
  HttpReply r = reply_for(raw);
  rc::effects::interpret_body(shape, check, path, r);
  check_evidence(r, shape);
  return r;
}

// What the typed calls read from a label reply (ObserveView, WeightInfo, Instance).
void read_label_reply(const HttpReply& r, bool rpc_route) {
  if (!r.http.ok_2xx()) return;
  FUZZ_CHECK(r.body["weight_version"].is_string());
  FUZZ_CHECK(r.body["weight_version"].get<std::string>().size() <= rc::kIdBytesMax);
  const bool bad_instance = r.body.contains("instance") && !r.body["instance"].is_string();
  const bool bad_workers = r.body.contains("workers") && !r.body["workers"].is_number_integer();
  if (rpc_route) FUZZ_CHECK(!bad_instance && !bad_workers);  // label_from_rpc builds them
  auto inst = rc::effects::instance_in_label_body(r.body);
  if (bad_instance) FUZZ_CHECK(!inst.has_value());
  if (rpc_route && inst) FUZZ_CHECK(!inst->empty());
  const std::string detail = rc::effects::label_detail(r.body);
  FUZZ_CHECK(rpc_route == !detail.empty() || !rpc_route);
}

void fuzz_sse(const std::string& raw, std::uint8_t knob) {
  // The same bytes split two ways must give the same events: chunk boundaries are the network's.
  struct Run {
    std::vector<std::string> chunks;
    rc::effects::SseState sse;
    bool fed_ok = true;
    rc::HttpEvidence ev;
  };
  const std::size_t stop_at = knob & 0x0F;  // the caller stops at this event (0: never)
  auto run = [&](Run& out, std::size_t step) {
    EngineClient::ChunkFn fn = [&](const json& j) {
      FUZZ_CHECK(!j.is_discarded());
      out.chunks.push_back(j.dump(-1, ' ', false, json::error_handler_t::replace));
      return stop_at == 0 || out.chunks.size() < stop_at;
    };
    out.sse.on_chunk = &fn;
    for (std::size_t at = 0; at < raw.size() && out.fed_ok; at += step) {
      const std::size_t n = std::min(step, raw.size() - at);
      out.fed_ok = out.sse.Feed(raw.data() + at, n);
    }
    if (out.fed_ok || out.sse.stopped) {
      if (!out.sse.too_big) out.sse.Finish(out.ev);
    }
    out.sse.on_chunk = nullptr;
  };
  Run whole, pieces;
  run(whole, raw.size() == 0 ? 1 : raw.size());
  run(pieces, 1 + 8 * (knob >> 4) * (knob >> 4));  // 1 byte .. 1.8 KiB per network read
  FUZZ_CHECK(whole.chunks == pieces.chunks);
  FUZZ_CHECK(whole.sse.done == pieces.sse.done);
  FUZZ_CHECK(whole.sse.stopped == pieces.sse.stopped);
  FUZZ_CHECK(whole.sse.bad_event == pieces.sse.bad_event);
  FUZZ_CHECK(whole.sse.events == pieces.sse.events);
  FUZZ_CHECK(whole.chunks.size() <= whole.sse.events);
  if (stop_at != 0) FUZZ_CHECK(whole.chunks.size() <= stop_at);
  if (whole.sse.stopped) FUZZ_CHECK(whole.chunks.size() == stop_at);
}

void fuzz_metrics(const std::string& raw) {
  const std::string inst = rc::effects::start_time_instance(raw);
  if (!inst.empty()) {
    FUZZ_CHECK(inst.rfind("start:", 0) == 0);
    const std::string v = inst.substr(6);
    FUZZ_CHECK(!v.empty() && v.size() <= 32);
    FUZZ_CHECK(v.find_first_not_of("0123456789.e+") == std::string::npos);
    FUZZ_CHECK(raw.find("process_start_time_seconds " + v) != std::string::npos);
  }
  rc::Result<rc::testing::MetricsMap> m = rc::testing::parse_prometheus_text(raw);
  if (!m.ok()) {
    FUZZ_CHECK(!m.status().message().empty());
    return;
  }
  FUZZ_CHECK(m->size() <= rc::testing::kMetricSeriesMax);
  for (const auto& [key, value] : *m) {
    const std::string_view name = rc::testing::metric_name_of(key);
    FUZZ_CHECK(!name.empty() && key.compare(0, name.size(), name) == 0);
    FUZZ_CHECK(rc::testing::metric_present(*m, name));
    (void)value;
  }
  (void)rc::testing::read_engine_load(*m);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::uint8_t route = data[0] % 10;
  const std::uint8_t knob = data[1];
  const std::string raw(reinterpret_cast<const char*>(data + 2), size - 2);
  using Shape = EngineClient::Shape;
  namespace fx = rc::effects;
  switch (route) {
    case 0: {  // GET /version, then the protocol line it implies
      HttpReply r = interpret(raw, Shape::kJsonObject, &fx::check_version, "/version");
      if (!r.http.ok_2xx()) return 0;
      const std::string v = r.body["version"].get<std::string>();
      const fx::EngineProtocol p = fx::detect_protocol(v);
      FUZZ_CHECK(p.version == v);
      if (!fx::parse_vllm_version(v).ok()) FUZZ_CHECK(p.line == fx::ProtocolLine::kUnknown);
      return 0;
    }
    case 1: {  // GET /weight_info
      HttpReply r = interpret(raw, Shape::kJsonObject, &fx::check_weight_info, "/weight_info");
      read_label_reply(r, /*rpc_route=*/false);
      return 0;
    }
    case 2: {  // POST /collective_rpc rc_weight_info / rc_set_weight_version
      HttpReply r = interpret(raw, Shape::kJsonObject, nullptr, "/collective_rpc");
      const std::string want = "rc-" + std::to_string(knob & 3);
      const bool set = (knob & 4) != 0;
      HttpReply n = fx::label_from_rpc(r, set ? "rc_set_weight_version" : "rc_weight_info",
                                       set ? &want : nullptr);
      FUZZ_CHECK(n.http.error.size() <= fx::kHttpErrorBytesMax);
      if (!n.http.ok_2xx()) return 0;
      FUZZ_CHECK(r.http.ok_2xx() && fx::check_rpc_label(r.body));
      const std::size_t workers = r.body["results"].size();
      FUZZ_CHECK(n.body["workers"].get<std::size_t>() == workers && workers >= 1);
      FUZZ_CHECK(workers <= fx::kRpcWorkersMax);
      if (set) FUZZ_CHECK(n.body["weight_version"] == want);
      if (n.body.contains("instance")) {
        const std::string inst = n.body["instance"].get<std::string>();
        FUZZ_CHECK(inst == fx::rpc_instances(r.body["results"]));
        FUZZ_CHECK(!inst.empty() && inst.size() <= rc::kTextBytesMax / 2);
      }
      read_label_reply(n, /*rpc_route=*/true);
      return 0;
    }
    case 3: {  // POST /pause, POST /resume
      HttpReply r = interpret(raw, Shape::kJsonObject, &fx::check_status, "/pause");
      if (r.http.ok_2xx()) (void)(r.body["status"] == "paused");
      return 0;
    }
    case 4: {  // GET /is_paused
      HttpReply r = interpret(raw, Shape::kJsonObject, &fx::check_is_paused, "/is_paused");
      if (r.http.ok_2xx()) (void)r.body["is_paused"].get<bool>();
      return 0;
    }
    case 5: {  // POST /reset_{prefix,encoder,mm}_cache
      const auto cache = static_cast<rc::CacheKind>(knob % 3);
      HttpReply r = interpret(raw, Shape::kEmptyOrJson, nullptr, fx::cache_path(cache));
      const rc::CacheResetObserved c = fx::reset_observed(cache, r);
      FUZZ_CHECK(c.cache == cache);
      FUZZ_CHECK(c.http.error.size() <= fx::kHttpErrorBytesMax);
      if (c.success_unreported) FUZZ_CHECK(c.reported_success && r.body.is_null());
      if (c.http.ok_2xx() && !c.success_unreported) {
        FUZZ_CHECK(r.body["success"].get<bool>() == c.reported_success);
      }
      return 0;
    }
    case 6: {  // GET /get_world_size
      HttpReply r = interpret(raw, Shape::kJsonObject, &fx::check_world_size, "/get_world_size");
      if (r.http.ok_2xx()) FUZZ_CHECK(r.body["world_size"].get<std::int64_t>() > 0);
      return 0;
    }
    case 7: {  // POST /update_weight_version
      HttpReply r =
          interpret(raw, Shape::kJsonObject, &fx::check_success, "/update_weight_version");
      if (r.http.ok_2xx()) (void)r.body["success"].get<bool>();
      return 0;
    }
    case 8:  // GET /metrics
      fuzz_metrics(raw);
      return 0;
    default:  // SSE stream of a generation call
      fuzz_sse(raw, knob);
      return 0;
  }
}
