// Numbers on the command lines of `replay`, `audit`, `demo` and `restore`, read strictly (every
// command but serve, whose flags are its configuration's). CLI11's own conversion takes
// "-1" into an unsigned option by wrapping it, clamps a value past the type's range, and accepts
// "0x10", "+3" and a leading space: the command would then run with a number nobody typed. So each
// number reaches its command as the text typed and is read here, once: anything but the grammar
// below, or a value out of range, is a usage error that quotes the text as typed.
//
// The messages carry that text between quotes, each quote in it doubled (text::quoted), and
// otherwise raw; whoever prints them escapes the whole line (text::escape_line), exactly once.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

#include "statemachine/quote.h"
#include "statemachine/status.h"

namespace rc::cli {

inline constexpr std::string_view kDecimalDigits = "0123456789";

// The number of decimal digits at the start of `text` from `at`.
inline std::size_t DigitsAt(std::string_view text, std::size_t at) {
  if (at >= text.size()) return 0;
  const std::size_t end = text.find_first_not_of(kDecimalDigits, at);
  return (end == std::string_view::npos ? text.size() : end) - at;
}

// `text` as a whole number in [min, max]: ASCII digits only (no sign, space, base prefix, fraction
// or exponent; leading zeros are digits). InvalidArgument "'TEXT' is not a whole number from MIN to
// MAX (digits only)" otherwise, an overflow of 64 bits included.
[[nodiscard]] inline Result<std::uint64_t> ParseWholeNumber(std::string_view text,
                                                            std::uint64_t min, std::uint64_t max) {
  RC_CHECK(min <= max);
  std::uint64_t value = 0;
  const bool digits_only = !text.empty() && DigitsAt(text, 0) == text.size();
  const std::errc read = digits_only
                             ? std::from_chars(text.data(), text.data() + text.size(), value).ec
                             : std::errc::invalid_argument;
  if (read != std::errc() || value < min || value > max) {
    return Status::InvalidArgument(text::quoted(text) + " is not a whole number from " +
                                   std::to_string(min) + " to " + std::to_string(max) +
                                   " (digits only)");
  }
  return value;
}

// Whether `text` is DIGITS[.DIGITS][(e|E)[+|-]DIGITS]: what ParseNonNegativeDecimal reads.
inline bool IsPlainDecimal(std::string_view text) {
  std::size_t at = DigitsAt(text, 0);
  if (at == 0) return false;
  if (at < text.size() && text[at] == '.') {
    const std::size_t fraction = DigitsAt(text, at + 1);
    if (fraction == 0) return false;
    at += 1 + fraction;
  }
  if (at < text.size() && (text[at] == 'e' || text[at] == 'E')) {
    ++at;
    if (at < text.size() && (text[at] == '+' || text[at] == '-')) ++at;
    const std::size_t exponent = DigitsAt(text, at);
    if (exponent == 0) return false;
    at += exponent;
  }
  return at == text.size();
}

// `text` as a finite number >= 0 written DIGITS[.DIGITS][(e|E)[+|-]DIGITS] ("0.5", "1e-3"): no
// sign, space, hex, "inf" or "nan"; a value a double cannot hold (1e999, 1e-999) is refused, never
// rounded to infinity or zero. InvalidArgument quoting `text` otherwise.
[[nodiscard]] inline Result<double> ParseNonNegativeDecimal(std::string_view text) {
  double value = 0;
  const std::errc read = IsPlainDecimal(text)
                             ? std::from_chars(text.data(), text.data() + text.size(), value).ec
                             : std::errc::invalid_argument;
  if (read != std::errc() || !std::isfinite(value)) {
    return Status::InvalidArgument(text::quoted(text) +
                                   " is not a finite number >= 0 written in decimal (such as 0.5 "
                                   "or 1e-3)");
  }
  return value;
}

// ParseWholeNumber for option `name`: its message begins "NAME: ".
[[nodiscard]] inline Result<std::uint64_t> ParseWholeNumberOption(std::string_view name,
                                                                  std::string_view text,
                                                                  std::uint64_t min,
                                                                  std::uint64_t max) {
  Result<std::uint64_t> value = ParseWholeNumber(text, min, max);
  if (!value.ok())
    return Status::InvalidArgument(std::string(name) + ": " + value.status().message());
  return value;
}

}  // namespace rc::cli
