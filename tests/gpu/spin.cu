#include "tests/gpu/spin.h"

namespace engram::testing {
namespace {

__global__ void Gate(const volatile int32_t* open) {
  while (*open == 0) {
    __nanosleep(1000);
  }
}

__global__ void SetFlag(int32_t* flag, int32_t value) { *flag = value; }

}  // namespace

cudaError_t LaunchGate(const volatile int32_t* open, int blocks, cudaStream_t stream) {
  Gate<<<blocks, 32, 0, stream>>>(open);
  return cudaGetLastError();
}

cudaError_t LaunchSetFlag(int32_t* flag, int32_t value, cudaStream_t stream) {
  SetFlag<<<1, 1, 0, stream>>>(flag, value);
  return cudaGetLastError();
}

}  // namespace engram::testing
