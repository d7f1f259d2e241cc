// ParseCpuList: a CPU list as Linux writes one ("0-7,16,18-19"; cpuset(7)) into the CPU numbers it names, in order.
// Used to pin the host-gather threads (the host_gather_cpus tuning knob), and by Tuning::Set to refuse a malformed
// list when it is set. Header-only and pure: every library may use it; thread-safe.
#pragma once

#include <sched.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace engram {

// InvalidArgument, naming the bad part, for an empty part, a non-number, a range whose end is below its start, or a
// CPU at or above CPU_SETSIZE.
inline absl::StatusOr<std::vector<int>> ParseCpuList(std::string_view text) {
  std::vector<int> cpus;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view part = text.substr(pos, comma - pos);
    const size_t dash = part.find('-');
    auto number = [](std::string_view n, int* out) {
      if (n.empty() || n.size() > 6 || n.find_first_not_of("0123456789") != std::string_view::npos) return false;
      int v = 0;
      for (const char c : n) v = v * 10 + (c - '0');
      *out = v;
      return true;
    };
    int lo = 0, hi = 0;
    const bool ok = dash == std::string_view::npos
                        ? number(part, &lo) && number(part, &hi)
                        : number(part.substr(0, dash), &lo) && number(part.substr(dash + 1), &hi);
    if (!ok || hi < lo || hi >= CPU_SETSIZE) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad CPU list \"", std::string(text), "\" at \"", std::string(part), "\""));
    }
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    pos = comma + 1;
  }
  return cpus;
}

}  // namespace engram
