#include "model/layout.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "model/fast_mod.h"
#include "model/numpy_random.h"
#include "model/primes.h"

namespace engram {

int64_t ShardRange::rows() const {
  int64_t total = 0;
  for (size_t i = 0; i < row_begin.size(); ++i) total += row_end[i] - row_begin[i];
  return total;
}

std::vector<int64_t> EngramMultipliers(int64_t layer_id, int64_t max_ngram, int64_t compressed_vocab) {
  const int64_t bound = std::max<int64_t>(1, (std::numeric_limits<int64_t>::max() / compressed_vocab) / 2);
  NumpyDefaultRng rng(static_cast<uint64_t>(10007 * layer_id));
  std::vector<int64_t> out(static_cast<size_t>(max_ngram));
  for (auto& m : out) m = rng.Integers(0, bound) * 2 + 1;
  return out;
}

namespace {

// docs/math.md section 4 restarts every search at engram_vocab_size - 1 and takes the smallest prime above it not yet
// seen. By induction the seen set is always the k smallest primes above the start (each search skips exactly those and
// takes the next one), so search k+1 returns the (k+1)-th prime above the start: a running cursor yields the same
// sequence with one NextPrime per bucket instead of re-testing every prime already taken (quadratic in layers).
class PrimeCursor {
 public:
  explicit PrimeCursor(int64_t vocab_size_engram) : cur_(static_cast<uint64_t>(vocab_size_engram - 1)) {}
  // The primes of the next layer: (max_ngram - 1) * n_heads of them, order-major then head.
  std::vector<int64_t> NextLayer(int64_t max_ngram, int64_t n_heads) {
    std::vector<int64_t> primes;
    primes.reserve(static_cast<size_t>(std::max<int64_t>(0, (max_ngram - 1) * n_heads)));
    for (int64_t n = 2; n <= max_ngram; ++n) {
      for (int64_t h = 0; h < n_heads; ++h) {
        cur_ = NextPrime(cur_);
        primes.push_back(static_cast<int64_t>(cur_));
      }
    }
    return primes;
  }

 private:
  uint64_t cur_;
};

}  // namespace

std::vector<std::vector<int64_t>> EngramPrimes(const std::vector<int64_t>& layer_ids, int64_t max_ngram,
                                               int64_t n_heads, int64_t vocab_size_engram) {
  PrimeCursor cursor(vocab_size_engram);
  std::vector<std::vector<int64_t>> out;
  out.reserve(layer_ids.size());
  for (size_t l = 0; l < layer_ids.size(); ++l) out.push_back(cursor.NextLayer(max_ngram, n_heads));
  return out;
}

absl::StatusOr<Layout> Layout::Build(const EngramConfig& config) {
  if (config.kind != ModelKind::kEngram) {
    return absl::UnimplementedError(
        absl::StrCat(config.architecture,
                     " uses per-layer embeddings (PLE), whose lookup math is not public: engram can plan "
                     "its placement but cannot hash or serve it"));
  }
  if (config.n_layers() > kMaxEngramLayers) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: `engram_layer_ids` lists ", config.n_layers(),
                                                   " layers, more than the ", kMaxEngramLayers, " allowed"));
  }
  if (config.num_embeddings.size() != config.layer_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: `engram_num_embeddings` has ",
                                                   config.num_embeddings.size(), " entries for ",
                                                   config.layer_ids.size(), " Engram layers"));
  }
  Layout l;
  l.config_ = config;
  l.bound_ = std::max<int64_t>(1, (std::numeric_limits<int64_t>::max() / config.compressed_vocab_size) / 2);
  // Layer by layer, so that a table that does not match its primes stops the search at that layer.
  PrimeCursor cursor(config.vocab_size_engram);
  for (size_t i = 0; i < config.layer_ids.size(); ++i) {
    l.primes_.push_back(cursor.NextLayer(config.max_ngram_size, config.n_heads));
    l.multipliers_.push_back(
        EngramMultipliers(config.layer_ids[i], config.max_ngram_size, config.compressed_vocab_size));
    std::vector<int64_t> offsets;
    int64_t sum = 0;
    for (int64_t p : l.primes_[i]) {
      offsets.push_back(sum);
      sum += p;
    }
    if (sum != config.num_embeddings[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: engram_num_embeddings[", i, "] (layer ", config.layer_ids[i], ") is ", config.num_embeddings[i],
          " but its ", l.primes_[i].size(), " prime buckets sum to ", sum, ": the table does not match the hashing"));
    }
    l.offsets_.push_back(std::move(offsets));
    std::vector<uint64_t> magics;
    for (int64_t p : l.primes_[i]) magics.push_back(FastModMagic(static_cast<uint64_t>(p)));
    l.magics_.push_back(std::move(magics));
    l.rows_.push_back(sum);
  }
  return l;
}

int64_t Layout::total_rows() const {
  int64_t t = 0;
  for (int64_t r : rows_) t += r;
  return t;
}

absl::StatusOr<ShardRange> Layout::Shard(int64_t tp_size, int64_t tp_rank) const {
  const int64_t cols = n_cols();
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("TP rank ", tp_rank, " of size ", tp_size, " is not valid"));
  }
  const int64_t part = (cols + tp_size - 1) / tp_size;
  if ((tp_size - 1) * part >= cols) {
    return absl::InvalidArgumentError(absl::StrCat("TP size ", tp_size, " leaves a shard without columns: ", cols,
                                                   " hash columns split in parts of ", part));
  }
  ShardRange r;
  r.tp_size = tp_size;
  r.tp_rank = tp_rank;
  r.col_begin = tp_rank * part;
  r.col_end = std::min((tp_rank + 1) * part, cols);
  for (int64_t layer = 0; layer < n_layers(); ++layer) {
    const auto& off = offsets_[layer];
    r.row_begin.push_back(off[r.col_begin]);
    r.row_end.push_back(r.col_end == cols ? rows_[layer] : off[r.col_end]);
  }
  return r;
}

}  // namespace engram
