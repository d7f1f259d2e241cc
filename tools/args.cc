#include "tools/args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace engram::tools {

absl::Status Args::Parse(int argc, char** argv, int first, const std::set<std::string>& valued,
                         const std::set<std::string>& flags) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a == "--") {
      positional_.push_back(a);
      continue;
    }
    std::string name = a, value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      has_value = true;
    }
    if (flags.count(name)) {
      if (has_value) return absl::InvalidArgumentError(absl::StrCat(name, " takes no value"));
      values_[name].push_back("true");
    } else if (valued.count(name)) {
      if (!has_value) {
        if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
        value = argv[++i];
      }
      values_[name].push_back(value);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown option ", name));
    }
  }
  return absl::OkStatus();
}

std::string Args::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.back();
}

std::vector<std::string> Args::GetAll(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

absl::StatusOr<int64_t> Args::GetInt(const std::string& name, int64_t fallback) const {
  if (!Has(name)) return fallback;
  int64_t v;
  if (!absl::SimpleAtoi(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " wants an integer, got '", Get(name), "'"));
  }
  return v;
}

absl::Status Args::RequireInts(const std::vector<std::string>& names, int64_t min, int64_t max) const {
  for (const auto& name : names) {
    auto v = GetInt(name, min);
    if (!v.ok()) return v.status();
    if (*v < min || *v > max) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [", min, ", ", max, "], got ", Get(name)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& option, const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(option, " wants a comma-separated list of integers, got '", text, "'"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace engram::tools
