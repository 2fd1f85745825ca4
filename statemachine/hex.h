// Hex text of bytes: lowercase on output, either case on input. Standard library only, so the
// fold (digests in WeightIdentity) and every layer above share one copy.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "statemachine/status.h"

namespace rc::hex {

// The digits, indexed by value: kLowerDigits[v] for 0 <= v < 16.
inline constexpr char kLowerDigits[] = "0123456789abcdef";

// Two lowercase digits per byte, most significant nibble first.
std::string encode(std::span<const std::uint8_t> bytes);
std::string encode(std::string_view bytes);

// The value of one hex digit (either case), or -1 when `c` is not one.
int digit_value(char c);

// True when every character is a lowercase hex digit (vacuously true for "").
bool is_lower(std::string_view text);

// Decodes exactly 2 * out.size() digits (either case) into `out`. InvalidArgument "bad digit at
// N" (N the index of the first non-digit) or a length message; `out` is unspecified on error.
[[nodiscard]] Status decode_into(std::string_view text, std::span<std::uint8_t> out);
// Decodes an even number of digits (either case) into bytes; the errors of decode_into.
[[nodiscard]] Result<std::string> decode(std::string_view text);

}  // namespace rc::hex
