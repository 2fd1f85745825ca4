// Text that came from outside (clients, engine bodies, files, headers): checked on input,
// escaped on output, so one record is always one line. Standard library only.
#pragma once

#include <string>
#include <string_view>

namespace rc::text {

// True when `s` is well-formed UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF).
bool valid_utf8(std::string_view s);

// True when `s` is valid UTF-8 without control characters (C0, DEL, C1) and without the Unicode
// line/paragraph separators (U+2028, U+2029) or bidirectional controls (U+202A..U+202E,
// U+2066..U+2069): what an identifier or a label may hold. Non-ASCII letters ("rc-é") are fine.
bool printable_utf8(std::string_view s);

// `s` with every ill-formed UTF-8 sequence replaced by U+FFFD: safe for any JSON serialiser.
std::string sanitize_utf8(std::string_view s);

// `s` as one line of printable text: control characters become \n, \r, \t or \u00XX (the
// separators and bidirectional controls above \uXXXX), a backslash becomes \\, each ill-formed
// byte becomes \xNN. Valid non-control UTF-8 is kept as is. Never throws past bad_alloc; the
// result is valid UTF-8 and contains no byte below 0x20 or 0x7F, so it is safe for JSON too.
std::string escape_line(std::string_view s);

// `s` cut to at most `max` bytes without splitting a UTF-8 sequence (what bounds a text field).
std::string utf8_prefix(std::string s, std::size_t max);

// How deep JSON from outside may nest arrays and objects. A parser may accept any depth, but
// copying, comparing or serialising a value recurses once per level: a small body nested 100,000
// deep would overflow the stack of whoever touches it. Real requests (JSON Schema tools included)
// stay far below.
inline constexpr std::size_t kJsonDepthMax = 128;

// True when `s`, read as JSON, nests arrays and objects at most `max_depth` deep (brackets inside
// strings do not count). Linear, no allocation: checked before parsing outside text.
bool json_depth_within(std::string_view s, std::size_t max_depth = kJsonDepthMax);

}  // namespace rc::text
