// main() of the GPU test binaries: probes the GPU first (tests/gpu/gpu_util.h). No GPU: prints why and exits 77,
// which ctest reports as skipped (SKIP_RETURN_CODE 77). A CUDA error while probing: prints it and exits 1 (a
// failure, never a skip). Otherwise runs the tests.
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/gpu/gpu_util.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const auto& probe = engram::testing::GpuProbe();
  switch (probe.kind) {
    case engram::testing::GpuProbeResult::kNoGpu:
      std::printf("no GPU: %s; GPU tests skipped (exit %d)\n", probe.detail.c_str(), engram::testing::kNoGpuExitCode);
      return engram::testing::kNoGpuExitCode;
    case engram::testing::GpuProbeResult::kError: std::printf("GPU probe failed: %s\n", probe.detail.c_str()); return 1;
    case engram::testing::GpuProbeResult::kAvailable: std::printf("GPU: %s\n", probe.detail.c_str()); break;
  }
  return RUN_ALL_TESTS();
}
