// Property test (rapidcheck): a metric label value written from any bytes is one the Prometheus
// text format accepts (no raw newline or quote, no escape but \\, \" and \n) and reads back as
// the value's one-line escaped form. Catches engine-given text (a relabelled weight_version with
// a tab) written with an escape the format does not know, which makes a scraper reject the
// whole page exactly while a taint is being reported.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "service/metrics.h"
#include "statemachine/text.h"

#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

namespace rc::service {
namespace {

// The label value as an exposition-format parser reads it; nullopt when the format refuses it.
std::optional<std::string> ParsedLabelValue(const std::string& written) {
  std::string out;
  for (std::size_t i = 0; i < written.size(); ++i) {
    const char c = written[i];
    if (c == '\n' || c == '"') return std::nullopt;
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (++i == written.size()) return std::nullopt;
    const char e = written[i];
    if (e == '\\' || e == '"') {
      out.push_back(e);
    } else if (e == 'n') {
      out.push_back('\n');
    } else {
      return std::nullopt;
    }
  }
  return out;
}

RC_GTEST_PROP(MetricLabels, AnyValueIsAValidLabelThatReadsAsItsEscapedLine,
              (const std::vector<std::uint8_t>& bytes)) {
  const std::string v(bytes.begin(), bytes.end());
  const std::optional<std::string> parsed = ParsedLabelValue(EscapeLabelValue(v));
  RC_ASSERT(parsed.has_value());
  RC_ASSERT(*parsed == rc::text::escape_line(v));
}

TEST(MetricLabels, ATabAndAQuoteAreWrittenAsTheFormatAllows) {
  EXPECT_EQ(EscapeLabelValue("rc-1\tx\"y\\"), "rc-1\\\\tx\\\"y\\\\\\\\");
  EXPECT_EQ(EscapeLabelValue("rc-1"), "rc-1");
}

}  // namespace
}  // namespace rc::service
