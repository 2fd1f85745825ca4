#include "statemachine/quote.h"

#include "statemachine/text.h"

namespace rc::text {
namespace {

// The characters no POSIX shell (nor zsh or bash interactively) gives a meaning to inside a word
// that is not its first: no expansion, globbing, quoting, redirection or separator. `=` and `~`
// are left out (zsh expands a leading `=cmd`, every shell a leading `~`), as is all non-ASCII.
bool is_plain(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '@' || c == '%' || c == '+' || c == ':' || c == ',' || c == '.' || c == '/' ||
         c == '-';
}

bool is_plain_word(std::string_view s) {
  if (s.empty()) return false;
  for (const char c : s) {
    if (!is_plain(c)) return false;
  }
  return true;
}

// `s` between single quotes; a quote inside cannot be escaped there, so each one closes the
// quoted part, adds an escaped quote and opens the next: `'\''`.
std::string single_quote_for_shell(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '\'';
  for (const char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  out += '\'';
  return out;
}

}  // namespace

std::string quoted(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '\'';
  for (const char c : s) {
    if (c == '\'') out += '\'';
    out += c;
  }
  out += '\'';
  return out;
}

std::string shell_quote(std::string_view s) {
  if (is_plain_word(s)) return std::string(s);
  if (printable_utf8(s)) return single_quote_for_shell(s);
  return single_quote_for_shell(escape_line(s));
}

}  // namespace rc::text
