#include "client/dp_device_engine.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/device_engine.h"
#include "client/dp_nccl_transport.h"
#include "spdlog/spdlog.h"

namespace engram::client {
namespace {

int32_t PeerMaxSlot() {
  const char* v = std::getenv("ENGRAM_DP_PEER_MAX_SLOT");
  if (v == nullptr || *v == 0) return kDefaultPeerMaxSlot;
  return static_cast<int32_t>(std::strtol(v, nullptr, 10));
}

class DpDeviceEngine final : public LookupEngine {
 public:
  ~DpDeviceEngine() override {
    // Drain the stream while the watchdog still runs: a member that died mid-step gets the communicator aborted.
    if (exchange_ != nullptr && !exchange_->aborted()) cudaStreamSynchronize(stream_);
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    if (event_ != nullptr) cudaEventDestroy(event_);
    for (uint16_t* s : staging_) cudaFree(s);
  }
  Backend backend() const override { return Backend::kCuda; }

  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl, const int32_t* lookback,
                    const uint8_t* dead, int32_t T, int32_t R, int32_t* out) override {
    return inner_->Hash(tokens, positions, qsl, lookback, dead, T, R, out);
  }
  absl::Status Gate(const GateInputs& g) override { return inner_->Gate(g); }

  absl::Status Lookup(int l, const int32_t* ids, int32_t T, int64_t stride, void* out, bool packed) override {
    const int L = static_cast<int>(staging_.size());
    if (l < 0 || l >= L) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", L, ")")));
    }
    if ((T > 0 && ids == nullptr) || out == nullptr || stride < cols_) {
      return Fail(absl::InvalidArgumentError("lookup: null or bad stride"));
    }
    std::vector<void*> outs(static_cast<size_t>(L), nullptr);
    outs[static_cast<size_t>(l)] = out;
    return Step(ids, stride, 0, T, l, 1, outs.data(), packed);
  }
  absl::Status Prefetch(const int32_t* hash_ids, int32_t T) override {
    if (hash_ids == nullptr && T > 0) return Fail(absl::InvalidArgumentError("prefetch: null hash ids"));
    const int L = static_cast<int>(staging_.size());
    std::vector<void*> outs(staging_.begin(), staging_.end());
    prefetched_ = Step(hash_ids, static_cast<int64_t>(L) * cols_, cols_, T, 0, L, outs.data(), false);
    return prefetched_;
  }
  // The exchange is on the engine's stream: work queued after it on that stream sees the rows.
  absl::Status Wait(int l) override {
    if (l < 0 || l >= static_cast<int>(staging_.size())) return absl::InvalidArgumentError("wait: layer out of range");
    {
      // Rows of a step the abort cut short are not rows; a step that finished before the group broke is whole.
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_in_flight_) return absl::AbortedError(abort_reason_);
    }
    return prefetched_;
  }
  uint16_t* staging(int l) const override {
    return l < 0 || l >= static_cast<int>(staging_.size()) ? nullptr : staging_[static_cast<size_t>(l)];
  }

  static absl::StatusOr<std::unique_ptr<LookupEngine>> Create(const Table& table, int32_t max_tokens,
                                                              cudaStream_t stream, Session& session,
                                                              const DpShardedPlan& plan, void* nccl_comm) {
    std::unique_ptr<DpDeviceEngine> e(new DpDeviceEngine());
    e->stream_ = stream;
    e->cols_ = table.n_cols();
    e->max_tokens_ = max_tokens;
    cudaGetDevice(&e->device_);
    ASSIGN_OR_RETURN(auto inner, DeviceEngine::Create(table, max_tokens, stream));
    e->inner_ = std::move(inner);
    const int64_t L = static_cast<int64_t>(table.layers().size()), D = table.head_dim();
    for (int64_t l = 0; l < L; ++l) {
      uint16_t* p = nullptr;
      const size_t bytes = static_cast<size_t>(max_tokens) * e->cols_ * D * 2;
      if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMemset(p, 0, bytes) != cudaSuccess) {
        return absl::ResourceExhaustedError("cannot allocate the DP staging buffers on the GPU");
      }
      e->staging_.push_back(p);  // columns outside the group's range stay zero
    }
    const int32_t me = static_cast<int32_t>(plan.edp_rank);
    // The group: rank 0's ncclUniqueId travels through engramd (or a placeholder when the engine brings its own).
    ASSIGN_OR_RETURN(const NcclApi* nccl, NcclApi::Get());
    GroupJoinRequest join;
    join.transport = "nccl";
    join.max_tokens = max_tokens;
    join.bytes_per_step = static_cast<uint64_t>(
        DpShardedStepBytes(table.layout(), plan, std::vector<int64_t>(static_cast<size_t>(plan.edp), max_tokens), me)
            .total());
    ncclUniqueId id{};
    if (me == 0) {
      if (nccl_comm == nullptr) {
        if (nccl->GetUniqueId(&id) != ncclSuccess) return absl::InternalError("ncclGetUniqueId failed");
        join.rendezvous.assign(id.internal, sizeof(id.internal));
      } else {
        join.rendezvous = "engine-communicator";
      }
    }
    ASSIGN_OR_RETURN(e->group_, DpGroup::Join(session, join, DpFormTimeout()));
    const GroupEvent& g = e->group_->formed();
    if (static_cast<int64_t>(g.members.size()) != plan.edp) {  // never an NCCL communicator of the wrong size
      return absl::InternalError(absl::StrCat("the daemon formed a group of ", g.members.size(),
                                              " members, expected ", plan.edp));
    }
    auto broken = [grp = e->group_.get()] { return grp->Broken(); };
    ncclComm_t comm = static_cast<ncclComm_t>(nccl_comm);
    if (comm == nullptr) {
      if (g.rendezvous.size() != sizeof(id.internal)) {
        return absl::FailedPreconditionError("the DP group's rendezvous is not an ncclUniqueId");
      }
      std::memcpy(id.internal, g.rendezvous.data(), sizeof(id.internal));
      ASSIGN_OR_RETURN(comm, DpNcclExchange::InitComm(id, static_cast<int32_t>(plan.edp), me, broken, DpFormTimeout()));
    }
    DpExchangeShape shape;
    shape.members = static_cast<int32_t>(plan.edp);
    shape.me = me;
    shape.slot = g.slot;
    shape.layers = static_cast<int32_t>(L);
    shape.cols = static_cast<int32_t>(e->cols_);
    shape.head_dim = static_cast<int32_t>(D);
    for (const auto& m : plan.members) {
      shape.col_begin.push_back(static_cast<int32_t>(m.col_begin));
      shape.col_end.push_back(static_cast<int32_t>(m.col_end));
    }
    shape.group_col_begin = static_cast<int32_t>(plan.group_col_begin);
    shape.group_col_end = static_cast<int32_t>(plan.group_col_end);
    std::vector<ShardLayer> shard;
    for (int64_t l = 0; l < L; ++l) {
      const auto& li = table.layers()[static_cast<size_t>(l)];
      shard.push_back({table.device_records(static_cast<int>(l)), li.row_begin, li.row_end});
    }
    ASSIGN_OR_RETURN(e->exchange_, DpNcclExchange::Create(shape, comm, /*own_comm=*/nccl_comm == nullptr, stream,
                                                          std::move(shard), broken, DpStepTimeout()));
    // Peer reads for small slots, when every member's shard is in GPU memory: all members decide alike, since the
    // facts (slot, every member's shard kind) are the group's. The shard kind is agreed through one all-gather.
    const bool on_gpu = table.records(0) == nullptr;  // a DEVICE shard has no host copy
    if (g.slot <= PeerMaxSlot()) {
      ASSIGN_OR_RETURN(bool all_on_gpu, e->AllMembers(on_gpu));
      if (all_on_gpu) {
        RETURN_IF_ERROR(e->exchange_->ExchangePeerShards(table.device_records(0)));
        e->peer_ = true;
      }
    }
    if (cudaEventCreateWithFlags(&e->event_, cudaEventDisableTiming) != cudaSuccess) {
      return absl::InternalError("cudaEventCreate failed");
    }
    e->watchdog_ = std::thread([raw = e.get()] { raw->Watch(); });
    spdlog::info("engram: event=dp_group_formed transport=nccl group={} members={} edp_rank={} slot={} path={} "
                 "exchange_bytes={}",
                 g.group, g.members.size(), me, g.slot, e->peer_ ? "nvlink-peer" : "all-to-all",
                 e->exchange_->device_bytes());
    return std::unique_ptr<LookupEngine>(std::move(e));
  }

 private:
  DpDeviceEngine() = default;

  // Whether `mine` holds on every member (one all-gather of a flag through the exchange's communicator).
  absl::StatusOr<bool> AllMembers(bool mine) {
    const int32_t n = static_cast<int32_t>(group_->formed().members.size());
    std::vector<int32_t> ids(static_cast<size_t>(cols_), mine ? 1 : 0);
    int32_t* d = nullptr;
    if (cudaMalloc(&d, static_cast<size_t>(cols_) * 4) != cudaSuccess) return absl::InternalError("cudaMalloc");
    cudaMemcpy(d, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
    int32_t* all = nullptr;
    cudaMalloc(&all, static_cast<size_t>(n) * cols_ * 4);
    ASSIGN_OR_RETURN(const NcclApi* nccl, NcclApi::Get());
    const ncclResult_t r = nccl->AllGather(d, all, static_cast<size_t>(cols_), ncclInt32, exchange_->comm(), stream_);
    ncclResult_t st = r;
    while (st == ncclInProgress || (st == ncclSuccess && r == ncclInProgress)) {
      nccl->CommGetAsyncError(exchange_->comm(), &st);
      if (st == ncclSuccess) break;
      if (auto why = group_->Broken()) return absl::AbortedError(*why);
      std::this_thread::yield();
    }
    if (st != ncclSuccess) return absl::InternalError(absl::StrCat("all-gather: ", nccl->GetErrorString(st)));
    std::vector<int32_t> got(static_cast<size_t>(n) * cols_);
    cudaStreamSynchronize(stream_);
    cudaMemcpy(got.data(), all, got.size() * 4, cudaMemcpyDeviceToHost);
    cudaFree(d);
    cudaFree(all);
    for (int32_t m = 0; m < n; ++m) {
      if (got[static_cast<size_t>(m) * cols_] != 1) return false;
    }
    return true;
  }

  absl::Status Fail(absl::Status st) {
    if (failed_.ok()) {
      failed_ = st;
      exchange_->Abort(std::string(st.message()));
    }
    return failed_;
  }

  absl::Status Step(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int l0, int nl,
                    void* const* outs, bool packed) {
    if (!failed_.ok()) return failed_;
    if (auto why = group_->Broken()) return Fail(absl::AbortedError(*why));
    if (auto why = exchange_->aborted()) return Fail(absl::AbortedError(*why));
    if (T < 0 || T > max_tokens_) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(T, " tokens; the engine was sized for ", max_tokens_)));
    }
    if (auto st = exchange_->Step(ids, token_stride, layer_stride, T, l0, nl, outs, packed, peer_); !st.ok()) {
      if (auto why = exchange_->aborted()) return Fail(absl::AbortedError(*why));
      return Fail(st);
    }
    std::lock_guard<std::mutex> lock(mu_);
    cudaEventRecord(event_, stream_);
    pending_since_ = std::chrono::steady_clock::now();
    pending_ = true;
    return absl::OkStatus();
  }

  // Aborts the communicator when the group breaks or a step overstays: kernels stuck on a dead member end.
  // A broken group: a step still queued gets a short grace to finish (a member that left after its last step is
  // no reason to cut ours), then the communicator is aborted so nothing waits on the member that is gone.
  void Watch() {
    cudaSetDevice(device_);
    const auto timeout = DpStepTimeout();
    std::optional<std::chrono::steady_clock::time_point> broken_at;
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::optional<std::string> why = group_->Broken();
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_ && cudaEventQuery(event_) != cudaErrorNotReady) pending_ = false;
      if (why && !broken_at) broken_at = std::chrono::steady_clock::now();
      const auto now = std::chrono::steady_clock::now();
      if (why && (!pending_ || now - *broken_at > std::chrono::milliseconds(1000))) {
        aborted_in_flight_ = pending_;
        abort_reason_ = *why;
        exchange_->Abort(*why);
        return;
      }
      if (pending_ && now - pending_since_ > timeout) {
        aborted_in_flight_ = true;
        abort_reason_ = absl::StrCat("a DP step did not finish within ", timeout.count(),
                                     " ms (a member stalled; ENGRAM_DP_STEP_TIMEOUT_MS)");
        exchange_->Abort(abort_reason_);
        return;
      }
    }
  }

  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  int64_t cols_ = 0;
  int32_t max_tokens_ = 0;
  std::unique_ptr<LookupEngine> inner_;
  std::unique_ptr<DpGroup> group_;
  std::unique_ptr<DpNcclExchange> exchange_;
  std::vector<uint16_t*> staging_;
  bool peer_ = false;
  absl::Status failed_;
  absl::Status prefetched_ = absl::FailedPreconditionError("wait before any prefetch");
  std::mutex mu_;  // event_, pending_*
  cudaEvent_t event_ = nullptr;
  bool pending_ = false;
  bool aborted_in_flight_ = false;  // the abort cut a queued step short
  std::string abort_reason_;
  std::chrono::steady_clock::time_point pending_since_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LookupEngine>> CreateDpDeviceEngine(const Table& table, int32_t max_tokens,
                                                                   cudaStream_t stream, Session& session,
                                                                   const DpShardedPlan& plan, void* nccl_comm) {
  return DpDeviceEngine::Create(table, max_tokens, stream, session, plan, nccl_comm);
}

}  // namespace engram::client
