// The lookup kernels (plain and row-order gathers, bf16 and packed outputs), the row-order tuning and the launch
// (kernels/engram_kernels.h has the contract; docs/math.md the definition). One kernel family kept whole: the
// variants share their geometry, helpers and launch choice.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cub/device/device_radix_sort.cuh>
#include <mutex>
#include <vector>

#include "kernels/alignment.h"
#include "kernels/engram_kernels.h"
#include "model/fast_mod.h"
#include "model/fp8.h"

namespace engram::kernels {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Lookup: one warp per (token, column) item, kRows items in flight per warp, a persistent grid-stride loop.
// Fast path: records whose size is a multiple of 8 bytes (head_dim a multiple of 256): each lane moves 8-byte words.

constexpr int kWarpsPerBlock = 8;
constexpr int kRows = 4;
// The row-order gather's defaults (LookupTuning), measured on the H200 (bench/RESULTS.md, 2026-11-30), random
// rows of a 16 GiB host table, a fresh batch of ids per call. Grid: few rows in flight keep the gather within a
// narrow span of the table and translate far faster than the persistent grid (1M rows: 16 blocks of 8 warps x 8
// rows 38.1 GB/s, 1056 blocks 33.0; 196K rows: 14.9 vs 11.2; 24K rows: 14.5 vs 10.2). Threshold: on that grid the
// sorted gather beats the plain kernel from 24K rows (14.1 vs 9.1 GB/s); at 6K rows the plain kernel is as fast
// or faster (10.1 vs 8.6 GB/s), and a batch repeated call after call is faster plain (its rows stay in L2).
constexpr int64_t kDefaultSortMinItems = 12288;
constexpr int32_t kDefaultSortVariant = 1;
constexpr int32_t kDefaultSortBlocks = 16;

struct LookupGeometry {
  int64_t items;  // T * C
  int32_t words;  // head_dim / 8: 8-value chunks per row
  int32_t rec_bytes;
  // Sorted order (optional): position p reads row sorted_rows[p] (relative to row_begin; `sentinel` = not owned)
  // and writes item sorted_items[p].
  const uint32_t* sorted_rows = nullptr;
  const uint32_t* sorted_items = nullptr;
  uint32_t sentinel = 0;
  bool packed_words = false;  // packed rows copied in 8-byte words (record size, output alignment and stride allow)
};

// The id of item = t * num_cols + c. Contiguous ids need no division; strided ones use a 32-bit division (items
// stay below 2^31, checked by the launcher), far cheaper than a 64-bit one.
__device__ __forceinline__ int64_t ItemId(const LookupArgs& a, int64_t item) {
  int64_t at = item;
  if (a.ids_stride != a.num_cols) {
    const uint32_t i = static_cast<uint32_t>(item), cols = static_cast<uint32_t>(a.num_cols);
    const uint32_t t = i / cols, c = i - t * cols;
    at = static_cast<int64_t>(t) * a.ids_stride + c;
  }
  return a.ids64 != nullptr ? a.ids64[at] : a.ids[at];
}

// Where item = t * num_cols + c starts in the output, in `unit`s (bf16 values or bytes) of `row` per row.
__device__ __forceinline__ int64_t OutIndex(const LookupArgs& a, int64_t item, int64_t row) {
  if (a.out_token_stride == 0) return item * row;
  const uint32_t i = static_cast<uint32_t>(item), cols = static_cast<uint32_t>(a.num_cols);
  const uint32_t t = i / cols, c = i - t * cols;
  return static_cast<int64_t>(t) * a.out_token_stride + static_cast<int64_t>(c) * row;
}

// Position p of the gather: the row to read (relative to row_begin, -1 when not owned) and the item to write.
__device__ __forceinline__ int64_t RowAt(const LookupArgs& a, const LookupGeometry& g, int64_t p, int64_t* item) {
  if (g.sorted_rows != nullptr) {
    *item = g.sorted_items[p];
    const uint32_t r = g.sorted_rows[p];
    return r == g.sentinel ? -1 : static_cast<int64_t>(r);
  }
  *item = p;
  const int64_t id = ItemId(a, p);
  return id >= a.row_begin && id < a.row_end ? id - a.row_begin : -1;
}

// Keys for the sorted gather: owned rows relative to row_begin, everything else the sentinel (sorted last).
__global__ void SortKeysKernel(LookupArgs a, int64_t items, uint32_t sentinel, uint32_t* keys, uint32_t* vals) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= items) return;
  const int64_t id = ItemId(a, p);
  keys[p] = id >= a.row_begin && id < a.row_end ? static_cast<uint32_t>(id - a.row_begin) : sentinel;
  vals[p] = static_cast<uint32_t>(p);
}

// 8 e4m3 values times one ue8m0 scale, rounded to bf16. On sm_89+ the conversions are the hardware's (e4m3x2 ->
// f16x2 is exact, f32x2 -> bf16x2 rounds to nearest even and makes every NaN 0x7FFF): the same bits as the
// portable path below and the CPU reference (model/fp8.h).
__device__ __forceinline__ uint4 Dequant8(uint64_t w, uint8_t scale_byte) {
  const float scale = Ue8m0ToFloat(scale_byte);
  uint32_t packed[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * k)), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
    packed[k] = *reinterpret_cast<const uint32_t*>(&b);
#else
    const uint16_t lo = FloatToBf16(E4M3ToFloat(static_cast<uint8_t>(w >> (16 * k))) * scale);
    const uint16_t hi = FloatToBf16(E4M3ToFloat(static_cast<uint8_t>(w >> (16 * k + 8))) * scale);
    packed[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
#endif
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// Words per lane known at compile time (1 for head_dim 256, 2 for 512); kR rows in flight per warp. kRuns: each
// block walks one contiguous run of positions (for the row-order gather: one region of the table per block) instead
// of the grid-stride interleave.
template <int kWordsPerLane, int kR, bool kRuns>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) LookupWordsKernel(LookupArgs a, LookupGeometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t D = a.head_dim;
  int64_t start, end, step;
  if (kRuns) {
    constexpr int64_t per = kWarpsPerBlock * kR;
    const int64_t run = ((g.items + gridDim.x - 1) / gridDim.x + per - 1) / per * per;
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * run;
    start = begin + (threadIdx.x >> 5) * kR;
    end = begin + run < g.items ? begin + run : g.items;
    step = per;
  } else {
    start = warp * kR;
    end = g.items;
    step = n_warps * kR;
  }
  for (int64_t first = start; first < end; first += step) {
    int64_t row[kR], item[kR];
    bool owned[kR];
    uint64_t w[kR][kWordsPerLane];
    uint8_t sc[kR][kWordsPerLane];
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      const int64_t r = first + k < end ? RowAt(a, g, first + k, &item[k]) : -1;
      owned[k] = r >= 0;
      row[k] = owned[k] ? r : 0;
    }
    // Issue every load before the first use.
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      const uint8_t* rec = a.records + row[k] * g.rec_bytes;
#pragma unroll
      for (int j = 0; j < kWordsPerLane; ++j) {
        const int word = lane + 32 * j;
        if (owned[k] && word < g.words) {
          w[k][j] = *reinterpret_cast<const uint64_t*>(rec + 8 * word);
          sc[k][j] = rec[D + word / 4];
        } else {
          w[k][j] = 0;
          sc[k][j] = 0;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      if (first + k >= end) break;
      uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.out) + OutIndex(a, item[k], D));
#pragma unroll
      for (int j = 0; j < kWordsPerLane; ++j) {
        const int word = lane + 32 * j;
        if (word < g.words) dst[word] = owned[k] ? Dequant8(w[k][j], sc[k][j]) : make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// Packed rows: copy the record bytes (8-byte words when the record size allows, else bytes).
__global__ void __launch_bounds__(kWarpsPerBlock * 32) LookupPackedKernel(LookupArgs a, LookupGeometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const bool words = g.packed_words;
  for (int64_t first = warp * kRows; first < g.items; first += n_warps * kRows) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (first + k >= g.items) break;
      int64_t item;
      const int64_t r = RowAt(a, g, first + k, &item);
      const bool owned = r >= 0;
      const uint8_t* rec = a.records + (owned ? r : 0) * g.rec_bytes;
      uint8_t* dst = static_cast<uint8_t*>(a.out) + OutIndex(a, item, g.rec_bytes);
      if (words) {
        for (int j = lane; j < g.rec_bytes / 8; j += 32) {
          reinterpret_cast<uint64_t*>(dst)[j] = owned ? reinterpret_cast<const uint64_t*>(rec)[j] : 0;
        }
      } else {
        for (int j = lane; j < g.rec_bytes; j += 32) dst[j] = owned ? rec[j] : 0;
      }
    }
  }
}

// Packed rows in 8-byte words with kR rows in flight per warp (every load issued before the first store), for
// records of up to 32 * kWordsPerLane words (head_dim 256: 33 words, 2 per lane).
template <int kWordsPerLane, int kR>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) LookupPackedWordsKernel(LookupArgs a, LookupGeometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int words = g.rec_bytes / 8;
  for (int64_t first = warp * kR; first < g.items; first += n_warps * kR) {
    int64_t item[kR];
    const uint64_t* rec[kR];
    bool owned[kR];
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      const int64_t r = first + k < g.items ? RowAt(a, g, first + k, &item[k]) : -1;
      owned[k] = r >= 0;
      rec[k] = reinterpret_cast<const uint64_t*>(a.records + (owned[k] ? r : 0) * g.rec_bytes);
    }
    uint64_t w[kR][kWordsPerLane];
#pragma unroll
    for (int k = 0; k < kR; ++k) {
#pragma unroll
      for (int j = 0; j < kWordsPerLane; ++j) {
        const int word = lane + 32 * j;
        w[k][j] = owned[k] && word < words ? rec[k][word] : 0;
      }
    }
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      if (first + k >= g.items) break;
      uint64_t* dst = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(a.out) + OutIndex(a, item[k], g.rec_bytes));
#pragma unroll
      for (int j = 0; j < kWordsPerLane; ++j) {
        const int word = lane + 32 * j;
        if (word < words) dst[word] = w[k][j];
      }
    }
  }
}

// Any head_dim (multiple of 32) whose record is not 8-byte sized: byte loads, 8 values per lane chunk.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) LookupBytesKernel(LookupArgs a, LookupGeometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t D = a.head_dim;
  for (int64_t p = warp; p < g.items; p += n_warps) {
    int64_t item;
    const int64_t r = RowAt(a, g, p, &item);
    const bool owned = r >= 0;
    const uint8_t* rec = a.records + (owned ? r : 0) * g.rec_bytes;
    uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.out) + OutIndex(a, item, D));
    for (int word = lane; word < g.words; word += 32) {
      uint64_t w = 0;
      if (owned) {
        for (int b = 0; b < 8; ++b) w |= static_cast<uint64_t>(rec[8 * word + b]) << (8 * b);
      }
      dst[word] = owned ? Dequant8(w, rec[D + word / 4]) : make_uint4(0, 0, 0, 0);
    }
  }
}

struct TuningState {
  std::atomic<int64_t> sort_min_items{kDefaultSortMinItems};
  std::atomic<int32_t> sort_variant{kDefaultSortVariant};
  std::atomic<int32_t> sort_blocks{kDefaultSortBlocks};
  std::atomic<bool> sort_only{false};
  std::atomic<int32_t> plain_rows{kRows};
  std::atomic<int32_t> plain_block_warps{kWarpsPerBlock};
  std::atomic<int64_t> decode_items{1536};
  std::atomic<int32_t> decode_rows{1};
  std::atomic<int32_t> decode_block_warps{4};
};

bool Pow2UpTo8(int32_t v) { return v == 1 || v == 2 || v == 4 || v == 8; }

TuningState& Tuning() {
  static TuningState state;
  return state;
}

// The kernel of a launch: the row-order variants (1-3) as LookupTuning::sort_variant names them; variant 0, the
// plain gather, with `rows` in flight per warp (1, 2, 4, 8).
template <int kW>
const void* WordsKernelFor(int variant, int rows) {
  switch (variant) {
    case 1: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 8, false>);
    case 2: return reinterpret_cast<const void*>(LookupWordsKernel<kW, kRows, true>);
    case 3: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 8, true>);
    default: break;
  }
  switch (rows) {
    case 1: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 1, false>);
    case 2: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 2, false>);
    case 8: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 8, false>);
    default: return reinterpret_cast<const void*>(LookupWordsKernel<kW, kRows, false>);
  }
}

template <int kWpl>
const void* PackedWordsKernelFor(int rows) {
  switch (rows) {
    case 1: return reinterpret_cast<const void*>(LookupPackedWordsKernel<kWpl, 1>);
    case 2: return reinterpret_cast<const void*>(LookupPackedWordsKernel<kWpl, 2>);
    case 8: return reinterpret_cast<const void*>(LookupPackedWordsKernel<kWpl, 8>);
    default: return reinterpret_cast<const void*>(LookupPackedWordsKernel<kWpl, kRows>);
  }
}

}  // namespace

LookupTuning GetLookupTuning() {
  LookupTuning t;
  t.sort_min_items = Tuning().sort_min_items.load();
  t.sort_variant = Tuning().sort_variant.load();
  t.sort_blocks = Tuning().sort_blocks.load();
  t.sort_only = Tuning().sort_only.load();
  t.plain_rows = Tuning().plain_rows.load();
  t.plain_block_warps = Tuning().plain_block_warps.load();
  t.decode_items = Tuning().decode_items.load();
  t.decode_rows = Tuning().decode_rows.load();
  t.decode_block_warps = Tuning().decode_block_warps.load();
  return t;
}

void SetLookupTuning(const LookupTuning& t) {
  Tuning().sort_min_items.store(t.sort_min_items);
  Tuning().sort_variant.store(std::clamp(t.sort_variant, 0, 3));
  Tuning().sort_blocks.store(std::max(t.sort_blocks, 0));
  Tuning().sort_only.store(t.sort_only);
  if (Pow2UpTo8(t.plain_rows)) Tuning().plain_rows.store(t.plain_rows);
  if (Pow2UpTo8(t.plain_block_warps)) Tuning().plain_block_warps.store(t.plain_block_warps);
  Tuning().decode_items.store(std::max<int64_t>(t.decode_items, 0));
  if (Pow2UpTo8(t.decode_rows)) Tuning().decode_rows.store(t.decode_rows);
  if (Pow2UpTo8(t.decode_block_warps)) Tuning().decode_block_warps.store(t.decode_block_warps);
}

bool ValidPlainShape(int32_t rows, int32_t block_warps) {
  return (rows == 0 || Pow2UpTo8(rows)) && (block_warps == 0 || Pow2UpTo8(block_warps));
}

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
