// DeviceEngine: the CUDA implementation of LookupEngine (lookup_engine.h), over an attached CUDA-backend Table: hash,
// lookup and gate kernels on the caller's stream, plus the side-stream prefetch of every layer into fixed staging
// buffers. Inputs are device pointers with explicit shapes; every misuse (null, too many tokens, layer out of range, a
// CPU-backend table) is a Status, never a crash. Owns the device copy of the layout and token map. One thread
// drives one engine; the Table must outlive it.
// Prefetch takes the UVA path (kernels::Prefetcher) or the host-gather path (client/engine/host_gather.h, created on
// first use over the table's host records, writing the same staging buffers); see LookupPath in lookup_engine.h.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/engine/calibration.h"
#include "client/engine/host_gather.h"
#include "client/engine/path_table.h"
#include "client/engine/prefetch.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "engram/tuning.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

class DeviceEngine final : public LookupEngine {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceEngine>> Create(const Table& table, int32_t max_tokens,
                                                              cudaStream_t stream, bool staging = true);
  ~DeviceEngine() override;
  Backend backend() const override { return Backend::kCuda; }
  // Its path, the host-gather threads and share, and the calibration's choices with their timings.
  std::string choice() const override { return choice_; }

  // Hash ids of a flattened batch: out [T, n_layers, n_cols] (device). See kernels::HashArgs for the inputs.
  using LookupEngine::Hash;
  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* query_start_loc,
                    const int32_t* lookback, const uint8_t* lookback_dead, const uint8_t* dead, int32_t num_tokens,
                    int32_t num_requests, int32_t* out) override;
  // Rows of layer `l` for ids[t * ids_stride + c]: bf16 [T, n_cols, head_dim] or packed [T, n_cols, record_bytes].
  absl::Status Lookup(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                      bool packed) override;
  absl::Status LookupInto(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out, bool packed,
                          const LookupWindow& window) override;
  absl::Status Gate(const GateInputs& g) override;
  absl::Status SetStream(void* stream) override;
  // Every layer's lookup on the side stream, after the work already queued on the engine's stream.
  absl::Status Prefetch(const int32_t* hash_ids, int32_t num_tokens) override;
  absl::Status Wait(int l) override;
  uint16_t* staging(int l) const override { return has_staging_ ? prefetcher_.staging(l) : nullptr; }
  absl::Status SetLookupPath(LookupPath path) override;
  LookupPath last_lookup_path() const override { return last_path_; }
  cudaStream_t stream() const { return stream_; }
  // kAuto's choice for a batch of `items` (tokens x columns) per layer: the nearest measured size's winner.
  bool HostWins(int64_t items) const;
  // The host path's UVA share for a batch of `items` per layer (timed at creation); -1: the engine's option.
  double ShareAt(int64_t items) const;
  // The row-order threshold (items per launch) this engine's direct lookups use, chosen at creation by timing the
  // plain and the row-order gather on this table (its size and pages decide which wins): [packed][background].
  // INT64_MAX: never sorted.
  int64_t sort_min_items(bool packed, bool background) const { return sort_min_items_[packed][background]; }
  // The threshold of the side-stream prefetch's launches (-1: the process-wide one).
  int64_t prefetch_sort_min_items() const { return prefetcher_.sort_min_items(); }
  // The host gather, once created (by the calibration or the first host-gather Prefetch); else null.
  const HostGather* host_gather() const { return host_.get(); }

 private:
  std::string calibration_;  // what Calibrate chose, for choice()
  std::string choice_;
  DeviceEngine() = default;
  void NotePath(LookupPath path, int64_t items);  // last_path_, and a log line the first time a path is taken
  const Table* table_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int32_t max_tokens_ = 0;
  std::unique_ptr<kernels::DeviceLayout> layout_;
  kernels::Prefetcher prefetcher_;
  bool has_staging_ = true;  // false: created without staging (no Prefetch)
  void* sort_scratch_ = nullptr;
  size_t sort_bytes_ = 0;
  // Lookup path choice.
  LookupPath path_ = LookupPath::kAuto, last_path_ = LookupPath::kAuto;
  std::vector<PathPoint> path_table_;
  unsigned paths_logged_ = 0;
  HostGatherOptions host_options_;
  int64_t sort_min_items_[2][2] = {{-1, -1}, {-1, -1}};  // [packed][background]; -1: the process-wide tuning
  DecodeShapes decode_;                                  // the plain gather's shape at decode sizes
  // Times the row-order threshold, the decode shapes and the host-gather plan on this table (calibration.h), as
  // the environment allows, and logs what was chosen and why.
  absl::Status Calibrate(const Tuning& tuning);
  absl::StatusOr<std::unique_ptr<HostGather>> MakeHostGather(int threads) const;
  std::unique_ptr<HostGather> host_;  // created by the calibration, else on the first host-gather Prefetch
  int32_t* d_ids_ = nullptr;          // host ids copied for the UVA path
  std::vector<int32_t> h_ids_;        // device ids copied for the host path
};

}  // namespace engram::client
