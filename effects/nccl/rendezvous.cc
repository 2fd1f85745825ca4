#include "effects/nccl/rendezvous.h"

#include <cstring>

namespace rc::effects::nccl {
namespace {

constexpr std::string_view kPrefix =
    "\x80\x03"
    "c_ctypes\n_unpickle\n"
    "cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n"
    "}"
    "C\x80";
constexpr std::string_view kSuffix = "\x86\x86R.";
static_assert(kPrefix.size() + kNcclUniqueIdBytes + kSuffix.size() == kPickledUniqueIdBytes);

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int DecodeChar(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

std::string PickleNcclUniqueId(const UniqueIdBytes& id) {
  std::string out;
  out.reserve(kPickledUniqueIdBytes);
  out.append(kPrefix);
  out.append(reinterpret_cast<const char*>(id.data()), id.size());
  out.append(kSuffix);
  RC_CHECK(out.size() == kPickledUniqueIdBytes);
  return out;
}

Result<UniqueIdBytes> UnpickleNcclUniqueId(std::string_view pickled) {
  if (pickled.size() != kPickledUniqueIdBytes) {
    return Status::InvalidArgument("pickled ncclUniqueId must be " +
                                   std::to_string(kPickledUniqueIdBytes) + " bytes, got " +
                                   std::to_string(pickled.size()));
  }
  if (pickled.substr(0, kPrefix.size()) != kPrefix ||
      pickled.substr(kPrefix.size() + kNcclUniqueIdBytes) != kSuffix) {
    return Status::InvalidArgument("pickled ncclUniqueId has an unexpected layout");
  }
  UniqueIdBytes id{};
  std::memcpy(id.data(), pickled.data() + kPrefix.size(), id.size());
  return id;
}

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  const auto* b = reinterpret_cast<const std::uint8_t*>(bytes.data());
  for (; i + 3 <= bytes.size(); i += 3) {
    const std::uint32_t v = (b[i] << 16) | (b[i + 1] << 8) | b[i + 2];
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(kAlphabet[(v >> 6) & 63]);
    out.push_back(kAlphabet[v & 63]);
  }
  const std::size_t rest = bytes.size() - i;
  if (rest == 1) {
    const std::uint32_t v = b[i] << 16;
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.append("==");
  } else if (rest == 2) {
    const std::uint32_t v = (b[i] << 16) | (b[i + 1] << 8);
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(kAlphabet[(v >> 6) & 63]);
    out.push_back('=');
  }
  return out;
}

Result<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) return Status::InvalidArgument("base64 length not a multiple of 4");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text[i + k];
      if (c == '=' && last && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return Status::InvalidArgument("base64 data after padding");
      v[k] = DecodeChar(c);
      if (v[k] < 0) return Status::InvalidArgument("invalid base64 character");
    }
    const std::uint32_t w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out.push_back(static_cast<char>((w >> 16) & 0xFF));
    if (pad < 2) out.push_back(static_cast<char>((w >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(w & 0xFF));
  }
  return out;
}

}  // namespace rc::effects::nccl
