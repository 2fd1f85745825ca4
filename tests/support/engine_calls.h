// Engine calls only tests make, on top of EngineClient's public Call(): /metrics parsed and
// /abort_requests. Production reads /metrics only as raw text (EngineClient::MetricsRaw, for the
// engine's instance) and never aborts requests on the engine.
#pragma once

#include <string>
#include <vector>

#include "effects/http/engine_client.h"
#include "statemachine/status.h"
#include "tests/support/prometheus.h"

namespace rc::testing {

// GET /metrics, parsed. Unavailable with the evidence summary when the exchange failed.
[[nodiscard]] Result<MetricsMap> Metrics(effects::EngineClient& client,
                                         const effects::CallOptions& o = {});

// POST /abort_requests {"request_ids": [...]}, within the client's call deadline.
effects::HttpReply AbortRequests(effects::EngineClient& client,
                                 const std::vector<std::string>& request_ids,
                                 const effects::CallOptions& o = {});

}  // namespace rc::testing
