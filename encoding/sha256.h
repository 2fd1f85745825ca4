// SHA-256 through OpenSSL's EVP interface: one shot (Sha256, Sha256Hex) and streaming
// (Sha256Hasher). A digest cannot fail short of OpenSSL itself being broken, so failures stop
// the process (RC_CHECK) instead of being returned.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

struct evp_md_ctx_st;  // EVP_MD_CTX, kept out of this header

namespace rc::encoding {

inline constexpr std::size_t kSha256Bytes = 32;
using Sha256Digest = std::array<std::uint8_t, kSha256Bytes>;

Sha256Digest Sha256(std::string_view bytes);
// Lowercase hex of Sha256(bytes), 64 characters.
std::string Sha256Hex(std::string_view bytes);

// For input that arrives in pieces (a file read in blocks): Update() as often as needed, then
// Finish(), after which the hasher starts over empty.
class Sha256Hasher {
 public:
  Sha256Hasher();
  ~Sha256Hasher();
  Sha256Hasher(const Sha256Hasher&) = delete;
  Sha256Hasher& operator=(const Sha256Hasher&) = delete;

  void Update(std::string_view bytes);
  Sha256Digest Finish();

 private:
  struct Free {
    void operator()(evp_md_ctx_st* ctx) const;
  };
  const std::unique_ptr<evp_md_ctx_st, Free> ctx_;  // never null
};

}  // namespace rc::encoding
