// Tests of rc::text (statemachine/text.h): UTF-8 validation against the Unicode standard's table
// of well-formed byte sequences, exhaustively where the space allows, and the one-line escaping
// that every output boundary relies on.
#include "statemachine/text.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace rc::text {
namespace {

// Reference: Unicode 15, Table 3-7 "Well-Formed UTF-8 Byte Sequences", written as byte ranges (a
// formulation independent of the decoder under test, which works on code points).
struct Range {
  std::uint8_t lo, hi;
};
struct Row {
  int len;
  Range b[4];
};
constexpr Row kTable[] = {
    {1, {{0x00, 0x7F}}},
    {2, {{0xC2, 0xDF}, {0x80, 0xBF}}},
    {3, {{0xE0, 0xE0}, {0xA0, 0xBF}, {0x80, 0xBF}}},
    {3, {{0xE1, 0xEC}, {0x80, 0xBF}, {0x80, 0xBF}}},
    {3, {{0xED, 0xED}, {0x80, 0x9F}, {0x80, 0xBF}}},
    {3, {{0xEE, 0xEF}, {0x80, 0xBF}, {0x80, 0xBF}}},
    {4, {{0xF0, 0xF0}, {0x90, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}},
    {4, {{0xF1, 0xF3}, {0x80, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}},
    {4, {{0xF4, 0xF4}, {0x80, 0x8F}, {0x80, 0xBF}, {0x80, 0xBF}}},
};

// Length of the well-formed sequence at s[i] per the table, 0 if none.
std::size_t RefSequence(const std::string& s, std::size_t i) {
  for (const Row& row : kTable) {
    if (i + row.len > s.size()) continue;
    bool match = true;
    for (int k = 0; k < row.len && match; ++k) {
      const auto b = static_cast<std::uint8_t>(s[i + k]);
      match = b >= row.b[k].lo && b <= row.b[k].hi;
    }
    if (match) return row.len;
  }
  return 0;
}

bool RefValid(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = RefSequence(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string Encode(std::uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

bool IsControl(std::uint32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }
bool IsLayout(std::uint32_t cp) {
  return cp == 0x2028 || cp == 0x2029 || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

// True when `s` holds no byte a terminal or a line reader treats as a control.
bool OneLineBytes(const std::string& s) {
  for (char c : s) {
    const auto b = static_cast<std::uint8_t>(c);
    if (b < 0x20 || b == 0x7F) return false;
  }
  return true;
}

// Proves every code point U+0000..U+10FFFF, encoded minimally, is valid exactly when it is not a
// surrogate, and printable exactly when it is not C0/DEL/C1 or a separator/bidi control; catches
// a decoder that rejects any 4-byte plane, accepts surrogates or treats 'é' as a control byte
// (the signed-char bug that refused "rc-é").
TEST(Text, EveryCodePoint) {
  for (std::uint32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    const std::string s = Encode(cp);
    const bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
    ASSERT_EQ(valid_utf8(s), !surrogate) << std::hex << cp;
    ASSERT_EQ(printable_utf8(s), !surrogate && !IsControl(cp) && !IsLayout(cp)) << std::hex << cp;
  }
  EXPECT_TRUE(printable_utf8("rc-\xC3\xA9"));                   // rc-é
  EXPECT_TRUE(printable_utf8("\xE4\xB8\xAD\xF0\x9F\x98\x80"));  // CJK and an emoji
}

// Proves the validator agrees with Table 3-7 on every 1-, 2- and 3-byte string (16.8 M inputs);
// catches overlongs (C0 80, E0 80 80), surrogates (ED A0 80), bad continuations and truncations.
TEST(Text, AllShortStringsMatchTheStandard) {
  std::string s;
  for (int a = 0; a < 256; ++a) {
    s.assign(1, static_cast<char>(a));
    ASSERT_EQ(valid_utf8(s), RefValid(s)) << a;
    for (int b = 0; b < 256; ++b) {
      s.assign({static_cast<char>(a), static_cast<char>(b)});
      ASSERT_EQ(valid_utf8(s), RefValid(s)) << a << " " << b;
      for (int c = 0; c < 256; ++c) {
        s.assign({static_cast<char>(a), static_cast<char>(b), static_cast<char>(c)});
        ASSERT_EQ(valid_utf8(s), RefValid(s)) << a << " " << b << " " << c;
      }
    }
  }
}

// Proves 4-byte strings agree with the standard for every lead and second byte, with third and
// fourth bytes at each class boundary; catches F4 90 80 80 (> U+10FFFF), F0 80 80 80 (overlong),
// F5..FF leads and continuations outside 80..BF.
TEST(Text, FourByteBoundaries) {
  const int edges[] = {0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xF4, 0xFF};
  std::string s(4, '\0');
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      for (int c : edges) {
        for (int d : edges) {
          s[0] = static_cast<char>(a), s[1] = static_cast<char>(b);
          s[2] = static_cast<char>(c), s[3] = static_cast<char>(d);
          ASSERT_EQ(valid_utf8(s), RefValid(s)) << a << " " << b << " " << c << " " << d;
        }
      }
    }
  }
}

// Proves the named edge cases one by one, so a failure reads as the rule it breaks.
TEST(Text, NamedEdgeCases) {
  EXPECT_TRUE(valid_utf8(""));
  EXPECT_TRUE(valid_utf8("\x7F"));
  EXPECT_TRUE(valid_utf8("\xC2\x80"));           // U+0080, first 2-byte
  EXPECT_TRUE(valid_utf8("\xDF\xBF"));           // U+07FF, last 2-byte
  EXPECT_TRUE(valid_utf8("\xE0\xA0\x80"));       // U+0800, first 3-byte
  EXPECT_TRUE(valid_utf8("\xED\x9F\xBF"));       // U+D7FF, before the surrogates
  EXPECT_TRUE(valid_utf8("\xEE\x80\x80"));       // U+E000, after them
  EXPECT_TRUE(valid_utf8("\xEF\xBF\xBF"));       // U+FFFF
  EXPECT_TRUE(valid_utf8("\xF0\x90\x80\x80"));   // U+10000, first 4-byte
  EXPECT_TRUE(valid_utf8("\xF4\x8F\xBF\xBF"));   // U+10FFFF, the last code point
  EXPECT_FALSE(valid_utf8("\xC0\x80"));          // overlong NUL
  EXPECT_FALSE(valid_utf8("\xC1\xBF"));          // overlong U+007F
  EXPECT_FALSE(valid_utf8("\xE0\x9F\xBF"));      // overlong U+07FF
  EXPECT_FALSE(valid_utf8("\xF0\x8F\xBF\xBF"));  // overlong U+FFFF
  EXPECT_FALSE(valid_utf8("\xED\xA0\x80"));      // U+D800
  EXPECT_FALSE(valid_utf8("\xED\xBF\xBF"));      // U+DFFF
  EXPECT_FALSE(valid_utf8("\xF4\x90\x80\x80"));  // U+110000
  EXPECT_FALSE(valid_utf8("\xF5\x80\x80\x80"));
  EXPECT_FALSE(valid_utf8("\xF8\x88\x80\x80\x80"));  // 5-byte form
  EXPECT_FALSE(valid_utf8("\xFE"));
  EXPECT_FALSE(valid_utf8("\xFF"));
  EXPECT_FALSE(valid_utf8("\x80"));          // lone continuation
  EXPECT_FALSE(valid_utf8("a\xC3"));         // truncated 2-byte at the end
  EXPECT_FALSE(valid_utf8("\xE2\x82"));      // truncated 3-byte
  EXPECT_FALSE(valid_utf8("\xF0\x9F\x98"));  // truncated 4-byte
  EXPECT_FALSE(valid_utf8("\xE2\x28\xA1"));  // bad continuation in the middle
  for (const char* bad : {"a\x01", "\x1B[2J", "a\x7F", "\xC2\x85", "\xC2\x9B", "\xE2\x80\xA8",
                          "\xE2\x80\xAE", "\xE2\x81\xA6"}) {
    EXPECT_FALSE(printable_utf8(bad)) << escape_line(bad);
  }
  EXPECT_FALSE(printable_utf8(std::string("a\0b", 3)));
}

// Proves sanitize_utf8 leaves valid text alone and replaces each ill-formed byte by U+FFFD so the
// result is always valid (what a JSON serialiser needs); catches a sanitizer that drops bytes
// silently, eats the following valid character or leaves a truncated sequence at the end.
TEST(Text, SanitizeAlwaysYieldsValidUtf8) {
  EXPECT_EQ(sanitize_utf8("rc-\xC3\xA9 \xF0\x9F\x98\x80"), "rc-\xC3\xA9 \xF0\x9F\x98\x80");
  EXPECT_EQ(sanitize_utf8("ab\xC3"), "ab\xEF\xBF\xBD");  // cut at the end
  EXPECT_EQ(sanitize_utf8("\xC3(x"), "\xEF\xBF\xBD(x");  // next char kept
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_TRUE(valid_utf8(sanitize_utf8(all)));
  EXPECT_TRUE(valid_utf8(sanitize_utf8(all + "\xF0\x9F")));
}

// Proves escape_line turns any bytes into one line of valid UTF-8 without a control byte, and is
// unambiguous (a literal backslash is doubled, so "\x41" in the input never reads as an escape);
// catches the forged "verification: OK" line and the NUL that truncated replay output.
TEST(Text, EscapeLineIsOneLine) {
  EXPECT_EQ(escape_line("ck\nverification: OK (forged line)"),
            "ck\\nverification: OK (forged line)");
  EXPECT_EQ(escape_line(std::string("a\0b", 3)), "a\\u0000b");
  EXPECT_EQ(escape_line("a\r\tb"), "a\\r\\tb");
  EXPECT_EQ(escape_line("\x1B[31mred"), "\\u001b[31mred");
  EXPECT_EQ(escape_line("\x7F"), "\\u007f");
  EXPECT_EQ(escape_line("\xC2\x85"), "\\u0085");          // NEL, a C1 line break
  EXPECT_EQ(escape_line("x\xE2\x80\xA8y"), "x\\u2028y");  // LINE SEPARATOR
  EXPECT_EQ(escape_line("\xE2\x80\xAE"), "\\u202e");      // RIGHT-TO-LEFT OVERRIDE
  EXPECT_EQ(escape_line("\xFF\xC3"), "\\xff\\xc3");
  EXPECT_EQ(escape_line("\\x41"), "\\\\x41");
  EXPECT_EQ(escape_line("rc-\xC3\xA9"), "rc-\xC3\xA9");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  for (const std::string& s : {all, all + all, std::string("\xE2\x80", 2)}) {
    const std::string e = escape_line(s);
    EXPECT_TRUE(valid_utf8(e));
    EXPECT_TRUE(printable_utf8(e));
    EXPECT_TRUE(OneLineBytes(e));
  }
}

// Proves json_depth_within counts only structural brackets: nesting past the bound is refused,
// brackets inside strings (after escaped quotes and backslashes too) never count; catches a scan
// that a string like "[[[" fools into refusing real requests, or that lets 100,000 levels through.
TEST(Text, JsonDepthCountsOnlyStructuralBrackets) {
  EXPECT_TRUE(json_depth_within(std::string(kJsonDepthMax, '[') + std::string(kJsonDepthMax, ']')));
  EXPECT_FALSE(json_depth_within(std::string(kJsonDepthMax + 1, '[')));
  EXPECT_FALSE(json_depth_within(std::string(100000, '[')));
  EXPECT_TRUE(json_depth_within("{\"a\":\"" + std::string(1000, '[') + "\"}"));
  EXPECT_TRUE(json_depth_within(R"({"a":"\"[[[[","b":[1]})", 2));
  EXPECT_FALSE(json_depth_within(R"({"a":"\\","b":[[1]]})", 2));
  EXPECT_TRUE(json_depth_within("[]{}[]{}", 1));
}

}  // namespace
}  // namespace rc::text
