// Timing and table helpers shared by the GPU benchmarks: the median of CUDA-event timings of a call, and a random
// fill of a host buffer (no NaN bytes, moderate scales) from several threads. Benchmarks only; single-threaded use
// per stream (FillRandom starts and joins its own threads).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "bench/cuda_check.h"

namespace engram::bench {

// Median milliseconds of `reps` timed calls of f on `stream` (after `warm` untimed ones). `before`, when set, runs
// ahead of each call outside the timed span (a fresh batch of ids, say).
inline double MedianMs(const std::function<void()>& f, cudaStream_t stream, int reps = 20, int warm = 3,
                       const std::function<void()>& before = {}) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) {
    if (before) before();
    f();
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    if (before) before();
    CUDA_CHECK(cudaEventRecord(a, stream));
    f();
    CUDA_CHECK(cudaEventRecord(b, stream));
    CUDA_CHECK(cudaEventSynchronize(b));
    float m = 0;
    CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
    ms.push_back(m);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

inline void FillRandom(uint8_t* p, size_t n, int threads) {
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=] {
      const size_t begin = n / threads * t, end = t == threads - 1 ? n : n / threads * (t + 1);
      uint64_t x = 0x9E3779B97F4A7C15ull * (t + 1);
      for (size_t i = begin; i + 8 <= end; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint64_t v = x & 0x7E7E7E7E7E7E7E7Eull;  // no NaN bytes, moderate scales
        std::memcpy(p + i, &v, 8);
      }
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace engram::bench
