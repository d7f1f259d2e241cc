#include "daemon/options.h"

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "daemon/metrics_http.h"
#include "model/file_util.h"

namespace engram::daemon {
namespace {

absl::StatusOr<std::vector<int64_t>> ParseTp(const std::string& origin, const std::string& v) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(v, ',', absl::SkipWhitespace())) {
    int64_t n;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &n) || n < 1 || n > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": tp wants a comma list of sizes >= 1, got '", v, "'"));
    }
    out.push_back(n);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(origin, ": tp is empty"));
  return out;
}

absl::Status Set(const std::string& origin, const std::string& key, const std::string& value, Options* o,
                 bool* checkpoints_replaced) {
  auto int_value = [&](int* field, int lo) -> absl::Status {
    int v;
    if (!absl::SimpleAtoi(value, &v) || v < lo) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": ", key, " wants an integer >= ", lo, ", got '", value, "'"));
    }
    *field = v;
    return absl::OkStatus();
  };
  if (key == "checkpoint") {
    if (!*checkpoints_replaced) o->checkpoints.clear();
    *checkpoints_replaced = true;
    o->checkpoints.push_back(value);
  } else if (key == "tp") {
    ASSIGN_OR_RETURN(o->tp_sizes, ParseTp(origin, value));
  } else if (key == "shm_dir") {
    o->shm_dir = value;
  } else if (key == "socket") {
    o->socket = value;
  } else if (key == "group") {
    o->group = value;
  } else if (key == "admin_group") {
    o->admin_group = value;
  } else if (key == "tickets") {
    return int_value(&o->tickets, 1);
  } else if (key == "ticket_hold_ms") {
    return int_value(&o->ticket_hold_ms, 1);
  } else if (key == "max_sessions") {
    return int_value(&o->max_sessions, 1);
  } else if (key == "max_sessions_per_uid") {
    return int_value(&o->max_sessions_per_uid, 1);
  } else if (key == "max_streams_per_uid") {
    return int_value(&o->max_streams_per_uid, 1);
  } else if (key == "max_connections_per_uid") {
    return int_value(&o->max_connections_per_uid, 1);
  } else if (key == "reflection") {
    if (value == "on" || value == "true" || value == "1") {
      o->reflection = true;
    } else if (value == "off" || value == "false" || value == "0") {
      o->reflection = false;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": reflection wants on or off, got '", value, "'"));
    }
  } else if (key == "threads") {
    return int_value(&o->threads, 0);
  } else if (key == "prewarm_registration") {
    if (value.empty())
      return absl::InvalidArgumentError(absl::StrCat(origin, ": prewarm_registration wants auto, off or a path"));
    o->prewarm_registration = value;
  } else if (key == "log_level") {
    o->log_level = value;
  } else if (key == "metrics_file") {
    o->metrics_file = value;
  } else if (key == "metrics_address") {
    if (auto st = ParseMetricsAddress(value).status(); !value.empty() && !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": ", st.message()));
    }
    o->metrics_address = value;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": unknown key '", key, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyConfigText(const std::string& text, const std::string& origin, Options* opts) {
  std::istringstream in(text);
  std::string line;
  int n = 0;
  bool replaced = false;
  while (std::getline(in, line)) {
    ++n;
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    auto eq = l.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", n, ": expected `key = value`"));
    }
    std::string key(absl::StripAsciiWhitespace(l.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(l.substr(eq + 1)));
    RETURN_IF_ERROR(Set(absl::StrCat(origin, ":", n), key, value, opts, &replaced));
  }
  return absl::OkStatus();
}

std::string CanonicalCheckpointPath(const std::string& dir, Env* env) {
  if (dir.empty()) return dir;
  std::string real;
  if (env->Realpath(dir.c_str(), &real) == 0) return real;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(dir, ec);
  if (ec) p = dir;
  std::string out = p.lexically_normal().string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  Options o;
  // First pass: the config file, so that flags override it.
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) o.config_file = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) o.config_file = a.substr(9);
  }
  if (!o.config_file.empty()) {
    ASSIGN_OR_RETURN(std::string text, ReadSmallFile(o.config_file, 1 << 20));
    RETURN_IF_ERROR(ApplyConfigText(text, o.config_file, &o));
  }
  bool replaced = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], value;
    if (a.rfind("--", 0) != 0) return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    std::string name = a.substr(2);
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(a, " needs a value"));
      value = argv[++i];
    }
    if (name == "config") continue;
    std::string key = name;
    for (auto& c : key) c = c == '-' ? '_' : c;
    RETURN_IF_ERROR(Set("command line", key, value, &o, &replaced));
  }
  if (o.checkpoints.empty()) return absl::InvalidArgumentError("no checkpoint to serve: give --checkpoint DIR");
  return o;
}

}  // namespace engram::daemon
