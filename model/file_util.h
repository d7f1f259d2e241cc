// Small file helpers shared by the model library: whole-file reads of small files (configs, headers, tokenizers)
// with errors that name the path. Large tensors never go through here (see safetensors.h for ranged reads).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace engram {

// Reads a whole file; refuses files larger than `max_bytes` (a guard against a wrong path pointing at a table).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes = size_t{1} << 30);

// Writes `data` to `path` atomically (temporary file in the same directory, then rename).
absl::Status WriteFileAtomic(const std::string& path, const std::string& data);

}  // namespace engram
