#include "statemachine/text.h"

#include <cstdint>

#include "statemachine/hex.h"

namespace rc::text {
namespace {

inline constexpr std::size_t kInvalid = 0;

// Length of the well-formed UTF-8 sequence at s[i], or kInvalid; `cp` receives its code point.
std::size_t sequence_at(std::string_view s, std::size_t i, std::uint32_t& cp) {
  const auto b = [&](std::size_t k) { return static_cast<std::uint8_t>(s[i + k]); };
  const std::uint8_t b0 = b(0);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  std::size_t len = 0;
  std::uint32_t min = 0;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return kInvalid;
  }
  if (i + len > s.size()) return kInvalid;
  for (std::size_t k = 1; k < len; ++k) {
    if ((b(k) & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b(k) & 0x3F);
  }
  const bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
  if (cp < min || cp > 0x10FFFF || surrogate) return kInvalid;
  return len;
}

bool is_control(std::uint32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }

// Code points that are not C0/C1 but still break "one record, one line" for a reader: the
// Unicode line and paragraph separators (editors and some terminals break lines there) and the
// bidirectional embedding/override/isolate controls (they reorder what follows on the line, so a
// field could visually forge the rest of it).
bool is_layout_control(std::uint32_t cp) {
  return cp == 0x2028 || cp == 0x2029 || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

// Appends `prefix` then `digits` lowercase hex digits of `value` (no formatting library: this
// runs on every byte of outside text and must not allocate beyond `out`).
void append_hex(std::string& out, const char* prefix, std::uint32_t value, int digits) {
  out += prefix;
  for (int shift = 4 * (digits - 1); shift >= 0; shift -= 4) {
    out += hex::kLowerDigits[(value >> shift) & 0xF];
  }
}

}  // namespace

bool valid_utf8(std::string_view s) {
  std::uint32_t cp = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = sequence_at(s, i, cp);
    if (n == kInvalid) return false;
    i += n;
  }
  return true;
}

bool printable_utf8(std::string_view s) {
  std::uint32_t cp = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = sequence_at(s, i, cp);
    if (n == kInvalid || is_control(cp) || is_layout_control(cp)) return false;
    i += n;
  }
  return true;
}

std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::uint32_t cp = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = sequence_at(s, i, cp);
    if (n == kInvalid) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

std::string escape_line(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::uint32_t cp = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = sequence_at(s, i, cp);
    if (n == kInvalid) {
      append_hex(out, "\\x", static_cast<std::uint8_t>(s[i]), 2);
      ++i;
      continue;
    }
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (is_control(cp) || is_layout_control(cp)) {
      append_hex(out, "\\u", cp, 4);
    } else {
      out.append(s.substr(i, n));
    }
    i += n;
  }
  return out;
}

std::string utf8_prefix(std::string s, std::size_t max) {
  if (s.size() <= max) return s;
  std::size_t end = max;
  while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) --end;
  s.resize(end);
  return s;
}

namespace {

// The index of the quote that closes the string opened just before `i` (s.size() if none).
std::size_t string_end(std::string_view s, std::size_t i) {
  while (i < s.size() && s[i] != '"') i += s[i] == '\\' ? 2 : 1;
  return i;
}

}  // namespace

bool json_depth_within(std::string_view s, std::size_t max_depth) {
  std::size_t depth = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      i = string_end(s, i + 1);
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return true;
}

}  // namespace rc::text
