#include "tests/gpu/spin.h"

namespace engram::testing {
namespace {

__device__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Spin(uint64_t ns) {
  const uint64_t start = GlobalTimer();
  while (GlobalTimer() - start < ns) {
  }
}

__global__ void SetFlag(int32_t* flag, int32_t value) { *flag = value; }

}  // namespace

cudaError_t LaunchSpin(uint64_t ns, int blocks, cudaStream_t stream) {
  Spin<<<blocks, 64, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t LaunchSetFlag(int32_t* flag, int32_t value, cudaStream_t stream) {
  SetFlag<<<1, 1, 0, stream>>>(flag, value);
  return cudaGetLastError();
}

}  // namespace engram::testing
