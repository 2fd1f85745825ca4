// Standard base64 (RFC 4648 §4: alphabet A-Z a-z 0-9 + /, '=' padding, no line breaks) through
// OpenSSL's EVP_EncodeBlock / EVP_DecodeBlock.
#pragma once

#include <string>
#include <string_view>

#include "statemachine/status.h"

namespace rc::encoding {

std::string Base64Encode(std::string_view bytes);

// Strict: the length is a multiple of 4, every character is in the alphabet, '=' appears only as
// the last one or two characters, and there is no whitespace. InvalidArgument otherwise. The
// caller bounds the length of `text`.
[[nodiscard]] Result<std::string> Base64Decode(std::string_view text);

}  // namespace rc::encoding
