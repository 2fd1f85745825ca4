// Small helpers of the subcommands that must never throw: the file system (error_code overloads)
// and typed reads of a server's JSON answer (outside input: any shape is a result, never an
// exception out of a subcommand).
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "journal/journal.h"

namespace rc::cli {

// A journal a writer holds is read as the writer has it: its WAL tail and clean-close checks
// cannot run there, and the report's verdict does not say so. stderr does (stdout keeps the
// report's format).
inline void NoteLiveWriter(const journal::Journal& j, const char* command) {
  if (!j.recovery().live_writer) return;
  std::fprintf(stderr,
               "rolloutcore %s: note: a writer holds this journal, so its WAL tail and clean-close "
               "checks were skipped; run again once the writer has stopped for those\n",
               command);
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
