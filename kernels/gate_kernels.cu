// The gate kernel and its launch (kernels/engram_kernels.h has the contract; docs/math.md the definition).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/alignment.h"
#include "kernels/engram_kernels.h"
#include "model/fast_mod.h"
#include "model/fp8.h"

namespace engram::kernels {
namespace {

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

}  // namespace

cudaError_t LaunchGate(const GateArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.hc_mult < 1 || a.dim < 8 || a.dim % 8 != 0) return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.hidden == nullptr || a.kv == nullptr || a.q_weight == nullptr || a.k_weight == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  for (const void* p :
       {static_cast<const void*>(a.hidden), static_cast<const void*>(a.kv), static_cast<const void*>(a.q_weight),
        static_cast<const void*>(a.k_weight), static_cast<const void*>(a.out)}) {
    if (!Aligned(p, 16)) return cudaErrorInvalidValue;
  }
  const int64_t blocks = static_cast<int64_t>(a.num_tokens) * a.hc_mult;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  GateKernel<<<static_cast<unsigned>(blocks), kGateThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace engram::kernels
