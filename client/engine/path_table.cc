#include "client/engine/path_table.h"

#include <cstdio>
#include <cstring>
#include <iterator>

namespace engram::client {
namespace {

// kAuto's choice, measured by bench_kernels on the H200 (bench/RESULTS.md, 2026-11-30): per batch size (items per
// layer, random rows of a 16 GiB table, fresh ids per batch), whether the host-gather path (the engine's
// configuration: every row, a share of the tokens on the UVA row-order kernel) beat the UVA path. A batch takes
// the choice of the nearest measured size (on a log scale).
// 1536 items (64 decode tokens x 24 columns) stays on UVA: 14 us in a graph, below the host path's ~90 us fixed cost.
constexpr PathPoint kDefaultPathTable[] = {
    {1536, false}, {6144, true}, {24576, true}, {196608, true}, {1048560, false}};

}  // namespace

std::vector<PathPoint> PathTable(const Tuning& tuning) {
  if (tuning.host_gather_min_items.value_or(0) > 0) return {{*tuning.host_gather_min_items, true, true}};
  if (!tuning.lookup_path_table.empty()) {
    std::vector<PathPoint> table;
    if (FILE* f = std::fopen(tuning.lookup_path_table.c_str(), "r")) {
      long long n = 0;
      char what[16] = {};
      while (std::fscanf(f, "%lld %15s", &n, what) == 2) {
        if (n > 0) table.push_back({n, std::strcmp(what, "host") == 0});
      }
      std::fclose(f);
    }
    if (!table.empty()) return table;
  }
  return std::vector<PathPoint>(std::begin(kDefaultPathTable), std::end(kDefaultPathTable));
}

LookupPath PathFromTuning(const Tuning& tuning) {
  if (tuning.lookup_path == "uva") return LookupPath::kUva;
  if (tuning.lookup_path == "host" || tuning.lookup_path == "host_gather") return LookupPath::kHostGather;
  return LookupPath::kAuto;
}

}  // namespace engram::client
