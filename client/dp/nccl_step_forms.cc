// DpNcclExchange, the collective step's two forms: pipelined (ids out, records packed and moved chunk by chunk
// while earlier chunks unpack) and sequential (all-gather of ids, one send/recv). The contract is in
// client/dp/nccl_exchange.h.
#include "client/dp/nccl_exchange.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "kernels/dp_kernels.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

absl::Status DpNcclExchange::StepPipelined(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T,
                                           int32_t l0, int32_t nl, void* const* outs, cudaStream_t stream,
                                           const int32_t* live) {
  const int64_t S = shape_.slot, rb = shape_.record_bytes();
  const int32_t me = shape_.me, n = shape_.members;
  auto cb = [&](int32_t s) { return shape_.col_begin[static_cast<size_t>(s)]; };
  auto cols = [&](int32_t s) { return shape_.col_end[static_cast<size_t>(s)] - cb(s); };
  const int32_t own = cols(me);
  // Where member p's blocks lie this step (p != me): ids to it, ids from it, records to it, records from it.
  int64_t ids_to[kernels::kMaxGatherMembers] = {}, ids_from[kernels::kMaxGatherMembers] = {};
  {
    int64_t to = 0, from = 0;
    for (int32_t p = 0; p < n; ++p) {
      if (p == me) continue;
      ids_to[p] = to;
      ids_from[p] = from;
      to += S * nl * cols(p);
      from += S * nl * own;
    }
  }
  const int64_t chunk_me = nl * S * own * rb;
  // 0. Fork: the side streams start after what the caller queued (the ids).
  if (auto st = Cuda(cudaEventRecord(ev_start_, stream), "event"); !st.ok()) return st;
  // 1. My own columns of my own tokens, straight from my shard into the staging columns: on the step's stream after
  // the packs (it runs while the records travel), or (own_concurrent) on a side stream from the start.
  auto own_columns = [&](cudaStream_t on) -> absl::Status {
    if (T == 0 || own == 0) return absl::OkStatus();
    kernels::PeerGatherArgs g;
    g.members = 1;
    g.layers = nl;
    for (int32_t li = 0; li < nl; ++li) {
      const ShardLayer& src = shard_[static_cast<size_t>(l0 + li)];
      g.records[0][li] = src.records;
      g.row_begin[0][li] = src.row_begin;
      g.row_end[0][li] = src.row_end;
      g.out[li] = static_cast<uint16_t*>(outs[l0 + li]);
    }
    g.col_begin[0] = cb(me);
    g.col_begin[1] = cb(me) + own;
    g.ids = ids;
    g.token_stride = token_stride;
    g.layer_stride = layer_stride;
    g.num_tokens = T;
    g.cols = shape_.cols;
    g.head_dim = shape_.head_dim;
    g.max_blocks = 0x7fffffff;  // short blocks: the SMs go back to the collectives as they finish
    g.live_tokens = live;
    return Cuda(kernels::LaunchPeerGather(g, on), "own columns kernel");
  };
  if (shape_.own_concurrent) {
    if (auto st = Cuda(cudaStreamWaitEvent(own_stream_, ev_start_, 0), "event"); !st.ok()) return st;
    if (auto st = own_columns(own_stream_); !st.ok()) return st;
    if (auto st = Cuda(cudaEventRecord(ev_own_, own_stream_), "event"); !st.ok()) return st;
  }
  // 2. My ids of each other member's columns, padded with -1 (DEAD) to the slot.
  {
    kernels::DpSplitIdsArgs a;
    a.ids = ids;
    a.token_stride = token_stride;
    a.layer_stride = layer_stride;
    a.num_tokens = T;
    a.slot = static_cast<int32_t>(S);
    a.layers = nl;
    a.members = n;
    a.me = me;
    for (int32_t s = 0; s < n; ++s) a.col_begin[s] = cb(s);
    a.col_begin[n] = shape_.col_end[static_cast<size_t>(n - 1)];
    a.out = send_ids_;
    a.live_tokens = live;
    for (int32_t p = 0; p < n; ++p) a.out_off[p] = ids_to[p];
    if (auto st = Cuda(kernels::LaunchDpSplitIds(a, stream), "ids split kernel"); !st.ok()) return st;
  }
  if (auto st = Cuda(cudaEventRecord(ev_split_, stream), "event"); !st.ok()) return st;
  if (auto st = Cuda(cudaStreamWaitEvent(comm_stream_, ev_split_, 0), "event"); !st.ok()) return st;
  const int32_t K = chunks(nl);
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (aborted_) return absl::AbortedError("the DP exchange was aborted");
  // 3. Each member gets the ids of its columns (one grouped send/recv on the communication stream).
  nccl_->GroupStart();
  for (int32_t p = 0; p < n; ++p) {
    if (p == me) continue;
    nccl_->Send(send_ids_ + ids_to[p], static_cast<size_t>(S * nl * cols(p)), ncclInt32, p, comm_, comm_stream_);
    nccl_->Recv(all_ids_ + ids_from[p], static_cast<size_t>(S * nl * own), ncclInt32, p, comm_, comm_stream_);
  }
  if (auto st = Wait(nccl_->GroupEnd(), "exchange of hash ids"); !st.ok()) return st;
  if (auto st = Cuda(cudaEventRecord(ev_ids_, comm_stream_), "event"); !st.ok()) return st;
  if (auto st = Cuda(cudaStreamWaitEvent(stream, ev_ids_, 0), "event"); !st.ok()) return st;
  // 4. Chunk k of rows r = layer * slot + token: packed on the step's stream, sent on the communication stream.
  const int64_t rows = nl * S;
  auto row = [&](int32_t k) { return rows * k / K; };
  for (int32_t k = 0; k < K; ++k) {
    kernels::DpPackArgs a;
    for (int32_t li = 0; li < nl; ++li) {
      const ShardLayer& src = shard_[static_cast<size_t>(l0 + li)];
      a.records[li] = src.records;
      a.row_begin[li] = src.row_begin;
      a.row_end[li] = src.row_end;
    }
    a.ids = all_ids_;
    a.out = send_recs_;
    for (int32_t p = 0; p < n; ++p) {
      a.ids_off[p] = ids_from[p];
      a.out_off[p] = p * chunk_me;
    }
    a.members = n;
    a.me = me;
    a.slot = static_cast<int32_t>(S);
    a.layers = nl;
    a.own = own;
    a.head_dim = shape_.head_dim;
    a.row0 = row(k);
    a.row1 = row(k + 1);
    if (auto st = Cuda(kernels::LaunchDpPack(a, stream), "pack kernel"); !st.ok()) return st;
    if (auto st = Cuda(cudaEventRecord(ev_pack_[k], stream), "event"); !st.ok()) return st;
  }
  if (!shape_.own_concurrent) {
    if (auto st = own_columns(stream); !st.ok()) return st;
  }
  for (int32_t k = 0; k < K; ++k) {
    if (auto st = Cuda(cudaStreamWaitEvent(comm_stream_, ev_pack_[k], 0), "event"); !st.ok()) return st;
    const int64_t r0 = row(k), r1 = row(k + 1);
    nccl_->GroupStart();
    for (int32_t p = 0; p < n; ++p) {
      if (p == me) continue;
      nccl_->Send(send_recs_ + p * chunk_me + r0 * own * rb, static_cast<size_t>((r1 - r0) * own * rb), ncclUint8, p,
                  comm_, comm_stream_);
      nccl_->Recv(recv_recs_ + recv_off_[static_cast<size_t>(p)] + r0 * cols(p) * rb,
                  static_cast<size_t>((r1 - r0) * cols(p) * rb), ncclUint8, p, comm_, comm_stream_);
    }
    if (auto st = Wait(nccl_->GroupEnd(), "all-to-all of records"); !st.ok()) return st;
    if (auto st = Cuda(cudaEventRecord(ev_recv_[k], comm_stream_), "event"); !st.ok()) return st;
  }
  // 5. Chunk k unpacked into the other members' columns as it arrives; then join the own-column stream.
  for (int32_t k = 0; k < K; ++k) {
    if (T == 0 && k + 1 < K) continue;  // no rows to unpack, but the join below waits for the last chunk
    if (auto st = Cuda(cudaStreamWaitEvent(stream, ev_recv_[k], 0), "event"); !st.ok()) return st;
    if (T == 0) break;
    kernels::DpUnpackArgs u;
    for (int32_t s = 0; s < n; ++s) {
      u.records[s] = s == me ? nullptr : recv_recs_ + recv_off_[static_cast<size_t>(s)];
      u.col_begin[s] = cb(s);
    }
    u.col_begin[n] = shape_.col_end[static_cast<size_t>(n - 1)];
    u.members = n;
    u.slot = static_cast<int32_t>(S);
    u.layers = nl;
    u.num_tokens = T;
    u.cols = shape_.cols;
    u.head_dim = shape_.head_dim;
    u.row0 = row(k);
    u.row1 = row(k + 1);
    u.live_tokens = live;
    for (int32_t li = 0; li < nl; ++li) u.out[li] = static_cast<uint16_t*>(outs[l0 + li]);
    if (n > 1) {
      if (auto st = Cuda(kernels::LaunchDpUnpack(u, stream), "unpack kernel"); !st.ok()) return st;
    }
  }
  return shape_.own_concurrent ? Cuda(cudaStreamWaitEvent(stream, ev_own_, 0), "event") : absl::OkStatus();
}

absl::Status DpNcclExchange::StepSequential(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T,
                                            int32_t l0, int32_t nl, void* const* outs, bool packed,
                                            cudaStream_t stream) {
  const int64_t S = shape_.slot, C = shape_.cols, rb = shape_.record_bytes(), D = shape_.head_dim;
  const int32_t me = shape_.me, n = shape_.members;
  const size_t row_bytes = static_cast<size_t>(packed ? rb : D * 2);
  auto lookup = [&](const ShardLayer& src, const int32_t* ids_at, int64_t stride, int32_t tokens, int32_t cols,
                    void* out, bool pk) {
    kernels::LookupArgs a;
    a.records = src.records;
    a.row_begin = src.row_begin;
    a.row_end = src.row_end;
    a.head_dim = static_cast<int32_t>(D);
    a.ids = ids_at;
    a.num_tokens = tokens;
    a.num_cols = cols;
    a.ids_stride = stride;
    a.out = out;
    a.packed = pk;
    return Cuda(kernels::LaunchLookup(a, stream), "lookup kernel");
  };
  // 1. My ids, padded with -1 (DEAD: zero rows) to the slot.
  if (T > 0) {
    for (int32_t li = 0; li < nl; ++li) {
      if (auto st = Cuda(cudaMemcpy2DAsync(send_ids_ + li * C, nl * C * 4, ids + li * layer_stride, token_stride * 4,
                                           C * 4, T, cudaMemcpyDeviceToDevice, stream),
                         "ids copy");
          !st.ok()) {
        return st;
      }
    }
  }
  if (T < S) {
    if (auto st = Cuda(cudaMemsetAsync(send_ids_ + T * nl * C, 0xFF, (S - T) * nl * C * 4, stream), "ids pad");
        !st.ok()) {
      return st;
    }
  }
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (aborted_) return absl::AbortedError("the DP exchange was aborted");
  // 2. All-gather of every member's ids.
  if (auto st = Wait(nccl_->AllGather(send_ids_, all_ids_, static_cast<size_t>(S * nl * C), ncclInt32, comm_, stream),
                     "all-gather of hash ids");
      !st.ok()) {
    return st;
  }
  // 3. My columns for every member's tokens, packed, one block per destination.
  const int32_t cbm = shape_.col_begin[static_cast<size_t>(me)], own = shape_.col_end[static_cast<size_t>(me)] - cbm;
  const int64_t chunk_me = nl * S * own * rb;
  for (int32_t d = 0; d < n; ++d) {
    for (int32_t li = 0; li < nl; ++li) {
      if (auto st = lookup(shard_[static_cast<size_t>(l0 + li)], all_ids_ + (d * S * nl + li) * C + cbm, nl * C,
                           static_cast<int32_t>(S), own, send_recs_ + d * chunk_me + li * S * own * rb, true);
          !st.ok()) {
        return st;
      }
    }
  }
  // 4. One all-to-all of the records (grouped send/recv; my own block is a device copy).
  nccl_->GroupStart();
  for (int32_t p = 0; p < n; ++p) {
    if (p == me) continue;
    const int64_t cols_p = shape_.col_end[static_cast<size_t>(p)] - shape_.col_begin[static_cast<size_t>(p)];
    const int64_t chunk_p = nl * S * cols_p * rb;
    nccl_->Send(send_recs_ + p * chunk_me, static_cast<size_t>(chunk_me), ncclUint8, p, comm_, stream);
    nccl_->Recv(recv_recs_ + recv_off_[static_cast<size_t>(p)], static_cast<size_t>(chunk_p), ncclUint8, p, comm_,
                stream);
  }
  if (auto st = Wait(nccl_->GroupEnd(), "all-to-all of records"); !st.ok()) return st;
  if (auto st = Cuda(cudaMemcpyAsync(recv_recs_ + recv_off_[static_cast<size_t>(me)], send_recs_ + me * chunk_me,
                                     static_cast<size_t>(chunk_me), cudaMemcpyDeviceToDevice, stream),
                     "own records");
      !st.ok()) {
    return st;
  }
  if (T == 0) return absl::OkStatus();
  // 5. Unpack my tokens' rows of every member's columns, in column order.
  if (!packed && n <= kernels::kMaxGatherMembers && nl <= kernels::kMaxGatherLayers) {
    // One launch: the received blocks as each member's "shard" (row t * os + c' is token t's column cb + c').
    return Gather(
        [&](int32_t s, int32_t li) {
          const int64_t os = shape_.col_end[static_cast<size_t>(s)] - shape_.col_begin[static_cast<size_t>(s)];
          return ShardLayer{recv_recs_ + recv_off_[static_cast<size_t>(s)] + li * S * os * rb, 0, S * os};
        },
        unpack_ids_, C, 0, T, nl, outs + l0, stream, "unpack kernel");
  }
  for (int32_t li = 0; li < nl; ++li) {
    for (int32_t s = 0; s < n; ++s) {
      const int64_t cb = shape_.col_begin[static_cast<size_t>(s)], os = shape_.col_end[static_cast<size_t>(s)] - cb;
      const uint8_t* recs = recv_recs_ + recv_off_[static_cast<size_t>(s)] + li * S * os * rb;
      const void* rows = recs;
      if (!packed) {
        // The received records as a table of their own (row i = record i), dequantised by the lookup kernel.
        if (auto st = lookup({recs, 0, S * os}, iota_, os, T, static_cast<int32_t>(os), tmp_rows_, false); !st.ok()) {
          return st;
        }
        rows = tmp_rows_;
      }
      if (auto st = Cuda(cudaMemcpy2DAsync(static_cast<uint8_t*>(outs[l0 + li]) + cb * row_bytes, C * row_bytes, rows,
                                           os * row_bytes, os * row_bytes, T, cudaMemcpyDeviceToDevice, stream),
                         "unpack copy");
          !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace engram::client
