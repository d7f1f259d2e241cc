// The lookup's gather kernels (kernels/engram_kernels.h has the contract; docs/math.md the definition): one warp
// per (token, column) item, rows in flight per warp, a persistent grid-stride loop, in item order or in the row order
// of sorted (row, item) pairs. Variants: bf16 rows dequantised from 8-byte words (head_dim 256 or 512) or from bytes
// (any head_dim), and packed records copied in words or bytes. WordsKernelFor / PackedWordsKernelFor name the
// instantiation a launch takes.
//
// Included by lookup_kernels.cu alone: the kernels are compiled whole-program (no separable compilation), so they
// live in the launching translation unit, with internal linkage. Stateless; the kernels read the records and ids
// and write only their items' output rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/engram_kernels.h"
#include "kernels/lookup_shape.h"
#include "model/fp8.h"

namespace engram::kernels {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Lookup: one warp per (token, column) item, kRows items in flight per warp, a persistent grid-stride loop.
// Fast path: records whose size is a multiple of 8 bytes (head_dim a multiple of 256): each lane moves 8-byte words.

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
}  // namespace engram::kernels
