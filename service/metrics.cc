#include "service/metrics.h"

#include <cstdio>

#include "statemachine/status.h"
#include "statemachine/text.h"

namespace rc::service {

std::string FormatDouble(double v) {
  char buf[64];
  const int n = std::snprintf(buf, sizeof(buf), "%.9g", v);
  RC_CHECK(n > 0 && static_cast<std::size_t>(n) < sizeof(buf));  // %.9g is at most 16 bytes
  return buf;
}

std::string EscapeLabelValue(const std::string& v) {
  // The value a scraper reads is escape_line(v): printable, one line. The exposition format knows
  // only the escapes \\, \" and \n, so escape_line's own (\t, \xNN, \uNNNN) are written
  // with their backslash escaped: a parser reads them as text, never as an unknown escape.
  const std::string line = rc::text::escape_line(v);
  std::string out;
  out.reserve(line.size() + 8);
  for (char c : line) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  RC_CHECK(out.find('\n') == std::string::npos);  // one sample line, whatever the value held
  return out;
}

void Histogram::ObserveUs(std::uint64_t us) {
  const double s = static_cast<double>(us) / 1e6;
  std::size_t i = 0;
  while (i < kBoundsS.size() && s > kBoundsS[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_us_.fetch_add(us, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

void Histogram::Render(std::string& out, const std::string& name, const std::string& labels) const {
  const std::string sep = labels.empty() ? "" : ",";
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < kBoundsS.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    out += name + "_bucket{" + labels + sep + "le=\"" + FormatDouble(kBoundsS[i]) + "\"} " +
           std::to_string(cumulative) + "\n";
  }
  cumulative += buckets_[kBoundsS.size()].load(std::memory_order_relaxed);
  out += name + "_bucket{" + labels + sep + "le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  const std::string braces = labels.empty() ? "" : "{" + labels + "}";
  out += name + "_sum" + braces + " " +
         FormatDouble(static_cast<double>(sum_us_.load(std::memory_order_relaxed)) / 1e6) + "\n";
  out += name + "_count" + braces + " " + std::to_string(count_.load(std::memory_order_relaxed)) +
         "\n";
}

}  // namespace rc::service
