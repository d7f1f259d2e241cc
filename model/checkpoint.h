// Checkpoint: a Hugging Face model directory opened for Engram (docs/math.md, section 1): config.json, the safetensors
// shards (through model.safetensors.index.json, a single model.safetensors, or every *.safetensors in the directory),
// and the path of tokenizer.json. Tensor names are accepted with or without a `model.` prefix.
//
//   ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
//   RETURN_IF_ERROR(ckpt->ValidateEngramTensors());         // names, dtypes, shapes vs config
//   const EngramTensors& t = ckpt->engram(layer_index);    // embed.weight / embed.scale / wkv / q / k
//   ckpt->ReadRange(*t.embed_weight, offset, dst, n);
//
// Only headers and the small JSON files are read by Open and Validate; table data is read by callers in ranges.
// Fingerprint(): the identity of the exact files, computed once by Open: xxh3-64 over the config's Engram fields,
// every Engram tensor's name, dtype, shape and size, the bytes of config.json and tokenizer.json, and, for every
// safetensors file holding an Engram tensor, its name, size, modification time and header bytes. Two checkpoints
// with the same fingerprint are the same files as far as can be told without reading table bytes: a fine-tune or a
// new revision written into the directory, or another directory with equal shapes, gets another fingerprint (a
// byte edited in place with the modification time restored is not caught).
// Immutable after Open; thread-safe for concurrent reads.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace engram {

// A tensor of the checkpoint with the file that holds it.
struct TensorRef {
  std::shared_ptr<const SafetensorsFile> file;
  const TensorInfo* info = nullptr;
  explicit operator bool() const { return info != nullptr; }
};

struct EngramTensors {
  int64_t layer_id = 0;
  TensorRef embed_weight;  // F8_E4M3 [rows, head_dim]
  TensorRef embed_scale;   // F8_E8M0 [rows, head_dim/32]
  TensorRef wkv_weight;    // F8_E4M3 [hidden*(hc_mult+1), n_cols*head_dim]
  TensorRef wkv_scale;     // F8_E8M0 [ceil(rows/32), ceil(cols/32)]
  TensorRef q_weight;      // BF16 [hc_mult, hidden]
  TensorRef k_weight;      // BF16 [hc_mult, hidden]
};

class Checkpoint {
 public:
  static absl::StatusOr<std::shared_ptr<const Checkpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const EngramConfig& config() const { return config_; }
  std::string config_path() const { return dir_ + "/config.json"; }
  std::string tokenizer_path() const { return dir_ + "/tokenizer.json"; }
  const std::vector<std::shared_ptr<const SafetensorsFile>>& files() const { return files_; }

  // A tensor by canonical name (without the `model.` prefix); empty ref when absent.
  TensorRef Find(const std::string& name) const;

  // Checks every Engram tensor against the config: present, dtype, shape. Errors name the file and tensor.
  absl::Status ValidateEngramTensors() const;
  // The Engram tensors of layer index `l` (position in engram_layer_ids). Call ValidateEngramTensors first.
  EngramTensors engram(int64_t l) const;

  uint64_t Fingerprint() const;

 private:
  absl::Status ComputeFingerprint();
  uint64_t fingerprint_ = 0;
  std::string dir_;
  EngramConfig config_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::map<std::string, TensorRef> tensors_;  // canonical name -> ref
};

// Canonical tensor name: strips one leading "model.".
std::string CanonicalTensorName(const std::string& name);

}  // namespace engram
