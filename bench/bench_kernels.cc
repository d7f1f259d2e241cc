// bench_kernels: the GPU kernels against ceilings measured in the same run.
//   ceilings   H2D cudaMemcpy from pinned memory (PCIe), D2D copy (HBM, bytes read + written)
//   lookup     from a shared segment through UVA (default 16 GiB in /dev/shm; ENGRAM_BENCH_SHM_DIR names another
//              directory, e.g. a huge=always tmpfs: the page kind engramd's --shm-dir gives), 196K and 1M rows; latency
//              for 1/2/4/64 tokens x 24 columns; from HBM, 1M rows
//   gate       T = 4096, 8192, D = 5120, hc_mult = 4
//   hash       T = 8192, V4.1-Flash layout (2 layers)
//   prefetch   8192-token lookup on the side stream during a busy main stream
//   paths      every lookup path (UVA, UVA row-order, host gather with and without de-duplication) at 24K / 196K /
//              1M rows, random and with 45% repeated rows (rows moved vs rows served), host-gather threads; the
//              crossover the engine's automatic choice uses (written to $ENGRAM_LOOKUP_PATH_TABLE when set); the
//              host gather's pipeline variants (prefetch distance, non-temporal stores, fused plan, copy issuer,
//              wake-up) side by side, batches back to back and after an idle gap ("host gather variant" lines)
// Usage: bench_kernels FLASH_CONFIG_JSON [TABLE_GIB]   (prints a table; times are medians of CUDA-event timings)
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/gpu_timing.h"
#include "client/engine/host_gather.h"
#include "client/engine/prefetch.h"
#include "client/tuning.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"
#include "model/layout.h"
#include "model/token_map.h"

using engram::bench::FillRandom;
using engram::bench::MedianMs;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_kernels FLASH_CONFIG_JSON [TABLE_GIB]\n");
    return 2;
  }
  const double table_gib = argc > 2 ? std::atof(argv[2]) : 16.0;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  // --- Ceilings -------------------------------------------------------------------------------------------------
  const size_t kCeil = size_t{2} << 30;
  void *pinned = nullptr, *d0 = nullptr, *d1 = nullptr;
  CUDA_CHECK(cudaMallocHost(&pinned, kCeil));
  FillRandom(static_cast<uint8_t*>(pinned), kCeil, threads);
  CUDA_CHECK(cudaMalloc(&d0, kCeil));
  CUDA_CHECK(cudaMalloc(&d1, kCeil));
  const double h2d_ms =
      MedianMs([&] { CUDA_CHECK(cudaMemcpyAsync(d0, pinned, kCeil, cudaMemcpyHostToDevice, s)); }, s, 5);
  const double d2d_ms =
      MedianMs([&] { CUDA_CHECK(cudaMemcpyAsync(d1, d0, kCeil, cudaMemcpyDeviceToDevice, s)); }, s, 10);
  const double h2d = kCeil / h2d_ms / 1e6, d2d = 2.0 * kCeil / d2d_ms / 1e6;
  std::printf("ceiling  H2D pinned memcpy %.1f GB/s   D2D copy %.0f GB/s (read + write)\n", h2d, d2d);
  CUDA_CHECK(cudaFreeHost(pinned));

  // --- UVA lookup from a shared segment ---------------------------------------------------------------------------
  const int64_t D = 256, rb = 264;
  const size_t seg_bytes = static_cast<size_t>(table_gib * (1ull << 30)) / rb * rb;
  const int64_t rows = static_cast<int64_t>(seg_bytes / rb);
  const char* shm_dir_env = std::getenv("ENGRAM_BENCH_SHM_DIR");
  const std::string shm_dir = shm_dir_env != nullptr && *shm_dir_env != '\0' ? shm_dir_env : "/dev/shm";
  // ENGRAM_BENCH_HG_VARIANTS_ONLY=1: the ceilings, then only the host-gather variants (a short run for tuning).
  const char* variants_env = std::getenv("ENGRAM_BENCH_HG_VARIANTS_ONLY");
  const bool variants_only = variants_env != nullptr && std::string(variants_env) == "1";
  const std::string path = shm_dir + "/engram-bench-" + std::to_string(::getpid());
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(seg_bytes)) != 0) {
    std::perror("segment");
    return 1;
  }
  auto* seg = static_cast<uint8_t*>(::mmap(nullptr, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  if (seg == MAP_FAILED) return 1;
  auto t0 = std::chrono::steady_clock::now();
  FillRandom(seg, seg_bytes, threads);
  const double fill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  CUDA_CHECK(cudaHostRegister(seg, seg_bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly));
  const double reg_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  void* dseg = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&dseg, seg, 0));
  std::printf(
      "segment  %.1f GiB in %s: first-touch fill %.2f s (%.1f GiB/s, %d threads), "
      "cudaHostRegister %.2f s\n",
      seg_bytes / 1073741824.0, shm_dir.c_str(), fill_s, seg_bytes / 1073741824.0 / fill_s, threads, reg_s);
  if (FILE* mi = std::fopen("/proc/meminfo", "r")) {  // how much of the segment landed on huge pages
    char line[256];
    while (std::fgets(line, sizeof(line), mi) != nullptr) {
      if (std::strncmp(line, "ShmemHugePages:", 15) == 0) std::printf("segment  host %s", line);
    }
    std::fclose(mi);
  }

  std::mt19937_64 rng(7);
  const int C = 24;
  const int64_t max_items = 1 << 20;
  std::vector<int32_t> ids(static_cast<size_t>(max_items));
  int32_t* d_ids = nullptr;
  uint16_t* d_out = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_ids), max_items * 4));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_out), max_items * D * 2));
  auto lookup = [&](const uint8_t* table, int64_t table_rows, int64_t items, bool packed, int max_blocks,
                    void* scratch = nullptr, size_t scratch_bytes = 0, const int32_t* ids_at = nullptr) {
    engram::kernels::LookupArgs a;
    a.records = table;
    a.row_begin = 0;
    a.row_end = table_rows;
    a.head_dim = static_cast<int32_t>(D);
    a.ids = ids_at != nullptr ? ids_at : d_ids;
    a.num_tokens = static_cast<int32_t>(items / C);
    a.num_cols = C;
    a.ids_stride = C;
    a.out = d_out;
    a.packed = packed;
    a.max_blocks = max_blocks;
    a.sort_scratch = scratch;
    a.sort_scratch_bytes = scratch_bytes;
    CUDA_CHECK(engram::kernels::LaunchLookup(a, s));
  };
  auto new_ids = [&](int64_t table_rows) {
    for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(table_rows));
    CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  };
  const engram::kernels::LookupTuning default_tuning = engram::kernels::GetLookupTuning();
  auto tune = [&](int64_t sort_min_items, int variant, bool sort_only, int blocks = -1) {
    engram::kernels::LookupTuning t = default_tuning;
    t.sort_min_items = sort_min_items;
    t.sort_variant = variant;
    t.sort_only = sort_only;
    if (blocks >= 0) t.sort_blocks = blocks;
    engram::kernels::SetLookupTuning(t);
  };
  // Fresh ids per call: consecutive calls take consecutive batches of the random ids in d_ids (up to 16), so that a
  // small batch's rows are not still in L2 and the TLBs from the call before (a repeated batch flatters them).
  auto batches = [&](int64_t items) { return static_cast<int>(std::min<int64_t>(16, max_items / items)); };
  if (!variants_only) {
    std::printf("\n%-44s %-12s %-12s %s\n", "lookup", "time", "GB/s rec.", "vs ceiling");
    for (int64_t n_rows : {int64_t{196608}, int64_t{1} << 20}) {
      for (bool packed : {false, true}) {
        new_ids(rows);
        const int64_t items = n_rows / C * C;
        const double ms =
            MedianMs([&] { lookup(static_cast<const uint8_t*>(dseg), rows, items, packed, 0); }, s, 10, 2);
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
      const double ms = MedianMs([&] { lookup(static_cast<const uint8_t*>(dseg), rows, items, false, 0); }, s, 10, 2);
      const double gbs = items * rb / ms / 1e6;
      std::printf("UVA %5.1f GiB shm, %7lld rows, bf16, ids sorted  %8.3f ms  %8.2f     %.3f of H2D\n",
                  seg_bytes / 1073741824.0, static_cast<long long>(items), ms, gbs, gbs / h2d);
    }
    // The kernel's own row-order gather (radix sort of (row, item) pairs in scratch), random ids: its stages (the sort
    // alone, then sort + gather, the scatter and dequantisation being fused into the gather) and its variants (how
    // the sorted positions are spread over the grid, rows in flight per warp).
    {
      const size_t scratch_bytes = engram::kernels::LookupSortScratchBytes(max_items);
      void* scratch = nullptr;
      CUDA_CHECK(cudaMalloc(&scratch, scratch_bytes));
      for (int64_t n_rows : {int64_t{24576}, int64_t{196608}, int64_t{1} << 20}) {
        new_ids(rows);
        const int64_t items = n_rows / C * C;
        const int sets = batches(items);
        int k = 0;
        auto run_blocks = [&](int max_blocks) {
          lookup(static_cast<const uint8_t*>(dseg), rows, items, false, max_blocks, scratch, scratch_bytes,
                 d_ids + (k++ % sets) * items);
        };
        auto run = [&] { run_blocks(0); };
        tune(1, 0, true);
        const double sort_ms = MedianMs(run, s, 10, 2);
        std::printf("UVA row-order, %7lld rows (fresh ids, %2d batches): sort alone (keys + radix) %8.3f ms\n",
                    static_cast<long long>(items), sets, sort_ms);
        for (int variant = 0; variant < 4; ++variant) {
          for (int blocks : {8, 16, 32, 66, 132, 0}) {
            if (variant >= 2 && blocks != 0 && blocks != 32) continue;
            tune(1, variant, false, blocks);
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
        new_ids(rows);
        const int64_t items = n_rows / C * C;
        const int sets = batches(items);
        int k = 0;
        auto run = [&] {
          lookup(static_cast<const uint8_t*>(dseg), rows, items, false, 0, scratch, scratch_bytes,
                 d_ids + (k++ % sets) * items);
        };
        tune(int64_t{1} << 40, default_tuning.sort_variant, false);
        const double plain = MedianMs(run, s, 20, 4);
        tune(1, default_tuning.sort_variant, false);
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
    for (int blocks : {4, 16}) {
      new_ids(rows);
      const int64_t items = (int64_t{1} << 20) / C * C;
      const double ms =
          MedianMs([&] { lookup(static_cast<const uint8_t*>(dseg), rows, items, false, blocks); }, s, 10, 2);
      std::printf("UVA %5.1f GiB shm, %7lld rows, bf16, %2d blocks    %8.3f ms  %8.2f\n", seg_bytes / 1073741824.0,
                  static_cast<long long>(items), blocks, ms, items * rb / ms / 1e6);
    }
    for (int64_t footprint_rows : {rows, int64_t{64 << 20} / rb}) {
      for (int tokens : {1, 2, 4, 64}) {
        new_ids(footprint_rows);
        const double ms =
            MedianMs([&] { lookup(static_cast<const uint8_t*>(dseg), rows, tokens * C, false, 0); }, s, 200, 20);
        // On the stream as a CUDA graph replays it: 20 dependent lookups per replay, time per lookup.
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 20; ++i) lookup(static_cast<const uint8_t*>(dseg), rows, tokens * C, false, 0);
        CUDA_CHECK(cudaStreamEndCapture(s, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        const double graph_ms = MedianMs([&] { CUDA_CHECK(cudaGraphLaunch(exec, s)); }, s, 50, 5) / 20;
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        std::printf("UVA latency %2d tokens x 24 columns, %5.0f MiB   %8.2f us  launch+run, %6.2f us in a graph\n",
                    tokens, footprint_rows * rb / 1048576.0, ms * 1e3, graph_ms * 1e3);
      }
    }
  }  // !variants_only
  // --- Every lookup path, bf16 out, against the same run's H2D ceiling ------------------------------------------
  {
    const size_t scratch_bytes = engram::kernels::LookupSortScratchBytes(max_items);
    void* scratch = nullptr;
    CUDA_CHECK(cudaMalloc(&scratch, scratch_bytes));
    // Repeats: each item copies an earlier item of its batch with probability 0.45 (the share of repeated lookups
    // measured on real text); otherwise a uniformly random row. `sets` batches side by side (fresh ids per call).
    auto fill_ids = [&](int64_t items, double repeat, int sets = 1) {
      std::uniform_real_distribution<double> u(0, 1);
      for (int k = 0; k < sets; ++k) {
        int32_t* b = ids.data() + k * items;
        for (int64_t i = 0; i < items; ++i) {
          b[i] = i > 0 && u(rng) < repeat ? b[rng() % i] : static_cast<int32_t>(rng() % static_cast<uint64_t>(rows));
        }
      }
      CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), items * sets * 4, cudaMemcpyHostToDevice));
    };
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    std::printf("\n%-58s %-11s %-10s %-10s %s\n", "lookup path (16 GiB shm, bf16 out)", "time", "served", "moved",
                "served vs H2D");
    struct Best {
      int64_t items;
      double uva, host;
      std::string uva_what, host_what;
    };
    std::vector<Best> best;
    auto make_hg = [&](int th) {
      engram::client::HostGatherOptions o;
      o.threads = th;
      auto g = engram::client::HostGather::Create({{seg, 0, rows, static_cast<const uint8_t*>(dseg)}}, {d_out},
                                                  static_cast<int32_t>(max_items / C), C, static_cast<int32_t>(D), o);
      if (!g.ok()) {
        std::printf("host gather: %s\n", std::string(g.status().message()).c_str());
        std::exit(1);
      }
      return std::move(*g);
    };
    const int default_threads = engram::client::DefaultGatherThreads(cores);
    if (!variants_only) {  // (the variants below then run alone: no idle engines' pools and buffers beside them)
      std::unique_ptr<engram::client::HostGather> hg = make_hg(default_threads);
      std::printf("host gather: %d threads (default share of %d cores); engine default: UVA share %.2f\n",
                  hg->threads(), cores, engram::client::tuning_default::kHostGatherUvaShare);
      // The engine's built-in share and its neighbours (the engine's calibration picks among 0.15-0.35).
      const std::vector<double> shares = {0.0, 0.15, 0.2, 0.25, 0.3, 0.4};
      for (double repeat : {0.0, 0.45}) {
        for (int64_t n_rows : {int64_t{6144}, int64_t{24576}, int64_t{196608}, int64_t{1} << 20}) {
          const int64_t items = n_rows / C * C;
          const int32_t tokens = static_cast<int32_t>(items / C);
          const int sets = batches(items);
          int k = 0;
          fill_ids(items, repeat, sets);
          auto line = [&](const std::string& what, double ms, int64_t moved) {
            const double served = items * rb / ms / 1e6;
            std::printf("%-7lld rows, %2.0f%% repeats, %2d batches, %-40s %8.3f ms %7.2f GB/s %7.2f GB/s  %.3f\n",
                        static_cast<long long>(items), repeat * 100, sets, what.c_str(), ms, served,
                        moved * rb / ms / 1e6, served / h2d);
          };
          auto uva_run = [&] {
            lookup(static_cast<const uint8_t*>(dseg), rows, items, false, 0, scratch, scratch_bytes,
                   d_ids + (k++ % sets) * items);
          };
          tune(int64_t{1} << 40, default_tuning.sort_variant, false);
          const double plain = MedianMs(uva_run, s, 10, 2);
          line("UVA kernel", plain, items);
          tune(1, default_tuning.sort_variant, false);
          const double sorted = MedianMs(uva_run, s, 10, 2);
          line("UVA row-order gather", sorted, items);
          engram::kernels::SetLookupTuning(default_tuning);
          const double uva_engine = MedianMs(uva_run, s, 10, 2);
          line(items >= default_tuning.sort_min_items ? "UVA, engine default (row-order)"
                                                      : "UVA, engine default (plain)",
               uva_engine, items);
          double host_best = 1e30, host_engine = 1e30;
          std::string host_what;
          for (double share : shares) {
            auto& g = *hg;
            g.set_uva_share(share);
            const double ms = MedianMs(
                [&] {
                  if (!g.Prefetch(ids.data() + (k++ % sets) * items, tokens, C, s).ok() || !g.Wait(0, s).ok()) {
                    std::exit(1);
                  }
                },
                s, 10, 2);
            char what[96];
            std::snprintf(what, sizeof what, "host gather, every row, UVA share %.2f", share);
            line(what, ms, g.stats(0).rows_moved);
            if (ms < host_best) {
              host_best = ms;
              host_what = what;
            }
            if (share == engram::client::tuning_default::kHostGatherUvaShare) host_engine = ms;
          }
          hg->set_uva_share(0);
          if (host_engine > 1e29) host_engine = host_best;
          std::printf(
              "%-7lld rows, %2.0f%% repeats: fastest UVA %.3f ms, fastest host %.3f ms (%s); engine: UVA %.3f ms, "
              "host %.3f ms\n",
              static_cast<long long>(items), repeat * 100, std::min(plain, sorted), host_best, host_what.c_str(),
              uva_engine, host_engine);
          if (repeat == 0.0) best.push_back({items, uva_engine, host_engine, "", host_what});
        }
      }
      hg.reset();
      // Threads and chunk sizes: how the host gather scales (random rows, fresh ids; every row; the engine's share).
      for (int64_t n_rows : {int64_t{24576}, int64_t{196608}, int64_t{1} << 20}) {
        const int64_t items = n_rows / C * C;
        const int sets = batches(items);
        int k = 0;
        fill_ids(items, 0.0, sets);
        for (int th : {16, 24}) {
          for (int64_t min_chunk : {int64_t{1024}, int64_t{4096}}) {
            if (th > cores || (min_chunk != 1024 && n_rows > 196608)) continue;
            engram::client::HostGatherOptions o;
            o.threads = th;
            o.min_chunk_rows = min_chunk;
            auto g =
                engram::client::HostGather::Create({{seg, 0, rows, static_cast<const uint8_t*>(dseg)}}, {d_out},
                                                   static_cast<int32_t>(max_items / C), C, static_cast<int32_t>(D), o);
            if (!g.ok()) return 1;
            for (double share : {0.0, engram::client::tuning_default::kHostGatherUvaShare}) {
              (*g)->set_uva_share(share);
              const double ms = MedianMs(
                  [&] {
                    if (!(*g)->Prefetch(ids.data() + (k++ % sets) * items, static_cast<int32_t>(items / C), C, s)
                             .ok() ||
                        !(*g)->Wait(0, s).ok()) {
                      std::exit(1);
                    }
                  },
                  s, 10, 2);
              std::printf(
                  "host gather %2d threads, chunks >= %4lld rows, every row, UVA share %.2f, %7lld rows %8.3f ms "
                  "%7.2f GB/s  %.3f of H2D\n",
                  th, static_cast<long long>(min_chunk), share, static_cast<long long>(items), ms,
                  items * rb / ms / 1e6, items * rb / ms / 1e6 / h2d);
            }
          }
        }
      }
    }  // !variants_only
    // Host-gather variants side by side (what separates the pipeline from the CPU gather ceiling): every
    // HostGatherOptions knob of the copy pipeline, each alone and together, against no knob set; every row, 0 and
    // the engine's UVA share; fresh ids per call. "b2b" = batches back to back (threads and dispatcher may still be
    // spinning); "idle" = 2 ms without work before each batch (everything asleep: a serving engine's case).
    {
      struct HgVariant {  // no pipeline knob set (the "before" row) unless named
        const char* name;
        int32_t prefetch = 16, nt = 0, fused = 0, issuer = 0, spin = 200, dspin = 0, prewake = 0;
        int64_t min_chunk = 1024, max_chunk = 8192;
        int32_t issue_min = 0, pass_spin = 200;
        int threads = 0;  // 0: the default share of the cores
      };
      const HgVariant hv[] = {
          {.name = "before (pf16)"},
          {.name = "pf0", .prefetch = 0},
          {.name = "pf8", .prefetch = 8},
          {.name = "pf32", .prefetch = 32},
          {.name = "nt", .nt = 1},
          {.name = "fused", .fused = 1},
          {.name = "issuer", .issuer = 1},
          {.name = "prewake+dspin200", .dspin = 200, .prewake = 1},
          {.name = "spin1000", .spin = 1000},
          {.name = "pass spin 20000", .pass_spin = 20000},
          {.name = "all (nt fused issuer prewake dspin200)",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1},
          {.name = "all, pf8", .prefetch = 8, .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
          {.name = "all, pf32", .prefetch = 32, .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
          {.name = "all, no nt", .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
          {.name = "all, chunks 256-8192",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256},
          {.name = "all, chunks 512-4096",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 512,
           .max_chunk = 4096},
          {.name = "default: all, chunks 256-1024, copies >= 4096",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 4096},
          // Copy sizes and thread counts around the default.
          {.name = "default, copies >= 2048",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 2048},
          {.name = "default, copies >= 8192",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 8192},
          {.name = "default, copies >= 16384",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 16384},
          {.name = "default, chunks 256-512",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 512,
           .issue_min = 4096},
          {.name = "default, 24 threads",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 4096,
           .threads = 24},
          {.name = "default, 30 threads",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 4096,
           .threads = 30},
          {.name = "default, 24 threads, copies >= 8192",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 8192,
           .threads = 24},
          {.name = "default, pf8",
           .prefetch = 8,
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 4096},
          {.name = "default, pf8, 24 threads",
           .prefetch = 8,
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 4096,
           .threads = 24},
          {.name = "default again (drift check)",
           .nt = 1,
           .fused = 1,
           .issuer = 1,
           .dspin = 200,
           .prewake = 1,
           .min_chunk = 256,
           .max_chunk = 1024,
           .issue_min = 4096},
          {.name = "fused + pass spin + prewake + dspin (no issuer)",
           .fused = 1,
           .dspin = 200,
           .prewake = 1,
           .pass_spin = 20000},
          {.name = "fused + nt + pass spin + prewake + dspin",
           .nt = 1,
           .fused = 1,
           .dspin = 200,
           .prewake = 1,
           .pass_spin = 20000},
      };
      const int64_t sizes[] = {24576, 196608, int64_t{1} << 20};
      std::vector<std::vector<int32_t>> size_ids;
      for (int64_t n_rows : sizes) {
        const int64_t items = n_rows / C * C;
        const int sets = batches(items);
        fill_ids(items, 0.0, sets);
        size_ids.emplace_back(ids.begin(), ids.begin() + items * sets);
      }
      cudaEvent_t ea, eb;
      CUDA_CHECK(cudaEventCreate(&ea));
      CUDA_CHECK(cudaEventCreate(&eb));
      // Median ms of `reps` batches (after 2 untimed), each after `idle_us` microseconds without work.
      // *pass_ms: the median host time of the threads' gather pass (HostGather::LayerStats::gather_ms).
      auto time_batches = [&](engram::client::HostGather& g, const std::vector<int32_t>& bids, int64_t items,
                              int idle_us, double* pass_ms) {
        const int sets = static_cast<int>(bids.size() / static_cast<size_t>(items));
        std::vector<float> ms;
        std::vector<double> pass;
        for (int r = 0; r < 12; ++r) {
          if (idle_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
          CUDA_CHECK(cudaEventRecord(ea, s));
          if (!g.Prefetch(bids.data() + (r % sets) * items, static_cast<int32_t>(items / C), C, s).ok() ||
              !g.Wait(0, s).ok()) {
            std::exit(1);
          }
          CUDA_CHECK(cudaEventRecord(eb, s));
          CUDA_CHECK(cudaEventSynchronize(eb));
          float m = 0;
          CUDA_CHECK(cudaEventElapsedTime(&m, ea, eb));
          if (r >= 2) ms.push_back(m);
          if (r >= 2) pass.push_back(g.stats(0).gather_ms);
        }
        std::sort(pass.begin(), pass.end());
        *pass_ms = pass[pass.size() / 2];
        std::sort(ms.begin(), ms.end());
        return static_cast<double>(ms[ms.size() / 2]);
      };
      std::printf(
          "\nhost gather variants (%d threads, every row, fresh ids; b2b = back to back, idle = 2 ms idle "
          "before each batch):\n",
          default_threads);
      struct BestHg {
        double ms = 1e30;
        std::string what;
      };
      std::vector<BestHg> best_b2b(6), best_idle(6);
      for (const HgVariant& v : hv) {
        engram::client::HostGatherOptions o;
        o.threads = v.threads > 0 ? std::min(v.threads, cores) : default_threads;
        o.prefetch_rows = v.prefetch;
        o.stream_stores = v.nt;
        o.fused = v.fused;
        o.copy_issuer = v.issuer;
        o.spin_us = v.spin;
        o.dispatch_spin_us = v.dspin;
        o.prewake = v.prewake;
        o.min_chunk_rows = v.min_chunk;
        o.max_chunk_rows = v.max_chunk;
        o.issue_min_rows = v.issue_min;
        o.pass_spin_us = v.pass_spin;
        auto g = engram::client::HostGather::Create({{seg, 0, rows, static_cast<const uint8_t*>(dseg)}}, {d_out},
                                                    static_cast<int32_t>(max_items / C), C, static_cast<int32_t>(D), o);
        if (!g.ok()) return 1;
        for (size_t si = 0; si < 3; ++si) {
          const int64_t items = sizes[si] / C * C;
          for (int sh = 0; sh < 2; ++sh) {
            const double share = sh == 0 ? 0.0 : engram::client::tuning_default::kHostGatherUvaShare;
            (*g)->set_uva_share(share);
            double pass_b2b = 0, pass_idle = 0;
            const double b2b = time_batches(**g, size_ids[si], items, 0, &pass_b2b);
            const double idle = time_batches(**g, size_ids[si], items, 2000, &pass_idle);
            const double gb_b2b = items * rb / b2b / 1e6, gb_idle = items * rb / idle / 1e6;
            std::printf(
                "host gather variant %-48s share %.2f %7lld rows  b2b %7.3f ms %6.2f GB/s %.3f of H2D  "
                "idle %7.3f ms %6.2f GB/s %.3f of H2D  (gather pass b2b %.3f ms, idle %.3f ms)\n",
                v.name, share, static_cast<long long>(items), b2b, gb_b2b, gb_b2b / h2d, idle, gb_idle, gb_idle / h2d,
                pass_b2b, pass_idle);
            const size_t bi = si * 2 + static_cast<size_t>(sh);
            if (b2b < best_b2b[bi].ms) best_b2b[bi] = {b2b, v.name};
            if (idle < best_idle[bi].ms) best_idle[bi] = {idle, v.name};
          }
        }
      }
      for (size_t bi = 0; bi < 6; ++bi) {
        const int64_t items = sizes[bi / 2] / C * C;
        std::printf(
            "host gather variants, %7lld rows, share %.2f: fastest b2b %s (%.3f ms, %.3f of H2D), fastest idle "
            "%s (%.3f ms, %.3f of H2D)\n",
            static_cast<long long>(items), bi % 2 == 0 ? 0.0 : engram::client::tuning_default::kHostGatherUvaShare,
            best_b2b[bi].what.c_str(), best_b2b[bi].ms, items * rb / best_b2b[bi].ms / 1e6 / h2d,
            best_idle[bi].what.c_str(), best_idle[bi].ms, items * rb / best_idle[bi].ms / 1e6 / h2d);
      }
      cudaEventDestroy(ea);
      cudaEventDestroy(eb);
    }
    if (variants_only) {
      CUDA_CHECK(cudaFree(scratch));
      CUDA_CHECK(cudaHostUnregister(seg));
      ::munmap(seg, seg_bytes);
      ::unlink(path.c_str());
      return 0;
    }
    // The automatic choice's table: per size, did the host-gather path (engine configuration) beat the UVA path?
    std::printf("automatic choice table (ENGRAM_LOOKUP_PATH_TABLE format):\n");
    FILE* out_table = nullptr;
    if (const char* table = std::getenv("ENGRAM_LOOKUP_PATH_TABLE"); table != nullptr)
      out_table = std::fopen(table, "w");
    for (const auto& b : best) {
      std::printf("  %lld %s   (UVA engine default %.3f ms, host gather engine default %.3f ms)\n",
                  static_cast<long long>(b.items), b.host < b.uva ? "host" : "uva", b.uva, b.host);
      if (out_table != nullptr)
        std::fprintf(out_table, "%lld %s\n", static_cast<long long>(b.items), b.host < b.uva ? "host" : "uva");
    }
    if (out_table != nullptr) std::fclose(out_table);
    CUDA_CHECK(cudaFree(scratch));
  }
  // Side-stream prefetch of 8192 tokens (2 layers) during a busy main stream (gate kernels, HBM-bound).
  const int T = 8192, HC = 4, HD = 5120;
  uint16_t *hidden = nullptr, *kv = nullptr, *qk = nullptr, *gout = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&hidden), size_t{T} * HC * HD * 2));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&kv), size_t{T} * (HC + 1) * HD * 2));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&qk), size_t{HC} * HD * 2));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&gout), size_t{T} * HC * HD * 2));
  CUDA_CHECK(cudaMemcpy(hidden, d0, size_t{T} * HC * HD * 2, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemcpy(kv, d0, size_t{T} * (HC + 1) * HD * 2, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemset(qk, 0x3F, size_t{HC} * HD * 2));
  auto gate = [&](int t, cudaStream_t st) {
    engram::kernels::GateArgs g{hidden, kv, qk, qk, nullptr, gout, t, HC, HD, 1e-6f};
    CUDA_CHECK(engram::kernels::LaunchGate(g, st));
  };
  std::printf("\n%-44s %-12s %-12s %s\n", "gate (D=5120, hc=4)", "time", "GB/s", "vs D2D");
  for (int t : {4096, 8192}) {
    const double ms = MedianMs([&] { gate(t, s); }, s, 20, 3);
    const double bytes = double(t) * (HC * HD * 2 * 2 + (HC + 1) * HD * 2);  // hidden in+out, kv in
    std::printf("T=%-42d %8.3f ms  %8.0f     %.3f of D2D\n", t, ms, bytes / ms / 1e6, bytes / ms / 1e6 / d2d);
  }

  // HBM lookup: 1M rows from a device table (the ceiling copies' buffers, 2 GiB of records).
  {
    const int64_t hbm_rows = static_cast<int64_t>(kCeil / rb);
    new_ids(hbm_rows);
    const int64_t items = (int64_t{1} << 20) / C * C;
    const double ms = MedianMs([&] { lookup(static_cast<const uint8_t*>(d0), hbm_rows, items, false, 0); }, s, 20, 3);
    const double rec = items * rb / ms / 1e6, moved = items * (rb + D * 2) / ms / 1e6;
    std::printf(
        "\nlookup HBM 2 GiB table, %lld rows, bf16        %8.3f ms  %8.0f rec.  %.3f of D2D counting rows "
        "read + bf16 written\n",
        static_cast<long long>(items), ms, rec, moved / d2d);
  }

  // Hash, V4.1-Flash layout.
  {
    auto cfg = engram::LoadEngramConfig(argv[1]);
    if (!cfg.ok()) return 1;
    auto layout = engram::Layout::Build(*cfg);
    std::vector<int32_t> map_ids(static_cast<size_t>(cfg->compressed_vocab_size));
    for (size_t i = 0; i < map_ids.size(); ++i) map_ids[i] = static_cast<int32_t>(i);
    auto map = engram::TokenMap::FromIds(map_ids);
    auto dl = engram::kernels::DeviceLayout::Upload(*layout, map);
    if (!dl.ok()) return 1;
    std::vector<int32_t> tok(T), qsl = {0, T / 2, T};
    std::vector<int64_t> pos(T);
    for (int i = 0; i < T; ++i) {
      tok[i] = static_cast<int32_t>(rng() % map_ids.size());
      pos[i] = i < T / 2 ? i : i - T / 2 + 100;
    }
    int32_t *dt, *dq, *dout;
    int64_t* dp;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dt), T * 4));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dq), 12));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dp), T * 8));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dout), size_t{T} * 48 * 4));
    CUDA_CHECK(cudaMemcpy(dt, tok.data(), T * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dq, qsl.data(), 12, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dp, pos.data(), T * 8, cudaMemcpyHostToDevice));
    engram::kernels::HashArgs h{dt, dp, dq, nullptr, nullptr, T, 2, dout, nullptr};
    const double ms = MedianMs([&] { CUDA_CHECK(engram::kernels::LaunchHash((*dl)->view(), h, s)); }, s, 100, 10);
    std::printf("hash T=8192, 2 layers x 24 columns               %8.2f us\n", ms * 1e3);

    // Prefetch during a busy main stream: main = 10 gate kernels of T=8192.
    for (int blocks : {0, 8, 16}) {
      engram::kernels::Prefetcher p;
      std::vector<engram::kernels::LayerTable> tables = {
          {static_cast<const uint8_t*>(dseg), 0, rows / 2},
          {static_cast<const uint8_t*>(dseg) + (rows / 2) * rb, 0, rows / 2}};
      if (auto st = p.Init(tables, T, 24, static_cast<int32_t>(D), blocks); !st.ok()) {
        std::printf("prefetcher: %s\n", std::string(st.message()).c_str());
        return 1;
      }
      // hash ids for the prefetch: random in range
      std::vector<int32_t> pid(size_t{T} * 48);
      for (auto& v : pid) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows / 2));
      CUDA_CHECK(cudaMemcpy(dout, pid.data(), pid.size() * 4, cudaMemcpyHostToDevice));
      auto busy = [&] {  // longer than the lookup, as the earlier layers of a real model are
        for (int i = 0; i < 60; ++i) gate(T, s);
      };
      const double alone = MedianMs(busy, s, 10, 2);
      const double side_alone = MedianMs(
          [&] {
            (void)p.Prefetch(dout, T, s);
            (void)p.Wait(1, s);
          },
          s, 10, 2);
      cudaEvent_t a, b;
      CUDA_CHECK(cudaEventCreate(&a));
      CUDA_CHECK(cudaEventCreate(&b));
      std::vector<float> with;
      int finished_first = 0;
      for (int r = 0; r < 10; ++r) {
        CUDA_CHECK(cudaEventRecord(a, s));
        (void)p.Prefetch(dout, T, s);
        busy();
        CUDA_CHECK(cudaEventRecord(b, s));
        CUDA_CHECK(cudaEventSynchronize(b));
        // Both events are complete now; the lookup finished first when its event is not later than the main one.
        float order = -1;
        if (cudaEventQuery(p.layer_event(1)) == cudaSuccess)
          CUDA_CHECK(cudaEventElapsedTime(&order, p.layer_event(1), b));
        finished_first += order >= 0;
        (void)p.Wait(1, s);
        float m = 0;
        CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
        with.push_back(m);
        CUDA_CHECK(cudaStreamSynchronize(s));
      }
      std::sort(with.begin(), with.end());
      std::printf("\nprefetch, background grid %s blocks: 8192 tokens x 2 layers (UVA) alone %.3f ms\n",
                  blocks ? std::to_string(blocks).c_str() : "default", side_alone);
      std::printf(
          "  main stream (60 gates T=8192) alone %.3f ms, with the prefetch %.3f ms: slowed %.1f%%; "
          "lookup done before the main stream in %d/10 runs\n",
          alone, with[with.size() / 2], (with[with.size() / 2] / alone - 1) * 100, finished_first);
    }
    // The host-gather path beside the same busy main stream: CPU threads and copy engines, the unpack on the GPU
    // (and, with the engine's UVA share, the row-order kernel on part of the tokens).
    for (double share : {0.0, engram::client::tuning_default::kHostGatherUvaShare}) {
      uint16_t *o0 = nullptr, *o1 = nullptr;
      CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&o0), size_t{T} * 24 * D * 2));
      CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&o1), size_t{T} * 24 * D * 2));
      engram::client::HostGatherOptions ho;
      ho.uva_share = share;
      auto g = engram::client::HostGather::Create(
          {{seg, 0, rows / 2, static_cast<const uint8_t*>(dseg)},
           {seg + (rows / 2) * rb, 0, rows / 2, static_cast<const uint8_t*>(dseg) + (rows / 2) * rb}},
          {o0, o1}, T, 24, static_cast<int32_t>(D), ho);
      if (!g.ok()) return 1;
      std::vector<int32_t> hid(size_t{T} * 48);
      for (auto& v : hid) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows / 2));
      auto busy = [&] {
        for (int i = 0; i < 60; ++i) gate(T, s);
      };
      const double alone = MedianMs(busy, s, 10, 2);
      const double side_alone = MedianMs(
          [&] {
            if (!(*g)->Prefetch(hid.data(), T, 48, s).ok() || !(*g)->Wait(1, s).ok()) std::exit(1);
          },
          s, 10, 2);
      const double with = MedianMs(
          [&] {
            if (!(*g)->Prefetch(hid.data(), T, 48, s).ok()) std::exit(1);
            busy();
            if (!(*g)->Wait(1, s).ok()) std::exit(1);
          },
          s, 10, 2);
      std::printf("\nprefetch, host gather (%d threads, UVA share %.2f): 8192 tokens x 2 layers alone %.3f ms\n",
                  (*g)->threads(), share, side_alone);
      std::printf(
          "  main stream (60 gates T=8192) alone %.3f ms, with the host-gather prefetch %.3f ms: slowed %.1f%%\n",
          alone, with, (with / alone - 1) * 100);
      g->reset();
      CUDA_CHECK(cudaFree(o0));
      CUDA_CHECK(cudaFree(o1));
    }
  }
  CUDA_CHECK(cudaHostUnregister(seg));
  ::munmap(seg, seg_bytes);
  ::unlink(path.c_str());
  return 0;
}
