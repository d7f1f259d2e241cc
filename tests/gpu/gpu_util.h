// Helpers for the GPU tests: what "no GPU" means, RAII device buffers, and CUDA error checks that fail the test.
//
// "No GPU" is exactly: no /dev/nvidia* device node, or the driver library libcuda.so.1 cannot be loaded, or
// cudaGetDeviceCount answers cudaErrorNoDevice (or zero devices); an insufficient driver with a device present is a
// broken installation and fails. Then the test binary
// prints the reason and exits kNoGpuExitCode, which ctest reports as skipped (SKIP_RETURN_CODE). Any other CUDA error
// while probing is a failure (exit 1), and inside the tests every CUDA call is checked. The binaries' main() is
// tests/gpu/gpu_main.cc; REQUIRE_GPU() asserts (it never skips: a test that runs without a GPU is a bug).
// Test-only; GpuProbe() is computed once per process.
#pragma once

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace engram::testing {

inline constexpr int kNoGpuExitCode = 77;

struct GpuProbeResult {
  enum Kind { kAvailable, kNoGpu, kError } kind;
  std::string detail;
};

inline GpuProbeResult ProbeGpuUncached() {
  glob_t g{};
  const bool nodes = ::glob("/dev/nvidia[0-9]*", 0, nullptr, &g) == 0 && g.gl_pathc > 0;
  ::globfree(&g);
  if (!nodes) return {GpuProbeResult::kNoGpu, "no /dev/nvidia<N> device node"};
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    const char* e = ::dlerror();
    return {GpuProbeResult::kNoGpu, std::string("the driver library libcuda.so.1 cannot be loaded: ") + (e ? e : "?")};
  }
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice) {  // device nodes, but none visible to this process (e.g. CUDA_VISIBLE_DEVICES="")
    return {GpuProbeResult::kNoGpu, std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err)};
  }
  // Past this point a device node exists and the driver library loads: an error (an insufficient driver included) is
  // a broken installation, which must fail, not read as "no GPU".
  if (err != cudaSuccess) {
    return {GpuProbeResult::kError,
            std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err)};
  }
  if (n == 0) return {GpuProbeResult::kNoGpu, "cudaGetDeviceCount: 0 devices"};
  return {GpuProbeResult::kAvailable, std::to_string(n) + " device(s)"};
}

inline const GpuProbeResult& GpuProbe() {
  static const GpuProbeResult r = ProbeGpuUncached();
  return r;
}

inline bool HasGpu() { return GpuProbe().kind == GpuProbeResult::kAvailable; }

#define REQUIRE_GPU() ASSERT_TRUE(::engram::testing::HasGpu()) << ::engram::testing::GpuProbe().detail

#define CUDA_OK(expr)                                                                          \
  do {                                                                                         \
    const cudaError_t cuda_ok_err_ = (expr);                                                   \
    ASSERT_EQ(cuda_ok_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(cuda_ok_err_); \
  } while (0)

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    void* p = nullptr;
    p_ = cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess ? static_cast<T*>(p) : nullptr;
    EXPECT_NE(p_, nullptr) << "cudaMalloc of " << n << " elements failed";
  }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  void Upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Fill(uint8_t byte) { EXPECT_EQ(cudaMemset(p_, byte, n_ * sizeof(T)), cudaSuccess); }
  std::vector<T> Download() const {
    std::vector<T> out(n_);
    EXPECT_EQ(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

}  // namespace engram::testing
