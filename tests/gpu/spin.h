// Test kernels for the prefetch tests: a main-stream kernel that keeps `blocks` blocks busy for about `ns`
// nanoseconds (wall clock, %globaltimer), and a flag writer. Test-only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace engram::testing {

cudaError_t LaunchSpin(uint64_t ns, int blocks, cudaStream_t stream);
// Writes `value` into *flag (device memory) when it runs.
cudaError_t LaunchSetFlag(int32_t* flag, int32_t value, cudaStream_t stream);

}  // namespace engram::testing
