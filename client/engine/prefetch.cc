#include "client/engine/prefetch.h"

#include "absl/strings/str_cat.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::kernels {

absl::Status Prefetcher::Init(std::vector<LayerTable> tables, int32_t max_tokens, int32_t n_cols, int32_t head_dim,
                              int32_t max_blocks) {
  if (side_ != nullptr) return absl::FailedPreconditionError("Prefetcher already initialised");
  if (tables.empty() || max_tokens < 1 || n_cols < 1 || head_dim < 32) {
    return absl::InvalidArgumentError("Prefetcher needs layers, max_tokens >= 1, n_cols >= 1, head_dim >= 32");
  }
  tables_ = std::move(tables);
  max_tokens_ = max_tokens;
  n_cols_ = n_cols;
  head_dim_ = head_dim;
  // Background grid: 8 blocks. The UVA gather is bound by address translation, not by SMs, and the row-order
  // gather is faster with few rows in flight: on an H200, 8192 tokens x 2 layers take 5.2 ms on 8 or 16 blocks,
  // 9.2 ms on 4, while a larger grid slows an HBM-bound main stream far more (60 gate kernels: 4 blocks +1.9%,
  // 8 blocks +2.1%, 16 blocks +6.5%, 66 blocks +21%; bench/RESULTS.md, 2026-11-30).
  max_blocks_ = max_blocks > 0 ? max_blocks : 8;
  int lo = 0, hi = 0;
  cudaDeviceGetStreamPriorityRange(&lo, &hi);
  if (auto st = CudaStatus(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, hi), "side stream"); !st.ok()) {
    return st;
  }
  if (auto st = CudaStatus(cudaEventCreateWithFlags(&ids_ready_, cudaEventDisableTiming), "event"); !st.ok()) {
    return st;
  }
  sort_bytes_ = LookupSortScratchBytes(static_cast<int64_t>(max_tokens) * n_cols);
  if (auto st = CudaStatus(cudaMalloc(&sort_scratch_, sort_bytes_), "sort scratch"); !st.ok()) return st;
  for (size_t l = 0; l < tables_.size(); ++l) {
    cudaEvent_t e = nullptr;
    if (auto st = CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDefault), "event"); !st.ok()) return st;
    done_.push_back(e);
    void* buf = nullptr;
    const size_t bytes = static_cast<size_t>(max_tokens) * n_cols * head_dim * 2;
    if (auto st = CudaStatus(cudaMalloc(&buf, bytes), "staging buffer"); !st.ok()) return st;
    staging_.push_back(static_cast<uint16_t*>(buf));
  }
  return absl::OkStatus();
}

absl::Status Prefetcher::Prefetch(const int32_t* ids, int32_t num_tokens, cudaStream_t main_stream) {
  if (side_ == nullptr) return absl::FailedPreconditionError("Prefetcher not initialised");
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens, the staging buffers hold ", max_tokens_));
  }
  if (ids == nullptr && num_tokens > 0) return absl::InvalidArgumentError("null hash ids");
  if (auto st = CudaStatus(cudaEventRecord(ids_ready_, main_stream), "record ids event"); !st.ok()) return st;
  if (auto st = CudaStatus(cudaStreamWaitEvent(side_, ids_ready_, 0), "side stream wait"); !st.ok()) return st;
  const int32_t L = static_cast<int32_t>(tables_.size());
  for (int32_t l = 0; l < L; ++l) {
    LookupArgs a;
    a.records = tables_[static_cast<size_t>(l)].records;
    a.row_begin = tables_[static_cast<size_t>(l)].row_begin;
    a.row_end = tables_[static_cast<size_t>(l)].row_end;
    a.head_dim = head_dim_;
    a.ids = ids + static_cast<int64_t>(l) * n_cols_;
    a.num_tokens = num_tokens;
    a.num_cols = n_cols_;
    a.ids_stride = static_cast<int64_t>(L) * n_cols_;
    a.out = staging_[static_cast<size_t>(l)];
    a.max_blocks = max_blocks_;
    a.sort_scratch = sort_scratch_;  // layers run one after another on the side stream: one scratch serves all
    a.sort_scratch_bytes = sort_bytes_;
    a.sort_min_items = sort_min_items_;
    if (auto st = CudaStatus(LaunchLookup(a, side_), "lookup launch"); !st.ok()) return st;
    if (auto st = CudaStatus(cudaEventRecord(done_[static_cast<size_t>(l)], side_), "record layer event"); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status Prefetcher::Wait(int32_t layer, cudaStream_t main_stream) {
  if (layer < 0 || layer >= static_cast<int32_t>(done_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  return CudaStatus(cudaStreamWaitEvent(main_stream, done_[static_cast<size_t>(layer)], 0), "wait layer event");
}

Prefetcher::~Prefetcher() {
  if (side_ != nullptr) cudaStreamSynchronize(side_);
  for (auto* b : staging_) cudaFree(b);
  cudaFree(sort_scratch_);
  for (auto e : done_) cudaEventDestroy(e);
  if (ids_ready_ != nullptr) cudaEventDestroy(ids_ready_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
}

}  // namespace engram::kernels
