// The DP-sharded peer gather (issue 12): one launch reads every member's shard of a node-local DP group directly
// (peer GPU memory over NVLink, mapped through CUDA IPC; or this GPU's own shard) and writes the bf16 rows of the
// group's columns straight into the caller's staging buffers [T, cols, head_dim] in column order: no scratch buffer,
// no copies, one launch per step for every layer. Rows of ids outside the owning member's range are zero; columns
// outside the group are not written. Dequantisation is model/fp8.h's DequantBf16, the CPU reference's own, so rows
// are bit-exact with it. Callable from plain C++; launches are asynchronous on the given stream; misuse is
// cudaErrorInvalidValue. Stateless; thread-safe as far as the CUDA runtime is.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace engram::kernels {

inline constexpr int kMaxGatherMembers = 8;
inline constexpr int kMaxGatherLayers = 4;

struct PeerGatherArgs {
  int32_t members = 0;  // group size
  int32_t layers = 0;   // layers of this step (entries [0, layers) below)
  // Member s's records of the step's layer li (row row_begin first) and its rows [row_begin, row_end).
  const uint8_t* records[kMaxGatherMembers][kMaxGatherLayers] = {};
  int64_t row_begin[kMaxGatherMembers][kMaxGatherLayers] = {};
  int64_t row_end[kMaxGatherMembers][kMaxGatherLayers] = {};
  int32_t col_begin[kMaxGatherMembers + 1] = {};  // member s owns columns [col_begin[s], col_begin[s + 1])
  const int32_t* ids = nullptr;                    // id(t, li, c) = ids[t * token_stride + li * layer_stride + c]
  int64_t token_stride = 0, layer_stride = 0;
  int32_t num_tokens = 0, cols = 0, head_dim = 0;  // head_dim: multiple of 32
  uint16_t* out[kMaxGatherLayers] = {};            // bf16 [T, cols, head_dim] per step layer
};

cudaError_t LaunchPeerGather(const PeerGatherArgs& args, cudaStream_t stream);

}  // namespace engram::kernels
