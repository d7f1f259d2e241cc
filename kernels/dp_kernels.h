// The DP-sharded exchange kernels. Callable from plain C++; launches are asynchronous on the given stream;
// misuse is cudaErrorInvalidValue. Dequantisation gives model/fp8.h's DequantBf16 bits (the CPU reference's; on sm_89+
// through the hardware's exact fp8/bf16 conversions), so rows are bit-exact with it. Records are head_dim e4m3 bytes
// then head_dim/32 ue8m0 scales (record_bytes = head_dim * 33/32). Stateless; thread-safe as far as the CUDA runtime
// is.
//   LaunchPeerGather  one launch reads every member's shard of a node-local DP group directly (peer GPU memory over
//                     NVLink, mapped through CUDA IPC; or this GPU's own shard) and writes the bf16 rows of the
//                     group's columns (or of one member's, members = 1) straight into the caller's staging buffers
//                     [T, cols, head_dim] in column order: no scratch buffer, no copies, every layer of a step in one
//                     launch. Rows of ids outside the owning member's range are zero; other columns are not written.
//   The all-to-all path's three steps (client/dp/nccl_exchange.h), over "rows" r = layer * slot + token of a step:
//   LaunchDpSplitIds  this rank's ids, padded with -1 (DEAD) to the slot, one block [slot][layers][cols_p] per other
//                     member p (only p's columns travel to p);
//   LaunchDpPack      the records of this rank's columns for the rows [row0, row1) of every other member's ids, one
//                     launch for every destination and layer: block [layers][slot][own cols][record_bytes] per member
//                     (zero records for ids this shard does not own, DEAD included);
//   LaunchDpUnpack    the received blocks' rows [row0, row1) with token < num_tokens, dequantised into the caller's
//                     staging columns of each member whose block is given (a null block: columns left as they are).
//   LaunchDpSetTokens writes one int32 on the device (a step's token count, read by a replayed CUDA graph).
// `live_tokens` (gather, split, unpack; optional): a device scalar read by the kernel; tokens at or above it are
// treated as beyond num_tokens (padding / not written). The CUDA-graph form launches with num_tokens = slot and the
// step's real count there, so one captured graph serves every token count.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace engram::kernels {

inline constexpr int kMaxGatherMembers = 8;
inline constexpr int kMaxGatherLayers = 4;

struct PeerGatherArgs {
  int32_t members = 0;  // group size (or 1: one member's columns)
  int32_t layers = 0;   // layers of this step (entries [0, layers) below)
  // Member s's records of the step's layer li (row row_begin first) and its rows [row_begin, row_end).
  const uint8_t* records[kMaxGatherMembers][kMaxGatherLayers] = {};
  int64_t row_begin[kMaxGatherMembers][kMaxGatherLayers] = {};
  int64_t row_end[kMaxGatherMembers][kMaxGatherLayers] = {};
  int32_t col_begin[kMaxGatherMembers + 1] = {};  // member s owns columns [col_begin[s], col_begin[s + 1])
  const int32_t* ids = nullptr;                   // id(t, li, c) = ids[t * token_stride + li * layer_stride + c]
  int64_t token_stride = 0, layer_stride = 0;
  int32_t num_tokens = 0, cols = 0, head_dim = 0;  // head_dim: multiple of 32
  uint16_t* out[kMaxGatherLayers] = {};            // bf16 [T, cols, head_dim] per step layer
  int32_t max_blocks = 0;                          // grid cap; 0: 8 blocks per SM (grid-stride)
  const int32_t* live_tokens = nullptr;            // device scalar: tokens >= it are not read or written
};

cudaError_t LaunchPeerGather(const PeerGatherArgs& args, cudaStream_t stream);

struct DpSplitIdsArgs {
  const int32_t* ids = nullptr;  // id(t, li, c) = ids[t * token_stride + li * layer_stride + c], t < num_tokens
  int64_t token_stride = 0, layer_stride = 0;
  int32_t num_tokens = 0, slot = 0, layers = 0, members = 0, me = 0;
  int32_t col_begin[kMaxGatherMembers + 1] = {};  // as PeerGatherArgs
  int32_t* out = nullptr;                         // member p's block at out + out_off[p] (p != me)
  int64_t out_off[kMaxGatherMembers] = {};
  const int32_t* live_tokens = nullptr;  // device scalar: tokens >= it are padding (-1)
};

cudaError_t LaunchDpSplitIds(const DpSplitIdsArgs& args, cudaStream_t stream);

struct DpPackArgs {
  // This rank's shard, per step layer.
  const uint8_t* records[kMaxGatherLayers] = {};
  int64_t row_begin[kMaxGatherLayers] = {}, row_end[kMaxGatherLayers] = {};
  const int32_t* ids = nullptr;  // member p's ids of my columns, [slot][layers][own], at ids + ids_off[p] (p != me)
  int64_t ids_off[kMaxGatherMembers] = {};
  uint8_t* out = nullptr;  // member p's records [layers][slot][own][record_bytes] at out + out_off[p] (p != me)
  int64_t out_off[kMaxGatherMembers] = {};
  int32_t members = 0, me = 0, slot = 0, layers = 0, own = 0, head_dim = 0;
  int64_t row0 = 0, row1 = 0;  // rows r = layer * slot + token of this launch
};

cudaError_t LaunchDpPack(const DpPackArgs& args, cudaStream_t stream);

struct DpUnpackArgs {
  const uint8_t* records[kMaxGatherMembers] = {};  // member s's block [layers][slot][cols_s][record_bytes], or null
  int32_t col_begin[kMaxGatherMembers + 1] = {};   // as PeerGatherArgs
  int32_t members = 0, slot = 0, layers = 0, num_tokens = 0, cols = 0, head_dim = 0;
  int64_t row0 = 0, row1 = 0;            // rows r = layer * slot + token of this launch
  uint16_t* out[kMaxGatherLayers] = {};  // bf16 [num_tokens, cols, head_dim] per step layer
  const int32_t* live_tokens = nullptr;  // device scalar: tokens >= it are not written
};

cudaError_t LaunchDpUnpack(const DpUnpackArgs& args, cudaStream_t stream);

cudaError_t LaunchDpSetTokens(int32_t* dst, int32_t value, cudaStream_t stream);

}  // namespace engram::kernels
