// bench_kernels' lookup sections (KernelBench, bench/bench_kernels.h): the UVA lookup from the shared segment (plain
// and packed, ids sorted, the kernel's row-order gather with its stages, variants and crossover, the grid size, the
// latency at decode sizes, on its own and in a CUDA graph) and the lookup from HBM. Each section reads the ids and
// output buffers, the segment mapping and the ceilings KernelBench owns, and frees what it allocates itself (the
// sort scratch); the row-order section leaves the lookup tuning at its defaults.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_kernels.h"
#include "bench/cuda_check.h"
#include "bench/gpu_timing.h"
#include "kernels/engram_kernels.h"

namespace engram::bench {

// --- UVA lookup from a shared segment ---------------------------------------------------------------------------
void KernelBench::UvaLookup() {
  std::printf("\n%-44s %-12s %-12s %s\n", "lookup", "time", "GB/s rec.", "vs ceiling");
  for (int64_t n_rows : {int64_t{196608}, int64_t{1} << 20}) {
    for (bool packed : {false, true}) {
      NewIds(rows);
      const int64_t items = n_rows / C * C;
      const double ms = MedianMs([&] { Lookup(static_cast<const uint8_t*>(dseg), rows, items, packed, 0); }, s, 10, 2);
      const double gbs = items * rb / ms / 1e6;
      std::printf("UVA %5.1f GiB shm, %7lld rows, %-6s         %8.3f ms  %8.2f     %.3f of H2D\n",
                  seg_bytes / 1073741824.0, static_cast<long long>(items), packed ? "packed" : "bf16", ms, gbs,
                  gbs / h2d);
    }
  }
  // Same ids, sorted: does locality in the table help the address translation that bounds the UVA path?
  for (int64_t n_rows : {int64_t{196608}, int64_t{1} << 20}) {
    const int64_t items = n_rows / C * C;
    for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows));
    std::sort(ids.begin(), ids.begin() + items);
    CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), items * 4, cudaMemcpyHostToDevice));
    const double ms = MedianMs([&] { Lookup(static_cast<const uint8_t*>(dseg), rows, items, false, 0); }, s, 10, 2);
    const double gbs = items * rb / ms / 1e6;
    std::printf("UVA %5.1f GiB shm, %7lld rows, bf16, ids sorted  %8.3f ms  %8.2f     %.3f of H2D\n",
                seg_bytes / 1073741824.0, static_cast<long long>(items), ms, gbs, gbs / h2d);
  }
}

// The kernel's own row-order gather (radix sort of (row, item) pairs in scratch), random ids: its stages (the sort
// alone, then sort + gather, the scatter and dequantisation being fused into the gather) and its variants (how
// the sorted positions are spread over the grid, rows in flight per warp).
void KernelBench::UvaRowOrder() {
  const size_t scratch_bytes = engram::kernels::LookupSortScratchBytes(max_items);
  void* scratch = nullptr;
  CUDA_CHECK(cudaMalloc(&scratch, scratch_bytes));
  for (int64_t n_rows : {int64_t{24576}, int64_t{196608}, int64_t{1} << 20}) {
    NewIds(rows);
    const int64_t items = n_rows / C * C;
    const int sets = Batches(items);
    int k = 0;
    auto run_blocks = [&](int max_blocks) {
      Lookup(static_cast<const uint8_t*>(dseg), rows, items, false, max_blocks, scratch, scratch_bytes,
             d_ids + (k++ % sets) * items);
    };
    auto run = [&] { run_blocks(0); };
    Tune(1, 0, true);
    const double sort_ms = MedianMs(run, s, 10, 2);
    std::printf("UVA row-order, %7lld rows (fresh ids, %2d batches): sort alone (keys + radix) %8.3f ms\n",
                static_cast<long long>(items), sets, sort_ms);
    for (int variant = 0; variant < 4; ++variant) {
      for (int blocks : {8, 16, 32, 66, 132, 0}) {
        if (variant >= 2 && blocks != 0 && blocks != 32) continue;
        Tune(1, variant, false, blocks);
        const double ms = MedianMs(run, s, 10, 2);
        const double gbs = items * rb / ms / 1e6;
        std::printf(
            "UVA row-order, %7lld rows, variant %d (%s), %4s blocks %8.3f ms %8.2f GB/s %.3f of H2D "
            "(gather %.3f ms)\n",
            static_cast<long long>(items), variant,
            variant == 0   ? "grid-stride, 4 rows/warp"
            : variant == 1 ? "grid-stride, 8 rows/warp"
            : variant == 2 ? "block runs, 4 rows/warp "
                           : "block runs, 8 rows/warp ",
            blocks ? std::to_string(blocks).c_str() : "all", ms, gbs, gbs / h2d, ms - sort_ms);
      }
    }
  }
  // Crossover of the plain and the row-order kernel (the default threshold is sort_min_items), fresh ids.
  for (int64_t n_rows : {int64_t{24576}, int64_t{32768}, int64_t{49152}, int64_t{98304}, int64_t{196608}}) {
    NewIds(rows);
    const int64_t items = n_rows / C * C;
    const int sets = Batches(items);
    int k = 0;
    auto run = [&] {
      Lookup(static_cast<const uint8_t*>(dseg), rows, items, false, 0, scratch, scratch_bytes,
             d_ids + (k++ % sets) * items);
    };
    Tune(int64_t{1} << 40, default_tuning.sort_variant, false);
    const double plain = MedianMs(run, s, 20, 4);
    Tune(1, default_tuning.sort_variant, false);
    const double sorted = MedianMs(run, s, 20, 4);
    std::printf("UVA crossover %7lld rows (fresh ids): plain %.3f ms (%.2f GB/s), row-order %.3f ms (%.2f GB/s)\n",
                static_cast<long long>(items), plain, items * rb / plain / 1e6, sorted, items * rb / sorted / 1e6);
  }
  engram::kernels::SetLookupTuning(default_tuning);
  std::printf("row-order gather default: from %lld items, variant %d, %d blocks\n",
              static_cast<long long>(default_tuning.sort_min_items), default_tuning.sort_variant,
              default_tuning.sort_blocks);
  CUDA_CHECK(cudaFree(scratch));
}

// Grid size: does the UVA gather need the whole GPU?
void KernelBench::UvaGridSize() {
  for (int blocks : {4, 16}) {
    NewIds(rows);
    const int64_t items = (int64_t{1} << 20) / C * C;
    const double ms =
        MedianMs([&] { Lookup(static_cast<const uint8_t*>(dseg), rows, items, false, blocks); }, s, 10, 2);
    std::printf("UVA %5.1f GiB shm, %7lld rows, bf16, %2d blocks    %8.3f ms  %8.2f\n", seg_bytes / 1073741824.0,
                static_cast<long long>(items), blocks, ms, items * rb / ms / 1e6);
  }
}

// Latency at decode sizes: from the whole segment and from a 64 MiB footprint of it.
void KernelBench::UvaLatency() {
  for (int64_t footprint_rows : {rows, int64_t{64 << 20} / rb}) {
    for (int tokens : {1, 2, 4, 64}) {
      NewIds(footprint_rows);
      const double ms =
          MedianMs([&] { Lookup(static_cast<const uint8_t*>(dseg), rows, tokens * C, false, 0); }, s, 200, 20);
      // On the stream as a CUDA graph replays it: 20 dependent lookups per replay, time per lookup.
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < 20; ++i) Lookup(static_cast<const uint8_t*>(dseg), rows, tokens * C, false, 0);
      CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const double graph_ms = MedianMs([&] { CUDA_CHECK(cudaGraphLaunch(exec, s)); }, s, 50, 5) / 20;
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      std::printf("UVA latency %2d tokens x 24 columns, %5.0f MiB   %8.2f us  launch+run, %6.2f us in a graph\n",
                  tokens, footprint_rows * rb / 1048576.0, ms * 1e3, graph_ms * 1e3);
    }
  }
}

// HBM lookup: 1M rows from a device table (the ceiling copies' buffers, 2 GiB of records).
void KernelBench::HbmLookup() {
  const int64_t hbm_rows = static_cast<int64_t>(kCeil / rb);
  NewIds(hbm_rows);
  const int64_t items = (int64_t{1} << 20) / C * C;
  const double ms = MedianMs([&] { Lookup(static_cast<const uint8_t*>(d0), hbm_rows, items, false, 0); }, s, 20, 3);
  const double rec = items * rb / ms / 1e6, moved = items * (rb + D * 2) / ms / 1e6;
  std::printf(
      "\nlookup HBM 2 GiB table, %lld rows, bf16        %8.3f ms  %8.0f rec.  %.3f of D2D counting rows "
      "read + bf16 written\n",
      static_cast<long long>(items), ms, rec, moved / d2d);
}

}  // namespace engram::bench
