// The client's CUDA pieces, compiled only with ENGRAM_CUDA: whether a usable GPU is present, chunked read-only host
// registration with rollback, and device copies. Everything returns Status; nothing here aborts the process.
// Registration objects own their chunks and unregister them on destruction. Thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace engram::client {

enum class CudaState { kUsable, kNoDevice, kNoUva };
// Whether a CUDA device exists and can use registered host memory through its host address (UVA).
CudaState ProbeCuda(std::string* why_not);

class HostRegistration {
 public:
  // Registers [ptr, ptr + bytes) read-only (cuMemHostRegister, DEVICEMAP | READ_ONLY, through the driver API) in
  // chunks of at most `chunk_bytes` (never >= 512 GiB); on a failure at chunk k, chunks 0..k-1 are unregistered and
  // the error names k.
  // `fail_at_chunk` >= 0 is a fault-injection seam for tests: that chunk fails as if the driver had refused it.
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Register(const void* ptr, size_t bytes, size_t chunk_bytes,
                                                                    int* failed_chunk, int fail_at_chunk = -1);
  ~HostRegistration();
  double seconds() const { return seconds_; }

 private:
  std::vector<void*> chunks_;
  double seconds_ = 0;
};

// A device copy of host bytes (the DEVICE table).
class DeviceCopy {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceCopy>> Create(const void* host, size_t bytes);
  ~DeviceCopy();
  const uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
};

}  // namespace engram::client
