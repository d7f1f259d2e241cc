// Test kernels for the prefetch test: a main-stream "gate" kernel that keeps `blocks` blocks busy until the host
// opens the gate (writes non-zero into a host-mapped flag), so "the main stream is still busy" is a fact the test
// controls, not a duration; and a flag writer. Test-only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace engram::testing {

// Runs until *open (host-mapped memory, device pointer) is non-zero.
cudaError_t LaunchGate(const volatile int32_t* open, int blocks, cudaStream_t stream);
// Writes `value` into *flag (device memory) when it runs.
cudaError_t LaunchSetFlag(int32_t* flag, int32_t value, cudaStream_t stream);

}  // namespace engram::testing
