// HostGather: the host-gather lookup path. CPU threads gather a batch's rows from the shared host mapping
// (client/engine/host_gather_plan.h) into pinned staging, chunk by chunk; each chunk is copied to the
// GPU as soon as it is full (the copy engine drains chunk k while the threads gather chunk k+1), and a GPU unpack
// (the lookup kernel over the dense gathered rows, so the same fp8 -> bf16 arithmetic as every other path)
// writes bf16 rows into the caller's staging buffers. Completion of layer l is an event; Wait(l) orders a stream
// after it, exactly like kernels::Prefetcher, so the engine code does not change.
//
// Split batches (options.uva_share > 0, layers with device_records): the last share of each batch's tokens is
// served at the same time by the UVA row-order gather (kernels::LaunchLookup with sort scratch) on a stream of
// its own, reading the same records through their device mapping; the two paths use different resources (the
// GPU's address translation vs CPU threads and a copy engine) and their bandwidths add up to the PCIe limit.
//
// Why: a random gather through UVA from a large host table is bound by the GPU's address translation (8-33 GB/s,
// bench/RESULTS.md); CPU threads reach several times that, and the bytes then cross PCIe as large DMA copies.
//
// Host work by nature: Prefetch runs the gather on a background thread and never enqueues anything that a CUDA
// graph could capture. It must not be called while `main_stream` is being captured (FailedPrecondition); captured
// decode steps keep the UVA kernels. Wait(l) blocks the calling thread until layer l's copies and unpack are
// enqueued (not until they complete), then makes `main_stream` wait for them on the GPU.
//
// Ownership: owns its threads, streams, events, pinned staging (per layer) and device scratch; the host records
// and the bf16 output buffers are the caller's and must outlive it. The host ids passed to Prefetch must stay
// valid until Wait of the last layer (or Sync) has returned. One thread drives a HostGather.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/engine/host_gather_plan.h"
#include "engram/tuning.h"

namespace engram::client {

struct HostGatherOptions {
  int threads = 0;            // gather threads; 0 = DefaultGatherThreads(the machine's cores)
  std::vector<int> cpus;      // CPU affinity of the gather threads (worker i on cpus[i % n]); empty = unpinned
  int32_t unpack_blocks = 0;  // grid of the GPU unpack; 0 = the whole GPU (it reads HBM only, briefly)
  int64_t min_chunk_rows = 256, max_chunk_rows = 1024;  // rows a gather thread takes at a time
  // Share of each batch's tokens gathered by the UVA row-order kernel concurrently (0 = none; needs every layer's
  // device_records); batches below uva_min_items items per layer are not split.
  double uva_share = 0;
  int64_t uva_min_items = 0;
  // Grid of the UVA share's kernel: few blocks, so that it disturbs the main stream little (the row-order gather
  // is as fast on 8 blocks of 8 rows per warp as on 16-32 at these sizes).
  int32_t uva_blocks = 8;
  // Row-order threshold of the UVA share's kernel (items per launch); -1: the process-wide
  // LookupTuning::sort_min_items. An engine passes its own (the one it calibrated, or its tuning's).
  int64_t uva_sort_min_items = -1;

  // How the batch reaches the copy engine (what closes the gap between the pipeline and the CPU gather ceiling). Each
  // field left at -1 is taken from its tuning knob when set (ENGRAM_<KNOB>, or the table's Tuning for an engine's
  // gather), else from the measured default in client/tuning.h (in brackets); HostGather::options() shows the result.
  int32_t prefetch_rows = -1;  // ENGRAM_HOST_GATHER_PREFETCH: rows prefetched ahead in each thread's list (16;
                               // 0 = none)
  int32_t stream_stores = -1;  // ENGRAM_HOST_GATHER_NT=1: non-temporal stores into the pinned staging (1)
  int32_t fused = -1;          // ENGRAM_HOST_GATHER_FUSED=1: each thread plans its own chunk (ids -> rows, index)
                               // right before gathering it: one pass, not two (1)
  int32_t copy_issuer = -1;    // ENGRAM_HOST_GATHER_ISSUER=1: the dispatcher thread enqueues the chunk copies (runs
                               // of finished chunks merged into one copy); the gather threads never call CUDA (1)
  int32_t spin_us = -1;        // ENGRAM_HOST_GATHER_SPIN_US: idle gather threads spin this long before sleeping (200)
  int32_t dispatch_spin_us = -1;  // ENGRAM_HOST_GATHER_DISPATCH_SPIN_US: the same for the dispatcher thread after a
                                  // batch (200)
  int32_t pass_spin_us = -1;      // ENGRAM_HOST_GATHER_PASS_SPIN_US: the dispatcher spins this long for a pass of the
                                  // threads to finish before it sleeps (200; a pass longer than that then also pays the
                                  // dispatcher's wake-up before the unpack is launched)
  int32_t prewake = -1;           // ENGRAM_HOST_GATHER_PREWAKE=1: Prefetch wakes the gather threads itself, so that
                                  // their wake-up overlaps the dispatcher's (1)
  int32_t issue_min_rows = -1;    // ENGRAM_HOST_GATHER_ISSUE_MIN_ROWS: with copy_issuer, a copy waits until this many
                                  // finished rows are contiguous (the last copy takes the rest): small chunks for the
                                  // threads, large copies for the copy engine (4096)
};

// The options with every -1 field resolved: the knob of `tuning` when set, else the measured default.
HostGatherOptions ResolveHostGatherOptions(HostGatherOptions options, const Tuning& tuning);

struct HostLayer {
  const uint8_t* records = nullptr;  // host-readable records, row_begin's first (the shared mapping)
  int64_t row_begin = 0, row_end = 0;
  const uint8_t* device_records = nullptr;  // the same records' device (UVA) address; only for uva_share > 0
};

class HostGather {
 public:
  // out[l]: device bf16 [max_tokens, n_cols, head_dim] per layer (the engine's staging buffers).
  static absl::StatusOr<std::unique_ptr<HostGather>> Create(std::vector<HostLayer> layers, std::vector<uint16_t*> out,
                                                            int32_t max_tokens, int32_t n_cols, int32_t head_dim,
                                                            HostGatherOptions options = {});
  ~HostGather();
  HostGather(const HostGather&) = delete;
  HostGather& operator=(const HostGather&) = delete;

  // Host ids: layer l's columns at host_ids + l * n_cols, ids[t * ids_stride + c]. Returns once the batch is handed
  // to the background thread; `main_stream`'s work queued so far is ordered before the unpack writes out[l].
  absl::Status Prefetch(const int32_t* host_ids, int32_t num_tokens, int64_t ids_stride, cudaStream_t main_stream);
  absl::Status Wait(int32_t layer, cudaStream_t main_stream);
  // Blocks until every layer of the last batch is enqueued; returns the batch's error, if any.
  absl::Status Sync();

  int threads() const { return pool_->threads(); }
  // The UVA share of later batches (clamped to [0, 1]; ignored without device records). Call between batches.
  void set_uva_share(double share) { opt_.uva_share = share; }
  const HostGatherOptions& options() const { return opt_; }  // as resolved by Create
  int32_t n_layers() const { return static_cast<int32_t>(layers_.size()); }
  cudaEvent_t layer_event(int32_t layer) const { return done_[static_cast<size_t>(layer)]; }
  // Of the last batch, per layer: items served and rows moved over PCIe.
  struct LayerStats {
    int64_t items = 0, rows_moved = 0;  // rows_moved counts the UVA share's items too
    int64_t uva_items = 0;              // items served by the UVA share
    double gather_ms = 0;               // host time of the threads' gather pass (the fused plan, the gather, the
                                        // copy issue; an unfused plan runs before it and is not counted)
  };
  LayerStats stats(int32_t layer) const { return stats_[static_cast<size_t>(layer)]; }

 private:
  HostGather() = default;
  // One layer of the batch: how its tokens split between the CPU threads and the UVA share.
  struct LayerBatch {
    int32_t l = 0;
    size_t li = 0;
    int32_t uva_tokens = 0, host_tokens = 0;
    int64_t host_items = 0, uva_items = 0;
  };
  void Dispatch();
  // The dispatcher's work for layer l (client/engine/host_gather_layer.cc): the split, the UVA share's launch, the
  // threads' gather pass with its copies, and the unpack.
  absl::Status RunLayer(int32_t l);
  LayerBatch SplitBatch(int32_t l) const;
  absl::Status LaunchUvaShare(const LayerBatch& b, bool serial);
  absl::Status GatherPass(const LayerBatch& b, bool fused, bool uva_in_pass);

  std::vector<HostLayer> layers_;
  std::vector<uint16_t*> out_;
  int32_t max_tokens_ = 0, n_cols_ = 0, head_dim_ = 0;
  int64_t rb_ = 0;
  HostGatherOptions opt_;
  int device_ = 0;
  std::unique_ptr<GatherPool> pool_;
  cudaStream_t copy_ = nullptr, unpack_ = nullptr, uva_ = nullptr;
  bool uva_ok_ = false;           // every layer has device records: batches may be split
  void* sort_scratch_ = nullptr;  // the UVA share's row-order sort (one launch at a time: one stream)
  size_t sort_bytes_ = 0;
  std::vector<cudaEvent_t> uva_done_;
  cudaEvent_t main_ready_ = nullptr;
  std::vector<cudaEvent_t> copied_, done_;
  std::vector<uint8_t*> pinned_rows_;   // [max_items, rb] per layer
  std::vector<int32_t*> pinned_index_;  // [max_items] per layer
  std::vector<uint8_t*> dev_rows_;
  std::vector<int32_t*> dev_index_;
  std::vector<GatherPlan> plans_;
  std::unique_ptr<std::atomic<uint8_t>[]> chunk_done_;  // copy_issuer: [chunk] gathered (and fenced)
  std::vector<LayerStats> stats_;

  // The batch handed to the dispatcher thread.
  std::thread dispatcher_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, pending_ = false, any_batch_ = false;
  std::atomic<bool> pending_flag_{false};  // pending_, readable without the lock (the dispatcher's spin)
  uint64_t batch_ = 0;                     // batches handed over
  int32_t issued_ = 0;                     // layers of batch_ enqueued so far
  absl::Status error_;                     // of batch_
  const int32_t* ids_ = nullptr;
  int32_t tokens_ = 0;
  int64_t stride_ = 0;
};

}  // namespace engram::client
