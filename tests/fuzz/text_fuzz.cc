// libFuzzer target for statemachine/text.h: whatever the bytes, escape_line yields one printable
// line of valid UTF-8, sanitize_utf8 yields valid UTF-8 and leaves valid input unchanged, and
// printable_utf8 implies valid_utf8. A failed check aborts (a crash libFuzzer reports).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "statemachine/text.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::string escaped = rc::text::escape_line(in);
  if (!rc::text::printable_utf8(escaped)) std::abort();
  for (char c : escaped) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) std::abort();
  }
  const std::string clean = rc::text::sanitize_utf8(in);
  if (!rc::text::valid_utf8(clean)) std::abort();
  if (rc::text::valid_utf8(in) && clean != in) std::abort();
  if (rc::text::printable_utf8(in) && !rc::text::valid_utf8(in)) std::abort();
  // Printable input without a backslash is left exactly as it was.
  if (rc::text::printable_utf8(in) && in.find('\\') == std::string_view::npos && escaped != in) {
    std::abort();
  }
  return 0;
}
