// The side-stream prefetcher: lookups started on the side stream complete while the main stream is held busy by a
// gate kernel that only the host can open (no durations: if the lookups did not overlap, they could not finish
// before the gate opens), and Wait(layer) orders the main stream after exactly that layer's lookup. The rows equal
// the CPU reference. Exits 77 (ctest skip) without a GPU; a CUDA error fails.
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "client/engine/prefetch.h"
#include "gtest/gtest.h"
#include "model/reference.h"
#include "tests/gpu/gpu_util.h"
#include "tests/gpu/spin.h"

namespace engram {
namespace {

using testing::DeviceBuffer;

TEST(GpuPrefetchTest, OverlapsTheMainStreamAndWaitOrders) {
  REQUIRE_GPU();
  std::mt19937_64 rng(std::random_device{}());
  const int64_t D = 256, rb = 264, rows = 400000;
  const int L = 2, C = 24, T = 8192;
  std::vector<std::vector<uint8_t>> host(L);
  std::vector<kernels::LayerTable> tables;
  for (int l = 0; l < L; ++l) {
    host[l].resize(static_cast<size_t>(rows * rb));
    for (auto& b : host[l]) b = static_cast<uint8_t>(rng());
    CUDA_OK(cudaHostRegister(host[l].data(), host[l].size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
    void* d = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&d, host[l].data(), 0));
    tables.push_back({static_cast<const uint8_t*>(d), 0, rows});
  }
  std::vector<int32_t> ids(static_cast<size_t>(T * L * C));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % rows);
  DeviceBuffer<int32_t> d_ids(ids), flag(1);
  flag.Fill(0);

  kernels::Prefetcher p;
  ASSERT_TRUE(p.Init(tables, T, C, static_cast<int32_t>(D)).ok());
  cudaStream_t main_stream;
  CUDA_OK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  cudaEvent_t main_done;
  CUDA_OK(cudaEventCreate(&main_done));
  // The host-mapped gate flag, closed.
  int32_t* gate_host = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&gate_host), sizeof(int32_t), cudaHostAllocMapped));
  *const_cast<volatile int32_t*>(gate_host) = 0;
  int32_t* gate_dev = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_dev), gate_host, 0));
  // The ids are "ready" on the main stream; then the main stream is held by the gate kernel on a few SMs.
  ASSERT_TRUE(p.Prefetch(d_ids.get(), T, main_stream).ok());
  CUDA_OK(testing::LaunchGate(gate_dev, 16, main_stream));
  CUDA_OK(testing::LaunchSetFlag(flag.get(), 1, main_stream));
  CUDA_OK(cudaEventRecord(main_done, main_stream));
  // Both layers' lookups finish while the gate is closed. (The bound only turns a hang into a failure; nothing is
  // timed: a lookup that does not overlap never finishes before the gate opens.)
  const auto t0 = std::chrono::steady_clock::now();
  while (cudaEventQuery(p.layer_event(L - 1)) == cudaErrorNotReady &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const cudaError_t lookups = cudaEventQuery(p.layer_event(L - 1));
  const cudaError_t main_state = cudaEventQuery(main_done);
  *const_cast<volatile int32_t*>(gate_host) = 1;  // open the gate whatever happened
  EXPECT_EQ(lookups, cudaSuccess) << "the lookups did not run beside the held main stream";
  EXPECT_EQ(main_state, cudaErrorNotReady) << "the gate did not hold the main stream";
  // Wait orders the main stream after layer 1's lookup: a copy of the staging buffer on the main stream sees it.
  ASSERT_TRUE(p.Wait(1, main_stream).ok());
  DeviceBuffer<uint16_t> copy(static_cast<size_t>(T * C * D));
  CUDA_OK(cudaMemcpyAsync(copy.get(), p.staging(1), static_cast<size_t>(T * C * D) * 2, cudaMemcpyDeviceToDevice,
                          main_stream));
  CUDA_OK(cudaStreamSynchronize(main_stream));
  EXPECT_EQ(flag.Download()[0], 1);
  std::vector<int32_t> layer1;
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < C; ++c) layer1.push_back(ids[static_cast<size_t>((t * L + 1) * C + c)]);
  }
  std::vector<uint16_t> want(layer1.size() * D);
  ASSERT_TRUE(LookupBf16Cpu({host[1].data(), 0, rows, D}, layer1, want).ok());
  EXPECT_EQ(copy.Download(), want);
  EXPECT_FALSE(p.Prefetch(d_ids.get(), T + 1, main_stream).ok());
  EXPECT_FALSE(p.Wait(2, main_stream).ok());
  for (auto& h : host) CUDA_OK(cudaHostUnregister(h.data()));
  cudaEventDestroy(main_done);
  CUDA_OK(cudaFreeHost(gate_host));
  cudaStreamDestroy(main_stream);
}

}  // namespace
}  // namespace engram
