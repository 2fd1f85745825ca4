// Reading quoted outputs back as their readers do: a command line an operator copies into a shell
// (parsed by the real /bin/sh), and a report field between single quotes whose quotes are doubled.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace rc::quoting_testing {

// The arguments /bin/sh makes of `words` (shell text as a tool printed it), each exactly as a
// program run with them would receive it: the shell runs `printf '%s\0' WORDS`. Whatever else the
// shell ran (a command the text smuggled in) shows in the output too: bytes after the last NUL
// are one more, unterminated, word. Callers pass only text whose smuggled commands are harmless.
inline std::vector<std::string> ShellWords(const std::string& words) {
  std::vector<std::string> out;
  std::FILE* p = ::popen(("printf '%s\\0' " + words).c_str(), "r");
  if (p == nullptr) return {"(popen failed)"};
  std::string printed;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) printed.append(buf, n);
  ::pclose(p);
  std::size_t start = 0;
  for (std::size_t nul = printed.find('\0'); nul != std::string::npos;
       nul = printed.find('\0', start)) {
    out.push_back(printed.substr(start, nul - start));
    start = nul + 1;
  }
  if (start < printed.size()) out.push_back(printed.substr(start));
  return out;
}

// `arg` as one shell word, byte for byte, whatever it holds (a line break included): between
// single quotes, each quote inside written '\''. The tests' own way to pass any argument.
inline std::string ExactShellWord(const std::string& arg) {
  std::string out = "'";
  for (const char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The field a report reader takes at `pos` of `line` (a quote must open it there): up to the first
// quote not followed by another, each doubled quote read as one quote. `pos` moves past the
// closing quote. nullopt when no quote opens the field at `pos` or none closes it.
inline std::optional<std::string> ReadQuoted(const std::string& line, std::size_t& pos) {
  if (pos >= line.size() || line[pos] != '\'') return std::nullopt;
  std::string field;
  for (std::size_t i = pos + 1; i < line.size(); ++i) {
    if (line[i] != '\'') {
      field += line[i];
    } else if (i + 1 < line.size() && line[i + 1] == '\'') {
      field += '\'';
      ++i;
    } else {
      pos = i + 1;
      return field;
    }
  }
  return std::nullopt;
}

}  // namespace rc::quoting_testing
