// The lookup path's automatic choice as data: the measured points (at N items per layer, did the host-gather path
// win?), where they come from (a plain threshold, a table file bench_kernels writes, or the built-in measurement,
// from the table's Tuning), and the forced path a Tuning names. The engine (client/engine/device_engine.h) takes a
// batch's choice from the nearest point on a log scale. Pure functions over values; thread-safe.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "engram/lookup_engine.h"
#include "engram/tuning.h"

namespace engram::client {

// One measured point of the automatic path choice: at `items` per layer, did the host-gather path win?
struct PathPoint {
  int64_t items = 0;
  bool host = false;
  bool threshold = false;  // the only point: host gather from `items` on
  double share = -1;       // the host path's UVA share at this size (timed at creation); -1: the engine's option
};

// host_gather_min_items=N: one threshold point; else the points of the lookup_path_table file (lines "ITEMS
// host|uva"; a missing, unreadable or empty file gives the built-in points); else the built-in points.
std::vector<PathPoint> PathTable(const Tuning& tuning);

// The point of `points` (anything with an `items` field) nearest `items` on a log scale, the first of equals; null
// when there is none. The engine's automatic choice reads its path table this way.
template <typename Point>
const Point* NearestPoint(const std::vector<Point>& points, int64_t items) {
  const Point* best = nullptr;
  double best_d = 0;
  for (const Point& p : points) {
    const double d = std::fabs(std::log(static_cast<double>(items)) - std::log(static_cast<double>(p.items)));
    if (best == nullptr || d < best_d) {
      best = &p;
      best_d = d;
    }
  }
  return best;
}

// The path lookup_path forces: "uva", "host" or "host_gather"; anything else (unset, "auto") is kAuto.
LookupPath PathFromTuning(const Tuning& tuning);

}  // namespace engram::client
