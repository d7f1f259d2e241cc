// The hash kernel and its launch (kernels/engram_kernels.h has the contract; docs/math.md the definition).
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
    if (a.query_start_loc[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
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
        // known ids still count. Its dead flag is not read; a known id flagged dead blocks as a dead token does.
        const int64_t k = static_cast<int64_t>(r) * (N - 1) + (lb - start_pos + (N - 1));
        const int32_t raw = a.lookback == nullptr ? -1 : a.lookback[k];
        if (raw == -1) {
          src = static_cast<int32_t>(L.pad_compressed);
        } else {
          src = CompressOrDead(raw, L, a.error_flag);
          if (a.lookback_dead != nullptr && a.lookback_dead[k] != 0) src = -1;
        }
      }
    }
    blocked = blocked || src < 0;
    const int64_t v = blocked ? L.pad_compressed : src;
    rolling ^= v * mult[s];
    if (s > 0) {
      const int32_t c = (s - 1) * H + h;
      const uint64_t bucket =
          FastMod(static_cast<uint64_t>(rolling), static_cast<uint64_t>(L.primes[base + c]), L.magics[base + c]);
      out[c] = static_cast<int32_t>(static_cast<int64_t>(bucket) + L.offsets[base + c]);
    }
  }
}

}  // namespace

cudaError_t LaunchHash(const LayoutView& layout, const HashArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.num_requests < 1 || layout.n_layers < 1 || layout.max_ngram < 2 || layout.n_heads < 1 ||
      layout.multipliers == nullptr || layout.primes == nullptr || layout.offsets == nullptr ||
      layout.magics == nullptr || layout.token_map == nullptr || a.query_start_loc == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (a.lookback_dead != nullptr && a.lookback == nullptr) return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.tokens == nullptr || a.positions == nullptr || a.out == nullptr) return cudaErrorInvalidValue;
  const int64_t threads = static_cast<int64_t>(a.num_tokens) * layout.n_layers * layout.n_heads;
  const int block = 256;
  HashKernel<<<static_cast<unsigned>((threads + block - 1) / block), block, 0, stream>>>(layout, a);
  return cudaGetLastError();
}

}  // namespace engram::kernels
