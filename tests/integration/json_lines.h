// Reading the JSON lines that engramctl attach and engram-replica print, for the multi-process tests. Test-only.
#pragma once

#include <set>
#include <sstream>
#include <string>

#include "nlohmann/json.hpp"

namespace engram::testing {

// The first (or last) line of `out` that is a JSON object; null when there is none.
inline nlohmann::json JsonLine(const std::string& out, bool last) {
  std::istringstream ss(out);
  std::string line;
  nlohmann::json found;
  while (std::getline(ss, line)) {
    if (line.empty() || line[0] != '{') continue;
    found = nlohmann::json::parse(line);
    if (!last) break;
  }
  return found;
}

// The "reasons" array of a decision as a set.
inline std::set<std::string> ReasonSet(const nlohmann::json& j) {
  std::set<std::string> s;
  for (const auto& r : j["reasons"]) s.insert(r.get<std::string>());
  return s;
}

}  // namespace engram::testing
