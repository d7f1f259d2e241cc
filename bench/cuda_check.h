// CUDA_CHECK(call): the GPU benchmarks' one way to stop on a CUDA error: prints file:line, the call and the
// driver's message, and exits 1 (a benchmark that lost its GPU has nothing left to measure). Benchmarks only;
// library code returns Status (client/table/cuda_backend.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_CHECK(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
