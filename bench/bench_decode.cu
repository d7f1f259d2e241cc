// bench_decode: the lookup at decode sizes (1-64 tokens x 24 columns) from a large host table through UVA, every
// shape of the plain gather (rows in flight per warp x warps per block) side by side, bf16 and packed out, in a CUDA
// graph (20 dependent lookups per replay, time per lookup) and eagerly (one launch between events, host launch
// included), against the floors measured in the same run:
//   launch floor   an empty kernel, 20 per graph replay: what a graph node costs with no work
//   read floor     one warp reading one 264-byte record of the table per launch, 20 per replay: one host read's
//                  round trip plus the node
// Fresh ids for every replay (a new batch is copied in outside the timed span), so no row is still in L2.
// Usage: bench_decode [TABLE_GIB]   (default 16; ENGRAM_BENCH_SHM_DIR: the directory of the table, default /dev/shm)
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/gpu_timing.h"
#include "kernels/engram_kernels.h"

namespace {

constexpr int kPerGraph = 20;
constexpr int C = 24;
constexpr int64_t D = 256, kRecord = 264;

__global__ void EmptyKernel() {}

__global__ void ReadOneKernel(const uint8_t* records, const int32_t* ids, uint64_t* out) {
  const uint64_t* rec = reinterpret_cast<const uint64_t*>(records + static_cast<int64_t>(ids[0]) * kRecord);
  out[threadIdx.x] = rec[threadIdx.x];
}

}  // namespace

int main(int argc, char** argv) {
  const double table_gib = argc > 1 ? std::atof(argv[1]) : 16.0;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  const size_t seg_bytes = static_cast<size_t>(table_gib * (1ull << 30)) / kRecord * kRecord;
  const int64_t rows = static_cast<int64_t>(seg_bytes / kRecord);
  const char* dir_env = std::getenv("ENGRAM_BENCH_SHM_DIR");
  const std::string dir = dir_env != nullptr && *dir_env != '\0' ? dir_env : "/dev/shm";
  const std::string path = dir + "/engram-bench-decode-" + std::to_string(::getpid());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(seg_bytes)) != 0) {
    std::perror("table");
    return 1;
  }
  auto* seg = static_cast<uint8_t*>(::mmap(nullptr, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ::unlink(path.c_str());
  if (seg == MAP_FAILED) return 1;
  engram::bench::FillRandom(seg, seg_bytes, threads);
  CUDA_CHECK(cudaHostRegister(seg, seg_bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly));
  uint8_t* dseg = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dseg), seg, 0));
  std::printf("table: %.1f GiB in %s, %lld rows of %lld bytes\n", seg_bytes / 1073741824.0, dir.c_str(),
              static_cast<long long>(rows), static_cast<long long>(kRecord));

  // A pool of random ids on the device; each replay's nodes read `kPerGraph` consecutive batches of the live
  // buffer, refilled from the next stretch of the pool before every replay.
  const int64_t max_items = 64 * C * kPerGraph;
  const int64_t pool_batches = 64;
  std::mt19937_64 rng(11);
  std::vector<int32_t> host_ids(static_cast<size_t>(max_items * pool_batches));
  for (auto& id : host_ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows));
  int32_t *d_pool = nullptr, *d_ids = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_pool), host_ids.size() * 4));
  CUDA_CHECK(cudaMemcpy(d_pool, host_ids.data(), host_ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_ids), max_items * 4));
  void* d_out = nullptr;
  CUDA_CHECK(cudaMalloc(&d_out, static_cast<size_t>(max_items) * kRecord * 2));
  int64_t next_batch = 0;
  auto refill = [&] {
    CUDA_CHECK(cudaMemcpyAsync(d_ids, d_pool + (next_batch++ % pool_batches) * max_items, max_items * 4,
                               cudaMemcpyDeviceToDevice, s));
  };
  // Microseconds per node of a graph of kPerGraph nodes that `launch(i)` captures.
  auto graph_us = [&](const std::function<void(int)>& launch) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kPerGraph; ++i) launch(i);
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double ms = engram::bench::MedianMs([&] { CUDA_CHECK(cudaGraphLaunch(exec, s)); }, s, 40, 5, refill);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return ms * 1e3 / kPerGraph;
  };

  const double launch_floor = graph_us([&](int) { EmptyKernel<<<1, 32, 0, s>>>(); });
  const double read_floor =
      graph_us([&](int i) { ReadOneKernel<<<1, 32, 0, s>>>(dseg, d_ids + i, static_cast<uint64_t*>(d_out) + 32 * i); });
  std::printf("floors (per graph node): empty kernel %.2f us, one record read from the table %.2f us\n", launch_floor,
              read_floor);

  const int shapes[] = {1, 2, 4, 8};
  for (bool packed : {false, true}) {
    std::printf("\n%s out: us per lookup in a graph / eager (launch included), rows per warp x warps per block\n",
                packed ? "packed" : "bf16");
    for (int tokens : {1, 2, 4, 8, 16, 32, 64}) {
      const int64_t items = static_cast<int64_t>(tokens) * C;
      auto args = [&](int i, int r, int w) {
        engram::kernels::LookupArgs a;
        a.records = dseg;
        a.row_begin = 0;
        a.row_end = rows;
        a.head_dim = static_cast<int32_t>(D);
        a.ids = d_ids + (i % kPerGraph) * items;
        a.num_tokens = tokens;
        a.num_cols = C;
        a.ids_stride = C;
        a.out = static_cast<uint8_t*>(d_out) + (i % kPerGraph) * items * (packed ? kRecord : 2 * D);
        a.packed = packed;
        a.plain_rows = r;
        a.plain_block_warps = w;
        return a;
      };
      double best = 1e30, best_eager = 1e30, dflt = 0, dflt_eager = 0, dec = 0, dec_eager = 0;
      int best_r = 0, best_w = 0;
      std::string line;
      for (int r : shapes) {
        for (int w : shapes) {
          const double g = graph_us([&](int i) { CUDA_CHECK(engram::kernels::LaunchLookup(args(i, r, w), s)); });
          int k = 0;
          const double e = engram::bench::MedianMs(
                               [&] { CUDA_CHECK(engram::kernels::LaunchLookup(args(k++, r, w), s)); }, s, 100, 10,
                               [&] {
                                 if (k % kPerGraph == 0) refill();
                               }) *
                           1e3;
          char cell[48];
          std::snprintf(cell, sizeof cell, " %dx%d %.2f/%.2f", r, w, g, e);
          line += cell;
          if (g < best) best = g, best_r = r, best_w = w;
          best_eager = std::min(best_eager, e);
          if (r == 4 && w == 8) dflt = g, dflt_eager = e;
          if (r == 1 && w == 4) dec = g, dec_eager = e;
        }
      }
      std::printf("%2d tokens:%s\n", tokens, line.c_str());
      std::printf(
          "%2d tokens %s: best in a graph %dx%d %.2f us (%.2f of the read floor); the decode default 1x4 %.2f us "
          "(%.2f of the best), the large-batch default 4x8 %.2f us (%.2f); eager best %.2f us, 1x4 %.2f, 4x8 %.2f\n",
          tokens, packed ? "packed" : "bf16", best_r, best_w, best, best / read_floor, dec, dec / best, dflt,
          dflt / best, best_eager, dec_eager, dflt_eager);
    }
  }
  CUDA_CHECK(cudaHostUnregister(seg));
  ::munmap(seg, seg_bytes);
  return 0;
}
