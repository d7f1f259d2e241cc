// KernelBench: the state bench_kernels' sections share, and the sections themselves. bench_kernels.cc sets it up
// (stream, ceilings, the shared segment and its device mapping, the ids and output buffers, the lookup tuning
// defaults), runs the sections in order and unmaps the segment; bench_kernels_lookup.cc holds the UVA and HBM
// lookups, bench_kernels_paths.cc every lookup path, the host-gather variants and the automatic choice table,
// bench_kernels_prefetch.cc the gate, the hash and the prefetches beside a busy main stream. One KernelBench per
// process, used from one thread; it owns every buffer it names (the device buffers live until the process exits).
// Internal to bench_kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::bench {

struct KernelBench {
  static constexpr size_t kCeil = size_t{2} << 30;   // bytes of each ceiling copy (d0 and d1)
  static constexpr int64_t D = 256, rb = 264;        // head dim; bytes of a record
  static constexpr int C = 24;                       // columns per token
  static constexpr int64_t max_items = 1 << 20;      // capacity of ids, d_ids and d_out
  static constexpr int T = 8192, HC = 4, HD = 5120;  // the gate's tokens, hc_mult and hidden size

  // Set up by main and bench_kernels.cc.
  cudaStream_t s = nullptr;
  int threads = 0;                    // the machine's cores (the fill threads)
  void *d0 = nullptr, *d1 = nullptr;  // the ceiling copies' device buffers (random bytes in d0)
  double h2d = 0, d2d = 0;            // ceilings, GB/s
  bool variants_only = false;         // ENGRAM_BENCH_HG_VARIANTS_ONLY=1
  bool paths_only = false;            // ENGRAM_BENCH_PATHS_ONLY=1
  std::string shm_dir, path;          // the segment's directory and file
  size_t seg_bytes = 0;
  int64_t rows = 0;  // records in the segment
  uint8_t* seg = nullptr;
  void* dseg = nullptr;  // the segment's device pointer (registered mapped, read-only)
  std::mt19937_64 rng{7};
  std::vector<int32_t> ids;  // host ids (max_items)
  int32_t* d_ids = nullptr;
  uint16_t* d_out = nullptr;  // bf16 lookup output, max_items x D
  engram::kernels::LookupTuning default_tuning;

  // The every-path sections (BeginPaths to EndPaths).
  size_t paths_scratch_bytes = 0;
  void* paths_scratch = nullptr;
  int cores = 0, default_threads = 0;
  struct Best {  // per size, the engine configuration of each path (the automatic choice table)
    int64_t items;
    double uva, host;
    std::string uva_what, host_what;
  };
  std::vector<Best> best;

  // The gate's buffers (GateKernel on), the hash's output (the prefetches' ids) and its device layout.
  uint16_t *hidden = nullptr, *kv = nullptr, *qk = nullptr, *gout = nullptr;
  int32_t* hash_out = nullptr;
  std::unique_ptr<engram::kernels::DeviceLayout> hash_layout;

  // bench_kernels.cc: setup, helpers, teardown.
  void Ceilings();
  bool MapSegment(double table_gib);  // false: the segment could not be made (printed)
  void AllocLookupBuffers();
  void Unmap();
  void Lookup(const uint8_t* table, int64_t table_rows, int64_t items, bool packed, int max_blocks,
              void* scratch = nullptr, size_t scratch_bytes = 0, const int32_t* ids_at = nullptr);
  void NewIds(int64_t table_rows);
  // Repeats: each item copies an earlier item of its batch with probability `repeat`; otherwise a uniformly random
  // row. `sets` batches side by side (fresh ids per call).
  void FillIds(int64_t items, double repeat, int sets = 1);
  void Tune(int64_t sort_min_items, int variant, bool sort_only, int blocks = -1);
  int Batches(int64_t items) const;
  void Gate(int t, cudaStream_t st);

  // bench_kernels_lookup.cc.
  void UvaLookup();
  void UvaRowOrder();
  void UvaGridSize();
  void UvaLatency();
  void HbmLookup();

  // bench_kernels_paths.cc; false: a host gather could not be made.
  void BeginPaths();
  void LookupPaths();
  bool HostGatherScaling();
  bool HostGatherVariants();
  void ChoiceTable();
  void EndPaths();

  // bench_kernels_prefetch.cc; false: a model file, a prefetcher or a host gather could not be made.
  void GateKernel();
  bool Hash(const char* config_json);
  bool PrefetchBesideMain();
  bool HostGatherBesideMain();
};

}  // namespace engram::bench
