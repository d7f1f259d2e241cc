// ENGRAM_HD: marks a small pure function callable from host and device code. Under nvcc it is
// __host__ __device__ __forceinline__; under a plain C++ compiler, inline. Every layer that shares arithmetic with the
// kernels (model/fp8.h, model/fast_mod.h) includes this; it carries no state.
#pragma once

#if defined(__CUDACC__)
#define ENGRAM_HD __host__ __device__ __forceinline__
#else
#define ENGRAM_HD inline
#endif
