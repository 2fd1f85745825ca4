// Base64 through EVP: RFC 4648 §10 vectors, round trips of every length, and the decoder's
// strictness (the checks EVP_DecodeBlock alone would not make).
#include "encoding/base64.h"

#include <gtest/gtest.h>

#include <string>

namespace rc::encoding {
namespace {

// Proves standard base64 (RFC 4648 vectors, '+' '/' and padding) and round trips of 128 bytes;
// catches URL-safe alphabets or missing padding that vLLM's validator rejects.
TEST(Base64, Rfc4648Vectors) {
  EXPECT_EQ(Base64Encode(""), "");
  EXPECT_EQ(Base64Encode("f"), "Zg==");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("foob"), "Zm9vYg==");
  EXPECT_EQ(Base64Encode("fooba"), "Zm9vYmE=");
  EXPECT_EQ(Base64Encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(Base64Encode(std::string("\xfb\xff\xbf", 3)), "+/+/");
  std::string raw;
  for (int i = 0; i < 128; ++i) raw.push_back(static_cast<char>(i * 37 + 11));
  const std::string enc = Base64Encode(raw);
  EXPECT_EQ(enc.size(), 172u);
  auto dec = Base64Decode(enc);
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(*dec, raw);
}

// Proves the decoder returns the RFC 4648 plaintexts without the padding's zero bytes; would
// catch EVP_DecodeBlock's output (always 3 bytes per group) passed through unchanged.
TEST(Base64, DecodesVectorsWithoutPaddingBytes) {
  for (const char* plain : {"", "f", "fo", "foo", "foob", "fooba", "foobar"}) {
    auto dec = Base64Decode(Base64Encode(plain));
    ASSERT_TRUE(dec.ok()) << plain;
    EXPECT_EQ(*dec, plain);
  }
}

// Proves every length from 0 to 300 bytes (all byte values) round trips; would catch an error in
// the last, partial group.
TEST(Base64, RoundTripsEveryLength) {
  std::string raw;
  for (int n = 0; n <= 300; ++n) {
    auto dec = Base64Decode(Base64Encode(raw));
    ASSERT_TRUE(dec.ok()) << n;
    ASSERT_EQ(*dec, raw) << n;
    raw.push_back(static_cast<char>(n * 97 + 3));
  }
}

// Proves the decoder keeps the strict grammar: length a multiple of 4, only the alphabet, '='
// only at the end; would catch text that EVP_DecodeBlock accepts on its own (surrounding
// whitespace, a trailing '-', '=' inside the data decoded as zero bits).
TEST(Base64, DecoderIsStrict) {
  EXPECT_FALSE(Base64Decode("Zm9").ok());
  EXPECT_FALSE(Base64Decode("Zm-v").ok());
  EXPECT_FALSE(Base64Decode("Z===").ok());
  EXPECT_FALSE(Base64Decode("Zg==Zg==").ok());
  EXPECT_FALSE(Base64Decode("====").ok());
  EXPECT_FALSE(Base64Decode("Zg=a").ok());
  EXPECT_FALSE(Base64Decode("Zm9v\n").ok());
  EXPECT_FALSE(Base64Decode(" Zm9v").ok());
  EXPECT_FALSE(Base64Decode("Zm9v    ").ok());
  EXPECT_FALSE(Base64Decode("Zm9vYmF-").ok());
  EXPECT_FALSE(Base64Decode("Zm9v\nYmFy").ok());
  EXPECT_FALSE(Base64Decode("Zm9vYmF_").ok());  // URL-safe alphabet
  EXPECT_FALSE(Base64Decode(std::string("Zm9\0", 4)).ok());
}

// Proves the messages name what is wrong, as the decoder this replaced did; would catch a
// generic failure that hides which rule the text broke.
TEST(Base64, ErrorsSayWhichRuleFailed) {
  EXPECT_EQ(Base64Decode("Zm9").status().message(), "base64 length not a multiple of 4");
  EXPECT_EQ(Base64Decode("Zg=a").status().message(), "base64 data after padding");
  EXPECT_EQ(Base64Decode("Z===").status().message(), "invalid base64 character");
  EXPECT_EQ(Base64Decode("Zg==Zg==").status().message(), "invalid base64 character");
  EXPECT_EQ(Base64Decode("Zm-v").status().message(), "invalid base64 character");
}

}  // namespace
}  // namespace rc::encoding
