// Implementation of kernels/dp_kernels.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dp_kernels.h"
#include "model/fp8.h"

namespace engram::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

// One warp per (token, layer, column) row of the group; each lane dequantises 8-value words of the record.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) PeerGatherKernel(PeerGatherArgs a, int64_t items) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int32_t gcb = a.col_begin[0], gc = a.col_begin[a.members] - gcb;
  const int32_t D = a.head_dim, words = D / 8, rec_bytes = D + D / 32;
  for (int64_t item = warp; item < items; item += n_warps) {
    const int32_t c = gcb + static_cast<int32_t>(item % gc);
    const int64_t rest = item / gc;
    const int32_t li = static_cast<int32_t>(rest % a.layers);
    const int64_t t = rest / a.layers;
    int32_t s = 0;
    while (s + 1 < a.members && c >= a.col_begin[s + 1]) ++s;
    const int64_t id = a.ids[t * a.token_stride + li * a.layer_stride + c];
    const bool owned = id >= a.row_begin[s][li] && id < a.row_end[s][li];
    const uint8_t* rec = owned ? a.records[s][li] + (id - a.row_begin[s][li]) * rec_bytes : nullptr;
    uint16_t* dst = a.out[li] + (t * a.cols + c) * D;
    for (int32_t w = lane; w < words; w += 32) {
      uint32_t packed[4] = {0, 0, 0, 0};
      if (owned) {
        const uint64_t v = *reinterpret_cast<const uint64_t*>(rec + 8 * w);
        const uint8_t scale = rec[D + w / 4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint16_t lo = DequantBf16(static_cast<uint8_t>(v >> (16 * k)), scale);
          const uint16_t hi = DequantBf16(static_cast<uint8_t>(v >> (16 * k + 8)), scale);
          packed[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
      }
      reinterpret_cast<uint4*>(dst)[w] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
}

}  // namespace

cudaError_t LaunchPeerGather(const PeerGatherArgs& a, cudaStream_t stream) {
  if (a.members < 1 || a.members > kMaxGatherMembers || a.layers < 1 || a.layers > kMaxGatherLayers ||
      a.num_tokens < 0 || a.head_dim < 32 || a.head_dim % 32 != 0 || a.cols < 1 || a.ids == nullptr ||
      a.col_begin[0] < 0 || a.col_begin[a.members] > a.cols || a.col_begin[a.members] <= a.col_begin[0]) {
    return cudaErrorInvalidValue;
  }
  for (int s = 0; s < a.members; ++s) {
    if (a.col_begin[s + 1] < a.col_begin[s]) return cudaErrorInvalidValue;
    for (int l = 0; l < a.layers; ++l) {
      if (a.records[s][l] == nullptr || (reinterpret_cast<uintptr_t>(a.records[s][l]) & 7) != 0) {
        return cudaErrorInvalidValue;
      }
    }
  }
  for (int l = 0; l < a.layers; ++l) {
    if (a.out[l] == nullptr || (reinterpret_cast<uintptr_t>(a.out[l]) & 15) != 0) return cudaErrorInvalidValue;
  }
  const int64_t items = static_cast<int64_t>(a.num_tokens) * a.layers * (a.col_begin[a.members] - a.col_begin[0]);
  if (items == 0) return cudaSuccess;
  int dev = 0, sms = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t blocks = std::min<int64_t>((items + kWarpsPerBlock - 1) / kWarpsPerBlock, int64_t{sms} * 8);
  PeerGatherKernel<<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), kWarpsPerBlock * 32, 0, stream>>>(a, items);
  return cudaGetLastError();
}

}  // namespace engram::kernels
