// Row oracle: an independent, deliberately simple reader of one Engram table row straight from a checkpoint's
// safetensors bytes, for the spot checks of engram-replica, `engramctl attach` and the tests. It shares no code with
// model/ (the production reader that fills segments and private tables): it parses config.json (`engram_head_dim`,
// `engram_layer_ids`, at the top level or under `text_config`), model.safetensors.index.json (or a lone
// model.safetensors) and each shard's header (8-byte little-endian length, JSON, `data_offsets`) itself, and preads
// the head_dim FP8 bytes of `layers.{L}.engram.embed.weight` row r and the head_dim/32 bytes of
// `layers.{L}.engram.embed.scale` row r (a `model.` prefix is accepted). The record it returns is the weight bytes
// followed by the scale bytes (head_dim + head_dim/32 bytes, 264 for head_dim 256).
// DequantBf16Row turns a record into the bf16 row a lookup must return, from the formats' definitions (e4m3: bias 7,
// subnormals, S.1111.111 NaN; ue8m0: the float with bits byte << 23; bf16 round to nearest even, every NaN 0x7FFF),
// computed in double, again without model/ code.
// Depends only on the C++ standard library and nlohmann_json. Not thread-safe: the header cache is unguarded; use one
// RowOracle per thread. Files are opened per read (no descriptor is held).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace engram::oracle {

// The bf16 values of a record's head_dim elements (the record holds head_dim e4m3 then head_dim/32 ue8m0 bytes).
std::vector<uint16_t> DequantBf16Row(const std::vector<uint8_t>& record, int64_t head_dim);

class RowOracle {
 public:
  // Reads config.json and the index; nullptr with *error set when they cannot be read.
  static std::unique_ptr<RowOracle> Open(const std::string& checkpoint_dir, std::string* error);

  int64_t head_dim() const { return head_dim_; }
  int64_t record_bytes() const { return head_dim_ + head_dim_ / 32; }
  const std::vector<int64_t>& layer_ids() const { return layer_ids_; }

  // The record of global row `row` of the table of layer `layer_id` (a value of engram_layer_ids, not an index);
  // nullopt with *error set when the tensors are missing, malformed or the row is out of range.
  std::optional<std::vector<uint8_t>> Record(int64_t layer_id, int64_t row, std::string* error);
  // The same, by index into engram_layer_ids.
  std::optional<std::vector<uint8_t>> RecordAt(int64_t layer_index, int64_t row, std::string* error);

 private:
  struct Tensor {
    std::string file;
    uint64_t data_begin = 0;  // absolute file offset of the tensor's first byte
    uint64_t data_end = 0;
    std::vector<int64_t> shape;
    std::string dtype;
  };
  std::optional<Tensor> Find(int64_t layer_id, const std::string& suffix, std::string* error);
  const std::map<std::string, Tensor>* Header(const std::string& file, std::string* error);

  std::string dir_;
  int64_t head_dim_ = 0;
  std::vector<int64_t> layer_ids_;
  std::map<std::string, std::string> weight_map_;  // tensor name -> shard file name (empty: one model.safetensors)
  std::map<std::string, std::map<std::string, Tensor>> headers_;
};

}  // namespace engram::oracle
