// HostGather's per-layer pipeline (client/engine/host_gather.h), run by its dispatcher thread: the split of a
// layer's tokens between the CPU threads and the UVA row-order kernel, the threads' gather pass with the copies it
// issues, and the GPU unpack. The gather threads, the dispatcher and the copy and unpack streams hand work to each
// other here; one layer at a time.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>

#include "base/spin.h"
#include "base/status_macros.h"
#include "client/engine/host_gather.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

using kernels::CudaStatus;

HostGather::LayerBatch HostGather::SplitBatch(int32_t l) const {
  LayerBatch b;
  b.l = l;
  b.li = static_cast<size_t>(l);
  const int64_t items = static_cast<int64_t>(tokens_) * n_cols_;
  // Tokens [host_tokens, tokens_) go to the UVA row-order gather, the rest to the CPU threads.
  int32_t uva_tokens = 0;
  if (uva_ok_ && opt_.uva_share > 0 && items >= std::max<int64_t>(opt_.uva_min_items, 1)) {
    uva_tokens =
        static_cast<int32_t>(std::clamp<double>(std::llround(tokens_ * std::min(opt_.uva_share, 1.0)), 0, tokens_));
  }
  b.uva_tokens = uva_tokens;
  b.host_tokens = tokens_ - uva_tokens;
  b.host_items = static_cast<int64_t>(b.host_tokens) * n_cols_;
  b.uva_items = items - b.host_items;
  return b;
}

absl::Status HostGather::LaunchUvaShare(const LayerBatch& b, bool serial) {
  if (b.uva_tokens > 0) {
    // Its ids packed after the host part's index in the pinned buffer, then to the device; the GPU starts at once.
    int32_t* packed = pinned_index_[b.li] + b.host_items;
    const int32_t* src = ids_ + static_cast<int64_t>(b.l) * n_cols_;
    auto pack = [&](int64_t t_begin, int64_t t_end) {
      for (int64_t t = t_begin; t < t_end; ++t) {
        std::memcpy(packed + t * n_cols_, src + (b.host_tokens + t) * stride_, static_cast<size_t>(n_cols_) * 4);
      }
    };
    if (serial) {
      pack(0, b.uva_tokens);
    } else {
      const int P = pool_->threads();
      pool_->Run([&](int w) {
        const Range r = SplitRange(b.uva_tokens, P, w);
        pack(r.begin, r.end);
      });
    }
    RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(uva_, done_[b.li], 0), "uva waits for previous unpack"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev_index_[b.li] + b.host_items, packed,
                                               static_cast<size_t>(b.uva_items) * 4, cudaMemcpyHostToDevice, uva_),
                               "uva ids copy"));
    const HostLayer& layer = layers_[b.li];
    kernels::LookupArgs u;
    u.records = layer.device_records;
    u.row_begin = layer.row_begin;
    u.row_end = layer.row_end;
    u.head_dim = head_dim_;
    u.ids = dev_index_[b.li] + b.host_items;
    u.num_tokens = b.uva_tokens;
    u.num_cols = n_cols_;
    u.ids_stride = n_cols_;
    u.out = out_[b.li] + b.host_items * head_dim_;
    u.sort_scratch = sort_scratch_;
    u.sort_scratch_bytes = sort_bytes_;
    u.sort_min_items = opt_.uva_sort_min_items;
    u.max_blocks = opt_.uva_blocks;
    RETURN_IF_ERROR(CudaStatus(kernels::LaunchLookup(u, uva_), "uva share lookup"));
  }
  if (uva_ok_) RETURN_IF_ERROR(CudaStatus(cudaEventRecord(uva_done_[b.li], uva_), "record uva event"));
  return absl::OkStatus();
}

absl::Status HostGather::GatherPass(const LayerBatch& b, bool fused, bool uva_in_pass) {
  const HostLayer& layer = layers_[b.li];
  const GatherPlan& plan = plans_[b.li];
  const int32_t* layer_ids = ids_ + static_cast<int64_t>(b.l) * n_cols_;
  int64_t chunk = PlanChunkRows(plan.n_rows, pool_->threads(), opt_.min_chunk_rows, opt_.max_chunk_rows);
  // Whole groups of 8 rows (8 x 264 B = 33 cache lines): no two threads write one line of the staging.
  constexpr int64_t kGrain = 8;
  if (chunk > kGrain) chunk = (chunk + kGrain - 1) / kGrain * kGrain;
  const int64_t n_chunks = chunk > 0 ? (plan.n_rows + chunk - 1) / chunk : 0;
  const GatherCopy how{opt_.prefetch_rows, opt_.stream_stores > 0};
  uint8_t* const staging = pinned_rows_[b.li];
  uint32_t* const rows = plans_[b.li].rows.data();
  auto gather_chunk = [&](int64_t c) {
    const int64_t begin = c * chunk, end = std::min(plan.n_rows, begin + chunk);
    if (fused) {
      PlanIdentityRange(layer_ids, n_cols_, stride_, layer.row_begin, layer.row_end, begin, end, rows,
                        pinned_index_[b.li]);
    }
    GatherRecords(layer.records, rb_, rows, begin, end, staging, how);
  };
  auto copy_rows = [&](int64_t first_chunk, int64_t end_chunk) {
    const int64_t begin = first_chunk * chunk, end = std::min(plan.n_rows, end_chunk * chunk);
    return cudaMemcpyAsync(dev_rows_[b.li] + begin * rb_, staging + begin * rb_,
                           static_cast<size_t>((end - begin) * rb_), cudaMemcpyHostToDevice, copy_);
  };
  std::atomic<int64_t> next{0};
  std::atomic<int> failed{0};
  const auto pass_start = std::chrono::steady_clock::now();
  absl::Status uva_status;
  if (opt_.copy_issuer > 0) {
    // The threads only gather; this thread launches the UVA share, then hands each run of finished chunks (in
    // order) to the copy engine.
    for (int64_t c = 0; c < n_chunks; ++c) chunk_done_[static_cast<size_t>(c)].store(0, std::memory_order_relaxed);
    pool_->Run(
        [&](int) {
          for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            gather_chunk(c);
            chunk_done_[static_cast<size_t>(c)].store(1, std::memory_order_release);
          }
        },
        [&] {
          if (uva_in_pass) uva_status = LaunchUvaShare(b, true);
          int64_t issued = 0;
          while (issued < n_chunks) {
            int64_t e = issued;
            while (e < n_chunks && chunk_done_[static_cast<size_t>(e)].load(std::memory_order_acquire) != 0) ++e;
            if (e == issued || (e < n_chunks && (e - issued) * chunk < opt_.issue_min_rows)) {
              CpuRelax();
              continue;
            }
            if (copy_rows(issued, e) != cudaSuccess) {
              failed.store(1);
              return;
            }
            issued = e;
          }
        });
  } else {
    const int device = device_;
    pool_->Run([&](int) {
      cudaSetDevice(device);
      for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
        gather_chunk(c);
        if (copy_rows(c, c + 1) != cudaSuccess) failed.store(1);
      }
    });
  }
  stats_[b.li].gather_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - pass_start).count();
  RETURN_IF_ERROR(uva_status);
  if (failed.load() != 0) return absl::InternalError("host gather: a chunk copy failed to enqueue");
  return absl::OkStatus();
}

absl::Status HostGather::RunLayer(int32_t l) {
  const LayerBatch b = SplitBatch(l);
  const size_t li = b.li;
  const HostLayer& layer = layers_[li];
  // The pinned staging of this layer is free once the previous batch's copies out of it are done; the device rows
  // (and ids) once the previous batch's unpack has read them.
  RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(copied_[li]), "previous copies"));
  if (uva_ok_) RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(uva_done_[li]), "previous uva share"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(copy_, done_[li], 0), "previous unpack"));
  // With copy_issuer the UVA share is launched by the dispatcher at the start of the gather pass (no pass of its
  // own); otherwise the pool packs its ids first.
  const bool uva_in_pass = opt_.copy_issuer > 0;
  if (!uva_in_pass) RETURN_IF_ERROR(LaunchUvaShare(b, false));
  // Fused: no planning pass; each thread plans the chunk it is about to gather (item order).
  GatherPlan& plan = plans_[li];
  const bool fused = opt_.fused > 0;
  if (fused) {
    plan.n_rows = b.host_items;
  } else {
    RETURN_IF_ERROR(PlanIdentity(ids_ + static_cast<int64_t>(l) * n_cols_, b.host_tokens, n_cols_, stride_,
                                 layer.row_begin, layer.row_end, *pool_, pinned_index_[li], &plan));
  }
  stats_[li] = {b.host_items + b.uva_items, plan.n_rows + b.uva_items, b.uva_items};
  auto copy_index = [&] {
    if (b.host_items == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(dev_index_[li], pinned_index_[li], static_cast<size_t>(b.host_items) * 4,
                                      cudaMemcpyHostToDevice, copy_),
                      "index copy");
  };
  if (!fused) RETURN_IF_ERROR(copy_index());
  RETURN_IF_ERROR(GatherPass(b, fused, uva_in_pass));
  if (fused) RETURN_IF_ERROR(copy_index());
  RETURN_IF_ERROR(CudaStatus(cudaEventRecord(copied_[li], copy_), "record copy event"));
  // The unpack: the lookup kernel over the dense gathered rows, item i reading row index[i] (-1: zeros).
  RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(unpack_, copied_[li], 0), "unpack waits for copies"));
  kernels::LookupArgs a;
  a.records = dev_rows_[li];
  a.row_begin = 0;
  a.row_end = plan.n_rows;
  a.head_dim = head_dim_;
  a.ids = dev_index_[li];
  a.num_tokens = b.host_tokens;
  a.num_cols = n_cols_;
  a.ids_stride = n_cols_;
  a.out = out_[li];
  a.max_blocks = opt_.unpack_blocks;
  RETURN_IF_ERROR(CudaStatus(kernels::LaunchLookup(a, unpack_), "unpack kernel"));
  if (b.uva_tokens > 0) RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(unpack_, uva_done_[li], 0), "join uva share"));
  return CudaStatus(cudaEventRecord(done_[li], unpack_), "record layer event");
}

}  // namespace engram::client
