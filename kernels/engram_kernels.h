// The fused Engram GPU kernels (the hash, lookup and gate of docs/math.md) and their launch wrappers. Callable from
// plain C++ (no CUDA compiler needed to include this header). Every pointer is a device pointer (or, for lookup
// records, a host pointer registered with CUDA and usable through UVA); shapes are runtime values, so one build serves
// any batch. Launches are asynchronous on the given stream; the wrappers validate what they can see on the host
// (shapes, nulls) and return cudaErrorInvalidValue for misuse, or the launch's error. Results equal the CPU
// reference in model/reference.h bit for bit (hash, lookup) or within bf16 rounding of a float64 oracle (gate).
//
// One piece of process-wide state: the row-order gather's tuning (LookupTuning below: atomics, set by the engine
// from its configuration and by benchmarks; a launch reads it once). Otherwise stateless; thread-safe as far as the
// CUDA runtime is. The kernels live in hash_kernels.cu, lookup_kernels.cu (with lookup_gather.cuh) and
// gate_kernels.cu; the tuning state in lookup_tuning.cc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

namespace engram::kernels {

// The layout tables of a model on the device (see DeviceLayout in device_layout.h for the owner).
struct LayoutView {
  int32_t n_layers = 0;
  int32_t max_ngram = 0;                 // N
  int32_t n_heads = 0;                   // H; n_cols = (N-1) * H
  const int64_t* multipliers = nullptr;  // [L, N]
  const int64_t* primes = nullptr;       // [L, C]
  const int64_t* offsets = nullptr;      // [L, C]
  const uint64_t* magics = nullptr;      // [L, C] FastModMagic(prime)
  const int32_t* token_map = nullptr;    // [vocab] raw id -> compressed id
  int32_t vocab = 0;
  int64_t pad_compressed = 0;  // token_map[pad_token_id]
  int32_t n_cols() const { return (max_ngram - 1) * n_heads; }
};

struct HashArgs {
  const int32_t* tokens = nullptr;           // [T] raw ids
  const int64_t* positions = nullptr;        // [T]
  const int32_t* query_start_loc = nullptr;  // [R+1]
  const int32_t* lookback = nullptr;         // [R, N-1] raw ids, -1 unknown; may be null (all unknown)
  const uint8_t* dead = nullptr;             // [T], nonzero = DEAD; may be null
  int32_t num_tokens = 0;
  int32_t num_requests = 0;
  int32_t* out = nullptr;  // [T, L, C]
  // Raised (set to 1) when a raw id lies outside the token map or positions are not contiguous; such a token is
  // hashed as DEAD. May be null.
  int32_t* error_flag = nullptr;
  // [R, N-1] nonzero = that lookback id is DEAD (the columns of `lookback`; read only where the id is not -1); may be
  // null (none dead). Needs `lookback`.
  const uint8_t* lookback_dead = nullptr;
};

cudaError_t LaunchHash(const LayoutView& layout, const HashArgs& args, cudaStream_t stream);

struct LookupArgs {
  const uint8_t* records = nullptr;  // record of row `row_begin` first; record = head_dim e4m3 + head_dim/32 ue8m0
  int64_t row_begin = 0;             // owned range [row_begin, row_end) of this layer's global row ids
  int64_t row_end = 0;
  int32_t head_dim = 0;            // multiple of 32
  const int32_t* ids = nullptr;    // ids[t * ids_stride + c]
  const int64_t* ids64 = nullptr;  // the same as int64 ids (SGLang's), read instead of `ids` when set
  int32_t num_tokens = 0;
  int32_t num_cols = 0;
  int64_t ids_stride = 0;  // usually L * C (the hash output of all layers), pointer offset by layer*C
  void* out = nullptr;     // bf16 [T, C, head_dim] or packed bytes [T, C, record_bytes]
  // Token t's first row at out + t * out_token_stride (bf16 values, or bytes when packed); 0 = dense (C rows per
  // token). bf16: a multiple of 8 values (16-byte rows). Packed: any stride (8-byte words where it is a multiple
  // of 8 and `out` 8-byte aligned, else bytes).
  int64_t out_token_stride = 0;
  bool packed = false;
  // Grid size cap: 0 = a persistent grid sized to the whole GPU (the row-order gather: LookupTuning::sort_blocks);
  // a background lookup passes a few blocks.
  int32_t max_blocks = 0;
  // Optional device scratch of LookupSortScratchBytes(items) bytes. With it, batches of at least
  // GetLookupTuning().sort_min_items items are gathered in row order (sorted (row, item) pairs): same output, and
  // through UVA faster for large batches, because address translation, not PCIe, bounds a random gather from a
  // large host table (bench/RESULTS.md); small batches gain nothing from the order and pay the sort. Records in
  // device memory (cudaPointerGetAttributes says so; not asked while `stream` is being captured) are not sorted.
  void* sort_scratch = nullptr;
  size_t sort_scratch_bytes = 0;
  // The row-order threshold for this launch (items); -1: the process-wide LookupTuning::sort_min_items. An engine
  // passes the threshold it calibrated on its own table (client/engine/device_engine.h).
  int64_t sort_min_items = -1;
  // The plain (item-order) gather's shape: rows in flight per warp (1, 2, 4 or 8; 0 = LookupTuning::plain_rows)
  // and warps per block (1, 2, 4 or 8; 0 = LookupTuning::plain_block_warps). At decode sizes (a few dozen rows) the
  // launch is one host read's latency, and how the rows spread over warps and SMs is what an engine calibrates
  // (client/engine/device_engine.h); larger batches keep the defaults.
  int32_t plain_rows = 0;
  int32_t plain_block_warps = 0;
};

// A shape of the plain gather is valid when both fields are 0 (the defaults) or one of 1, 2, 4, 8.
bool ValidPlainShape(int32_t rows, int32_t block_warps);

size_t LookupSortScratchBytes(int64_t max_items);

// Process-wide tuning of the row-order gather, read by every LaunchLookup (benchmarks and tests change it; the
// defaults are the measured best, bench/RESULTS.md). Environment overrides, read once at first use:
// ENGRAM_LOOKUP_SORT_MIN_ITEMS, ENGRAM_LOOKUP_SORT_VARIANT, ENGRAM_LOOKUP_SORT_BLOCKS. Thread-safe (each field is read
// atomically).
struct LookupTuning {
  int64_t sort_min_items = 12288;  // row-order gather from this many items per launch (when scratch is given)
  // How the sorted positions are spread over the grid: 0 = grid-stride, 4 rows in flight per warp; 1 = 8 rows per
  // warp; 2 = one contiguous run of positions per block (4 rows per warp); 3 = runs, 8 rows per warp.
  int32_t sort_variant = 1;
  // Grid of the row-order gather when the caller sets no max_blocks (0 = the persistent grid). Few rows in flight
  // keep the in-flight rows in a narrow span of the table, which the GPU's address translation caches serve far
  // better than the whole GPU's worth of rows spread over the table (bench/RESULTS.md).
  int32_t sort_blocks = 16;
  bool sort_only = false;  // profiling: sort, then skip the gather (the output is left unwritten)
  // The plain gather's default shape (LookupArgs::plain_rows / plain_block_warps): 4 rows per warp, 8 warps; up to
  // decode_items items, 1 row per warp and 4 warps per block (at 1-64 tokens x 24 columns of a 16 GiB host table
  // on the H200, within 2% of the best of the 16 shapes at every size, and 1.6x faster than 4 x 8 at one token:
  // bench/RESULTS.md). An engine times the shapes on its own table (client/engine/calibration.h).
  int32_t plain_rows = 4;
  int32_t plain_block_warps = 8;
  int64_t decode_items = 1536;
  int32_t decode_rows = 1;
  int32_t decode_block_warps = 4;
};
LookupTuning GetLookupTuning();
void SetLookupTuning(const LookupTuning& tuning);
// Sets only the row-order gather's variant (clamped to 0..3) and/or grid (at least 0), each where given, leaving
// every other field as it is: two engines created at once, each naming one, both take effect (a get-then-set of the
// whole record could write back the other's old value).
void SetLookupSortShape(std::optional<int32_t> variant, std::optional<int32_t> blocks);

cudaError_t LaunchLookup(const LookupArgs& args, cudaStream_t stream);

struct GateArgs {
  const uint16_t* hidden = nullptr;    // bf16 [T, hc, D]
  const uint16_t* kv = nullptr;        // bf16 [T, (hc+1)*D]
  const uint16_t* q_weight = nullptr;  // bf16 [hc, D]
  const uint16_t* k_weight = nullptr;  // bf16 [hc, D]
  const uint8_t* mask = nullptr;       // [T] nonzero = DEAD (gate 0); may be null
  uint16_t* out = nullptr;             // bf16 [T, hc, D]
  int32_t num_tokens = 0;
  int32_t hc_mult = 0;
  int32_t dim = 0;  // D, multiple of 8
  float eps = 1e-6f;
};

cudaError_t LaunchGate(const GateArgs& args, cudaStream_t stream);

// Multiprocessor count of the current device (cached per device).
int DeviceSmCount();

}  // namespace engram::kernels
