// EngramConfig: the Engram fields of a Hugging Face config.json (docs/math.md, section 1), parsed and validated.
//
// ParseEngramConfig accepts the whole config.json text (or the path of the file) and finds the text config, which
// may be nested under `text_config` for multimodal checkpoints. It recognises DeepseekV41ForCausalLM
// (`engram_layer_ids`) and the Qwen4Exp PLE architectures (`ple_layer_ids`); the latter parse but carry kind kPle,
// which callers must refuse honestly where the math is not public. Values are checked for sanity (head_dim a
// multiple of 32, positive sizes, int32-addressable tables); the per-layer row counts are checked against the prime
// buckets by the layout (layout.h), since that needs the primes.
//
// The text is hostile input: nesting deeper than json_util.h's limit, fields of the wrong type and integers outside
// int64 are refused with an error naming the field; no exception escapes. At most kMaxEngramLayers layers.
//
// Plain value type; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace engram {

enum class ModelKind { kEngram, kPle };

// The most Engram (or PLE) layers a config may list. V4.1 has 2; a model has at most a few hundred transformer
// layers, and each Engram layer costs a prime search and a table: 1024 is generous and keeps a hostile config's
// layout work bounded.
inline constexpr int64_t kMaxEngramLayers = 1024;

struct EngramConfig {
  std::string architecture;  // architectures[0]
  ModelKind kind = ModelKind::kEngram;
  std::vector<int64_t> layer_ids;       // engram_layer_ids (or ple_layer_ids)
  std::vector<int64_t> num_embeddings;  // engram_num_embeddings, one per layer (may be empty for PLE)
  int64_t max_ngram_size = 0;           // N
  int64_t n_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size_engram = 0;      // engram_vocab_size: prime search starts above it minus one
  int64_t compressed_vocab_size = 0;  // engram_compressed_vocab_size
  int64_t pad_token_id = 0;           // engram_pad_token_id / engram_pad_id
  int64_t hidden_size = 0;
  int64_t hc_mult = 0;
  double rms_norm_eps = 1e-6;
  int64_t vocab_size = 0;  // the backbone's raw vocab (informational)

  // Derived quantities.
  int64_t n_layers() const { return static_cast<int64_t>(layer_ids.size()); }
  int64_t n_cols() const { return (max_ngram_size - 1) * n_heads; }
  int64_t scales_per_row() const { return head_dim / 32; }
  int64_t record_bytes() const { return head_dim + head_dim / 32; }
};

absl::StatusOr<EngramConfig> ParseEngramConfig(const std::string& json_text);
absl::StatusOr<EngramConfig> LoadEngramConfig(const std::string& path);

std::string ModelKindName(ModelKind kind);

}  // namespace engram
