// The lookup's launch (kernels/engram_kernels.h has the contract): the checks of a launch's arguments, the
// row-order sort of (row, item) pairs when it pays, the choice of gather kernel and shape (kernels/lookup_gather.cuh)
// and the persistent grid, from the SM count and resident blocks looked up once per device and kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <mutex>
#include <vector>

#include "kernels/alignment.h"
#include "kernels/engram_kernels.h"
#include "kernels/lookup_gather.cuh"
#include "kernels/lookup_shape.h"

namespace engram::kernels {

size_t LookupSortScratchBytes(int64_t max_items) {
  if (max_items <= 0 || max_items >= (int64_t{1} << 31)) return 0;
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                  static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                  static_cast<int>(max_items), 0, 32);
  const size_t arr = (static_cast<size_t>(max_items) * 4 + 255) / 256 * 256;
  return 4 * arr + temp;
}

namespace {

// Per launch, the SM count and a kernel's resident blocks per SM are looked up once per (device, kernel, block)
// and kept: the queries cost the host microseconds, which an eager decode-size launch would otherwise wait for.
struct LaunchFacts {
  int device;
  const void* fn;
  int threads;
  int value;  // SMs (fn == nullptr) or resident blocks per SM
};
std::mutex facts_mu;
std::vector<LaunchFacts>& Facts() {
  static std::vector<LaunchFacts> facts;
  return facts;
}

int Fact(const void* fn, int threads) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  {
    std::lock_guard<std::mutex> lock(facts_mu);
    for (const LaunchFacts& f : Facts()) {
      if (f.device == dev && f.fn == fn && f.threads == threads) return f.value;
    }
  }
  int v = 0;
  const cudaError_t e = fn == nullptr ? cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev)
                                      : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, fn, threads, 0);
  if (e != cudaSuccess || v < 1) {
    (void)cudaGetLastError();  // a failed query is not a launch's error
    return 1;
  }
  std::lock_guard<std::mutex> lock(facts_mu);
  if (Facts().size() < 4096) Facts().push_back({dev, fn, threads, v});
  return v;
}

}  // namespace

int DeviceSmCount() { return Fact(nullptr, 0); }

cudaError_t LaunchLookup(const LookupArgs& a, cudaStream_t stream) {
  if (a.head_dim < 32 || a.head_dim % 32 != 0 || a.num_tokens < 0 || a.num_cols < 1 || a.row_end < a.row_begin ||
      a.ids_stride < a.num_cols || !ValidPlainShape(a.plain_rows, a.plain_block_warps)) {
    return cudaErrorInvalidValue;
  }
  const int64_t items = static_cast<int64_t>(a.num_tokens) * a.num_cols;
  if (items == 0) return cudaSuccess;
  if (items >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if ((a.ids == nullptr && a.ids64 == nullptr) || a.out == nullptr ||
      (a.records == nullptr && a.row_end > a.row_begin)) {
    return cudaErrorInvalidValue;
  }
  LookupGeometry g{items, a.head_dim / 8, a.head_dim + a.head_dim / 32};
  const LookupTuning tuning = GetLookupTuning();
  int variant = 0;  // the plain (item-order) gather always takes the grid-stride kernel
  int64_t grid_cap = a.max_blocks;
  const int64_t sort_min_items = a.sort_min_items >= 0 ? a.sort_min_items : tuning.sort_min_items;
  bool sort = a.sort_scratch != nullptr && items >= std::max<int64_t>(sort_min_items, 1);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (sort && a.records != nullptr && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusNone) {
    // Records in HBM need no row order (nor the small grid): only a host table's address translation does. (Not
    // asked under graph capture, where the launch keeps the row order.)
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, a.records) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query (an unknown pointer) is not the launch's error
    } else if (attr.type == cudaMemoryTypeDevice) {
      sort = false;
    }
  }
  if (sort) {
    // Sort (row, item) pairs by row so that the gather walks the table in address order.
    const int64_t count = a.row_end - a.row_begin;
    if (count >= 0xFFFFFFFFll) return cudaErrorInvalidValue;
    const uint32_t sentinel = static_cast<uint32_t>(count);
    int end_bit = 1;
    while (end_bit < 32 && (uint64_t{1} << end_bit) <= sentinel) ++end_bit;
    const size_t arr = (static_cast<size_t>(items) * 4 + 255) / 256 * 256;
    auto* base = static_cast<uint8_t*>(a.sort_scratch);
    auto* keys_in = reinterpret_cast<uint32_t*>(base);
    auto* keys_out = reinterpret_cast<uint32_t*>(base + arr);
    auto* vals_in = reinterpret_cast<uint32_t*>(base + 2 * arr);
    auto* vals_out = reinterpret_cast<uint32_t*>(base + 3 * arr);
    size_t temp = 0;
    cub::DeviceRadixSort::SortPairs(nullptr, temp, keys_in, keys_out, vals_in, vals_out, static_cast<int>(items), 0,
                                    end_bit, stream);
    if (4 * arr + temp > a.sort_scratch_bytes) return cudaErrorInvalidValue;
    SortKeysKernel<<<static_cast<unsigned>((items + 255) / 256), 256, 0, stream>>>(a, items, sentinel, keys_in,
                                                                                   vals_in);
    if (cudaError_t e = cub::DeviceRadixSort::SortPairs(base + 4 * arr, temp, keys_in, keys_out, vals_in, vals_out,
                                                        static_cast<int>(items), 0, end_bit, stream);
        e != cudaSuccess) {
      return e;
    }
    g.sorted_rows = keys_out;
    g.sorted_items = vals_out;
    g.sentinel = sentinel;
    if (tuning.sort_only) return cudaGetLastError();
    variant = tuning.sort_variant;
    if (grid_cap <= 0) grid_cap = tuning.sort_blocks;
  }
  if (!a.packed && (!Aligned(a.out, 16) || a.out_token_stride % 8 != 0)) return cudaErrorInvalidValue;
  if (a.out_token_stride != 0 &&
      a.out_token_stride < static_cast<int64_t>(a.num_cols) * (a.packed ? g.rec_bytes : a.head_dim)) {
    return cudaErrorInvalidValue;
  }
  g.packed_words = g.rec_bytes % 8 == 0 && Aligned(a.records, 8) && Aligned(a.out, 8) && a.out_token_stride % 8 == 0;
  // Rows in flight per warp and warps per block: the row-order variants fix their own (8 warps; 4 or 8 rows); the
  // plain gather takes the launch's shape, else the tuning's.
  const bool wide = variant == 1 || variant == 3;
  const bool decode = items <= tuning.decode_items;
  int rows_per_warp = variant != 0       ? (wide ? 8 : kRows)
                      : a.plain_rows > 0 ? a.plain_rows
                      : decode           ? tuning.decode_rows
                                         : tuning.plain_rows;
  const int block_warps = variant != 0              ? kWarpsPerBlock
                          : a.plain_block_warps > 0 ? a.plain_block_warps
                          : decode                  ? tuning.decode_block_warps
                                                    : tuning.plain_block_warps;
  // Packed rows of head_dim 256 or 512 in words (several rows in flight per warp); other packed records one row
  // at a time per warp (kRows per grid-stride step).
  const int packed_wpl = !g.packed_words         ? 0
                         : g.rec_bytes / 8 <= 32 ? 1
                         : g.rec_bytes / 8 <= 64 ? 2
                         : g.rec_bytes / 8 <= 96 ? 3
                                                 : 0;
  const bool words = g.rec_bytes % 8 == 0 && Aligned(a.records, 8);
  const void* fn = a.packed                       ? (packed_wpl == 1   ? PackedWordsKernelFor<1>(rows_per_warp)
                                                     : packed_wpl == 2 ? PackedWordsKernelFor<2>(rows_per_warp)
                                                     : packed_wpl == 3 ? PackedWordsKernelFor<3>(rows_per_warp)
                                                                       : reinterpret_cast<const void*>(LookupPackedKernel))
                   : (words && a.head_dim == 256) ? WordsKernelFor<1>(variant, rows_per_warp)
                   : (words && a.head_dim == 512) ? WordsKernelFor<2>(variant, rows_per_warp)
                                                  : reinterpret_cast<const void*>(LookupBytesKernel);
  const bool one_row_kernels =
      (a.packed && packed_wpl == 0) || (!a.packed && !(words && (a.head_dim == 256 || a.head_dim == 512)));
  if (one_row_kernels) rows_per_warp = 1;  // (LookupPackedKernel steps kRows items per warp, one at a time)
  const int64_t per_warp = a.packed && packed_wpl == 0 ? kRows : rows_per_warp;
  const int64_t warps_needed = (items + per_warp - 1) / per_warp;
  int64_t blocks = (warps_needed + block_warps - 1) / block_warps;
  // Persistent grid: exactly the blocks that fit at once (more would run as a second, partial wave).
  const int per_sm = Fact(fn, block_warps * 32);
  const int64_t persistent = static_cast<int64_t>(DeviceSmCount()) * std::max(per_sm, 1);
  blocks = std::min(blocks, a.max_blocks > 0 ? grid_cap : grid_cap > 0 ? std::min(grid_cap, persistent) : persistent);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(blocks, 1))), block(block_warps * 32);
  void* params[] = {const_cast<LookupArgs*>(&a), &g};
  if (cudaError_t e = cudaLaunchKernel(fn, grid, block, params, 0, stream); e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace engram::kernels
