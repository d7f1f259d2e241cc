// LookupEngine: one replica's per-step Engram path over an attached Table, the same calls on either backend, and
// the library's one public way to hash, look up and gate:
//   Hash -> (Prefetch ... Wait(layer) | Lookup) -> Gate.
// CUDA backend: the fused kernels on the caller's stream, pointers are device pointers (DeviceEngine).
// CPU backend (no usable GPU): the CPU reference, pointers are host pointers, Prefetch computes every layer into
// the staging buffers at once and Wait returns at once. Staging buffers sit at fixed addresses, sized from
// max_tokens (CUDA-graph friendly). Every misuse (null, too many tokens, layer out of range) is a Status.
// DP_SHARDED table (embedding_across_dp): Create joins the node-local DP group and the exchange runs inside
// Prefetch/Lookup, collectives every member calls (client/dp/dp_engine.h); CreateOnHost sees only the local shard.
// Lookup paths (CUDA backend): the UVA kernel (graph-capturable; row-order gather from 12288 items) or
// the host-gather path (client/engine/host_gather.h: CPU threads, pinned staging, chunked copies, GPU unpack, a share
// of the tokens on the UVA row-order kernel at the same time), which is host work and so runs only outside CUDA graph
// capture. LookupPath::kAuto picks per batch; SetLookupPath forces.
// One thread drives one engine; the Table must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engram/client.h"

namespace engram::client {

// kAuto: the host-gather path when the stream is not capturing, the ids are host memory and the engine's table of
// measured winners (per batch size in items per layer, from bench_kernels; the file named by
// ENGRAM_LOOKUP_PATH_TABLE or a plain threshold ENGRAM_HOST_GATHER_MIN_ITEMS replace it) says host; else UVA. kUva /
// kHostGather force a path (ENGRAM_LOOKUP_PATH=uva|host|auto sets the engine's initial choice). kHostGather under graph
// capture is an error.
enum class LookupPath { kAuto, kUva, kHostGather };
inline const char* LookupPathName(LookupPath p) {
  return p == LookupPath::kUva ? "uva" : p == LookupPath::kHostGather ? "host_gather" : "auto";
}

// Where one layer's lookup writes, for an engine that owns its output layout (vLLM's `out`): the window of
// columns [col_begin, col_begin + num_cols) of the hash ids (a TP rank's heads), written as rows j = 0..num_cols-1
// of each token; token t's first row at out + t * out_token_stride (bf16 elements, or bytes when packed; 0 = dense,
// num_cols rows per token); `background` leaves most of the GPU to the caller's other streams (a small grid).
struct LookupWindow {
  int32_t col_begin = 0;
  int32_t num_cols = -1;  // -1: every column from col_begin on
  int64_t out_token_stride = 0;
  bool background = false;
  bool ids_int64 = false;  // `ids` points at int64 ids (SGLang's); an id past int32 is outside every table
};

struct GateInputs {
  const uint16_t* hidden = nullptr;    // bf16 [T, hc, D]
  const uint16_t* kv = nullptr;        // bf16 [T, (hc+1)*D]
  const uint16_t* q_weight = nullptr;  // bf16 [hc, D]
  const uint16_t* k_weight = nullptr;  // bf16 [hc, D]
  const uint8_t* mask = nullptr;       // [T], nonzero = DEAD; may be null
  uint16_t* out = nullptr;             // bf16 [T, hc, D]
  int32_t num_tokens = 0, hc_mult = 0, dim = 0;
  float eps = 1e-6f;
};

class LookupEngine {
 public:
  // `stream` is a cudaStream_t for the CUDA backend (nullptr: the default stream); ignored on the CPU backend.
  static absl::StatusOr<std::unique_ptr<LookupEngine>> Create(const Table& table, int32_t max_tokens,
                                                              void* stream = nullptr);
  // staging false: no staging buffers (an engine that only looks up into its caller's buffers, as the engine
  // plugins do, saves n_layers x max_tokens x n_cols x head_dim bf16 of GPU memory); Prefetch and staging() then
  // fail / return null. DP_SHARDED tables always get them (their exchange writes there).
  static absl::StatusOr<std::unique_ptr<LookupEngine>> Create(const Table& table, int32_t max_tokens, void* stream,
                                                              bool staging);
  // The CPU engine over the table's host records whatever its backend (host pointers in and out): the C API's host
  // calls and host-side checks. Its lookups fail with FailedPrecondition on a DEVICE table (no host copy). Unlike
  // Create, it does not report its choice to engramd (a checker beside the serving engine is not what it runs).
  static absl::StatusOr<std::unique_ptr<LookupEngine>> CreateOnHost(const Table& table, int32_t max_tokens);
  virtual ~LookupEngine() = default;
  virtual Backend backend() const = 0;
  // What this engine chose when it was made and why, as one line of key=value pairs (backend=, lookup_path=, its
  // calibration's choices and timings); Create reports it to engramd through the table's session.
  virtual std::string choice() const { return absl::StrCat("backend=", backend() == Backend::kCuda ? "cuda" : "cpu"); }

  // Flattened batch of `num_requests` requests (docs/math.md section 5): out [T, n_layers, n_cols] int32 row ids.
  // lookback [R, N-1] raw ids oldest first, -1 unknown (null: all unknown); lookback_dead [R, N-1] nonzero = that
  // lookback id is DEAD, in the columns of `lookback` and read only where the id is known (null: none; needs
  // lookback); dead [T] nonzero = DEAD (null: none).
  virtual absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* query_start_loc,
                            const int32_t* lookback, const uint8_t* lookback_dead, const uint8_t* dead,
                            int32_t num_tokens, int32_t num_requests, int32_t* out) = 0;
  // The same with no lookback id dead.
  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* query_start_loc,
                    const int32_t* lookback, const uint8_t* dead, int32_t num_tokens, int32_t num_requests,
                    int32_t* out) {
    return Hash(tokens, positions, query_start_loc, lookback, nullptr, dead, num_tokens, num_requests, out);
  }
  // Rows of layer `l` for ids[t * ids_stride + c]: bf16 [T, n_cols, head_dim] or packed [T, n_cols, record_bytes].
  virtual absl::Status Lookup(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                              bool packed) = 0;
  // The same rows into the caller's layout (LookupWindow): ids still point at column 0 of token 0 (the window's
  // columns are read at ids[t * ids_stride + window.col_begin + j]). Engines of a DP_SHARDED table take only the
  // dense full window (the exchange writes whole tokens).
  virtual absl::Status LookupInto(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                                  bool packed, const LookupWindow& window);
  virtual absl::Status Gate(const GateInputs& g) = 0;
  // Every layer's rows for hash ids [T, n_layers, n_cols] into staging(l) (bf16 [max_tokens, n_cols, head_dim]).
  // CUDA backend: hash_ids may be device or host memory; the host-gather path reads host ids (device ids cost a
  // copy and a stream synchronisation; host ids must stay valid until Wait of the last layer has returned), the UVA
  // path device ids (host ids are copied).
  virtual absl::Status Prefetch(const int32_t* hash_ids, int32_t num_tokens) = 0;
  virtual absl::Status Wait(int l) = 0;
  // The path of later Prefetch calls (kAuto by default). The CPU backend has one path and accepts only kAuto.
  virtual absl::Status SetLookupPath(LookupPath path) {
    return path == LookupPath::kAuto ? absl::OkStatus()
                                     : absl::UnimplementedError("this engine has a single lookup path");
  }
  // The path the last Prefetch took (kAuto before the first, and on the CPU backend).
  virtual LookupPath last_lookup_path() const { return LookupPath::kAuto; }
  // Layer l's staging buffer; null for a layer out of range, an engine made without staging, or (CPU backend,
  // allocated on first use) staging memory that could not be allocated: Prefetch then says so (ResourceExhausted)
  // and the engine stays usable.
  virtual uint16_t* staging(int l) const = 0;
  // What the base LookupInto checks against (engines that keep the default implementation say it).
  virtual const Table* table_for_checks() const { return nullptr; }
  virtual int32_t max_tokens_for_checks() const { return 0; }
  // The CUDA stream later calls run on (a cudaStream_t; nullptr: the default stream), so that an engine follows
  // its caller's current stream (torch's, under graph capture a side stream torch picks). The CPU backend ignores it.
  virtual absl::Status SetStream(void* stream) {
    (void)stream;
    return absl::OkStatus();
  }

 protected:
  // The checks every LookupInto makes: the layer, the window inside [0, n_cols) and the ids' stride, the output's
  // token stride at least one dense token. Returns the window with num_cols resolved.
  absl::StatusOr<LookupWindow> CheckWindow(const Table& table, int l, const int32_t* ids, int32_t num_tokens,
                                           int32_t max_tokens, int64_t ids_stride, const void* out, bool packed,
                                           const LookupWindow& window) const;
};

}  // namespace engram::client
