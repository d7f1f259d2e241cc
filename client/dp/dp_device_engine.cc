// DpDeviceEngine (client/dp/dp_device_engine.h): its creation (the group, the agreed facts of client/dp/agreement.h,
// the exchange) and its steps with their watchdog, which share the same state.
#include "client/dp/dp_device_engine.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "client/dp/agreement.h"
#include "client/dp/nccl_exchange.h"
#include "client/dp/nccl_group.h"
#include "client/dp/step_watch.h"
#include "client/engine/device_engine.h"
#include "client/log.h"

namespace engram::client {
namespace {

class DpDeviceEngine final : public LookupEngine {
 public:
  ~DpDeviceEngine() override {
    // Drain the streams while the watchdog still runs: a member that died mid-step gets the communicator aborted.
    if (exchange_ != nullptr && !exchange_->aborted()) {
      cudaStreamSynchronize(stream_);
      if (side_ != nullptr) cudaStreamSynchronize(side_);
    }
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    for (cudaEvent_t e : {ids_ready_, prefetched_event_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : step_events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (side_ != nullptr) cudaStreamDestroy(side_);
    if (d_ids_ != nullptr) cudaFree(d_ids_);
    for (uint16_t* s : staging_) cudaFree(s);
  }
  Backend backend() const override { return Backend::kCuda; }

  using LookupEngine::Hash;
  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl, const int32_t* lookback,
                    const uint8_t* lookback_dead, const uint8_t* dead, int32_t T, int32_t R, int32_t* out) override {
    return inner_->Hash(tokens, positions, qsl, lookback, lookback_dead, dead, T, R, out);
  }
  absl::Status Gate(const GateInputs& g) override { return inner_->Gate(g); }
  const Table* table_for_checks() const override { return table_; }
  int32_t max_tokens_for_checks() const override { return max_tokens_; }
  // Later steps run on `stream` (the exchange takes its stream per step; the side stream forks from this one).
  absl::Status SetStream(void* stream) override {
    stream_ = static_cast<cudaStream_t>(stream);
    return inner_->SetStream(stream);
  }

  absl::Status Lookup(int l, const int32_t* ids, int32_t T, int64_t stride, void* out, bool packed) override {
    const int L = static_cast<int>(staging_.size());
    if (l < 0 || l >= L) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", L, ")")));
    }
    if (T > 0 && (ids == nullptr || out == nullptr || stride < cols_)) {  // T == 0: this rank's empty step
      return Fail(absl::InvalidArgumentError("lookup: null or bad stride"));
    }
    std::vector<void*> outs(static_cast<size_t>(L), nullptr);
    outs[static_cast<size_t>(l)] = out;
    // On the engine's stream itself: work queued after Lookup sees the rows.
    return Step(ids, stride, 0, T, l, 1, outs.data(), packed, stream_);
  }
  // The exchange runs on the engine's side stream (as DeviceEngine's prefetch does): it starts after the work queued
  // on the engine's stream (the hash ids) and Wait(l) joins it back into that stream with an event, never blocking
  // the host. Host ids are copied to the device first.
  absl::Status Prefetch(const int32_t* hash_ids, int32_t T) override {
    if (hash_ids == nullptr && T > 0) return Fail(absl::InvalidArgumentError("prefetch: null hash ids"));
    if (T < 0 || T > max_tokens_) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(T, " tokens; the engine was sized for ", max_tokens_)));
    }
    const int L = static_cast<int>(staging_.size());
    const int32_t* ids = hash_ids;
    if (T > 0) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, hash_ids) != cudaSuccess) {
        return Fail(absl::InvalidArgumentError("prefetch: hash id pointer"));
      }
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
        // d_ids_ may still be read by the previous Prefetch's exchange on the side stream (two Prefetch calls without
        // a Wait between them): the copy waits for that step's end (a no-op before the first step).
        if (cudaStreamWaitEvent(stream_, prefetched_event_, 0) != cudaSuccess) {
          return Fail(absl::InternalError("prefetch: order after the previous step"));
        }
        if (cudaMemcpyAsync(d_ids_, hash_ids, static_cast<size_t>(T) * L * cols_ * 4, cudaMemcpyHostToDevice,
                            stream_) != cudaSuccess) {
          return Fail(absl::InternalError("prefetch: hash ids to the device"));
        }
        ids = d_ids_;
      }
    }
    if (cudaEventRecord(ids_ready_, stream_) != cudaSuccess ||
        cudaStreamWaitEvent(side_, ids_ready_, 0) != cudaSuccess) {
      return Fail(absl::InternalError("prefetch: fork of the side stream"));
    }
    std::vector<void*> outs(staging_.begin(), staging_.end());
    prefetched_ = Step(ids, static_cast<int64_t>(L) * cols_, cols_, T, 0, L, outs.data(), false, side_);
    if (prefetched_.ok() && cudaEventRecord(prefetched_event_, side_) != cudaSuccess) {
      prefetched_ = Fail(absl::InternalError("prefetch: event"));
    }
    return prefetched_;
  }
  absl::Status Wait(int l) override {
    if (l < 0 || l >= static_cast<int>(staging_.size())) return absl::InvalidArgumentError("wait: layer out of range");
    {
      // Rows of a step the abort cut short are not rows; a step that finished before the group broke is whole.
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_in_flight_) return absl::AbortedError(abort_reason_);
    }
    if (!prefetched_.ok()) return prefetched_;
    // Work queued on the engine's stream after this sees the rows (one event for every layer: the step's end).
    if (cudaStreamWaitEvent(stream_, prefetched_event_, 0) != cudaSuccess) {
      return Fail(absl::InternalError("wait: join of the side stream"));
    }
    return absl::OkStatus();
  }
  uint16_t* staging(int l) const override {
    return l < 0 || l >= static_cast<int>(staging_.size()) ? nullptr : staging_[static_cast<size_t>(l)];
  }

  static absl::StatusOr<std::unique_ptr<LookupEngine>> Create(const Table& table, int32_t max_tokens,
                                                              cudaStream_t stream, Session& session,
                                                              const DpShardedPlan& plan, void* nccl_comm) {
    std::unique_ptr<DpDeviceEngine> e(new DpDeviceEngine(table));
    e->stream_ = stream;
    e->cols_ = table.n_cols();
    e->max_tokens_ = max_tokens;
    cudaGetDevice(&e->device_);
    ASSIGN_OR_RETURN(auto inner, DeviceEngine::Create(table, max_tokens, stream));
    e->inner_ = std::move(inner);
    const int64_t L = static_cast<int64_t>(table.layers().size()), D = table.head_dim();
    RETURN_IF_ERROR(e->AllocateStaging(L, D));
    const int32_t me = static_cast<int32_t>(plan.edp_rank);
    ASSIGN_OR_RETURN(const NcclApi* nccl, NcclApi::Get());
    ASSIGN_OR_RETURN(NcclGroup formed,
                     FormNcclGroup(session, table.layout(), plan, max_tokens, *nccl, nccl_comm, e->form_timeout()));
    e->group_ = std::move(formed.group);
    ncclComm_t comm = formed.comm;
    const GroupEvent& g = e->group_->formed();
    auto broken = [grp = e->group_.get()] { return grp->Broken(); };
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
    // Facts every member must share, agreed once through the communicator (client/dp/agreement.h).
    const bool on_gpu = table.records(0) == nullptr;  // a DEVICE shard has no host copy
    auto agreed = e->AllGatherInts(comm, static_cast<int32_t>(plan.edp),
                                   DpAgreementMine(table.tuning(), on_gpu, DpNcclExchange::SplitSupported()));
    if (!agreed.ok()) {
      if (nccl_comm == nullptr) nccl->CommAbort(comm);  // formed here, not yet owned by an exchange
      return agreed.status();
    }
    const DpAgreement a = DecideDpAgreement(*agreed, plan.edp, g.slot);
    shape.chunk_bytes = a.chunk_bytes;
    shape.sequential = a.sequential;
    shape.graph = a.graph;
    // Opt-in: the steps on a blocking twin of a communicator formed here (rank 0's choice, and only when every
    // member can split: so every member splits or none does); the engine's own communicator is used as it is.
    bool blocking = false;
    if (nccl_comm == nullptr && a.blocking && a.all_split) {
      auto twin = DpNcclExchange::BlockingTwin(comm, me, broken, e->form_timeout());
      if (twin.ok()) {
        comm = *twin;
        blocking = true;
      } else if (!absl::IsUnimplemented(twin.status())) {
        return twin.status();  // both communicators aborted
      }
    }
    std::vector<ShardLayer> shard;
    for (int64_t l = 0; l < L; ++l) {
      const auto& li = table.layers()[static_cast<size_t>(l)];
      shard.push_back({table.device_records(static_cast<int>(l)), li.row_begin, li.row_end});
    }
    ASSIGN_OR_RETURN(e->exchange_, DpNcclExchange::Create(shape, comm, /*own_comm=*/nccl_comm == nullptr, stream,
                                                          std::move(shard), broken, e->watch_.timeout()));
    // Peer reads for small slots, when every member's shard is in GPU memory: all members decide alike, since the
    // facts (slot, every member's shard kind, the agreed threshold) are the group's.
    if (g.slot <= a.peer_max_slot && a.all_on_gpu) RETURN_IF_ERROR(e->TryPeerReads());
    RETURN_IF_ERROR(e->CreateStepResources(max_tokens, L));
    e->watchdog_ = std::thread([raw = e.get()] { raw->Watch(); });
    Log().info(
        "engram: event=dp_group_formed transport=nccl group={} members={} edp_rank={} slot={} path={} "
        "a2a={} nccl={} chunks={} exchange_bytes={}",
        g.group, g.members.size(), me, g.slot, e->peer_ ? "nvlink-peer" : "all-to-all",
        shape.sequential ? "sequential"
        : shape.graph    ? "graph"
                         : "pipelined",
        nccl_comm != nullptr ? "engine's"
        : blocking           ? "blocking"
                             : "non-blocking",
        e->exchange_->chunks(static_cast<int32_t>(L)), e->exchange_->device_bytes());
    return std::unique_ptr<LookupEngine>(std::move(e));
  }

 private:
  explicit DpDeviceEngine(const Table& table) : table_(&table), watch_(DpStepTimeout(table.tuning())) {}

  std::chrono::milliseconds form_timeout() const { return DpFormTimeout(table_->tuning()); }

  // The staging the exchange writes: every layer's bf16 rows of the whole TP shard's columns; columns outside the
  // group's range stay zero.
  absl::Status AllocateStaging(int64_t L, int64_t D) {
    for (int64_t l = 0; l < L; ++l) {
      uint16_t* p = nullptr;
      const size_t bytes = static_cast<size_t>(max_tokens_) * cols_ * D * 2;
      if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMemset(p, 0, bytes) != cudaSuccess) {
        return absl::ResourceExhaustedError("cannot allocate the DP staging buffers on the GPU");
      }
      staging_.push_back(p);
    }
    return absl::OkStatus();
  }

  // Every member leaves ExchangePeerShards with the same answer: where the GPUs cannot map each other's memory the
  // whole group takes the all-to-all path instead.
  absl::Status TryPeerReads() {
    const absl::Status peer = exchange_->ExchangePeerShards(table_->device_records(0));
    if (peer.ok()) {
      peer_ = true;
    } else if (absl::IsFailedPrecondition(peer)) {
      Log().warn("engram: event=dp_peer_reads_unavailable group={} reason={} (the group uses the all-to-all path)",
                 engram::LogValue(group_->formed().group), engram::LogQuoted(std::string(peer.message())));
    } else {
      return peer;
    }
    return absl::OkStatus();
  }

  // The events, the prefetch stream and the device copy of host hash ids that the steps use.
  absl::Status CreateStepResources(int32_t max_tokens, int64_t L) {
    for (cudaEvent_t* ev : {&ids_ready_, &prefetched_event_}) {
      if (cudaEventCreateWithFlags(ev, cudaEventDisableTiming) != cudaSuccess) {
        return absl::InternalError("cudaEventCreate failed");
      }
    }
    for (cudaEvent_t& ev : step_events_) {
      if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
        return absl::InternalError("cudaEventCreate failed");
      }
    }
    if (cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMalloc(&d_ids_, static_cast<size_t>(max_tokens) * L * cols_ * 4) != cudaSuccess) {
      return absl::ResourceExhaustedError("cannot create the DP prefetch stream and id buffer");
    }
    return absl::OkStatus();
  }

  // Every member's `mine` (the same length on each), member m's at [m * mine.size(), ...): one all-gather through
  // the communicator, polled with the group's broken check.
  absl::StatusOr<std::vector<int32_t>> AllGatherInts(ncclComm_t comm, int32_t n, const std::vector<int32_t>& mine) {
    std::vector<int32_t> got(static_cast<size_t>(n) * mine.size());
    RETURN_IF_ERROR(DpNcclExchange::AllGather(
        comm, stream_, n, mine.data(), mine.size() * 4, got.data(), [this] { return group_->Broken(); },
        std::chrono::steady_clock::now() + form_timeout(), "the group's first all-gather"));
    return got;
  }

  absl::Status Fail(absl::Status st) {
    if (failed_.ok()) {
      // A collective that fails because a member died usually races engramd's word on it (NCCL sees the closed
      // socket first): wait briefly for the group's reason, so that the error names the member that left.
      if (st.code() == absl::StatusCode::kInternal || st.code() == absl::StatusCode::kDeadlineExceeded) {
        std::optional<std::string> why = group_->Broken();
        for (int i = 0; !why && i < 50; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          why = group_->Broken();
        }
        if (why) st = absl::Status(st.code(), absl::StrCat(st.message(), " (", *why, ")"));
      }
      failed_ = st;
      exchange_->Abort(std::string(st.message()));
      // The others learn it from engramd at once instead of at their step timeout.
      group_->Leave(absl::StrCat("its DP engine failed a step: ", st.message()));
    }
    return failed_;
  }

  absl::Status Step(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int l0, int nl,
                    void* const* outs, bool packed, cudaStream_t stream) {
    if (!failed_.ok()) return failed_;
    if (auto why = group_->Broken()) return Fail(absl::AbortedError(*why));
    if (auto why = exchange_->aborted()) return Fail(absl::AbortedError(*why));
    if (T < 0 || T > max_tokens_) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(T, " tokens; the engine was sized for ", max_tokens_)));
    }
    if (auto st = exchange_->Step(ids, token_stride, layer_stride, T, l0, nl, outs, packed, peer_, stream); !st.ok()) {
      if (auto why = exchange_->aborted()) return Fail(absl::AbortedError(*why));
      return Fail(st);
    }
    std::lock_guard<std::mutex> lock(mu_);
    // The step's end, for the watchdog: one event per queued step. With the ring full (a host 64 steps ahead) the
    // step is not tracked: the oldest ones are, and they overstay first if a member stalls.
    if (queued_ < kStepEvents) {
      cudaEventRecord(step_events_[(oldest_ + queued_) % kStepEvents], stream);
      ++queued_;
      watch_.Enqueued(StepWatch::Clock::now());
    }
    return absl::OkStatus();
  }

  // Aborts the communicator when the group breaks or a step overstays: kernels stuck on a dead member end.
  // A broken group: a step still queued gets a short grace to finish (a member that left after its last step is
  // no reason to cut ours), then the communicator is aborted so nothing waits on the member that is gone.
  void Watch() {
    cudaSetDevice(device_);
    std::optional<std::chrono::steady_clock::time_point> broken_at;
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::optional<std::string> why = group_->Broken();
      std::lock_guard<std::mutex> lock(mu_);
      const auto now = StepWatch::Clock::now();
      while (queued_ > 0 && cudaEventQuery(step_events_[oldest_]) != cudaErrorNotReady) {
        oldest_ = (oldest_ + 1) % kStepEvents;
        --queued_;
        watch_.Finished(now);
      }
      const bool pending = queued_ > 0;
      if (why && !broken_at) broken_at = now;
      if (why && (!pending || now - *broken_at > std::chrono::milliseconds(1000))) {
        aborted_in_flight_ = pending;
        abort_reason_ = *why;
        exchange_->Abort(*why);
        return;
      }
      // No queued step has finished for the timeout (enqueueing more does not restart it: client/dp/step_watch.h).
      if (watch_.Overdue(now)) {
        aborted_in_flight_ = true;
        abort_reason_ = absl::StrCat("no queued DP step finished within ", watch_.timeout().count(),
                                     " ms (a member stalled; ENGRAM_DP_STEP_TIMEOUT_MS)");
        exchange_->Abort(abort_reason_);
        return;
      }
    }
  }

  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;             // the prefetch stream
  cudaEvent_t ids_ready_ = nullptr;         // recorded on stream_ by Prefetch: the side stream starts after it
  cudaEvent_t prefetched_event_ = nullptr;  // the prefetch step's end on side_, joined by Wait
  int32_t* d_ids_ = nullptr;                // host hash ids copied for the device [max_tokens, L, cols]
  int device_ = 0;
  int64_t cols_ = 0;
  int32_t max_tokens_ = 0;
  const Table* table_ = nullptr;
  std::unique_ptr<LookupEngine> inner_;
  std::unique_ptr<DpGroup> group_;
  std::unique_ptr<DpNcclExchange> exchange_;
  std::vector<uint16_t*> staging_;
  bool peer_ = false;
  absl::Status failed_;
  absl::Status prefetched_ = absl::FailedPreconditionError("wait before any prefetch");
  std::mutex mu_;  // the step events, watch_, aborted_in_flight_, abort_reason_
  static constexpr int kStepEvents = 64;
  cudaEvent_t step_events_[kStepEvents] = {};  // a ring: queued_ steps' ends from oldest_ on
  int oldest_ = 0, queued_ = 0;
  StepWatch watch_;
  bool aborted_in_flight_ = false;  // the abort cut a queued step short
  std::string abort_reason_;
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
