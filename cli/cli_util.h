// Small helpers of the subcommands that must never throw: the file system (error_code overloads),
// the texts typed on their command lines, and typed reads of a server's JSON answer (outside
// input: any shape is a result, never an exception out of a subcommand).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "effects/file_kind.h"
#include "journal/journal.h"
#include "statemachine/quote.h"
#include "statemachine/status.h"
#include "statemachine/text.h"
#include "statemachine/types.h"

namespace rc::cli {

// What a text option names, and so the rule its text follows.
enum class TextKind : std::uint8_t {
  kId,    // a rollout id, label or engine name: the fold's rule for ids
  kText,  // a source URI: text a client declares, as the fold bounds it
  kPath,  // a file or directory: any text but the empty one
  kUrl,   // an HTTP endpoint: http:// or https:// and a host, printable ASCII without spaces
};

// Whether `text` is http:// or https://, then a host (anything but '/' first), in printable ASCII
// without spaces: what an HTTP client can be pointed at.
inline bool IsHttpUrl(std::string_view text) {
  const bool printable = std::all_of(text.begin(), text.end(), [](char c) {
    return static_cast<unsigned char>(c) > ' ' && static_cast<unsigned char>(c) < 0x7f;
  });
  for (const std::string_view scheme :
       {std::string_view("http://"), std::string_view("https://")}) {
    if (text.substr(0, scheme.size()) != scheme) continue;
    const std::string_view rest = text.substr(scheme.size());
    return printable && !rest.empty() && rest.front() != '/';
  }
  return false;
}

// Whether `text` follows the rule of `kind`.
inline bool FitsTextKind(const std::string& text, TextKind kind) {
  switch (kind) {
    case TextKind::kId:
      return !text.empty() && text.size() <= kIdBytesMax && text::printable_utf8(text);
    case TextKind::kText:
      return !text.empty() && text.size() <= kTextBytesMax && text::printable_utf8(text);
    case TextKind::kPath:
      return !text.empty();
    case TextKind::kUrl:
      return IsHttpUrl(text);
  }
  return false;
}

// The rule of `kind`, as a usage error states it.
inline std::string TextKindRule(TextKind kind) {
  switch (kind) {
    case TextKind::kId:
      return "an id: 1 to " + std::to_string(kIdBytesMax) + " bytes of printable UTF-8";
    case TextKind::kText:
      return "1 to " + std::to_string(kTextBytesMax) + " bytes of printable UTF-8";
    case TextKind::kPath:
      return "a path (an empty one names nothing)";
    case TextKind::kUrl:
      return "an http:// or https:// URL naming a host (printable ASCII, no spaces)";
  }
  return "a value of its kind";
}

// `text` of option `name` against the rule of its kind. CLI11 takes `--opt ''` as the option
// given with an empty text, which a command must never read as the option left out (an empty
// `audit --rollout` would audit the whole journal). InvalidArgument "NAME: 'TEXT' is not RULE"
// otherwise, the text between quotes with each quote in it doubled (text::quoted) and otherwise
// raw: whoever prints the message escapes the whole line, once.
[[nodiscard]] inline Status CheckTextOption(std::string_view name, const std::string& text,
                                            TextKind kind) {
  if (FitsTextKind(text, kind)) return Status::OK();
  return Status::InvalidArgument(std::string(name) + ": " + text::quoted(text) + " is not " +
                                 TextKindRule(kind));
}

// One text option of a command: its name as its messages show it, the CLI11 option (whether it
// was given), its text and its kind.
struct TextOption {
  std::string_view name;
  const CLI::Option* option;
  const std::string* text;
  TextKind kind;
};

// The first option given whose text breaks its rule (CheckTextOption); OK when none does. An
// option left out is not read: its text is the command's default, or "" for none.
[[nodiscard]] inline Status CheckTextOptions(std::initializer_list<TextOption> options) {
  for (const TextOption& o : options) {
    if (o.option->count() > 0) RC_RETURN_IF_ERROR(CheckTextOption(o.name, *o.text, o.kind));
  }
  return Status::OK();
}

// A journal whose LOCK another process held past the reader's wait (a writer, or a reader slow to
// open) is read as a secondary: its WAL tail and the tables a dead open left cannot be checked
// there (the durable mark and the clean close still are), and the report's verdict does not say
// so. stderr does (stdout keeps the report's format).
inline void NoteLiveWriter(const journal::Journal& j, const char* command) {
  if (!j.recovery().live_writer) return;
  std::fprintf(stderr,
               "rolloutcore %s: note: another process holds this journal's LOCK (a writer, or "
               "another reader), so its WAL tail and leftover-table checks were skipped; run again "
               "once it has stopped for those\n",
               command);
}

// The file at `path`, named `what` ("config file"), must be a regular file before anything reads
// it: a FIFO with no writer blocks its reader's open and every read for ever, and a directory,
// socket or device is no file to read. It is opened with O_PATH (which names the file without
// opening it for reading: no wait on a FIFO, no side effect of a device's open) and fstat'ed.
// InvalidArgument "WHAT 'PATH' is a FIFO, not a regular file:
// ..." otherwise; a path that cannot be opened is left to the reader, which names its own error.
[[nodiscard]] inline Status CheckRegularFile(std::string_view what, const std::string& path) {
  const int fd = ::open(path.c_str(), O_PATH | O_CLOEXEC);  // names the file, opens nothing
  if (fd < 0) return Status::OK();
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  ::close(fd);
  if (!stated || S_ISREG(st.st_mode)) return Status::OK();
  return Status::InvalidArgument(std::string(what) + " " + text::quoted(path) + " is " +
                                 effects::NotRegularKind(st.st_mode) +
                                 ", not a regular file: refused before reading it");
}

// A journal's directory must hold only regular files and directories (no FIFO, socket or device,
// nor a link to one): the journal's open reads its files (CURRENT, the MANIFEST, ...) with
// blocking opens, and the open of a FIFO with no writer never returns. Each entry is stat'ed,
// never opened, so the check itself cannot block. InvalidArgument naming the entry otherwise; a
// path that is not a directory, or cannot be listed, is left to the journal's open, which names
// its own error.
[[nodiscard]] inline Status CheckJournalFiles(const std::string& path) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat st {};
    if (::stat(it->path().c_str(), &st) != 0) continue;  // gone, or a dangling link
    if (S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) continue;
    return Status::InvalidArgument("journal " + text::quoted(path) + " holds " +
                                   text::quoted(it->path().filename().string()) + ", " +
                                   effects::NotRegularKind(st.st_mode) +
                                   ": refused before opening the journal (its open would wait on "
                                   "it)");
  }
  return Status::OK();
}

// Whether `path` exists and is not an empty directory; a path that cannot be inspected counts as
// holding files (the caller refuses to start over it).
inline bool HoldsFiles(const std::string& path) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  if (ec) return true;
  if (!exists) return false;
  const bool empty = std::filesystem::is_empty(path, ec);
  return ec || !empty;
}

// The typed reads below take an object's field: absent leaves `out` as it is and succeeds; a
// field of another type (null included) fails, as does an `object` that is not an object.
inline bool ReadString(const nlohmann::json& object, const char* key, std::string& out) {
  if (!object.is_object()) return false;
  const auto it = object.find(key);
  if (it == object.end()) return true;
  if (!it->is_string()) return false;
  out = it->get<std::string>();
  return true;
}

inline bool ReadUint32(const nlohmann::json& object, const char* key, std::uint32_t& out) {
  if (!object.is_object()) return false;
  const auto it = object.find(key);
  if (it == object.end()) return true;
  if (!it->is_number_unsigned()) return false;
  const std::uint64_t v = it->get<std::uint64_t>();
  if (v > std::numeric_limits<std::uint32_t>::max()) return false;
  out = static_cast<std::uint32_t>(v);
  return true;
}

inline bool ReadBool(const nlohmann::json& object, const char* key, bool& out) {
  if (!object.is_object()) return false;
  const auto it = object.find(key);
  if (it == object.end()) return true;
  if (!it->is_boolean()) return false;
  out = it->get<bool>();
  return true;
}

// An object field; absent: `out` is left pointing where it was.
inline bool ReadObject(const nlohmann::json& object, const char* key, const nlohmann::json*& out) {
  if (!object.is_object()) return false;
  const auto it = object.find(key);
  if (it == object.end()) return true;
  if (!it->is_object()) return false;
  out = &*it;
  return true;
}

}  // namespace rc::cli
