// Synthetic checkpoints: a real, small-or-large DeepseekV41ForCausalLM checkpoint directory written for tests,
// demos and benchmarks (config.json, a byte-level BPE tokenizer.json, tokenizer_config.json, safetensors shards and
// model.safetensors.index.json). Table contents are deterministic pseudo-random FP8 (no NaN encodings) with ue8m0
// scales in [2^-12, 2^3]; every byte is a function of (seed, tensor, offset), so tests can recompute any of it.
//
// The compressed vocabulary is computed from the generated tokenizer with the model library's TokenMap and written
// into the config; `engram_vocab_size` is chosen so that the tables total about `table_mib`.
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
  int64_t shards = 2;         // safetensors files, at most one per layer (round-robin); >1 writes an index
  bool model_prefix = false;  // name tensors "model.layers..." as some exporters do
  int threads = 0;            // 0 = hardware concurrency
};

struct SyntheticResult {
  int64_t compressed_vocab = 0;
  int64_t raw_vocab = 0;
  int64_t engram_vocab_size = 0;
  uint64_t table_bytes = 0;  // records
  uint64_t file_bytes = 0;   // all safetensors files
  double seconds = 0;
};

absl::StatusOr<SyntheticResult> WriteSyntheticCheckpoint(const SyntheticSpec& spec);

// The byte at `offset` of the named tensor's data, as the generator wrote it (for tests).
uint8_t SyntheticByte(uint64_t seed, const std::string& tensor, uint64_t offset, bool is_scale, bool is_bf16);

// The tokenizer.json text the generator writes (byte-level BPE).
std::string SyntheticTokenizerJson(uint64_t seed);

}  // namespace engram::tools
