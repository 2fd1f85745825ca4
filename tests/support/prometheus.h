// Prometheus text exposition (format 0.0.4) parsing, bounded, and the few vLLM series tests read.
// Test support only: production code parses no /metrics text. The engine's instance is taken
// from process_start_time_seconds in the raw text (start_time_instance, effects/http/
// response_parsers.h); the controller reads no series (docs/vllm-protocol.md §2).
//
//   line   := comment | sample | empty
//   sample := name [ "{" label ("," label)* [","] "}" ] value [ timestamp ]
//   label  := lname "=" '"' escaped-string '"'
// Keys of MetricsMap are `name` or `name{labels}` with the label text exactly as exposed.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "statemachine/status.h"

namespace rc::testing {

inline constexpr std::size_t kMetricSeriesMax = 200000;

using MetricsMap = std::map<std::string, double>;

// Fails on a malformed sample line or more than kMetricSeriesMax series; NaN/+Inf/-Inf accepted.
[[nodiscard]] Result<MetricsMap> parse_prometheus_text(std::string_view text);

// The metric name of a key ("a{b=\"c\"}" -> "a").
std::string_view metric_name_of(std::string_view key);

// Sum of every series named exactly `name`, over all label sets; 0 when absent.
double metric_sum(const MetricsMap& m, std::string_view name);
// Whether any series is named exactly `name`.
bool metric_present(const MetricsMap& m, std::string_view name);

// The vLLM gauges and counters the tests read, summed over labels (engines, models).
struct EngineLoad {
  double prefix_cache_hits_total = 0;     // vllm:prefix_cache_hits_total (tokens)
  double prefix_cache_queries_total = 0;  // vllm:prefix_cache_queries_total (tokens)
  double num_requests_running = 0;        // vllm:num_requests_running
  double num_requests_waiting = 0;        // vllm:num_requests_waiting
};
EngineLoad read_engine_load(const MetricsMap& m);

}  // namespace rc::testing
