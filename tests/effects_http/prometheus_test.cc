// Prometheus text parsing: labels, escapes, special values, sums over label sets, bounds.
#include "tests/support/prometheus.h"

#include <gtest/gtest.h>

#include <cmath>

namespace rc::testing {
namespace {

// Proves samples with quoted label values containing '}', ',', spaces and escaped quotes parse to
// the right values; would catch a parser that splits on the first '}' or space.
TEST(Prometheus, ParsesLabelsEscapesAndTimestamps) {
  const char* text =
      "# HELP vllm:prefix_cache_hits_total hits\n"
      "# TYPE vllm:prefix_cache_hits_total counter\n"
      "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"a} b, \\\"c\\\"\"} 10\n"
      "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 5 1700000000000\n"
      "\n"
      "up 1\r\n"
      "vllm:gauge_nan NaN\n"
      "vllm:gauge_inf{x=\"y\",} +Inf\n";
  Result<MetricsMap> m = parse_prometheus_text(text);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->size(), 5u);
  EXPECT_DOUBLE_EQ(metric_sum(*m, "vllm:prefix_cache_hits_total"), 15.0);
  EXPECT_DOUBLE_EQ(m->at("up"), 1.0);
  EXPECT_TRUE(std::isnan(m->at("vllm:gauge_nan")));
  EXPECT_TRUE(std::isinf(m->at("vllm:gauge_inf{x=\"y\",}")));
}

// Proves sums match names exactly; would catch vllm:num_requests_waiting absorbing
// vllm:num_requests_waiting_by_reason (a prefix of it) and double-counting the queue.
TEST(Prometheus, SumsMatchExactNames) {
  const char* text =
      "vllm:num_requests_waiting{engine=\"0\"} 4\n"
      "vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 3\n"
      "vllm:num_requests_waiting{engine=\"1\"} 1\n"
      "vllm:num_requests_running{engine=\"0\"} 7\n"
      "vllm:prefix_cache_queries_total{engine=\"0\"} 100\n"
      "vllm:prefix_cache_hits_total{engine=\"0\"} 40\n";
  Result<MetricsMap> m = parse_prometheus_text(text);
  ASSERT_TRUE(m.ok());
  EngineLoad l = read_engine_load(*m);
  EXPECT_DOUBLE_EQ(l.num_requests_waiting, 5.0);
  EXPECT_DOUBLE_EQ(l.num_requests_running, 7.0);
  EXPECT_DOUBLE_EQ(l.prefix_cache_queries_total, 100.0);
  EXPECT_DOUBLE_EQ(l.prefix_cache_hits_total, 40.0);
  EXPECT_TRUE(metric_present(*m, "vllm:num_requests_waiting_by_reason"));
  EXPECT_FALSE(metric_present(*m, "vllm:num_requests"));
  EXPECT_DOUBLE_EQ(metric_sum(*m, "absent"), 0.0);
}

// Proves malformed lines are errors, not silently skipped or zero; would catch a parser that
// turns garbage into a 0 gauge (a drain check would then see "no running requests").
TEST(Prometheus, MalformedLinesAreErrors) {
  for (const char* bad :
       {"vllm:x{a=\"b\" 1\n", "vllm:x notanumber\n", "{a=\"b\"} 1\n", "vllm:x\n", "9bad 1\n"}) {
    EXPECT_FALSE(parse_prometheus_text(bad).ok()) << bad;
  }
}

// Proves the series bound holds; would catch an unbounded map on a hostile /metrics.
TEST(Prometheus, SeriesAreBounded) {
  std::string text;
  for (std::size_t i = 0; i <= kMetricSeriesMax; ++i) {
    text += "m{i=\"" + std::to_string(i) + "\"} 1\n";
  }
  EXPECT_FALSE(parse_prometheus_text(text).ok());
}

}  // namespace
}  // namespace rc::testing
