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

absl::StatusOr<std::unique_ptr<DpNcclExchange>> DpNcclExchange::Create(const DpExchangeShape& shape, ncclComm_t comm,
                                                                       bool own_comm, cudaStream_t stream,
                                                                       std::vector<ShardLayer> shard, BrokenFn broken,
                                                                       std::chrono::milliseconds timeout) {
  auto api = NcclApi::Get();
  if (!api.ok()) return api.status();
  if (shape.members < 1 || shape.me < 0 || shape.me >= shape.members || shape.slot < 1 || shape.layers < 1 ||
      static_cast<int32_t>(shape.col_begin.size()) != shape.members ||
      static_cast<int32_t>(shard.size()) != shape.layers) {
    if (own_comm && comm != nullptr) (*api)->CommAbort(comm);  // owned from here on, even when refused
    return absl::InvalidArgumentError("DP exchange: inconsistent shape");
  }
  std::unique_ptr<DpNcclExchange> x(new DpNcclExchange());
  x->nccl_ = *api;
  x->shape_ = shape;
  x->comm_ = comm;
  x->own_comm_ = own_comm;
  x->stream_ = stream;
  x->shard_ = std::move(shard);
  x->broken_ = std::move(broken);
  x->timeout_ = timeout;
  const size_t n = static_cast<size_t>(shape.members), S = static_cast<size_t>(shape.slot),
               L = static_cast<size_t>(shape.layers), C = static_cast<size_t>(shape.cols),
               rb = static_cast<size_t>(shape.record_bytes()), D = static_cast<size_t>(shape.head_dim);
  for (int32_t m = 0; m < shape.members; ++m) {
    x->part_ = std::max(x->part_, shape.col_end[static_cast<size_t>(m)] - shape.col_begin[static_cast<size_t>(m)]);
  }
  const size_t own = static_cast<size_t>(shape.col_end[static_cast<size_t>(shape.me)] -
                                         shape.col_begin[static_cast<size_t>(shape.me)]);
  size_t recv_total = 0;
  for (int32_t m = 0; m < shape.members; ++m) {
    x->recv_off_.push_back(recv_total);
    const size_t cols_m =
        static_cast<size_t>(shape.col_end[static_cast<size_t>(m)] - shape.col_begin[static_cast<size_t>(m)]);
    recv_total += L * S * cols_m * rb;
  }
  auto alloc = [&](void** p, size_t bytes) -> absl::Status {
    x->device_bytes_ += bytes;
    return x->Cuda(cudaMalloc(p, std::max<size_t>(bytes, 256)), "cudaMalloc of the exchange buffers");
  };
  const size_t P = static_cast<size_t>(x->part_);
  if (auto st = alloc(reinterpret_cast<void**>(&x->send_ids_), S * L * C * 4); !st.ok()) return st;
  if (auto st = alloc(reinterpret_cast<void**>(&x->all_ids_), n * S * L * C * 4); !st.ok()) return st;
  if (auto st = alloc(reinterpret_cast<void**>(&x->send_recs_), n * L * S * own * rb); !st.ok()) return st;
  if (auto st = alloc(reinterpret_cast<void**>(&x->recv_recs_), recv_total); !st.ok()) return st;
  if (auto st = alloc(reinterpret_cast<void**>(&x->tmp_rows_), S * P * std::max(D * 2, rb)); !st.ok()) return st;
  if (auto st = alloc(reinterpret_cast<void**>(&x->iota_), S * P * 4); !st.ok()) return st;
  // The unpack's row of (token t, column c): t * os + (c - cb) of the owning member's received block.
  std::vector<int32_t> unpack(S * C, 0);
  for (size_t t = 0; t < S; ++t) {
    for (int32_t m = 0; m < shape.members; ++m) {
      const int32_t cb = shape.col_begin[static_cast<size_t>(m)], os = shape.col_end[static_cast<size_t>(m)] - cb;
      for (int32_t c = cb; c < cb + os; ++c) {
        unpack[t * C + static_cast<size_t>(c)] = static_cast<int32_t>(t) * os + (c - cb);
      }
    }
  }
  if (auto st = alloc(reinterpret_cast<void**>(&x->unpack_ids_), S * C * 4); !st.ok()) return st;
  if (auto st =
          x->Cuda(cudaMemcpy(x->unpack_ids_, unpack.data(), unpack.size() * 4, cudaMemcpyHostToDevice), "unpack ids");
      !st.ok()) {
    return st;
  }
  std::vector<int32_t> iota(S * P);
  std::iota(iota.begin(), iota.end(), 0);
  if (auto st = x->Cuda(cudaMemcpy(x->iota_, iota.data(), iota.size() * 4, cudaMemcpyHostToDevice), "iota"); !st.ok()) {
    return st;
  }
  // The pipelined path's side streams: the collectives first in line for SMs freed by the packing/unpacking kernels.
  int least = 0, greatest = 0;
  if (auto st = x->Cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities"); !st.ok()) return st;
  if (auto st = x->Cuda(cudaStreamCreateWithPriority(&x->comm_stream_, cudaStreamNonBlocking, greatest), "stream");
      !st.ok()) {
    return st;
  }
  if (auto st = x->Cuda(cudaStreamCreateWithPriority(&x->own_stream_, cudaStreamNonBlocking, least), "stream");
      !st.ok()) {
    return st;
  }
  if (auto st = x->Cuda(cudaStreamCreateWithFlags(&x->cap_stream_, cudaStreamNonBlocking), "stream"); !st.ok()) {
    return st;
  }
  if (auto st = alloc(reinterpret_cast<void**>(&x->live_), 4); !st.ok()) return st;
  std::vector<cudaEvent_t*> events = {&x->ev_start_, &x->ev_split_, &x->ev_ids_, &x->ev_own_, &x->ev_done_};
  for (int k = 0; k < kMaxChunks; ++k) {
    events.push_back(&x->ev_pack_[k]);
    events.push_back(&x->ev_recv_[k]);
  }
  for (cudaEvent_t* e : events) {
    if (auto st = x->Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event"); !st.ok()) return st;
  }
  return x;
}

DpNcclExchange::~DpNcclExchange() {
  {
    // Before the communicator goes: NCCL's destroy and abort wait until no graph that captured it is alive.
    std::lock_guard<std::recursive_mutex> lock(mu_);
    DropGraphs();
  }
  for (void* p : ipc_opened_) cudaIpcCloseMemHandle(p);
  for (void* p : {static_cast<void*>(send_ids_), static_cast<void*>(all_ids_), static_cast<void*>(send_recs_),
                  static_cast<void*>(recv_recs_), static_cast<void*>(tmp_rows_), static_cast<void*>(iota_),
                  static_cast<void*>(unpack_ids_), static_cast<void*>(live_)}) {
    if (p != nullptr) cudaFree(p);
  }
  for (cudaEvent_t e : {ev_start_, ev_split_, ev_ids_, ev_own_, ev_done_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (int k = 0; k < kMaxChunks; ++k) {
    if (ev_pack_[k] != nullptr) cudaEventDestroy(ev_pack_[k]);
    if (ev_recv_[k] != nullptr) cudaEventDestroy(ev_recv_[k]);
  }
  for (cudaStream_t st : {comm_stream_, own_stream_, cap_stream_}) {  // released once their work is done
    if (st != nullptr) cudaStreamDestroy(st);
  }
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (own_comm_ && comm_ != nullptr && !aborted_) {
    // A finished group: release the communicator without waiting on peers that may be gone (abort is local).
    nccl_->CommAbort(comm_);
  }
}

void DpNcclExchange::Abort(const std::string& why) {
  {
    // The reason before the flag, under their own lock: a reader that sees aborted_ sees why (it read an empty
    // reason when it took mu_ between the flag and the reason).
    std::lock_guard<std::mutex> reason_lock(reason_mu_);
    if (aborted_) return;
    abort_reason_ = why;
    aborted_ = true;
  }
  std::lock_guard<std::recursive_mutex> lock(mu_);  // the engine thread leaves its NCCL polling once aborted_ is set
  // A graph in flight is freed when it completes (the abort ends its NCCL kernels); NCCL's abort waits for that.
  DropGraphs();
  // The engine's own communicator is the engine's to abort: a failed step must not free it under the caller.
  if (comm_ != nullptr && own_comm_) nccl_->CommAbort(comm_);
}

void DpNcclExchange::DropGraphs() {
  for (CachedGraph& g : graphs_) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
}

bool DpNcclExchange::GraphKey::operator==(const GraphKey& o) const {
  if (ids != o.ids || token_stride != o.token_stride || layer_stride != o.layer_stride || l0 != o.l0 || nl != o.nl) {
    return false;
  }
  for (int i = 0; i < 4; ++i) {
    if (outs[i] != o.outs[i]) return false;
  }
  return true;
}

absl::Status DpNcclExchange::StepGraph(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T,
                                       int32_t l0, int32_t nl, void* const* outs, cudaStream_t stream) {
  GraphKey key;
  key.ids = ids;
  key.token_stride = token_stride;
  key.layer_stride = layer_stride;
  key.l0 = l0;
  key.nl = nl;
  for (int32_t li = 0; li < nl && li < 4; ++li) key.outs[li] = outs[l0 + li];
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (aborted_) return absl::AbortedError("the DP exchange was aborted");
  auto it = std::find_if(graphs_.begin(), graphs_.end(), [&](const CachedGraph& g) { return g.key == key; });
  if (it == graphs_.end()) {
    // A shape's first step runs directly (NCCL connects lazily, outside any capture; a one-off shape costs no
    // capture); its second is captured. More shapes than graphs kept (e.g. ids from a different buffer every step):
    // enqueued directly, never recaptured.
    const bool seen = std::find(seen_.begin(), seen_.end(), key) != seen_.end();
    if (!seen && seen_.size() < 2 * kMaxGraphs) seen_.push_back(key);
    if (!seen || graphs_.size() >= kMaxGraphs) {
      return StepPipelined(ids, token_stride, layer_stride, T, l0, nl, outs, stream);
    }
  }
  if (it == graphs_.end()) {
    // Capture the pipelined step for the full slot, token count from live_, on the exchange's own stream (the
    // caller's may be the legacy stream, which cannot be captured). Capturing runs no collective (NCCL connected
    // during the direct first step), so a member that captured and one that did not still pair their sends.
    if (auto st = Cuda(cudaStreamBeginCapture(cap_stream_, cudaStreamCaptureModeRelaxed), "begin capture"); !st.ok()) {
      return st;
    }
    absl::Status st = StepPipelined(ids, token_stride, layer_stride, shape_.slot, l0, nl, outs, cap_stream_, live_);
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(cap_stream_, &graph);
    if (st.ok()) st = Cuda(end, "end capture");
    cudaGraphExec_t exec = nullptr;
    if (st.ok()) st = Cuda(cudaGraphInstantiateWithFlags(&exec, graph, 0), "graph instantiate");
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!st.ok()) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("DP exchange: capture of the step's CUDA graph: ", st.message()));
    }
    graphs_.push_back({key, exec});
    it = graphs_.end() - 1;
  }
  if (auto st = Cuda(kernels::LaunchDpSetTokens(live_, T, stream), "token count"); !st.ok()) return st;
  return Cuda(cudaGraphLaunch(it->exec, stream), "graph launch");
}

std::optional<std::string> DpNcclExchange::aborted() const {
  if (!aborted_) return std::nullopt;
  std::lock_guard<std::mutex> lock(reason_mu_);
  return abort_reason_;
}

absl::Status DpNcclExchange::AllGather(ncclComm_t comm, cudaStream_t stream, int32_t members, const void* mine,
                                       size_t bytes, void* all, const BrokenFn& stop,
                                       std::chrono::steady_clock::time_point deadline, const char* what,
                                       std::recursive_mutex* mu) {
  ASSIGN_OR_RETURN(const NcclApi* n, NcclApi::Get());
  const size_t total = bytes * static_cast<size_t>(members);
  void* d = nullptr;
  if (cudaMalloc(&d, bytes + total) != cudaSuccess) return absl::InternalError(absl::StrCat(what, ": cudaMalloc"));
  absl::Status result;
  if (cudaMemcpy(d, mine, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    result = absl::InternalError(absl::StrCat(what, ": copy in"));
  }
  if (result.ok()) {
    std::unique_lock<std::recursive_mutex> lock;
    if (mu != nullptr) lock = std::unique_lock<std::recursive_mutex>(*mu);
    result = Poll(comm, n->AllGather(d, static_cast<uint8_t*>(d) + bytes, bytes, ncclUint8, comm, stream), stop,
                  deadline, what);
  }
  // Its kernels wait for every member: polled too (a member gone now must not hang this one).
  if (result.ok()) result = WaitStream(stream, stop, deadline, what);
  if (result.ok() && cudaMemcpy(all, static_cast<uint8_t*>(d) + bytes, total, cudaMemcpyDeviceToHost) != cudaSuccess) {
    result = absl::InternalError(absl::StrCat(what, ": copy back"));
  }
  // cudaFree waits for the device: with the all-gather still waiting for a member (the caller aborts the
  // communicator next), the small buffer is left behind instead.
  if (result.ok() || cudaStreamQuery(stream) != cudaErrorNotReady) cudaFree(d);
  return result;
}

int32_t DpNcclExchange::chunks(int32_t nl) const {
  const int64_t rows = static_cast<int64_t>(nl) * shape_.slot;
  const int64_t bytes = rows * part_ * shape_.record_bytes() * std::max(shape_.members - 1, 1);
  if (shape_.chunk_bytes <= 0) return 1;
  const int64_t k = (bytes + shape_.chunk_bytes - 1) / shape_.chunk_bytes;
  return static_cast<int32_t>(std::clamp<int64_t>(k, 1, std::min<int64_t>(rows, kMaxChunks)));
}

absl::Status DpNcclExchange::Gather(const Source& source, const int32_t* ids, int64_t token_stride,
                                    int64_t layer_stride, int32_t T, int32_t nl, void* const* outs, cudaStream_t stream,
                                    const char* what) {
  const int32_t n = shape_.members;
  kernels::PeerGatherArgs g;
  g.members = n;
  g.layers = nl;
  for (int32_t s = 0; s < n; ++s) {
    for (int32_t li = 0; li < nl; ++li) {
      const ShardLayer src = source(s, li);
      g.records[s][li] = src.records;
      g.row_begin[s][li] = src.row_begin;
      g.row_end[s][li] = src.row_end;
    }
    g.col_begin[s] = shape_.col_begin[static_cast<size_t>(s)];
  }
  g.col_begin[n] = shape_.col_end[static_cast<size_t>(n - 1)];
  g.ids = ids;
  g.token_stride = token_stride;
  g.layer_stride = layer_stride;
  g.num_tokens = T;
  g.cols = shape_.cols;
  g.head_dim = shape_.head_dim;
  for (int32_t li = 0; li < nl; ++li) g.out[li] = static_cast<uint16_t*>(outs[li]);
  return Cuda(kernels::LaunchPeerGather(g, stream), what);
}

absl::Status DpNcclExchange::Step(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int32_t l0,
                                  int32_t nl, void* const* outs, bool packed, bool peer, cudaStream_t stream) {
  if (auto why = aborted()) return absl::AbortedError(*why);
  if (T < 0 || T > shape_.slot || l0 < 0 || nl < 1 || l0 + nl > shape_.layers) {
    return absl::InvalidArgumentError("DP exchange: step outside the exchange's shape");
  }
  const int32_t n = shape_.members;
  const bool one_launch = !packed && n <= kernels::kMaxGatherMembers && nl <= kernels::kMaxGatherLayers;
  if (!peer) {
    // Steps follow each other on the device whatever streams their callers use: the buffers and side streams are
    // the exchange's (the event is the previous step's end; never recorded yet, the wait is a no-op). Under graph
    // capture the caller's stream order is the graph's, and an event from outside the capture cannot be joined.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (auto st = Cuda(cudaStreamIsCapturing(stream, &capture), "capture status"); !st.ok()) return st;
    const bool eager = capture == cudaStreamCaptureStatusNone;
    if (eager) {
      if (auto st = Cuda(cudaStreamWaitEvent(stream, ev_done_, 0), "event"); !st.ok()) return st;
    }
    // The graph form outside a caller's capture; inside one, the pipelined form joins the caller's graph.
    absl::Status st = !one_launch || shape_.sequential
                          ? StepSequential(ids, token_stride, layer_stride, T, l0, nl, outs, packed, stream)
                      : shape_.graph && eager ? StepGraph(ids, token_stride, layer_stride, T, l0, nl, outs, stream)
                                              : StepPipelined(ids, token_stride, layer_stride, T, l0, nl, outs, stream);
    if (!st.ok() || !eager) return st;
    return Cuda(cudaEventRecord(ev_done_, stream), "event");
  }
  if (peers_.empty()) return absl::FailedPreconditionError("DP exchange: peer reads without peer shards");
  if (T == 0) return absl::OkStatus();
  if (one_launch) {
    // One launch: every member's shard read in place, bf16 rows straight into the caller's staging columns.
    return Gather([&](int32_t s, int32_t li) { return peers_[static_cast<size_t>(s)][static_cast<size_t>(l0 + li)]; },
                  ids, token_stride, layer_stride, T, nl, outs + l0, stream, "peer gather kernel");
  }
  const int64_t C = shape_.cols, D = shape_.head_dim;
  const size_t row_bytes = static_cast<size_t>(packed ? shape_.record_bytes() : D * 2);
  for (int32_t li = 0; li < nl; ++li) {
    for (int32_t s = 0; s < n; ++s) {
      const int32_t cb = shape_.col_begin[static_cast<size_t>(s)], os = shape_.col_end[static_cast<size_t>(s)] - cb;
      const ShardLayer& src = peers_[static_cast<size_t>(s)][static_cast<size_t>(l0 + li)];
      kernels::LookupArgs a;
      a.records = src.records;
      a.row_begin = src.row_begin;
      a.row_end = src.row_end;
      a.head_dim = static_cast<int32_t>(D);
      a.ids = ids + li * layer_stride + cb;
      a.num_tokens = T;
      a.num_cols = os;
      a.ids_stride = token_stride;
      a.out = tmp_rows_;
      a.packed = packed;
      if (auto st = Cuda(kernels::LaunchLookup(a, stream), "lookup kernel"); !st.ok()) return st;
      if (auto st =
              Cuda(cudaMemcpy2DAsync(static_cast<uint8_t*>(outs[l0 + li]) + cb * row_bytes, C * row_bytes, tmp_rows_,
                                     os * row_bytes, os * row_bytes, T, cudaMemcpyDeviceToDevice, stream),
                   "peer rows copy");
          !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace engram::client
