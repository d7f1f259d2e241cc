// Synthetic checkpoints: a real, small-or-large DeepseekV41ForCausalLM checkpoint directory written for tests,
// demos and benchmarks (config.json, a byte-level BPE tokenizer.json, tokenizer_config.json, safetensors shards and
// model.safetensors.index.json). Table contents are deterministic pseudo-random FP8 (no NaN encodings) with ue8m0
// scales in [2^-12, 2^3]; every byte is a function of (seed, tensor, offset), so tests can recompute any of it.
//
// The compressed vocabulary is computed from the generated tokenizer with the model library's TokenMap and written
// into the config; `engram_vocab_size` is chosen so that the tables total about `table_mib`, or given.
//
// Sparse checkpoints (`sparse`, and every LikeModel geometry): the tensors have their full shapes but the layer
// tables (embed.weight, embed.scale) hold data only in a few pattern regions (SparsePatternRegions: the first and
// last rows, every column boundary, the rows whose record or weight bytes cross 2^31 .. 2^36) and holes elsewhere,
// so a model-sized checkpoint costs megabytes of disk and seconds to write. A hole reads as zero bytes (a zero row:
// scale byte 0 decodes to +0.0). The regions are listed in `engram-pattern.json` next to config.json for the tools
// that check a node end to end (engram-replica --verify).
// Single call, uses `threads` worker threads for the table data; not reentrant on the same directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace engram::tools {

struct SyntheticSpec {
  std::string out_dir;
  double table_mib = 64;  // approximate total bytes of all Engram tables (records)
  std::vector<int64_t> layers = {1, 3};
  int64_t heads = 4;
  int64_t max_ngram = 3;
  int64_t head_dim = 256;
  int64_t hidden = 256;
  int64_t hc_mult = 4;
  uint64_t seed = 1;
  int64_t shards = 2;             // safetensors files, at most one per layer (round-robin); >1 writes an index
  bool model_prefix = false;      // name tensors "model.layers..." as some exporters do
  int threads = 0;                // 0 = hardware concurrency
  int64_t engram_vocab_size = 0;  // > 0: this engram_vocab_size (table_mib is then ignored)
  bool sparse = false;            // pattern regions only in the layer tables, holes elsewhere
};

// The geometry of a published model, sparse, one safetensors file per layer. Known names: "deepseek-v4.1-flash"
// (engram_layer_ids [1, 14], 8 heads, n-grams up to 4, head_dim 256, engram_vocab_size 16,000,000, hidden 5120,
// hc_mult 4, from the model's config.json: 188.83 GiB of tables). The tokenizer stays the synthetic one, so
// engram_compressed_vocab_size and vocab_size are this generator's, not the model's.
absl::StatusOr<SyntheticSpec> LikeModel(const std::string& name);
std::vector<std::string> KnownModels();

// One region of a sparse table: rows [row_begin, row_end) of a layer's table, written with pattern bytes.
struct PatternRegion {
  int64_t row_begin = 0, row_end = 0;
  std::string why;  // e.g. "last rows", "column 3 starts", "record bytes cross 2^36"
};
inline constexpr int64_t kPatternRegionRows = 256;
inline constexpr char kPatternFileName[] = "engram-pattern.json";

// The regions written for the table of the layer at index `layer` (into engram_layer_ids) of a checkpoint whose
// layers have `rows[i]` rows and whose columns of that layer start at `column_offsets`: sorted, disjoint, inside
// [0, rows[layer]). Byte crossings count record offsets (record_bytes per row) from the start of a TP 1 segment's
// records (all earlier layers first) and weight offsets (head_dim per row) from the start of embed.weight.
std::vector<PatternRegion> SparsePatternRegions(const std::vector<int64_t>& rows, int64_t layer,
                                                const std::vector<int64_t>& column_offsets, int64_t head_dim);

struct SyntheticResult {
  int64_t compressed_vocab = 0;
  int64_t raw_vocab = 0;
  int64_t engram_vocab_size = 0;
  uint64_t table_bytes = 0;    // records
  uint64_t file_bytes = 0;     // all safetensors files (their sizes; a sparse file holds fewer bytes on disk)
  uint64_t written_bytes = 0;  // tensor bytes written (all of them unless sparse)
  double seconds = 0;
};

absl::StatusOr<SyntheticResult> WriteSyntheticCheckpoint(const SyntheticSpec& spec);

// The byte at `offset` of the named tensor's data, as the generator wrote it (for tests).
uint8_t SyntheticByte(uint64_t seed, const std::string& tensor, uint64_t offset, bool is_scale, bool is_bf16);

// The tokenizer.json text the generator writes (byte-level BPE).
std::string SyntheticTokenizerJson(uint64_t seed);

}  // namespace engram::tools
