// Histogram: a Prometheus-style histogram of seconds as a plain value type: fixed upper bounds (kSecondsBounds, the
// same for every histogram engramd exports, from 10 ms to about 5 minutes: a replica registers a 94 GiB shard in a few
// seconds on huge pages, a first registration after boot in about ten), a count per bound (not cumulative: the
// renderer sums them), a count and a sum. A value above the last bound is counted in `count` only (the +Inf bucket).
// Negative or non-finite values (a replica may send anything) are ignored. Copyable; not thread-safe on its own (the
// ReplicaRegistry keeps its histograms under its mutex and hands out copies).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace engram::daemon {

inline constexpr std::array<double, 14> kSecondsBounds = {0.01, 0.05, 0.1, 0.25, 0.5, 1,   2.5,
                                                          5,    10,   20,  40,   80,  160, 320};

struct Histogram {
  std::array<uint64_t, kSecondsBounds.size()> buckets{};  // buckets[i]: values in (bounds[i-1], bounds[i]]
  uint64_t count = 0;
  double sum = 0;

  void Observe(double v) {
    if (!std::isfinite(v) || v < 0) return;
    ++count;
    sum += v;
    for (size_t i = 0; i < kSecondsBounds.size(); ++i) {
      if (v <= kSecondsBounds[i]) {
        ++buckets[i];
        return;
      }
    }
  }
};

}  // namespace engram::daemon
