#include "tests/support/prometheus.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace rc::testing {

namespace {

bool is_name_char(char c, bool first) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
  return alpha || (!first && c >= '0' && c <= '9');
}

// Parses a float the exposition format allows: decimal, NaN, +Inf, -Inf.
bool parse_value(std::string_view s, double* out) {
  if (s == "NaN") {
    *out = std::nan("");
    return true;
  }
  if (s == "+Inf" || s == "Inf") {
    *out = INFINITY;
    return true;
  }
  if (s == "-Inf") {
    *out = -INFINITY;
    return true;
  }
  if (s.empty() || s.size() > 64) return false;
  std::string tmp(s);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(tmp.c_str(), &end);
  if (end != tmp.c_str() + tmp.size() || errno == ERANGE) return false;
  *out = v;
  return true;
}

// Parses one sample line into (key, value). Returns false when malformed.
bool parse_sample(std::string_view line, std::string* key, double* value) {
  std::size_t i = 0;
  while (i < line.size() && is_name_char(line[i], i == 0)) ++i;
  if (i == 0) return false;
  std::size_t key_end = i;
  if (i < line.size() && line[i] == '{') {
    bool in_quotes = false;
    ++i;
    for (; i < line.size(); ++i) {
      const char c = line[i];
      if (in_quotes) {
        if (c == '\\') {
          ++i;
          continue;
        }
        if (c == '"') in_quotes = false;
      } else if (c == '"') {
        in_quotes = true;
      } else if (c == '}') {
        break;
      }
    }
    if (i >= line.size()) return false;
    ++i;  // past '}'
    key_end = i;
  }
  *key = std::string(line.substr(0, key_end));
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  std::size_t v_end = i;
  while (v_end < line.size() && line[v_end] != ' ' && line[v_end] != '\t') ++v_end;
  return parse_value(line.substr(i, v_end - i), value);  // a trailing timestamp is ignored
}

}  // namespace

Result<MetricsMap> parse_prometheus_text(std::string_view text) {
  MetricsMap out;
  std::size_t pos = 0;
  std::size_t line_no = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    if (line.empty() || line.front() == '#') continue;
    std::string key;
    double value = 0;
    if (!parse_sample(line, &key, &value)) {
      return Status::Corruption("malformed metrics line " + std::to_string(line_no) + ": " +
                                std::string(line.substr(0, 120)));
    }
    out[std::move(key)] = value;
    if (out.size() > kMetricSeriesMax) {
      return Status::Corruption("more than " + std::to_string(kMetricSeriesMax) + " series");
    }
  }
  return out;
}

std::string_view metric_name_of(std::string_view key) {
  const std::size_t brace = key.find('{');
  return brace == std::string_view::npos ? key : key.substr(0, brace);
}

double metric_sum(const MetricsMap& m, std::string_view name) {
  double sum = 0;
  // Keys with this name sort together: "name" < "name{..." and no other name shares the prefix
  // followed by '{' or end.
  for (auto it = m.lower_bound(std::string(name)); it != m.end(); ++it) {
    if (it->first.compare(0, name.size(), name) != 0) break;
    if (metric_name_of(it->first) == name) sum += it->second;
  }
  return sum;
}

bool metric_present(const MetricsMap& m, std::string_view name) {
  for (auto it = m.lower_bound(std::string(name)); it != m.end(); ++it) {
    if (it->first.compare(0, name.size(), name) != 0) break;
    if (metric_name_of(it->first) == name) return true;
  }
  return false;
}

EngineLoad read_engine_load(const MetricsMap& m) {
  EngineLoad l;
  l.prefix_cache_hits_total = metric_sum(m, "vllm:prefix_cache_hits_total");
  l.prefix_cache_queries_total = metric_sum(m, "vllm:prefix_cache_queries_total");
  l.num_requests_running = metric_sum(m, "vllm:num_requests_running");
  l.num_requests_waiting = metric_sum(m, "vllm:num_requests_waiting");
  return l;
}

}  // namespace rc::testing
