// Engine calibration: what a DeviceEngine (device_engine.h) times on its own table, on the host and GPU in hand,
// when it is created, and the choices it keeps:
//   - the row-order threshold: from which batch size the row-order gather beats the plain one (per output format,
//     full grid or background), since the table's size and pages decide that;
//   - the decode shape: at 1-64 tokens a lookup is one host read's latency, and how its rows spread over warps and
//     SMs (kernels::LookupArgs::plain_rows / plain_block_warps) is timed in a CUDA graph, as decode steps run it;
//   - the host-gather plan: per batch size, the host-gather path (at each UVA share, with each thread count) against
//     the UVA row-order gather, so the automatic path choice and its share follow this host's CPUs and memory.
// Every measurement uses fresh random rows of layer 0 (no row in a cache from before) and keeps the best of a few
// rounds. Each result carries its timings as text for the engine's log line. A failure is a Status (the engine is
// then not created); nothing is left allocated. Not thread-safe: the engine's creating thread runs it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/engine/host_gather.h"

namespace engram::client {

// The table being calibrated (its layers as the GPU reads them), and the engine's scratch and staging.
struct CalibrationLayer {
  const uint8_t* device_records = nullptr;
  int64_t row_begin = 0, row_end = 0;
  void* staging = nullptr;  // room for max_tokens x n_cols rows in either format (the engine's staging, or null)
};
struct CalibrationTarget {
  std::vector<CalibrationLayer> layers;  // layer 0 is timed alone; the host-gather plan times every layer
  int32_t head_dim = 0, n_cols = 0;
  int32_t max_tokens = 0;  // the engine's batch limit: no size beyond it is timed
  void* sort_scratch = nullptr;
  size_t sort_bytes = 0;
};

struct RowOrderChoice {
  // [packed][background]: sort from this many items; INT64_MAX = never.
  int64_t from_items[2][2] = {{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max()},
                              {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max()}};
  std::string text;  // "bf16:24576,bf16_bg:never,..."
};
absl::StatusOr<RowOrderChoice> CalibrateRowOrder(const CalibrationTarget& t, cudaStream_t stream);

// The plain gather's shape per decode size.
struct DecodeShapes {
  static constexpr int kSizes = 4;
  static constexpr int32_t kTokens[kSizes] = {1, 4, 16, 64};  // the measured sizes
  int32_t rows[2][kSizes] = {};                               // [packed][size]; 0 = the kernels' default
  int32_t warps[2][kSizes] = {};
  double us[2][kSizes] = {};          // the chosen shape's time per lookup in a graph
  double default_us[2][kSizes] = {};  // the default shape's
  std::string text;                   // "bf16:1=2x4(3.1us;default 3.5us),..."
  // The shape for a launch of `num_tokens` (the nearest measured size on a log scale; none past 2x the largest).
  void For(bool packed, int32_t num_tokens, int32_t* rows_out, int32_t* warps_out) const;
};
// Runs on a stream of its own (graph capture needs one; the engine's may be the legacy default stream).
absl::StatusOr<DecodeShapes> CalibrateDecode(const CalibrationTarget& t);

// Per batch size (items per layer): the host-gather path's best UVA share, and whether it beat the UVA path.
struct HostPoint {
  int64_t items = 0;
  bool host = false;
  double share = 0;
  double host_ms = 0, uva_ms = 0;  // all layers of one batch
  std::string tried;               // every share's time: "0.15:1.712,0.25:1.690,..."
};
struct HostPlan {
  int threads = 0;  // the gather threads the engine keeps
  std::vector<HostPoint> points;
  std::string text;  // "threads=8(tried 8:1.210 12:1.180ms) 24576:host@0.25(host 0.15:0.32,0.25:0.31ms;uva 0.44ms) ..."
};
// The gather thread counts the host-gather calibration tries: `base` (the default), and three quarters of `cpus`
// (at most 24) when that is more and the count is not fixed by hand.
std::vector<int> HostGatherCalibrationThreads(int cpus, int base, bool fixed);
// The UVA shares it tries (tuning_default::kHostGatherCalibrationShares).
std::vector<double> HostGatherCalibrationShares();
// `make(threads)` creates a host gather over every layer of the table, writing the layers' staging (the engine's
// own options with `threads`); the one of the chosen thread count is handed back in *kept. `threads` lists the
// counts to try (the first is the default, kept on a tie within 3%); `shares` the UVA shares. Sizes from 6144 items
// per layer up to the engine's limit.
absl::StatusOr<HostPlan> CalibrateHostGather(
    const CalibrationTarget& t, const std::vector<int>& threads, const std::vector<double>& shares,
    const std::function<absl::StatusOr<std::unique_ptr<HostGather>>(int threads)>& make, cudaStream_t stream,
    std::unique_ptr<HostGather>* kept);

}  // namespace engram::client
