#include "client/table/cuda_backend.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "base/worker_threads.h"
#include "client/fault_points.h"

namespace engram::client {
namespace {

// The driver's cuMemHostRegister / cuMemHostUnregister, reached through the runtime (no link against libcuda, so a
// machine without a driver still loads us). Registering through the driver API leaves no sticky runtime error
// behind a failure.
struct DriverApi {
  using Register = CUresult (*)(void*, size_t, unsigned int);
  using Unregister = CUresult (*)(void*);
  using ErrorName = CUresult (*)(CUresult, const char**);
  using GetCtx = CUresult (*)(CUcontext*);
  using SetCtx = CUresult (*)(CUcontext);
  Register reg = nullptr;
  Unregister unreg = nullptr;
  ErrorName name = nullptr;
  GetCtx get_ctx = nullptr;
  SetCtx set_ctx = nullptr;
};

const DriverApi& Driver() {
  static const DriverApi api = [] {
    DriverApi d;
    cudaDriverEntryPointQueryResult q;
    cudaGetDriverEntryPointByVersion("cuMemHostRegister", reinterpret_cast<void**>(&d.reg), 12000, cudaEnableDefault,
                                     &q);
    cudaGetDriverEntryPointByVersion("cuMemHostUnregister", reinterpret_cast<void**>(&d.unreg), 12000,
                                     cudaEnableDefault, &q);
    cudaGetDriverEntryPointByVersion("cuGetErrorName", reinterpret_cast<void**>(&d.name), 12000, cudaEnableDefault, &q);
    cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", reinterpret_cast<void**>(&d.get_ctx), 4000, cudaEnableDefault,
                                     &q);
    cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", reinterpret_cast<void**>(&d.set_ctx), 4000, cudaEnableDefault,
                                     &q);
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

// Why a machine has no usable GPU, in the operator's words: the runtime says "driver version is insufficient" both
// for a machine with no driver at all (no GPU) and for one whose driver is too old.
std::string NoGpuReason(cudaError_t e) {
  if (e == cudaSuccess || e == cudaErrorNoDevice) return "no CUDA device on this machine";
  if (e == cudaErrorInsufficientDriver) {
    void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (driver == nullptr) return "no GPU driver on this machine (libcuda.so.1 is not installed)";
    ::dlclose(driver);
    return "the GPU driver is older than the CUDA runtime this library was built with: update the driver";
  }
  return absl::StrCat("CUDA is unusable here (", cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")");
}

CudaState ProbeCuda(std::string* why_not) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why_not) *why_not = NoGpuReason(e);
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
                                                                             const RegisterOptions& options,
                                                                             int* failed_chunk) {
  constexpr size_t kMaxChunk = size_t{511} << 30;
  const size_t chunk_bytes = std::clamp<size_t>(options.chunk_bytes, size_t{1} << 21, kMaxChunk);
  std::unique_ptr<HostRegistration> r(new HostRegistration());
  const DriverApi& drv = Driver();
  if (drv.reg == nullptr || drv.unreg == nullptr) {
    return absl::UnavailableError("the CUDA driver's cuMemHostRegister is not available");
  }
  cudaFree(nullptr);  // make the device's primary context current for the driver calls
  CUcontext ctx = nullptr;
  if (drv.get_ctx != nullptr) drv.get_ctx(&ctx);
  const auto t0 = std::chrono::steady_clock::now();
  auto* p = static_cast<uint8_t*>(const_cast<void*>(ptr));
  const size_t n_chunks = bytes == 0 ? 0 : (bytes + chunk_bytes - 1) / chunk_bytes;
  std::vector<CUresult> result(n_chunks, CUDA_ERROR_NOT_READY);  // NOT_READY: never attempted
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto worker = [&](bool own_thread) {
    if (own_thread && ctx != nullptr && drv.set_ctx != nullptr) drv.set_ctx(ctx);  // the caller's context
    for (size_t k = next++; k < n_chunks && !failed.load(std::memory_order_relaxed); k = next++) {
      const size_t off = k * chunk_bytes, n = std::min(chunk_bytes, bytes - off);
      const CUresult e = Fault(FaultPoint::kRegisterChunk, static_cast<int64_t>(k))
                             ? CUDA_ERROR_OUT_OF_MEMORY
                             : drv.reg(p + off, n, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY);
      result[k] = e;
      if (e != CUDA_SUCCESS) failed.store(true, std::memory_order_relaxed);
    }
  };
  const int threads = static_cast<int>(
      std::clamp<size_t>(static_cast<size_t>(std::max(1, options.threads)), 1, std::max<size_t>(n_chunks, 1)));
  if (threads == 1) {
    worker(false);
  } else {
    RunWorkers(threads, worker);  // a refused thread is one worker fewer; none started: the caller registers
  }
  // Every registered chunk belongs to r (its destructor unregisters them); the lowest failure is the one reported.
  size_t bad = n_chunks;
  for (size_t k = 0; k < n_chunks; ++k) {
    if (result[k] == CUDA_SUCCESS) {
      r->chunks_.push_back(p + k * chunk_bytes);
    } else if (result[k] != CUDA_ERROR_NOT_READY && bad == n_chunks) {
      bad = k;
    }
  }
  if (bad != n_chunks) {
    const size_t off = bad * chunk_bytes, n = std::min(chunk_bytes, bytes - off);
    if (failed_chunk) *failed_chunk = static_cast<int>(bad);
    return absl::ResourceExhaustedError(absl::StrCat("cuMemHostRegister of chunk ", bad, " (", n, " bytes at offset ",
                                                     off, "): ", DriverError(result[bad])));
    // r's destructor unregisters the chunks registered so far.
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
