// A small command-line parser for engram's tools: `--name value`, `--name=value` and boolean `--flag`, with a
// fixed set of known options per command so that a typo is an error (exit code 2), never silently ignored.
//
//   Args a;
//   if (auto st = a.Parse(argc, argv, 2, {"--checkpoint", "--tp"}, {"--json"}); !st.ok()) ...
//   a.Get("--tp", "1"); a.Has("--json");
//
// Plain value type; single-threaded use.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace engram::tools {

class Args {
 public:
  // Parses argv[first..argc). `valued` options take a value; `flags` do not. Repeated valued options accumulate.
  absl::Status Parse(int argc, char** argv, int first, const std::set<std::string>& valued,
                     const std::set<std::string>& flags);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  std::vector<std::string> GetAll(const std::string& name) const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback) const;
  // Every one of `names` that is present must be an integer in [min, max]: a value that does not parse, or would be
  // truncated where it is used (--tp-size 4294967297), is an error naming the option, never the default.
  absl::Status RequireInts(const std::vector<std::string>& names, int64_t min, int64_t max) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
};

// Parses "1,2,3" into integers; an error names the option.
absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& option, const std::string& text);

}  // namespace engram::tools
