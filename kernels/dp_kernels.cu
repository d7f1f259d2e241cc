// Implementation of kernels/dp_kernels.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/alignment.h"
#include "kernels/dp_kernels.h"
#include "kernels/engram_kernels.h"
#include "model/fp8.h"

namespace engram::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kRows = 4;  // rows in flight per warp (their loads are issued before the first use)

// 8 e4m3 bytes of a record (8-byte aligned or not).
__device__ __forceinline__ uint64_t LoadWord(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) v |= static_cast<uint64_t>(p[k]) << (8 * k);
  return v;
}

// 8 e4m3 values times one ue8m0 scale as bf16. On sm_89+ with the hardware's conversions: e4m3x2 -> f16x2 and
// f16 -> f32 are exact, the product is the same IEEE single multiply, and f32x2 -> bf16x2 rounds to nearest even and
// makes every NaN 0x7FFF, exactly as model/fp8.h's FloatToBf16: the same bits as DequantBf16 (the portable path).
__device__ __forceinline__ uint4 Dequant8(uint64_t v, uint8_t scale_byte) {
  uint32_t packed[4];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float scale = Ue8m0ToFloat(scale_byte);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v >> (16 * k)), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
    packed[k] = *reinterpret_cast<const uint32_t*>(&b);
  }
#else
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t lo = DequantBf16(static_cast<uint8_t>(v >> (16 * k)), scale_byte);
    const uint16_t hi = DequantBf16(static_cast<uint8_t>(v >> (16 * k + 8)), scale_byte);
    packed[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
#endif
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// kRows rows of one warp: rec[k] (null: a zero row) dequantised into dst[k] (null: no row). kJ words of 8 values
// per lane (head_dim <= 256 * kJ); every load is issued before the first store.
template <int kJ>
__device__ __forceinline__ void DequantRows(const uint8_t* const (&rec)[kRows], uint16_t* const (&dst)[kRows],
                                            int32_t D, int lane, bool aligned) {
  const int32_t words = D / 8;
  uint64_t w[kRows][kJ];
  uint8_t sc[kRows][kJ];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const int32_t word = lane + 32 * j;
      if (rec[k] != nullptr && word < words) {
        w[k][j] = LoadWord(rec[k] + 8 * word, aligned);
        sc[k][j] = rec[k][D + word / 4];
      } else {
        w[k][j] = 0;
        sc[k][j] = 0;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if (dst[k] == nullptr) continue;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const int32_t word = lane + 32 * j;
      if (word < words) {
        reinterpret_cast<uint4*>(dst[k])[word] =
            rec[k] != nullptr ? Dequant8(w[k][j], sc[k][j]) : make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// kRows (token, layer, column) items per warp and iteration (grid-stride).
template <int kJ>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) PeerGatherKernel(PeerGatherArgs a, int64_t items, bool aligned) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t gcb = a.col_begin[0], gc = a.col_begin[a.members] - gcb;
  const int32_t D = a.head_dim, rec_bytes = D + D / 32;
  const int64_t live = a.live_tokens != nullptr ? *a.live_tokens : a.num_tokens;
  for (int64_t first = warp * kRows; first < items; first += n_warps * kRows) {
    const uint8_t* rec[kRows];
    uint16_t* dst[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      rec[k] = nullptr;
      dst[k] = nullptr;
      const int64_t item = first + k;
      if (item >= items) continue;
      const int32_t c = gcb + static_cast<int32_t>(item % gc);
      const int64_t rest = item / gc;
      const int32_t li = static_cast<int32_t>(rest % a.layers);
      const int64_t t = rest / a.layers;
      if (t >= live) continue;
      int32_t s = 0;
      while (s + 1 < a.members && c >= a.col_begin[s + 1]) ++s;
      const int64_t id = a.ids[t * a.token_stride + li * a.layer_stride + c];
      if (id >= a.row_begin[s][li] && id < a.row_end[s][li]) {
        rec[k] = a.records[s][li] + (id - a.row_begin[s][li]) * rec_bytes;
      }
      dst[k] = a.out[li] + (t * a.cols + c) * D;
    }
    DequantRows<kJ>(rec, dst, D, lane, aligned);
  }
}

__global__ void DpSplitIdsKernel(DpSplitIdsArgs a, int64_t items) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= items) return;
  const int32_t gcb = a.col_begin[0], gc = a.col_begin[a.members] - gcb;
  const int32_t mb = a.col_begin[a.me], own = a.col_begin[a.me + 1] - mb, others = gc - own;
  const int32_t ci = static_cast<int32_t>(x % others);
  const int64_t rest = x / others;
  const int32_t li = static_cast<int32_t>(rest % a.layers);
  const int64_t t = rest / a.layers;
  const int32_t c = gcb + ci < mb ? gcb + ci : gcb + ci + own;
  int32_t p = 0;
  while (p + 1 < a.members && c >= a.col_begin[p + 1]) ++p;
  const int32_t cb = a.col_begin[p], cols_p = a.col_begin[p + 1] - cb;
  const int64_t live = a.live_tokens != nullptr ? min(*a.live_tokens, a.num_tokens) : a.num_tokens;
  a.out[a.out_off[p] + (t * a.layers + li) * cols_p + (c - cb)] =
      t < live ? a.ids[t * a.token_stride + li * a.layer_stride + c] : -1;
}

// kGroup records per warp and iteration, copied as one flat run of W words (the loads of up to 8 words per lane
// issued before their stores). Records this shard does not own are zero.
constexpr int kGroup = 4;

template <typename W>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) DpPackKernel(DpPackArgs a, int64_t items) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t D = a.head_dim, rb = D + D / 32, wpr = rb / static_cast<int32_t>(sizeof(W));
  const int64_t rows = a.row1 - a.row0;
  const int32_t total = kGroup * wpr;
  for (int64_t first = warp * kGroup; first < items; first += n_warps * kGroup) {
    const W* src = nullptr;
    W* dst = nullptr;
    if (lane < kGroup && first + lane < items) {
      const int64_t x = first + lane;
      const int32_t cc = static_cast<int32_t>(x % a.own);
      const int64_t rest = x / a.own;
      const int64_t r = a.row0 + rest % rows;
      const int32_t q = static_cast<int32_t>(rest / rows);
      const int32_t p = q < a.me ? q : q + 1;
      const int32_t li = static_cast<int32_t>(r / a.slot);
      const int64_t t = r - static_cast<int64_t>(li) * a.slot;
      const int64_t id = a.ids[a.ids_off[p] + (t * a.layers + li) * a.own + cc];
      if (id >= a.row_begin[li] && id < a.row_end[li]) {
        src = reinterpret_cast<const W*>(a.records[li] + (id - a.row_begin[li]) * rb);
      }
      dst = reinterpret_cast<W*>(a.out + a.out_off[p] + (r * a.own + cc) * rb);
    }
    for (int32_t base = 0; base < total; base += 8 * 32) {
      W v[8];
      W* d[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int32_t w = base + i * 32 + lane;
        const int32_t g = min(w / wpr, kGroup - 1);
        const W* s = reinterpret_cast<const W*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), g));
        d[i] = reinterpret_cast<W*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), g));
        const int32_t j = w - g * wpr;
        if (w >= total || d[i] == nullptr)
          d[i] = nullptr;
        else
          d[i] += j;
        v[i] = d[i] != nullptr && s != nullptr ? s[j] : W(0);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (d[i] != nullptr) *d[i] = v[i];
      }
    }
  }
}

// Rows [row0, row1) of the given members' blocks, tokens below num_tokens only: `seg` lists per layer the run of
// rows [seg_row[k], seg_row[k] + seg_len[k]) to unpack; items enumerate (row, given column) pairs.
struct UnpackPlan {
  int32_t segs = 0;
  int64_t seg_row[kMaxGatherLayers] = {}, seg_len[kMaxGatherLayers] = {};
  int32_t given_cols = 0;
};

template <int kJ>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    DpUnpackKernel(DpUnpackArgs a, UnpackPlan p, int64_t items, bool aligned) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t D = a.head_dim, rb = D + D / 32;
  const int64_t live = a.live_tokens != nullptr ? *a.live_tokens : a.num_tokens;
  for (int64_t first = warp * kRows; first < items; first += n_warps * kRows) {
    const uint8_t* rec[kRows];
    uint16_t* dst[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      rec[k] = nullptr;
      dst[k] = nullptr;
      const int64_t x = first + k;
      if (x >= items) continue;
      int32_t ci = static_cast<int32_t>(x % p.given_cols);
      int64_t ri = x / p.given_cols;
      int32_t sg = 0;
      while (sg + 1 < p.segs && ri >= p.seg_len[sg]) ri -= p.seg_len[sg++];
      const int64_t r = p.seg_row[sg] + ri;
      const int32_t li = static_cast<int32_t>(r / a.slot);
      const int64_t t = r - static_cast<int64_t>(li) * a.slot;
      if (t >= live) continue;
      int32_t s = 0;
      for (; s < a.members; ++s) {
        if (a.records[s] == nullptr) continue;
        const int32_t cols_s = a.col_begin[s + 1] - a.col_begin[s];
        if (ci < cols_s) break;
        ci -= cols_s;
      }
      const int32_t cols_s = a.col_begin[s + 1] - a.col_begin[s];
      rec[k] = a.records[s] + (r * cols_s + ci) * rb;
      dst[k] = a.out[li] + (t * a.cols + a.col_begin[s] + ci) * D;
    }
    DequantRows<kJ>(rec, dst, D, lane, aligned);
  }
}

__global__ void DpSetTokensKernel(int32_t* dst, int32_t value) { *dst = value; }

bool ColsOk(const int32_t* col_begin, int32_t members, int32_t cols) {
  if (members < 1 || members > kMaxGatherMembers || col_begin[0] < 0 || col_begin[members] > cols ||
      col_begin[members] <= col_begin[0]) {
    return false;
  }
  for (int s = 0; s < members; ++s) {
    if (col_begin[s + 1] < col_begin[s]) return false;
  }
  return true;
}

int WordsPerLane(int32_t head_dim) { return head_dim <= 256 ? 1 : head_dim <= 512 ? 2 : head_dim <= 1024 ? 4 : 0; }

template <typename K, typename... Args>
cudaError_t LaunchRows(int kj, int64_t blocks, cudaStream_t stream, K k1, K k2, K k4, Args... args) {
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(blocks, 1))), block(kWarpsPerBlock * 32);
  (kj == 1 ? k1 : kj == 2 ? k2 : k4)<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchPeerGather(const PeerGatherArgs& a, cudaStream_t stream) {
  if (a.layers < 1 || a.layers > kMaxGatherLayers || a.num_tokens < 0 || a.head_dim < 32 || a.head_dim % 32 != 0 ||
      WordsPerLane(a.head_dim) == 0 || a.cols < 1 || a.ids == nullptr || !ColsOk(a.col_begin, a.members, a.cols)) {
    return cudaErrorInvalidValue;
  }
  // 8-byte loads when every record is 8-byte aligned (records of 264 bytes from an aligned base), else byte loads.
  bool aligned = (a.head_dim + a.head_dim / 32) % 8 == 0;
  for (int s = 0; s < a.members; ++s) {
    for (int l = 0; l < a.layers; ++l) {
      if (a.records[s][l] == nullptr) return cudaErrorInvalidValue;
      aligned = aligned && Aligned(a.records[s][l], 8);
    }
  }
  for (int l = 0; l < a.layers; ++l) {
    if (a.out[l] == nullptr || !Aligned(a.out[l], 16)) return cudaErrorInvalidValue;
  }
  const int64_t items = static_cast<int64_t>(a.num_tokens) * a.layers * (a.col_begin[a.members] - a.col_begin[0]);
  if (items == 0) return cudaSuccess;
  const int64_t cap = a.max_blocks > 0 ? int64_t{a.max_blocks} : int64_t{DeviceSmCount()} * 8;
  const int64_t blocks = std::min<int64_t>((items + kWarpsPerBlock * kRows - 1) / (kWarpsPerBlock * kRows), cap);
  return LaunchRows(WordsPerLane(a.head_dim), blocks, stream, PeerGatherKernel<1>, PeerGatherKernel<2>,
                    PeerGatherKernel<4>, a, items, aligned);
}

cudaError_t LaunchDpSplitIds(const DpSplitIdsArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.slot < a.num_tokens || a.slot < 1 || a.layers < 1 || a.me < 0 || a.me >= a.members ||
      (a.ids == nullptr && a.num_tokens > 0) || a.out == nullptr ||
      !ColsOk(a.col_begin, a.members, a.col_begin[a.members])) {
    return cudaErrorInvalidValue;
  }
  const int32_t others = a.col_begin[a.members] - a.col_begin[0] - (a.col_begin[a.me + 1] - a.col_begin[a.me]);
  const int64_t items = static_cast<int64_t>(a.slot) * a.layers * others;
  if (items == 0) return cudaSuccess;
  DpSplitIdsKernel<<<static_cast<unsigned>((items + 255) / 256), 256, 0, stream>>>(a, items);
  return cudaGetLastError();
}

cudaError_t LaunchDpPack(const DpPackArgs& a, cudaStream_t stream) {
  if (a.members < 1 || a.members > kMaxGatherMembers || a.me < 0 || a.me >= a.members || a.layers < 1 ||
      a.layers > kMaxGatherLayers || a.slot < 1 || a.own < 1 || a.head_dim < 32 || a.head_dim % 32 != 0 ||
      a.ids == nullptr || a.out == nullptr || a.row0 < 0 || a.row1 < a.row0 ||
      a.row1 > static_cast<int64_t>(a.layers) * a.slot) {
    return cudaErrorInvalidValue;
  }
  for (int l = 0; l < a.layers; ++l) {
    if (a.records[l] == nullptr && a.row_end[l] > a.row_begin[l]) return cudaErrorInvalidValue;
  }
  const int32_t rb = a.head_dim + a.head_dim / 32;
  const int64_t items = (a.members - 1) * (a.row1 - a.row0) * a.own;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = (items + kWarpsPerBlock * kGroup - 1) / (kWarpsPerBlock * kGroup);
  // One group of records per warp, no grid-stride loop: short blocks leave SMs to a concurrent NCCL kernel.
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks, 0x7fffffff))), block(kWarpsPerBlock * 32);
  bool a8 = rb % 8 == 0 && Aligned(a.out, 8), a4 = rb % 4 == 0 && Aligned(a.out, 4);
  for (int l = 0; l < a.layers; ++l) {
    a8 = a8 && Aligned(a.records[l], 8);
    a4 = a4 && Aligned(a.records[l], 4);
  }
  for (int p = 0; p < a.members; ++p) {
    a8 = a8 && a.out_off[p] % 8 == 0;
    a4 = a4 && a.out_off[p] % 4 == 0;
  }
  if (a8) {
    DpPackKernel<uint64_t><<<grid, block, 0, stream>>>(a, items);
  } else if (a4) {
    DpPackKernel<uint32_t><<<grid, block, 0, stream>>>(a, items);
  } else {
    DpPackKernel<uint8_t><<<grid, block, 0, stream>>>(a, items);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDpUnpack(const DpUnpackArgs& a, cudaStream_t stream) {
  if (a.layers < 1 || a.layers > kMaxGatherLayers || a.slot < 1 || a.num_tokens < 0 || a.num_tokens > a.slot ||
      a.head_dim < 32 || a.head_dim % 32 != 0 || WordsPerLane(a.head_dim) == 0 || a.cols < 1 ||
      !ColsOk(a.col_begin, a.members, a.cols) || a.row0 < 0 || a.row1 < a.row0 ||
      a.row1 > static_cast<int64_t>(a.layers) * a.slot) {
    return cudaErrorInvalidValue;
  }
  UnpackPlan p;
  bool aligned = (a.head_dim + a.head_dim / 32) % 8 == 0;
  for (int s = 0; s < a.members; ++s) {
    if (a.records[s] == nullptr) continue;
    aligned = aligned && Aligned(a.records[s], 8);
    p.given_cols += a.col_begin[s + 1] - a.col_begin[s];
  }
  int64_t rows = 0;
  for (int l = 0; l < a.layers; ++l) {
    if (a.out[l] == nullptr || !Aligned(a.out[l], 16)) return cudaErrorInvalidValue;
    // Layer l's rows of this launch that hold tokens: [l * slot, l * slot + num_tokens) within [row0, row1).
    const int64_t lo = std::max<int64_t>(a.row0, static_cast<int64_t>(l) * a.slot);
    const int64_t hi = std::min<int64_t>(a.row1, static_cast<int64_t>(l) * a.slot + a.num_tokens);
    if (hi > lo) {
      p.seg_row[p.segs] = lo;
      p.seg_len[p.segs++] = hi - lo;
      rows += hi - lo;
    }
  }
  const int64_t items = rows * p.given_cols;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = (items + kWarpsPerBlock * kRows - 1) / (kWarpsPerBlock * kRows);
  return LaunchRows(WordsPerLane(a.head_dim), std::min<int64_t>(blocks, 0x7fffffff), stream, DpUnpackKernel<1>,
                    DpUnpackKernel<2>, DpUnpackKernel<4>, a, p, items, aligned);
}

cudaError_t LaunchDpSetTokens(int32_t* dst, int32_t value, cudaStream_t stream) {
  if (dst == nullptr || value < 0) return cudaErrorInvalidValue;
  DpSetTokensKernel<<<1, 1, 0, stream>>>(dst, value);
  return cudaGetLastError();
}

}  // namespace engram::kernels
