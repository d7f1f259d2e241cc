// Helpers for the GPU tests: device detection (tests skip cleanly without a GPU), RAII device buffers, and
// CUDA error checks that fail the test. Test-only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace engram::testing {

inline bool HasGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!::engram::testing::HasGpu()) GTEST_SKIP() << "no CUDA device on this machine: GPU test skipped"

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    void* p = nullptr;
    p_ = cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess ? static_cast<T*>(p) : nullptr;
  }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  void Upload(const std::vector<T>& host) { cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice); }
  void Fill(uint8_t byte) { cudaMemset(p_, byte, n_ * sizeof(T)); }
  std::vector<T> Download() const {
    std::vector<T> out(n_);
    cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

}  // namespace engram::testing
