// Prefetcher: runs the lookups of every Engram layer on a side CUDA stream, as soon as the hash ids are known,
// into staging buffers at fixed device addresses (CUDA-graph friendly), with one event per layer.
//
//   Prefetcher p;
//   RETURN_IF_ERROR(p.Init(tables, max_tokens, n_cols, head_dim));        // once
//   RETURN_IF_ERROR(p.Prefetch(ids_on_device, T, main_stream));           // after the hash kernel on main_stream
//   ... main stream runs the earlier layers ...
//   RETURN_IF_ERROR(p.Wait(layer, main_stream)); use p.staging(layer)     // main stream now ordered after it
//
// Prefetch makes the side stream wait for the work already queued on `main_stream` (the ids), then launches each
// layer's lookup with a small background grid (8 blocks by default: the UVA path is bound by address
// translation, not SMs, and a small grid disturbs the main stream least; see prefetch.cc) and records that layer's
// event. Wait makes `main_stream` wait for that event; it never blocks the host. Owns its stream, events and buffers.
// One thread drives one Prefetcher.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace engram::kernels {

struct LayerTable {
  const uint8_t* records = nullptr;  // device-visible (UVA host or HBM)
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

class Prefetcher {
 public:
  Prefetcher() = default;
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  absl::Status Init(std::vector<LayerTable> tables, int32_t max_tokens, int32_t n_cols, int32_t head_dim,
                    int32_t max_blocks = 0);
  // ids: device [T, L, C] hash ids (layer l's columns at ids + l * n_cols, stride L * C).
  absl::Status Prefetch(const int32_t* ids, int32_t num_tokens, cudaStream_t main_stream);
  absl::Status Wait(int32_t layer, cudaStream_t main_stream);
  // The row-order threshold (items per launch) of every layer's lookup: an engine passes the one it calibrated on
  // its table or took from its tuning; -1 (the default): the process-wide LookupTuning::sort_min_items.
  void set_sort_min_items(int64_t items) { sort_min_items_ = items; }
  int64_t sort_min_items() const { return sort_min_items_; }
  // bf16 [max_tokens, n_cols, head_dim] per layer; fixed for the Prefetcher's life.
  uint16_t* staging(int32_t layer) const { return staging_[static_cast<size_t>(layer)]; }
  cudaEvent_t layer_event(int32_t layer) const { return done_[static_cast<size_t>(layer)]; }
  cudaStream_t side_stream() const { return side_; }

 private:
  std::vector<LayerTable> tables_;
  int32_t max_tokens_ = 0, n_cols_ = 0, head_dim_ = 0, max_blocks_ = 0;
  cudaStream_t side_ = nullptr;
  cudaEvent_t ids_ready_ = nullptr;
  std::vector<cudaEvent_t> done_;
  std::vector<uint16_t*> staging_;
  void* sort_scratch_ = nullptr;  // row-order gather of large batches (engram_kernels.h)
  size_t sort_bytes_ = 0;
  int64_t sort_min_items_ = -1;
};

}  // namespace engram::kernels
