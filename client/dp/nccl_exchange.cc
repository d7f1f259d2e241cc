#include "client/dp/nccl_exchange.h"

#include <dlfcn.h>

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
namespace {

constexpr int kMaxPeerLayers = 16;

// What a member exports for peer reads: its shard allocation and where each layer lies in it.
struct PeerExport {
  cudaIpcMemHandle_t handle;
  int32_t ok;  // 1: `handle` is valid
  int64_t offset[kMaxPeerLayers];
  int64_t row_begin[kMaxPeerLayers];
  int64_t row_end[kMaxPeerLayers];
};

template <typename F>
bool Load(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(::dlsym(lib, name));
  return *fn != nullptr;
}

}  // namespace

absl::StatusOr<const NcclApi*> NcclApi::Get() {
  static const absl::StatusOr<const NcclApi*> api = []() -> absl::StatusOr<const NcclApi*> {
    void* lib = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = ::dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return absl::UnavailableError(absl::StrCat("DP_SHARDED on the GPU needs NCCL: ", ::dlerror(),
                                                 " (install libnccl2; it is loaded at run time)"));
    }
    auto* a = new NcclApi();
    ncclResult_t (*get_version)(int*) = nullptr;
    const bool ok = Load(lib, "ncclGetUniqueId", &a->GetUniqueId) &&
                    Load(lib, "ncclCommInitRankConfig", &a->CommInitRankConfig) &&
                    Load(lib, "ncclCommGetAsyncError", &a->CommGetAsyncError) &&
                    Load(lib, "ncclCommAbort", &a->CommAbort) && Load(lib, "ncclCommDestroy", &a->CommDestroy) &&
                    Load(lib, "ncclCommFinalize", &a->CommFinalize) && Load(lib, "ncclAllGather", &a->AllGather) &&
                    Load(lib, "ncclSend", &a->Send) && Load(lib, "ncclRecv", &a->Recv) &&
                    Load(lib, "ncclGroupStart", &a->GroupStart) && Load(lib, "ncclGroupEnd", &a->GroupEnd) &&
                    Load(lib, "ncclGetErrorString", &a->GetErrorString) && Load(lib, "ncclGetVersion", &get_version);
    if (!ok) return absl::UnavailableError("libnccl.so.2 lacks an entry point this build needs (NCCL >= 2.14)");
    get_version(&a->version);
    Load(lib, "ncclCommSplit", &a->CommSplit);  // optional: without it the steps keep the non-blocking communicator
    return a;
  }();
  return api;
}

absl::StatusOr<ncclComm_t> DpNcclExchange::InitComm(const ncclUniqueId& id, int32_t members, int32_t me,
                                                    const BrokenFn& broken, std::chrono::milliseconds timeout) {
  auto api = NcclApi::Get();
  if (!api.ok()) return api.status();
  const NcclApi* n = *api;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // every call returns; we poll with a deadline and can abort
  ncclComm_t comm = nullptr;
  const ncclResult_t r = n->CommInitRankConfig(&comm, members, id, me, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) n->CommAbort(comm);
    return absl::InternalError(absl::StrCat("NCCL communicator: ", n->GetErrorString(r)));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    ncclResult_t st = ncclSuccess;
    n->CommGetAsyncError(comm, &st);
    if (st == ncclSuccess) return comm;
    if (st != ncclInProgress) {
      n->CommAbort(comm);
      return absl::InternalError(absl::StrCat("NCCL communicator: ", n->GetErrorString(st)));
    }
    std::optional<std::string> why = broken ? broken() : std::nullopt;
    if (!why && std::chrono::steady_clock::now() > deadline) why = "the NCCL communicator did not form in time";
    if (why) {
      n->CommAbort(comm);
      return absl::AbortedError(*why);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

absl::Status DpNcclExchange::Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("DP exchange: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status DpNcclExchange::Poll(ncclComm_t comm, ncclResult_t r, const BrokenFn& stop,
                                  std::chrono::steady_clock::time_point deadline, const char* what) {
  ASSIGN_OR_RETURN(const NcclApi* n, NcclApi::Get());
  if (r != ncclSuccess && r != ncclInProgress) {
    return absl::InternalError(absl::StrCat("DP exchange: ", what, ": ", n->GetErrorString(r)));
  }
  while (true) {
    ncclResult_t st = ncclSuccess;
    n->CommGetAsyncError(comm, &st);
    if (st == ncclSuccess) return absl::OkStatus();
    if (st != ncclInProgress) {
      return absl::InternalError(absl::StrCat("DP exchange: ", what, ": ", n->GetErrorString(st)));
    }
    if (std::optional<std::string> why = stop ? stop() : std::nullopt) return absl::AbortedError(*why);
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("DP exchange: ", what, " did not complete in time"));
    }
    std::this_thread::yield();
  }
}

absl::Status DpNcclExchange::WaitStream(cudaStream_t stream, const BrokenFn& stop,
                                        std::chrono::steady_clock::time_point deadline, const char* what) {
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(q)));
    if (std::optional<std::string> why = stop ? stop() : std::nullopt) return absl::AbortedError(*why);
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not complete in time"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

absl::Status DpNcclExchange::Wait(ncclResult_t r, const char* what) {
  return Poll(comm_, r, [this]() -> std::optional<std::string> {
    if (aborted_) return "the DP exchange was aborted";
    return std::nullopt;
  }, std::chrono::steady_clock::now() + timeout_, what);
}

bool DpNcclExchange::SplitSupported() {
  auto api = NcclApi::Get();
  if (!api.ok() || (*api)->CommSplit == nullptr) return false;
  // NCCL_COMM_SPLIT_SHARE_RESOURCES=1 overrides the config: the twin would share (and die with) its parent.
  const char* share = std::getenv("NCCL_COMM_SPLIT_SHARE_RESOURCES");
  return share == nullptr || std::atoi(share) == 0;
}

absl::StatusOr<ncclComm_t> DpNcclExchange::BlockingTwin(ncclComm_t comm, int32_t me, const BrokenFn& broken,
                                                        std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(const NcclApi* n, NcclApi::Get());
  if (n->CommSplit == nullptr) return absl::UnimplementedError("this NCCL has no ncclCommSplit");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.splitShare = 0;  // the twin must outlive its parent's abort
  ncclComm_t twin = nullptr;
  const ncclResult_t r = n->CommSplit(comm, 0, me, &twin, &cfg);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  absl::Status st = Poll(comm, r, broken, deadline, "the blocking communicator");
  if (st.ok() && twin != nullptr) st = Poll(twin, ncclSuccess, broken, deadline, "the blocking communicator");
  if (st.ok() && twin == nullptr) st = absl::InternalError("DP exchange: ncclCommSplit gave no communicator");
  if (!st.ok()) {
    n->CommAbort(comm);  // first: an interrupted split hands its child over only when the parent's abort joins it
    if (twin != nullptr) n->CommAbort(twin);
    return st;
  }
  n->CommAbort(comm);  // local: the twin owns its own resources (splitShare 0; SplitSupported refuses the env override)
  return twin;
}

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
    const size_t cols_m = static_cast<size_t>(shape.col_end[static_cast<size_t>(m)] -
                                              shape.col_begin[static_cast<size_t>(m)]);
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
  if (auto st = x->Cuda(cudaMemcpy(x->unpack_ids_, unpack.data(), unpack.size() * 4, cudaMemcpyHostToDevice),
                        "unpack ids");
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
    if (auto st = Cuda(cudaStreamBeginCapture(cap_stream_, cudaStreamCaptureModeRelaxed), "begin capture");
        !st.ok()) {
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

absl::Status DpNcclExchange::ExchangePeerShards(const void* alloc_base) {
  if (shape_.layers > kMaxPeerLayers) return absl::UnimplementedError("peer reads: too many layers");
  const BrokenFn stop = [this]() -> std::optional<std::string> {
    if (aborted_) return "the DP exchange was aborted";
    return broken_ ? broken_() : std::nullopt;
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  // Test-only fault point (ENGRAM_DP_FAULT=peer-open; unset in production): this member cannot map the others.
  const char* fault = std::getenv("ENGRAM_DP_FAULT");
  const bool fail_open = fault != nullptr && std::strcmp(fault, "peer-open") == 0;
  // 1. Every member's export, with whether it could make one (a local failure still takes part in the all-gather).
  PeerExport mine{};
  std::string why;
  if (cudaError_t e = cudaIpcGetMemHandle(&mine.handle, const_cast<void*>(alloc_base)); e != cudaSuccess) {
    why = absl::StrCat("cudaIpcGetMemHandle: ", cudaGetErrorString(e));
  } else {
    mine.ok = 1;
  }
  for (int32_t l = 0; l < shape_.layers; ++l) {
    mine.offset[l] = shard_[static_cast<size_t>(l)].records - static_cast<const uint8_t*>(alloc_base);
    mine.row_begin[l] = shard_[static_cast<size_t>(l)].row_begin;
    mine.row_end[l] = shard_[static_cast<size_t>(l)].row_end;
  }
  const size_t n = static_cast<size_t>(shape_.members);
  std::vector<PeerExport> all(n);
  RETURN_IF_ERROR(AllGather(comm_, stream_, shape_.members, &mine, sizeof(mine), all.data(), stop, deadline,
                            "DP exchange: all-gather of the peer handles", &mu_));
  // 2. Map the others' shards (only if every member exported one).
  bool exported = true;
  for (const PeerExport& x : all) exported = exported && x.ok == 1;
  std::vector<std::vector<ShardLayer>> peers(n);
  std::vector<void*> opened;
  int32_t mapped = exported ? 1 : 0;
  if (!exported && why.empty()) why = "a member could not export its shard";
  for (size_t s = 0; s < n && mapped == 1; ++s) {
    const uint8_t* base = static_cast<const uint8_t*>(alloc_base);
    if (static_cast<int32_t>(s) != shape_.me) {
      void* p = nullptr;
      const cudaError_t e = fail_open ? cudaErrorPeerAccessUnsupported
                                      : cudaIpcOpenMemHandle(&p, all[s].handle, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        why = absl::StrCat("cudaIpcOpenMemHandle of dp member ", s, "'s shard: ", cudaGetErrorString(e));
        mapped = 0;
        break;
      }
      opened.push_back(p);
      base = static_cast<const uint8_t*>(p);
    }
    for (int32_t l = 0; l < shape_.layers; ++l) {
      peers[s].push_back({base + all[s].offset[l], all[s].row_begin[l], all[s].row_end[l]});
    }
  }
  // 3. The group takes the peer path only if every member mapped every other one.
  std::vector<int32_t> every(n);
  RETURN_IF_ERROR(AllGather(comm_, stream_, shape_.members, &mapped, sizeof(mapped), every.data(), stop, deadline,
                            "DP exchange: all-gather of the peer mappings", &mu_));
  bool all_mapped = true;
  for (size_t s = 0; s < n; ++s) {
    if (every[s] != 1 && all_mapped) {
      all_mapped = false;
      if (mapped == 1) why = absl::StrCat("dp member ", s, " could not map the others' shards");
    }
  }
  if (!all_mapped) {
    for (void* p : opened) cudaIpcCloseMemHandle(p);
    return absl::FailedPreconditionError(absl::StrCat("peer reads are not possible in this group: ", why));
  }
  ipc_opened_.insert(ipc_opened_.end(), opened.begin(), opened.end());
  peers_ = std::move(peers);
  return absl::OkStatus();
}

int32_t DpNcclExchange::chunks(int32_t nl) const {
  const int64_t rows = static_cast<int64_t>(nl) * shape_.slot;
  const int64_t bytes = rows * part_ * shape_.record_bytes() * std::max(shape_.members - 1, 1);
  if (shape_.chunk_bytes <= 0) return 1;
  const int64_t k = (bytes + shape_.chunk_bytes - 1) / shape_.chunk_bytes;
  return static_cast<int32_t>(std::clamp<int64_t>(k, 1, std::min<int64_t>(rows, kMaxChunks)));
}

absl::Status DpNcclExchange::Gather(const Source& source, const int32_t* ids, int64_t token_stride,
                                    int64_t layer_stride, int32_t T, int32_t nl, void* const* outs,
                                    cudaStream_t stream, const char* what) {
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

absl::Status DpNcclExchange::Step(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T,
                                  int32_t l0, int32_t nl, void* const* outs, bool packed, bool peer,
                                  cudaStream_t stream) {
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
      if (auto st = Cuda(cudaMemcpy2DAsync(static_cast<uint8_t*>(outs[l0 + li]) + cb * row_bytes, C * row_bytes,
                                           tmp_rows_, os * row_bytes, os * row_bytes, T, cudaMemcpyDeviceToDevice,
                                           stream),
                         "peer rows copy");
          !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DpNcclExchange::StepPipelined(const int32_t* ids, int64_t token_stride, int64_t layer_stride,
                                           int32_t T, int32_t l0, int32_t nl, void* const* outs,
                                           cudaStream_t stream, const int32_t* live) {
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

absl::Status DpNcclExchange::StepSequential(const int32_t* ids, int64_t token_stride, int64_t layer_stride,
                                            int32_t T, int32_t l0, int32_t nl, void* const* outs, bool packed,
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
      if (auto st = Cuda(cudaMemcpy2DAsync(static_cast<uint8_t*>(outs[l0 + li]) + cb * row_bytes, C * row_bytes,
                                           rows, os * row_bytes, os * row_bytes, T, cudaMemcpyDeviceToDevice, stream),
                         "unpack copy");
          !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace engram::client
