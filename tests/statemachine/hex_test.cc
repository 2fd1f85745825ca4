// Hex text of bytes (statemachine/hex.h): encoding, decoding in either case, and the checks.
#include "statemachine/hex.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <string>

namespace rc::hex {
namespace {

// Proves encode writes two lowercase digits per byte, high nibble first (RFC 4648 §10 base16
// vectors, lowercased); would catch swapped nibbles, uppercase or a dropped leading zero.
TEST(Hex, EncodesKnownVectors) {
  EXPECT_EQ(encode(std::string_view("")), "");
  EXPECT_EQ(encode(std::string_view("f")), "66");
  EXPECT_EQ(encode(std::string_view("foobar")), "666f6f626172");
  const std::array<std::uint8_t, 4> bytes{0x00, 0x0f, 0xa0, 0xff};
  EXPECT_EQ(encode(bytes), "000fa0ff");
}

// Proves every byte value round trips through encode and decode; would catch a digit table or
// decoder that is wrong for some value.
TEST(Hex, RoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::string text = encode(all);
  ASSERT_EQ(text.size(), 512u);
  EXPECT_TRUE(is_lower(text));
  auto back = decode(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, all);
}

// Proves decoding accepts either case and names the first bad digit; would catch a decoder that
// accepts 'g' or a space as a digit, or reports the wrong position.
TEST(Hex, DecodesEitherCaseAndNamesTheBadDigit) {
  auto mixed = decode("0aFf");
  ASSERT_TRUE(mixed.ok());
  EXPECT_EQ(*mixed, std::string("\x0a\xff", 2));
  EXPECT_EQ(decode("0g").status().message(), "bad digit at 1");
  EXPECT_EQ(decode(" 0").status().message(), "bad digit at 0");
  EXPECT_FALSE(decode("abc").ok());
  std::array<std::uint8_t, 2> out{};
  EXPECT_FALSE(decode_into("00", out).ok());  // 2 digits for 2 bytes: the wrong length
  EXPECT_EQ(decode_into("00zz", out).message(), "bad digit at 2");
}

// Proves is_lower accepts only lowercase digits (the fold's rule for declared digests); would
// catch uppercase or other characters let through.
TEST(Hex, IsLowerAcceptsOnlyLowercaseDigits) {
  EXPECT_TRUE(is_lower(""));
  EXPECT_TRUE(is_lower("0123456789abcdef"));
  EXPECT_FALSE(is_lower("ABC"));
  EXPECT_FALSE(is_lower("0x1"));
  EXPECT_EQ(digit_value('F'), 15);
  EXPECT_EQ(digit_value('/'), -1);
  EXPECT_EQ(digit_value(':'), -1);
}

}  // namespace
}  // namespace rc::hex
