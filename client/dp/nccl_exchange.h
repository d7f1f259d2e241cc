// DpNcclExchange: the production transport of the DP-sharded exchange (client/dp/plan.h) on the GPU, over NCCL
// (loaded at run time with dlopen("libnccl.so.2"): the library is linked dynamically, never bundled, and a process
// that never runs DP_SHARDED never needs it). Two paths, the same rows bit for bit:
//   collective  (pipelined, the default) this rank's own columns of its own tokens are read straight from its shard
//               into the caller's staging columns (no record, no copy), on a side stream, concurrently with the rest;
//               the other members' columns travel: a grouped send/recv gives each member the ids of its columns
//               (padded with -1 to the group slot: static shapes), one launch packs this rank's 264-byte records for
//               every other member's ids, and one grouped send/recv per chunk of (layer, token) rows moves them: the
//               records of chunk k travel (on a high-priority communication stream) while chunk k + 1 is packed and
//               chunk k - 1 is unpacked to bf16 straight into the caller's columns. Chunks: the step's record bytes
//               over DpExchangeShape::chunk_bytes, a group-wide fact, so every member issues the same collectives.
//               (graph, DpExchangeShape::graph) the same pipelined step captured into a CUDA graph once per
//               (ids, strides, layers, outputs) -- on that shape's second step, the first runs directly -- and
//               replayed: a step costs the host one tiny kernel (the token count into a device scalar that the
//               kernels read; the graph is captured for the full slot) and one cudaGraphLaunch instead of 2 + chunks
//               host-polled NCCL groups (~60 us each on a non-blocking communicator). Captured on the exchange's own
//               stream (relaxed capture mode), replayed on the caller's; up to kMaxGraphs shapes, further ones
//               enqueued directly; under the caller's own capture the step is enqueued directly too (no nested
//               instantiate: the pipelined form becomes part of the caller's graph). Abort destroys the graphs
//               before aborting the communicator (NCCL does not release a communicator while a graph that captured
//               it lives; a graph in flight is freed as it completes).
//               (sequential) the simpler form, for packed output and as DpExchangeShape::sequential: all-gather
//               of every member's ids, lookup of members x slot tokens, one send/recv, own block copied, unpack;
//   peer reads  (slots up to a threshold, every member's shard in GPU memory) each rank reads the other members'
//               shards directly over NVLink (CUDA IPC mappings exchanged once through the communicator): no
//               collective; one launch of the peer gather (kernels/dp_kernels.h) writes bf16 rows straight into the
//               caller's columns (packed output: a lookup per member and a strided copy).
// The path is chosen from the group slot, so every member takes the same one. A step is enqueued on the stream the
// caller passes, into fixed buffers sized at creation; side streams fork from it and join back into it through
// events, so work queued on that stream after Step sees the rows, and nothing synchronises the host (CUDA-graph
// friendly). A communicator formed here is non-blocking (ncclConfig_t.blocking = 0: a member that never comes cannot
// hang the others): every NCCL call is polled with a deadline and an abort check, waits for collective kernels are
// polled too, and Abort() (any thread) calls ncclCommAbort, which ends kernels stuck waiting for a member that died.
// BlockingTwin (opt-in) trades that for less host time per step. Either the engine's own communicator (not owned:
// used as it is, never split, never aborted here) or one formed here from an ncclUniqueId.
// Thread-compatible, except Abort() and aborted(), which are thread-safe.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/dp/nccl_api.h"
#include "client/tuning.h"

namespace engram::client {

// One layer of a shard on the device (or UVA-visible host memory): records of rows [row_begin, row_end).
struct ShardLayer {
  const uint8_t* records = nullptr;
  int64_t row_begin = 0, row_end = 0;
};

struct DpExchangeShape {
  int32_t members = 0, me = 0, slot = 0, layers = 0, cols = 0, head_dim = 0;
  std::vector<int32_t> col_begin, col_end;  // per member (edp rank)
  int32_t group_col_begin = 0, group_col_end = 0;
  // Collective path: record bytes a member sends per chunk, at most (0: one chunk per step); `sequential`: the
  // unpipelined form. Both must be alike on every member (they decide which collectives run).
  // `own_concurrent`: this rank's own columns are read on a side stream from the step's start (else on the step's
  // stream after the packs, while the records travel); a local choice.
  int64_t chunk_bytes = kDefaultDpChunkBytes;
  bool sequential = false;
  bool graph = false;  // the pipelined step as a replayed CUDA graph (a local choice: the collectives are the same)
  bool own_concurrent = false;
  int32_t record_bytes() const { return head_dim + head_dim / 32; }
  // The measured defaults (client/tuning.h, where the measurements are cited).
  static constexpr int64_t kDefaultDpChunkBytes = tuning_default::kDpChunkBytes;
  static constexpr int32_t kDefaultGraphMaxSlot = tuning_default::kDpGraphMaxSlot;
};

class DpNcclExchange {
 public:
  using BrokenFn = std::function<std::optional<std::string>()>;
  // A communicator formed from `id` (rank shape.me of shape.members), polled until ready or `timeout`/`broken`.
  static absl::StatusOr<ncclComm_t> InitComm(const ncclUniqueId& id, int32_t members, int32_t me,
                                             const BrokenFn& broken, std::chrono::milliseconds timeout);
  // Opt-in (ENGRAM_DP_NCCL_BLOCKING=1, off by default): a blocking twin of the non-blocking `comm` InitComm formed
  // (ncclCommSplit, every member calls it, polled like InitComm) for the steps. A non-blocking communicator launches
  // every NCCL group from a new host thread (50-150 us of host time per group on the H200 machines); a blocking one
  // enqueues inline (bench_dp: 13 us). The price, why it is not the default: on a blocking communicator NCCL
  // connects the peers lazily inside the first collectives on the calling thread, and a launch can block behind a
  // stalled peer, so a member that stops (or dies before its first step) can hold the others inside an NCCL call
  // where no deadline or Abort reaches them (Abort needs the lock the step holds). On success `comm` is released and
  // the twin returned; on failure both are aborted. Unimplemented when !SplitSupported() (the caller keeps `comm`).
  static absl::StatusOr<ncclComm_t> BlockingTwin(ncclComm_t comm, int32_t me, const BrokenFn& broken,
                                                 std::chrono::milliseconds timeout);
  // This process can split a twin that does not share its parent's resources (ncclCommSplit present and
  // NCCL_COMM_SPLIT_SHARE_RESOURCES not set): a fact the members agree on before any of them splits.
  static bool SplitSupported();
  // Polls `stream` until its work is done, `stop` names a reason or `deadline` passes (kernels of a collective wait
  // for every member: never an unbounded synchronize).
  static absl::Status WaitStream(cudaStream_t stream, const BrokenFn& stop,
                                 std::chrono::steady_clock::time_point deadline, const char* what);
  // Polls `comm` after an NCCL call that returned `r` until the call is done (ncclSuccess), failed, `stop` names a
  // reason, or `deadline` passes. For a blocking communicator this returns at once.
  static absl::Status Poll(ncclComm_t comm, ncclResult_t r, const BrokenFn& stop,
                           std::chrono::steady_clock::time_point deadline, const char* what);
  // `shard`: this rank's records per layer; `own_comm`: destroy (or abort) the communicator with the exchange.
  static absl::StatusOr<std::unique_ptr<DpNcclExchange>> Create(const DpExchangeShape& shape, ncclComm_t comm,
                                                                bool own_comm, cudaStream_t stream,
                                                                std::vector<ShardLayer> shard, BrokenFn broken,
                                                                std::chrono::milliseconds timeout);
  ~DpNcclExchange();

  // Peer reads: `peers[s][l]` are member s's shard layers as this GPU can address them (its own for s == me).
  void SetPeerShards(std::vector<std::vector<ShardLayer>> peers) { peers_ = std::move(peers); }
  // The collective form of SetPeerShards between processes: every member exports its shard's allocation (CUDA
  // IPC; `alloc_base` is the cudaMalloc base holding every layer) and maps the others'. A collective that every
  // member leaves with the same answer: FailedPrecondition (naming why) when any member could not export or map (GPUs
  // that cannot reach each other's memory), and nothing mapped then; other errors are the collective's own.
  absl::Status ExchangePeerShards(const void* alloc_base);
  // One all-gather of `bytes` per member through `comm` on `stream` into `all` (members x bytes), polled (the call
  // and its kernels) with `stop` and `deadline`; `mu`, when given, is held around the NCCL call.
  static absl::Status AllGather(ncclComm_t comm, cudaStream_t stream, int32_t members, const void* mine, size_t bytes,
                                void* all, const BrokenFn& stop, std::chrono::steady_clock::time_point deadline,
                                const char* what, std::recursive_mutex* mu = nullptr);
  bool has_peers() const { return !peers_.empty(); }
  const ShardLayer& peer_shard(int32_t member, int32_t layer) const {
    return peers_[static_cast<size_t>(member)][static_cast<size_t>(layer)];
  }

  // One step over layers [l0, l0 + nl) on `stream`: ids(t, li, c) = ids[t * token_stride + li * layer_stride + c]
  // (device), outs[l0 + li] receives bf16 [T, cols, head_dim] or, packed, [T, cols, record_bytes]; columns outside
  // the group are left as they are (the caller zeroes them once). `peer`: the peer-read path (needs peer shards).
  absl::Status Step(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int32_t l0, int32_t nl,
                    void* const* outs, bool packed, bool peer, cudaStream_t stream);
  // Chunks of the collective path for a step of `nl` layers (group-wide: slot, column split, chunk_bytes).
  int32_t chunks(int32_t nl) const;

  // Aborts the communicator (thread-safe): kernels waiting for a dead member end; every later Step fails.
  void Abort(const std::string& why);
  std::optional<std::string> aborted() const;
  size_t device_bytes() const { return device_bytes_; }
  ncclComm_t comm() const { return comm_; }

 private:
  DpNcclExchange() = default;
  absl::Status Wait(ncclResult_t r, const char* what);
  absl::Status Cuda(cudaError_t e, const char* what);
  // The peer gather over member s's layer l0 + li as `source(s, li)`, into outs[li] (li < nl): the peer path, and
  // the sequential path's unpack.
  using Source = std::function<ShardLayer(int32_t s, int32_t li)>;
  absl::Status Gather(const Source& source, const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T,
                      int32_t nl, void* const* outs, cudaStream_t stream, const char* what);
  // `live`: a device scalar of the token count (T is then the slot): the graph form's capture.
  absl::Status StepPipelined(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int32_t l0,
                             int32_t nl, void* const* outs, cudaStream_t stream, const int32_t* live = nullptr);
  absl::Status StepGraph(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int32_t l0,
                         int32_t nl, void* const* outs, cudaStream_t stream);
  void DropGraphs();  // with mu_ held
  struct GraphKey {
    const int32_t* ids = nullptr;
    int64_t token_stride = 0, layer_stride = 0;
    int32_t l0 = 0, nl = 0;
    void* outs[4] = {};
    bool operator==(const GraphKey& o) const;
  };
  struct CachedGraph {
    GraphKey key;
    cudaGraphExec_t exec = nullptr;
  };
  static constexpr size_t kMaxGraphs = 4;  // further shapes run the pipelined form directly (no recapture churn)
  std::vector<CachedGraph> graphs_;        // guarded by mu_
  std::vector<GraphKey> seen_;             // shapes stepped once (captured on their second step); guarded by mu_
  int32_t* live_ = nullptr;                // the graph form's token count (device)
  cudaStream_t cap_stream_ = nullptr;
  absl::Status StepSequential(const int32_t* ids, int64_t token_stride, int64_t layer_stride, int32_t T, int32_t l0,
                              int32_t nl, void* const* outs, bool packed, cudaStream_t stream);
  static constexpr int kMaxChunks = 16;

  const NcclApi* nccl_ = nullptr;
  DpExchangeShape shape_;
  ncclComm_t comm_ = nullptr;
  bool own_comm_ = false;
  cudaStream_t stream_ = nullptr;
  std::vector<ShardLayer> shard_;
  std::vector<std::vector<ShardLayer>> peers_;
  std::vector<void*> ipc_opened_;
  BrokenFn broken_;
  std::chrono::milliseconds timeout_{60000};
  int32_t part_ = 0;
  // Side streams of the pipelined path (NCCL on comm_stream_, high priority; own columns on own_stream_) and the
  // events that fork them from the step's stream and join them back.
  cudaStream_t comm_stream_ = nullptr, own_stream_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_split_ = nullptr, ev_ids_ = nullptr, ev_own_ = nullptr, ev_done_ = nullptr;
  cudaEvent_t ev_pack_[kMaxChunks] = {}, ev_recv_[kMaxChunks] = {};
  int32_t* send_ids_ =
      nullptr;  // sequential [slot, layers, cols]; pipelined: per other member [slot, layers, its cols]
  int32_t* all_ids_ =
      nullptr;  // sequential [members, slot, layers, cols]; pipelined: per other member [slot, layers, own]
  uint8_t* send_recs_ = nullptr;  // [members][layers][slot][own cols][rb]
  uint8_t* recv_recs_ = nullptr;  // [members][layers][slot][their cols][rb]
  std::vector<size_t> recv_off_;
  uint16_t* tmp_rows_ = nullptr;   // [slot, part, head_dim] bf16
  int32_t* iota_ = nullptr;        // [slot * part]
  int32_t* unpack_ids_ = nullptr;  // [slot, cols]: the received-block row of (token, column)
  size_t device_bytes_ = 0;
  // Held around NCCL calls, graph capture and launch, and by Abort: never abort a communicator in use (recursive:
  // the graph form holds it across the capture of the pipelined step, which takes it for its NCCL calls).
  mutable std::recursive_mutex mu_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;  // guarded by reason_mu_, set before aborted_
  mutable std::mutex reason_mu_;
};

}  // namespace engram::client
