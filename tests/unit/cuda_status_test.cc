// CudaStatus (kernels/device_layout.h) says whose fault a CUDA error is, with the same codes the CPU engine uses:
// a bad argument is INVALID_ARGUMENT on both backends. Needs the CUDA headers and runtime library, not a GPU (the
// error names come from the runtime without touching a device).
#include "gtest/gtest.h"
#include "kernels/device_layout.h"

namespace engram::kernels {
namespace {

TEST(CudaStatusTest, CodesFollowTheCause) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x").ok());
  EXPECT_EQ(CudaStatus(cudaErrorInvalidValue, "launch").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaStatus(cudaErrorInvalidConfiguration, "launch").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaStatus(cudaErrorNoDevice, "probe").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CudaStatus(cudaErrorIllegalAddress, "kernel").code(), absl::StatusCode::kInternal);
  const absl::Status st = CudaStatus(cudaErrorInvalidValue, "lookup kernel");
  EXPECT_NE(st.message().find("lookup kernel"), std::string::npos) << st;
  EXPECT_NE(st.message().find("cudaErrorInvalidValue"), std::string::npos) << st;
}

}  // namespace
}  // namespace engram::kernels
