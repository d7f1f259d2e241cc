#include "client/cuda_backend.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"

namespace engram::client {
namespace {

// The driver's cuMemHostRegister / cuMemHostUnregister, reached through the runtime (no link against libcuda, so a
// machine without a driver still loads us). Registering through the driver API leaves no sticky runtime error
// behind a failure.
struct DriverApi {
  using Register = CUresult (*)(void*, size_t, unsigned int);
  using Unregister = CUresult (*)(void*);
  using ErrorName = CUresult (*)(CUresult, const char**);
  Register reg = nullptr;
  Unregister unreg = nullptr;
  ErrorName name = nullptr;
};

const DriverApi& Driver() {
  static const DriverApi api = [] {
    DriverApi d;
    cudaDriverEntryPointQueryResult q;
    cudaGetDriverEntryPointByVersion("cuMemHostRegister", reinterpret_cast<void**>(&d.reg), 12000, cudaEnableDefault, &q);
    cudaGetDriverEntryPointByVersion("cuMemHostUnregister", reinterpret_cast<void**>(&d.unreg), 12000,
                                     cudaEnableDefault, &q);
    cudaGetDriverEntryPointByVersion("cuGetErrorName", reinterpret_cast<void**>(&d.name), 12000, cudaEnableDefault, &q);
    cudaGetLastError();
    return d;
  }();
  return api;
}

std::string DriverError(CUresult r) {
  const char* n = nullptr;
  if (Driver().name != nullptr && Driver().name(r, &n) == CUDA_SUCCESS && n != nullptr) return n;
  return absl::StrCat("CUresult ", static_cast<int>(r));
}

}  // namespace

CudaState ProbeCuda(std::string* why_not) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why_not) *why_not = e == cudaSuccess ? "no CUDA device" : cudaGetErrorString(e);
    cudaGetLastError();  // not sticky, but leave nothing behind
    return CudaState::kNoDevice;
  }
  int dev = 0, host_ptr = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, dev);
  if (!host_ptr) {
    if (why_not) *why_not = "the GPU cannot use registered host memory through its host address (no UVA)";
    return CudaState::kNoUva;
  }
  return CudaState::kUsable;
}

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Register(const void* ptr, size_t bytes,
                                                                             size_t chunk_bytes, int* failed_chunk,
                                                                             int fail_at_chunk) {
  constexpr size_t kMaxChunk = size_t{511} << 30;
  chunk_bytes = std::clamp<size_t>(chunk_bytes, size_t{1} << 21, kMaxChunk);
  std::unique_ptr<HostRegistration> r(new HostRegistration());
  const DriverApi& drv = Driver();
  if (drv.reg == nullptr || drv.unreg == nullptr) {
    return absl::UnavailableError("the CUDA driver's cuMemHostRegister is not available");
  }
  cudaFree(nullptr);  // make the device's primary context current for the driver calls
  const auto t0 = std::chrono::steady_clock::now();
  auto* p = static_cast<uint8_t*>(const_cast<void*>(ptr));
  for (size_t off = 0, k = 0; off < bytes; off += chunk_bytes, ++k) {
    const size_t n = std::min(chunk_bytes, bytes - off);
    const CUresult e = static_cast<int>(k) == fail_at_chunk
                           ? CUDA_ERROR_OUT_OF_MEMORY
                           : drv.reg(p + off, n, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY);
    if (e != CUDA_SUCCESS) {
      if (failed_chunk) *failed_chunk = static_cast<int>(k);
      return absl::ResourceExhaustedError(absl::StrCat("cuMemHostRegister of chunk ", k, " (", n, " bytes at offset ",
                                                       off, "): ", DriverError(e)));
      // r's destructor unregisters the chunks registered so far.
    }
    r->chunks_.push_back(p + off);
  }
  r->seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

HostRegistration::~HostRegistration() {
  for (void* c : chunks_) Driver().unreg(c);
}

absl::StatusOr<std::unique_ptr<DeviceCopy>> DeviceCopy::Create(const void* host, size_t bytes) {
  std::unique_ptr<DeviceCopy> d(new DeviceCopy());
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1)); e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  d->data_ = static_cast<uint8_t*>(p);
  if (cudaError_t e = cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("copy of the table to the GPU: ", cudaGetErrorString(e)));
  }
  return d;
}

DeviceCopy::~DeviceCopy() {
  if (data_ != nullptr) cudaFree(data_);
}

}  // namespace engram::client
