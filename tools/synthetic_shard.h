// The tensor bytes of a synthetic checkpoint (tools/synthetic.h) and the safetensors shard writer: every byte is a
// function of (seed, tensor name, offset), shaped by the tensor's kind (FP8 E4M3 without NaN encodings, ue8m0
// scales in [2^-12, 2^3], bf16 of magnitude in [0.5, 2)), so that tests recompute any of it (SyntheticByte). A
// shard is written by a pool of threads, chunk by chunk; a sparse tensor writes only its byte ranges and leaves
// holes (zero bytes) elsewhere.
//
// Internal to tools/synthetic*.cc. Ownership: the caller owns the planned tensors; WriteShard owns its file
// descriptor and threads for the call. Thread-safety: the byte functions are pure; WriteShard is one call per file.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace engram::tools::synthetic_internal {

uint64_t SplitMix(uint64_t x);

enum class Kind { kE4M3, kScale, kBf16 };

// Bytes [offset, offset + n) of the tensor whose name hashes to `tensor_hash`, written to dst[0, n).
void Fill(uint64_t seed, uint64_t tensor_hash, uint64_t offset, uint64_t n, Kind kind, uint8_t* dst);

uint64_t NameHash(const std::string& name);

struct PlannedTensor {
  std::string name;       // as written
  std::string canonical;  // without "model."
  std::string dtype;
  std::vector<int64_t> shape;
  Kind kind = Kind::kE4M3;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // relative to the data start
  // Sparse: only these byte ranges [begin, end) of the tensor are written, the rest is a hole; empty: all of it.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

// Writes the safetensors file `path` holding `tensors` (their offsets set here), filled by `threads` threads; adds
// the file's size to *file_bytes and the tensor bytes written to *written_bytes.
absl::Status WriteShard(const std::string& path, std::vector<PlannedTensor>& tensors, uint64_t seed, int threads,
                        uint64_t* file_bytes, uint64_t* written_bytes);

}  // namespace engram::tools::synthetic_internal
