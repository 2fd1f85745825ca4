#include "encoding/base64.h"

#include <openssl/evp.h>

namespace rc::encoding {
namespace {

// EVP_*Block take an int length: longer input goes through in chunks of whole groups (3 bytes
// encode to 4 characters), so that no chunk but the last is padded.
constexpr std::size_t kEncodeChunkBytes = std::size_t{3} << 20;
constexpr std::size_t kDecodeChunkChars = std::size_t{4} << 20;

bool InAlphabet(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' ||
         c == '/';
}

// How many '=' end `text`, once the strict grammar holds. EVP_DecodeBlock alone is laxer: it skips
// leading and trailing whitespace, decodes '=' anywhere as zero bits and keeps the padding's zero
// bytes; so nothing reaches it that this did not accept.
Result<std::size_t> CheckedPadding(std::string_view text) {
  if (text.size() % 4 != 0) return Status::InvalidArgument("base64 length not a multiple of 4");
  std::size_t pad = 0;
  while (pad < 2 && pad < text.size() && text[text.size() - 1 - pad] == '=') ++pad;
  const std::size_t last_group = text.empty() ? 0 : text.size() - 4;
  for (std::size_t i = 0; i + pad < text.size(); ++i) {
    // A '=' where padding may start (a last group's third character) with data after it.
    if (text[i] == '=' && i >= last_group + 2) {
      return Status::InvalidArgument("base64 data after padding");
    }
    if (!InAlphabet(text[i])) return Status::InvalidArgument("invalid base64 character");
  }
  return pad;
}

const unsigned char* Bytes(std::string_view s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

}  // namespace

std::string Base64Encode(std::string_view bytes) {
  std::string out((bytes.size() + 2) / 3 * 4 + 1, '\0');  // + the NUL EVP_EncodeBlock writes
  std::size_t written = 0;
  for (std::size_t at = 0; at < bytes.size(); at += kEncodeChunkBytes) {
    const std::string_view chunk = bytes.substr(at, kEncodeChunkBytes);
    auto* dst = reinterpret_cast<unsigned char*>(out.data()) + written;
    const int n = EVP_EncodeBlock(dst, Bytes(chunk), static_cast<int>(chunk.size()));
    RC_CHECK(n >= 0 && static_cast<std::size_t>(n) == (chunk.size() + 2) / 3 * 4);
    written += static_cast<std::size_t>(n);
  }
  out.resize(written);
  return out;
}

Result<std::string> Base64Decode(std::string_view text) {
  Result<std::size_t> pad = CheckedPadding(text);
  if (!pad.ok()) return pad.status();
  std::string out(text.size() / 4 * 3, '\0');
  std::size_t written = 0;
  for (std::size_t at = 0; at < text.size(); at += kDecodeChunkChars) {
    const std::string_view chunk = text.substr(at, kDecodeChunkChars);
    auto* dst = reinterpret_cast<unsigned char*>(out.data()) + written;
    const int n = EVP_DecodeBlock(dst, Bytes(chunk), static_cast<int>(chunk.size()));
    // Checked above, so OpenSSL cannot refuse it; padding decodes as zero bytes, dropped below.
    RC_CHECK(n >= 0 && static_cast<std::size_t>(n) == chunk.size() / 4 * 3);
    written += static_cast<std::size_t>(n);
  }
  out.resize(written - *pad);
  return out;
}

}  // namespace rc::encoding
