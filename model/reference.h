// The CPU reference of the Engram kernels (docs/math.md: section 5 hash ids, 6 lookup, 7 gate): the ground truth every
// GPU kernel is compared against, bit for bit (hash, lookup) or within bf16 rounding of a float64 oracle (gate).
// Written for clarity first; hashing is also the CPU backend's hot path, so it avoids per-token allocation.
//
// Inputs are spans with explicit shapes; every inconsistency is an InvalidArgument status, never a crash.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "model/layout.h"
#include "model/token_map.h"

namespace engram {

// A flattened batch of request chunks (the serving engine's view of one step).
struct HashBatch {
  std::span<const int32_t> tokens;           // [T] raw token ids
  std::span<const int64_t> positions;        // [T] absolute positions; contiguous inside each request's chunk
  std::span<const int32_t> query_start_loc;  // [R+1] request boundaries: 0 = qsl[0] <= ... <= qsl[R] = T
  // [R, N-1] raw ids of the N-1 tokens before each chunk (oldest first), -1 where unknown; empty = all unknown.
  std::span<const int32_t> lookback;
  std::span<const uint8_t> dead;  // [T] nonzero = token takes no part in n-grams; empty = none dead
  // [R, N-1] nonzero = that lookback id is DEAD (the columns of `lookback`); read only where the id is known (not -1):
  // an unknown id hashes as pad whatever its flag. Empty = no lookback id is dead; needs `lookback` when given.
  std::span<const uint8_t> lookback_dead = {};
};

// out: [T, n_layers, n_cols] int32 global row ids of each layer's table.
absl::Status HashIdsCpu(const Layout& layout, const TokenMap& token_map, const HashBatch& batch,
                        std::span<int32_t> out);

// A layer's owned rows [row_begin, row_end) as packed records (row_begin's record first).
struct RecordTable {
  const uint8_t* records = nullptr;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t head_dim = 0;
  int64_t record_bytes() const { return head_dim + head_dim / 32; }
};

// out: [n, head_dim] bf16 bits. Ids outside [row_begin, row_end) (or negative) give zero rows.
absl::Status LookupBf16Cpu(const RecordTable& table, std::span<const int32_t> ids, std::span<uint16_t> out);
// out: [n, record_bytes] raw record bytes; zero records for ids outside the owned range.
absl::Status LookupPackedCpu(const RecordTable& table, std::span<const int32_t> ids, std::span<uint8_t> out);

// Packs rows of split weight [n, head_dim] and scale [n, head_dim/32] arrays into records.
void PackRecords(const uint8_t* weight, const uint8_t* scale, int64_t n_rows, int64_t head_dim, uint8_t* out);

struct GateShape {
  int64_t tokens = 0;
  int64_t hc_mult = 0;
  int64_t dim = 0;  // D = hidden_size
  float eps = 1e-6f;
};

// hidden [T, hc, D] bf16, kv [T, (hc+1)*D] bf16, q_weight/k_weight [hc, D] bf16, mask [T] (nonzero = DEAD, may be
// empty) -> out [T, hc, D] bf16 = hidden + g * value, fp32 accumulation.
absl::Status GateCpu(const GateShape& shape, std::span<const uint16_t> hidden, std::span<const uint16_t> kv,
                     std::span<const uint16_t> q_weight, std::span<const uint16_t> k_weight,
                     std::span<const uint8_t> mask, std::span<uint16_t> out);

}  // namespace engram
