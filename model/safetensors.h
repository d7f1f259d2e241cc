// SafetensorsFile: one `.safetensors` file, its header parsed and validated as hostile input, its data read in
// ranges (never whole: a 94 GiB tensor streams through caller-sized buffers).
//
// Format: 8-byte little-endian header length, a JSON header mapping tensor names to {dtype, shape, data_offsets}
// (offsets relative to the end of the header) plus an optional `__metadata__` map of strings, then raw data.
// Open() refuses, naming file and tensor: a header length past EOF or absurdly large, bad JSON, unknown dtypes,
// negative or non-integer shapes, byte counts that disagree with dtype x shape, offsets out of order, overlapping,
// or past the end of the file (truncated data).
//
// Thread-safety: after Open, all methods are const and safe to call concurrently (reads use pread on a shared fd).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/dtype.h"

namespace engram {

struct TensorInfo {
  std::string name;  // as written in the file
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // absolute byte offset in the file
  uint64_t end = 0;    // exclusive
  uint64_t bytes() const { return end - begin; }
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t header_bytes() const { return data_start_; }  // 8 + JSON header length
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* Find(const std::string& name) const;

  // Reads `n` bytes starting `offset` bytes into `tensor`'s data. Fails on ranges outside the tensor and on short
  // reads (the file shrank since Open), naming file and tensor.
  absl::Status ReadRange(const TensorInfo& tensor, uint64_t offset, void* dst, uint64_t n) const;
  // Advises the kernel that the range will not be needed again (drops page cache behind a streaming reader).
  void DropCache(const TensorInfo& tensor, uint64_t offset, uint64_t n) const;
  // Reads what the page cache holds of the range without waiting for the disk (preadv2 RWF_NOWAIT): returns how many
  // bytes from `offset` on were copied into dst, a prefix of the range (n when it is all cached, 0 when its first page
  // is not). It may start the kernel's readahead of the rest. Unlike mincore, it answers the same for any reader of
  // the file (mincore reports every page cached to a process that neither owns the file nor may write it).
  // Errors: a range outside the tensor (OutOfRange), a file system without such reads (Unimplemented), a failed read.
  absl::StatusOr<uint64_t> ReadIfCached(const TensorInfo& tensor, uint64_t offset, void* dst, uint64_t n) const;

 private:
  SafetensorsFile() = default;
  // The error of a read that returned `r` <= 0 at file byte `at` (errno for r < 0).
  absl::Status ReadFailed(const TensorInfo& tensor, uint64_t at, ssize_t r) const;
  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Parses a header (the JSON text) for a file of `file_size` bytes whose data starts at `data_start`. Exposed so
// that tests and fuzzers can feed it hostile headers without files.
absl::StatusOr<std::map<std::string, TensorInfo>> ParseSafetensorsHeader(const std::string& path,
                                                                         const std::string& json_text,
                                                                         uint64_t data_start, uint64_t file_size,
                                                                         std::map<std::string, std::string>* meta);

}  // namespace engram
