#include "tests/support/engine_calls.h"

#include <nlohmann/json.hpp>

namespace rc::testing {

using effects::EngineClient;

Result<MetricsMap> Metrics(EngineClient& client, const effects::CallOptions& o) {
  effects::HttpReply r = client.MetricsRaw(o);
  if (!r.http.ok_2xx()) {
    return Status::Unavailable(std::string("GET /metrics: ") + transport_name(r.http.transport) +
                               " status=" + std::to_string(r.http.http_status) + " " +
                               r.http.error);
  }
  return parse_prometheus_text(r.raw);
}

effects::HttpReply AbortRequests(EngineClient& client, const std::vector<std::string>& request_ids,
                                 const effects::CallOptions& o) {
  EngineClient::Request r;
  r.method = EngineClient::Method::kPost;
  r.path = "/abort_requests";
  // Invalid UTF-8 in an id is replaced, as the client's own calls do, instead of throwing.
  r.json_body = nlohmann::json{{"request_ids", request_ids}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
  r.shape = EngineClient::Shape::kJsonObject;
  r.timeout_ms = client.deadlines().call_timeout_ms;
  return client.Call(r, o);
}

}  // namespace rc::testing
