// Reading the JSON lines that engramctl attach and engram-replica print, for the multi-process tests. Test-only.
#pragma once

#include <set>
#include <sstream>
#include <string>
#include <vector>

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

// Every line of `out` that is a JSON object, in order; a line that does not parse is a discarded value
// (is_discarded()), never an exception.
inline std::vector<nlohmann::json> JsonLines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  std::istringstream ss(out);
  for (std::string line; std::getline(ss, line);) {
    if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line, nullptr, false));
  }
  return lines;
}

// The "reasons" array of a decision as a set.
inline std::set<std::string> ReasonSet(const nlohmann::json& j) {
  std::set<std::string> s;
  for (const auto& r : j["reasons"]) s.insert(r.get<std::string>());
  return s;
}

}  // namespace engram::testing
