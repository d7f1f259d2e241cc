// The lookup's launch shape (kernels/engram_kernels.h, LaunchLookup): the warps per block and rows in flight per warp
// of the persistent gather, and the row-order gather's defaults that LookupTuning starts from. Shared by the gather
// kernels (kernels/lookup_gather.cuh), their launch (lookup_kernels.cu) and the tuning state (lookup_tuning.cc).
// Constants only; usable from host and device code.
#pragma once

#include <cstdint>

namespace engram::kernels {

inline constexpr int kWarpsPerBlock = 8;
inline constexpr int kRows = 4;
// The row-order gather's defaults (LookupTuning), measured on the H200 (bench/RESULTS.md, 2026-11-30), random
// rows of a 16 GiB host table, a fresh batch of ids per call. Grid: few rows in flight keep the gather within a
// narrow span of the table and translate far faster than the persistent grid (1M rows: 16 blocks of 8 warps x 8
// rows 38.1 GB/s, 1056 blocks 33.0; 196K rows: 14.9 vs 11.2; 24K rows: 14.5 vs 10.2). Threshold: on that grid the
// sorted gather beats the plain kernel from 24K rows (14.1 vs 9.1 GB/s); at 6K rows the plain kernel is as fast
// or faster (10.1 vs 8.6 GB/s), and a batch repeated call after call is faster plain (its rows stay in L2).
inline constexpr int64_t kDefaultSortMinItems = 12288;
inline constexpr int32_t kDefaultSortVariant = 1;
inline constexpr int32_t kDefaultSortBlocks = 16;

}  // namespace engram::kernels
