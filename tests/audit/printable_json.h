// What the JSON-output tests check of a line: printable ASCII only, and every string it holds.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace rc::json_testing {

// Every byte printable ASCII (and '\n' where `newlines`: an indented document).
inline bool PrintableAscii(const std::string& s, bool newlines = false) {
  return std::all_of(s.begin(), s.end(),
                     [&](char c) { return (c >= 0x20 && c < 0x7f) || (newlines && c == '\n'); });
}

// Every string value in `j`, depth first.
inline void CollectStrings(const nlohmann::json& j, std::vector<std::string>& out) {
  if (j.is_string()) {
    out.push_back(j.get<std::string>());
    return;
  }
  if (!j.is_structured()) return;
  for (const auto& v : j) CollectStrings(v, out);
}

}  // namespace rc::json_testing
