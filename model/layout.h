// Layout: everything about an Engram model's tables that derives from config.json and the compressed vocabulary size
// alone (docs/math.md, sections 3, 4 and 8): the hash multipliers (bit-exact with NumPy), the prime bucket of every
// (layer, order, head) column, the column offsets inside each layer's table, and how TP shards split the columns.
//
//   ASSIGN_OR_RETURN(Layout layout, Layout::Build(config));
//   layout.multipliers(l)[s], layout.primes(l)[c], layout.offsets(l)[c]     (l: index into engram_layer_ids)
//   ASSIGN_OR_RETURN(ShardRange r, layout.Shard(tp_size, tp_rank));
//
// Build validates that each layer's primes sum to `engram_num_embeddings` (a checkpoint whose table does not match
// its hashing would be silently wrong) and refuses more than kMaxEngramLayers layers (config.h); the prime search
// is linear in the number of buckets (one NextPrime each, see layout.cc). A Layout is immutable after Build; share
// it freely across threads.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"

namespace engram {

// A TP shard: the contiguous column range it owns and, per layer, the contiguous row range those columns cover.
struct ShardRange {
  int64_t tp_size = 1;
  int64_t tp_rank = 0;
  int64_t col_begin = 0;  // [col_begin, col_end)
  int64_t col_end = 0;
  std::vector<int64_t> row_begin;  // per layer, [row_begin, row_end) of that layer's table
  std::vector<int64_t> row_end;
  int64_t rows() const;  // summed over layers
  int64_t bytes(int64_t record_bytes) const { return rows() * record_bytes; }
};

class Layout {
 public:
  static absl::StatusOr<Layout> Build(const EngramConfig& config);

  const EngramConfig& config() const { return config_; }
  int64_t n_layers() const { return config_.n_layers(); }
  int64_t n_cols() const { return config_.n_cols(); }
  int64_t max_ngram() const { return config_.max_ngram_size; }
  int64_t record_bytes() const { return config_.record_bytes(); }
  // NumPy bound for the multiplier draw: max(1, (INT64_MAX / compressed_vocab) / 2).
  int64_t multiplier_bound() const { return bound_; }

  const std::vector<int64_t>& multipliers(int64_t layer) const { return multipliers_[layer]; }  // N values
  const std::vector<int64_t>& primes(int64_t layer) const { return primes_[layer]; }            // n_cols values
  const std::vector<int64_t>& offsets(int64_t layer) const { return offsets_[layer]; }          // n_cols values
  // FastModMagic of every prime (fast_mod.h), for division-free `rolling % prime`.
  const std::vector<uint64_t>& mod_magics(int64_t layer) const { return magics_[layer]; }
  int64_t rows(int64_t layer) const { return rows_[layer]; }
  int64_t total_rows() const;
  int64_t table_bytes() const { return total_rows() * record_bytes(); }

  // docs/math.md section 8: part = ceil(n_cols / tp_size); shard r owns [r*part, min((r+1)*part, n_cols)); every shard
  // must own at least one column.
  absl::StatusOr<ShardRange> Shard(int64_t tp_size, int64_t tp_rank) const;

 private:
  EngramConfig config_;
  int64_t bound_ = 1;
  std::vector<std::vector<int64_t>> multipliers_;
  std::vector<std::vector<int64_t>> primes_;
  std::vector<std::vector<int64_t>> offsets_;
  std::vector<std::vector<uint64_t>> magics_;
  std::vector<int64_t> rows_;
};

// NumPy's multipliers for one layer id: default_rng(10007 * layer_id).integers(0, bound, N, int64) * 2 + 1.
std::vector<int64_t> EngramMultipliers(int64_t layer_id, int64_t max_ngram, int64_t compressed_vocab);

// The prime buckets (docs/math.md section 4) of every layer (config order), per layer n_cols primes, order-major
// then head.
std::vector<std::vector<int64_t>> EngramPrimes(const std::vector<int64_t>& layer_ids, int64_t max_ngram,
                                               int64_t n_heads, int64_t vocab_size_engram);

}  // namespace engram
