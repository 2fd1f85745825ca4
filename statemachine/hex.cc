#include "statemachine/hex.h"

namespace rc::hex {

std::string encode(std::span<const std::uint8_t> bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const std::uint8_t b : bytes) {
    out.push_back(kLowerDigits[b >> 4]);
    out.push_back(kLowerDigits[b & 0xF]);
  }
  return out;
}

std::string encode(std::string_view bytes) {
  return encode(std::span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
}

int digit_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool is_lower(std::string_view text) {
  for (const char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

Status decode_into(std::string_view text, std::span<std::uint8_t> out) {
  if (text.size() != out.size() * 2) {
    return Status::InvalidArgument("expected " + std::to_string(out.size() * 2) +
                                   " hex digits, got " + std::to_string(text.size()));
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int high = digit_value(text[2 * i]);
    if (high < 0) return Status::InvalidArgument("bad digit at " + std::to_string(2 * i));
    const int low = digit_value(text[2 * i + 1]);
    if (low < 0) return Status::InvalidArgument("bad digit at " + std::to_string(2 * i + 1));
    out[i] = static_cast<std::uint8_t>(high << 4 | low);
  }
  return Status::OK();
}

Result<std::string> decode(std::string_view text) {
  if (text.size() % 2 != 0) {
    return Status::InvalidArgument("odd number of hex digits: " + std::to_string(text.size()));
  }
  std::string out(text.size() / 2, '\0');
  Status st = decode_into(text, std::span(reinterpret_cast<std::uint8_t*>(out.data()), out.size()));
  if (!st.ok()) return st;
  return out;
}

}  // namespace rc::hex
