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

// How to register: chunks of at most `chunk_bytes` (clamped to [2 MiB, 511 GiB]) handed out to `threads` workers
// (at most one per chunk; 1 = the calling thread, in order). Tests make a chunk fail as if the driver had refused
// it through the fault point kRegisterChunk (client/fault_points.h).
struct RegisterOptions {
  size_t chunk_bytes = size_t{16} << 30;
  int threads = 1;
};

class HostRegistration {
 public:
  // Registers [ptr, ptr + bytes) read-only (cuMemHostRegister, DEVICEMAP | READ_ONLY, through the driver API) in
  // chunks, from `options.threads` threads. On a failure no chunk stays registered (every chunk registered by any
  // thread is unregistered before returning), `failed_chunk` receives the lowest chunk index that failed and the
  // error names it; workers take no new chunk once one has failed.
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Register(const void* ptr, size_t bytes,
                                                                    const RegisterOptions& options, int* failed_chunk);
  // The same, one thread (the original interface).
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Register(const void* ptr, size_t bytes, size_t chunk_bytes,
                                                                    int* failed_chunk) {
    return Register(ptr, bytes, RegisterOptions{chunk_bytes, 1}, failed_chunk);
  }
  ~HostRegistration();
  double seconds() const { return seconds_; }
  size_t chunks() const { return chunks_.size(); }

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
