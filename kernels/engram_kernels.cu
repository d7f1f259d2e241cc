// Implementation of the kernels declared in engram_kernels.h. See that header for the contract.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/engram_kernels.h"
#include "model/fast_mod.h"
#include "model/fp8.h"

namespace engram::kernels {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Hash: one thread per (token, layer, head). Each recomputes the rolling n-gram hash (N multiply-xors) and writes
// the N-1 bucket ids of its head: threads of consecutive heads write consecutive columns.

__device__ __forceinline__ int32_t CompressOrDead(int64_t raw, const LayoutView& L, int32_t* error_flag) {
  if (raw < 0 || raw >= L.vocab) {
    if (error_flag) atomicExch(error_flag, 1);
    return -1;
  }
  return L.token_map[raw];
}

__global__ void HashKernel(LayoutView L, HashArgs a) {
  const int32_t H = L.n_heads, NL = L.n_layers, N = L.max_ngram, C = (N - 1) * H;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(a.num_tokens) * NL * H) return;
  const int32_t h = static_cast<int32_t>(idx % H);
  const int32_t l = static_cast<int32_t>((idx / H) % NL);
  const int32_t t = static_cast<int32_t>(idx / (static_cast<int64_t>(H) * NL));
  // Request of token t: the last r with qsl[r] <= t.
  int32_t lo = 0, hi = a.num_requests - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (a.query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int32_t r = lo;
  const int32_t begin = a.query_start_loc[r];
  // A request start outside [0, t] (boundaries that decrease, start past 0 or lie past T) reads nothing: the token
  // is refused (the error flag) and hashed as blocked.
  const bool in_range = begin >= 0 && begin <= t;
  const int64_t start_pos = in_range ? a.positions[begin] : 0;
  const int64_t pos = a.positions[t];
  bool blocked = false;
  if (!in_range || pos != start_pos + (t - begin) || pos < 0) {
    if (a.error_flag) atomicExch(a.error_flag, 1);
    blocked = true;
  }
  const int64_t* mult = L.multipliers + static_cast<int64_t>(l) * N;
  const int64_t base = static_cast<int64_t>(l) * C;
  int32_t* out = a.out + (static_cast<int64_t>(t) * NL + l) * C;
  int64_t rolling = 0;
  for (int32_t s = 0; s < N; ++s) {
    const int64_t lb = pos - s;
    int32_t src = -1;
    if (!blocked && lb >= 0) {
      if (lb >= start_pos) {
        const int64_t tt = begin + (lb - start_pos);
        if (a.dead == nullptr || a.dead[tt] == 0) src = CompressOrDead(a.tokens[tt], L, a.error_flag);
      } else {
        // An unknown lookback id (-1, or no lookback given) hashes as the pad token and does not block: older
        // known ids still count.
        const int32_t raw = a.lookback == nullptr
                                ? -1
                                : a.lookback[static_cast<int64_t>(r) * (N - 1) + (lb - start_pos + (N - 1))];
        src = raw == -1 ? static_cast<int32_t>(L.pad_compressed) : CompressOrDead(raw, L, a.error_flag);
      }
    }
    blocked = blocked || src < 0;
    const int64_t v = blocked ? L.pad_compressed : src;
    rolling ^= v * mult[s];
    if (s > 0) {
      const int32_t c = (s - 1) * H + h;
      const uint64_t bucket = FastMod(static_cast<uint64_t>(rolling), static_cast<uint64_t>(L.primes[base + c]),
                                      L.magics[base + c]);
      out[c] = static_cast<int32_t>(static_cast<int64_t>(bucket) + L.offsets[base + c]);
    }
  }
}

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
  int64_t items;       // T * C
  int32_t words;       // head_dim / 8: 8-value chunks per row
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

// ---------------------------------------------------------------------------------------------------------------
// Gate: one block per (token, branch). Pass 1 reduces dot(h*q*k, key), |h|^2, |key|^2 in fp32 over 8-value vectors;
// pass 2 writes h + g * value.

constexpr int kGateThreads = 256;

__device__ __forceinline__ void Unpack8(uint4 v, float* f) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = Bf16ToFloat(static_cast<uint16_t>(u[k] & 0xFFFF));
    f[2 * k + 1] = Bf16ToFloat(static_cast<uint16_t>(u[k] >> 16));
  }
}

__global__ void __launch_bounds__(kGateThreads) GateKernel(GateArgs a) {
  const int32_t HC = a.hc_mult, D = a.dim, V = D / 8;
  const int64_t t = blockIdx.x / HC;
  const int32_t c = blockIdx.x % HC;
  const uint4* h = reinterpret_cast<const uint4*>(a.hidden + (t * HC + c) * D);
  const uint4* key = reinterpret_cast<const uint4*>(a.kv + (t * (HC + 1) + c) * D);
  const uint4* value = reinterpret_cast<const uint4*>(a.kv + (t * (HC + 1) + HC) * D);
  const uint4* q = reinterpret_cast<const uint4*>(a.q_weight + static_cast<int64_t>(c) * D);
  const uint4* k = reinterpret_cast<const uint4*>(a.k_weight + static_cast<int64_t>(c) * D);
  uint4* out = reinterpret_cast<uint4*>(a.out + (t * HC + c) * D);
  const bool dead = a.mask != nullptr && a.mask[t] != 0;

  __shared__ float red[3][kGateThreads / 32];
  __shared__ float gate;
  if (!dead) {
    float dot = 0.f, hh = 0.f, kk = 0.f;
    for (int32_t v = threadIdx.x; v < V; v += kGateThreads) {
      float fh[8], fk[8], fq[8], fw[8];
      Unpack8(h[v], fh);
      Unpack8(key[v], fk);
      Unpack8(q[v], fq);
      Unpack8(k[v], fw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dot += fh[j] * fq[j] * fw[j] * fk[j];
        hh += fh[j] * fh[j];
        kk += fk[j] * fk[j];
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      dot += __shfl_xor_sync(0xffffffffu, dot, off);
      hh += __shfl_xor_sync(0xffffffffu, hh, off);
      kk += __shfl_xor_sync(0xffffffffu, kk, off);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
      red[0][warp] = dot;
      red[1][warp] = hh;
      red[2][warp] = kk;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float sd = 0.f, sh = 0.f, sk = 0.f;
      for (int w = 0; w < kGateThreads / 32; ++w) {
        sd += red[0][w];
        sh += red[1][w];
        sk += red[2][w];
      }
      const float Df = static_cast<float>(D);
      const float x = sd / sqrtf(sh / Df + a.eps) / sqrtf(sk / Df + a.eps) / sqrtf(Df);
      const float mag = sqrtf(fmaxf(fabsf(x), 1e-6f));
      const float z = x > 0.f ? mag : (x < 0.f ? -mag : 0.f);
      gate = 1.f / (1.f + expf(-z));
    }
    __syncthreads();
  }
  const float g = dead ? 0.f : gate;
  for (int32_t v = threadIdx.x; v < V; v += kGateThreads) {
    float fh[8], fv[8];
    Unpack8(h[v], fh);
    Unpack8(value[v], fv);
    uint32_t u[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u[j] = static_cast<uint32_t>(FloatToBf16(fh[2 * j] + g * fv[2 * j])) |
             (static_cast<uint32_t>(FloatToBf16(fh[2 * j + 1] + g * fv[2 * j + 1])) << 16);
    }
    out[v] = make_uint4(u[0], u[1], u[2], u[3]);
  }
}

bool Aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

struct TuningState {
  std::atomic<int64_t> sort_min_items{kDefaultSortMinItems};
  std::atomic<int32_t> sort_variant{kDefaultSortVariant};
  std::atomic<int32_t> sort_blocks{kDefaultSortBlocks};
  std::atomic<bool> sort_only{false};
  TuningState() {
    if (const char* v = std::getenv("ENGRAM_LOOKUP_SORT_MIN_ITEMS"); v != nullptr && *v != '\0') {
      sort_min_items.store(std::atoll(v));
    }
    if (const char* v = std::getenv("ENGRAM_LOOKUP_SORT_VARIANT"); v != nullptr && *v != '\0') {
      sort_variant.store(std::clamp(std::atoi(v), 0, 3));
    }
    if (const char* v = std::getenv("ENGRAM_LOOKUP_SORT_BLOCKS"); v != nullptr && *v != '\0') {
      sort_blocks.store(std::max(std::atoi(v), 0));
    }
  }
};

TuningState& Tuning() {
  static TuningState state;
  return state;
}

template <int kW>
const void* WordsKernelFor(int variant) {
  switch (variant) {
    case 1: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 8, false>);
    case 2: return reinterpret_cast<const void*>(LookupWordsKernel<kW, kRows, true>);
    case 3: return reinterpret_cast<const void*>(LookupWordsKernel<kW, 8, true>);
    default: return reinterpret_cast<const void*>(LookupWordsKernel<kW, kRows, false>);
  }
}

template <int kW>
void LaunchWords(int variant, dim3 grid, dim3 block, cudaStream_t stream, const LookupArgs& a,
                 const LookupGeometry& g) {
  switch (variant) {
    case 1: LookupWordsKernel<kW, 8, false><<<grid, block, 0, stream>>>(a, g); break;
    case 2: LookupWordsKernel<kW, kRows, true><<<grid, block, 0, stream>>>(a, g); break;
    case 3: LookupWordsKernel<kW, 8, true><<<grid, block, 0, stream>>>(a, g); break;
    default: LookupWordsKernel<kW, kRows, false><<<grid, block, 0, stream>>>(a, g); break;
  }
}

}  // namespace

LookupTuning GetLookupTuning() {
  LookupTuning t;
  t.sort_min_items = Tuning().sort_min_items.load();
  t.sort_variant = Tuning().sort_variant.load();
  t.sort_blocks = Tuning().sort_blocks.load();
  t.sort_only = Tuning().sort_only.load();
  return t;
}

void SetLookupTuning(const LookupTuning& t) {
  Tuning().sort_min_items.store(t.sort_min_items);
  Tuning().sort_variant.store(std::clamp(t.sort_variant, 0, 3));
  Tuning().sort_blocks.store(std::max(t.sort_blocks, 0));
  Tuning().sort_only.store(t.sort_only);
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

int DeviceSmCount() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 1;
  return sms > 0 ? sms : 1;
}

cudaError_t LaunchHash(const LayoutView& layout, const HashArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.num_requests < 1 || layout.n_layers < 1 || layout.max_ngram < 2 || layout.n_heads < 1 ||
      layout.multipliers == nullptr || layout.primes == nullptr || layout.offsets == nullptr ||
      layout.magics == nullptr || layout.token_map == nullptr || a.query_start_loc == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.tokens == nullptr || a.positions == nullptr || a.out == nullptr) return cudaErrorInvalidValue;
  const int64_t threads = static_cast<int64_t>(a.num_tokens) * layout.n_layers * layout.n_heads;
  const int block = 256;
  HashKernel<<<static_cast<unsigned>((threads + block - 1) / block), block, 0, stream>>>(layout, a);
  return cudaGetLastError();
}

cudaError_t LaunchLookup(const LookupArgs& a, cudaStream_t stream) {
  if (a.head_dim < 32 || a.head_dim % 32 != 0 || a.num_tokens < 0 || a.num_cols < 1 || a.row_end < a.row_begin ||
      a.ids_stride < a.num_cols) {
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
    SortKeysKernel<<<static_cast<unsigned>((items + 255) / 256), 256, 0, stream>>>(a, items, sentinel, keys_in, vals_in);
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
  const int64_t warps_needed = a.packed || g.rec_bytes % 8 != 0 ? items : (items + kRows - 1) / kRows;
  int64_t blocks = (warps_needed + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // Persistent grid: exactly the blocks that fit at once (more would run as a second, partial wave).
  int per_sm = 1;
  // Packed rows of head_dim 256 or 512 in words, 8 rows in flight per warp on the row-order gather's wide variants.
  const int packed_wpl = !g.packed_words ? 0
                         : g.rec_bytes / 8 <= 32 ? 1 : g.rec_bytes / 8 <= 64 ? 2 : g.rec_bytes / 8 <= 96 ? 3 : 0;
  const bool packed_wide = variant == 1 || variant == 3;
  const void* packed_fn =
      packed_wpl == 1 ? (packed_wide ? reinterpret_cast<const void*>(LookupPackedWordsKernel<1, 8>)
                                     : reinterpret_cast<const void*>(LookupPackedWordsKernel<1, kRows>))
      : packed_wpl == 2 ? (packed_wide ? reinterpret_cast<const void*>(LookupPackedWordsKernel<2, 8>)
                                       : reinterpret_cast<const void*>(LookupPackedWordsKernel<2, kRows>))
      : packed_wpl == 3 ? (packed_wide ? reinterpret_cast<const void*>(LookupPackedWordsKernel<3, 8>)
                                       : reinterpret_cast<const void*>(LookupPackedWordsKernel<3, kRows>))
                        : reinterpret_cast<const void*>(LookupPackedKernel);
  const void* fn = a.packed ? packed_fn
                   : (g.rec_bytes % 8 == 0 && a.head_dim == 256) ? WordsKernelFor<1>(variant)
                   : (g.rec_bytes % 8 == 0 && a.head_dim == 512) ? WordsKernelFor<2>(variant)
                                                                 : reinterpret_cast<const void*>(LookupBytesKernel);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kWarpsPerBlock * 32, 0) != cudaSuccess) per_sm = 1;
  const int64_t persistent = static_cast<int64_t>(DeviceSmCount()) * std::max(per_sm, 1);
  blocks = std::min(blocks, a.max_blocks > 0 ? grid_cap : grid_cap > 0 ? std::min(grid_cap, persistent) : persistent);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(blocks, 1))), block(kWarpsPerBlock * 32);
  const bool words = g.rec_bytes % 8 == 0 && Aligned(a.records, 8);
  if (a.packed) {
    if (packed_wpl == 1) {
      if (packed_wide) LookupPackedWordsKernel<1, 8><<<grid, block, 0, stream>>>(a, g);
      else LookupPackedWordsKernel<1, kRows><<<grid, block, 0, stream>>>(a, g);
    } else if (packed_wpl == 2) {
      if (packed_wide) LookupPackedWordsKernel<2, 8><<<grid, block, 0, stream>>>(a, g);
      else LookupPackedWordsKernel<2, kRows><<<grid, block, 0, stream>>>(a, g);
    } else if (packed_wpl == 3) {
      if (packed_wide) LookupPackedWordsKernel<3, 8><<<grid, block, 0, stream>>>(a, g);
      else LookupPackedWordsKernel<3, kRows><<<grid, block, 0, stream>>>(a, g);
    } else {
      LookupPackedKernel<<<grid, block, 0, stream>>>(a, g);
    }
  } else if (words && a.head_dim == 256) {
    LaunchWords<1>(variant, grid, block, stream, a, g);
  } else if (words && a.head_dim == 512) {
    LaunchWords<2>(variant, grid, block, stream, a, g);
  } else {
    LookupBytesKernel<<<grid, block, 0, stream>>>(a, g);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGate(const GateArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.hc_mult < 1 || a.dim < 8 || a.dim % 8 != 0) return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.hidden == nullptr || a.kv == nullptr || a.q_weight == nullptr || a.k_weight == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  for (const void* p : {static_cast<const void*>(a.hidden), static_cast<const void*>(a.kv),
                        static_cast<const void*>(a.q_weight), static_cast<const void*>(a.k_weight),
                        static_cast<const void*>(a.out)}) {
    if (!Aligned(p, 16)) return cudaErrorInvalidValue;
  }
  const int64_t blocks = static_cast<int64_t>(a.num_tokens) * a.hc_mult;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  GateKernel<<<static_cast<unsigned>(blocks), kGateThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace engram::kernels
