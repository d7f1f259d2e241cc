// bench_kernels' lookup-path sections (KernelBench, bench/bench_kernels.h): every lookup path (the UVA kernel, the
// UVA row-order gather, the host gather at the engine's UVA share and its neighbours) against the same run's H2D
// ceiling, random and with repeated rows; how the host gather scales with threads and chunk sizes; its pipeline
// variants side by side, batches back to back and after an idle gap; the automatic choice's table. BeginPaths
// allocates the row-order sort scratch these sections share and prints their table's header, EndPaths frees it;
// each section makes and drops its own host gathers; ChoiceTable reads what LookupPaths found (KernelBench::best).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/bench_kernels.h"
#include "bench/cuda_check.h"
#include "bench/gpu_timing.h"
#include "client/engine/calibration.h"
#include "client/engine/host_gather.h"
#include "client/engine/path_table.h"
#include "client/tuning.h"
#include "kernels/engram_kernels.h"

namespace engram::bench {

// --- Every lookup path, bf16 out, against the same run's H2D ceiling ------------------------------------------
void KernelBench::BeginPaths() {
  paths_scratch_bytes = engram::kernels::LookupSortScratchBytes(max_items);
  CUDA_CHECK(cudaMalloc(&paths_scratch, paths_scratch_bytes));
  cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("\n%-58s %-11s %-10s %-10s %s\n", "lookup path (16 GiB shm, bf16 out)", "time", "served", "moved",
              "served vs H2D");
  default_threads = engram::client::DefaultGatherThreads(cores);
}

// Each path at 6K to 1M rows, random rows and 45% repeats; the engine configuration of each (KernelBench::best).
void KernelBench::LookupPaths() {
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
  std::unique_ptr<engram::client::HostGather> hg = make_hg(default_threads);
  std::printf("host gather: %d threads (default share of %d cores); engine default: UVA share %.2f\n", hg->threads(),
              cores, engram::client::tuning_default::kHostGatherUvaShare);
  // The engine's built-in share and its neighbours.
  const std::vector<double> shares = {0.0, 0.15, 0.2, 0.25, 0.3, 0.4};
  // The plan an engine over this table would calibrate at creation (the same call, thread counts and shares as
  // DeviceEngine's), timed below beside the fixed configurations.
  engram::client::CalibrationTarget target;
  target.layers.push_back({static_cast<const uint8_t*>(dseg), 0, rows, d_out});
  target.head_dim = static_cast<int32_t>(D);
  target.n_cols = C;
  target.max_tokens = static_cast<int32_t>(max_items / C);
  target.sort_scratch = paths_scratch;
  target.sort_bytes = paths_scratch_bytes;
  std::unique_ptr<engram::client::HostGather> calibrated;
  auto plan = engram::client::CalibrateHostGather(
      target, engram::client::HostGatherCalibrationThreads(cores, default_threads, false),
      engram::client::HostGatherCalibrationShares(),
      [&](int th) -> absl::StatusOr<std::unique_ptr<engram::client::HostGather>> { return make_hg(th); }, s,
      &calibrated);
  if (!plan.ok()) {
    std::printf("engine calibration: %s\n", std::string(plan.status().message()).c_str());
    std::exit(1);
  }
  std::printf("engine calibration of this table: %s\n", plan->text.c_str());
  if (calibrated == nullptr) calibrated = make_hg(plan->threads);
  for (double repeat : {0.0, 0.45}) {
    for (int64_t n_rows : {int64_t{6144}, int64_t{24576}, int64_t{196608}, int64_t{1} << 20}) {
      const int64_t items = n_rows / C * C;
      const int32_t tokens = static_cast<int32_t>(items / C);
      const int sets = Batches(items);
      int k = 0;
      FillIds(items, repeat, sets);
      auto line = [&](const std::string& what, double ms, int64_t moved) {
        const double served = items * rb / ms / 1e6;
        std::printf("%-7lld rows, %2.0f%% repeats, %2d batches, %-40s %8.3f ms %7.2f GB/s %7.2f GB/s  %.3f\n",
                    static_cast<long long>(items), repeat * 100, sets, what.c_str(), ms, served, moved * rb / ms / 1e6,
                    served / h2d);
      };
      auto uva_run = [&] {
        Lookup(static_cast<const uint8_t*>(dseg), rows, items, false, 0, paths_scratch, paths_scratch_bytes,
               d_ids + (k++ % sets) * items);
      };
      Tune(int64_t{1} << 40, default_tuning.sort_variant, false);
      const double plain = MedianMs(uva_run, s, 10, 2);
      line("UVA kernel", plain, items);
      Tune(1, default_tuning.sort_variant, false);
      const double sorted = MedianMs(uva_run, s, 10, 2);
      line("UVA row-order gather", sorted, items);
      engram::kernels::SetLookupTuning(default_tuning);
      const double uva_engine = MedianMs(uva_run, s, 10, 2);
      line(items >= default_tuning.sort_min_items ? "UVA, engine default (row-order)" : "UVA, engine default (plain)",
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
      // The calibrated plan's point nearest this size, as the engine's automatic choice reads it.
      const engram::client::HostPoint* near = engram::client::NearestPoint(plan->points, items);
      if (near != nullptr) {
        double cal_ms = uva_engine;
        if (near->host) {
          calibrated->set_uva_share(near->share);
          cal_ms = MedianMs(
              [&] {
                if (!calibrated->Prefetch(ids.data() + (k++ % sets) * items, tokens, C, s).ok() ||
                    !calibrated->Wait(0, s).ok()) {
                  std::exit(1);
                }
              },
              s, 10, 2);
        }
        const double best_ms = std::min({plain, sorted, host_best});
        std::printf(
            "%-7lld rows, %2.0f%% repeats: engine's calibrated plan: %s (%d threads, share %.2f) %.3f ms, %.3f of H2D, "
            "%.2f of the fastest configuration here\n",
            static_cast<long long>(items), repeat * 100, near->host ? "host gather" : "UVA", calibrated->threads(),
            near->share, cal_ms, items * rb / cal_ms / 1e6 / h2d, cal_ms / best_ms);
        if (near->host) {
          // Where a gap between the calibration's time and this one comes from: the calibration's own measure
          // (wall clock from Prefetch to a synchronized stream, the best of 2 fresh batches) against its median over
          // 10; the same plan on a gather created just now; the default gather at the same share.
          auto wall = [&](engram::client::HostGather& g, int n, bool best_of) {
            std::vector<double> v;
            for (int i = 0; i < n; ++i) {
              const auto t0 = std::chrono::steady_clock::now();
              if (!g.Prefetch(ids.data() + (k++ % sets) * items, tokens, C, s).ok() || !g.Wait(0, s).ok()) {
                std::exit(1);
              }
              CUDA_CHECK(cudaStreamSynchronize(s));
              v.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
            }
            std::sort(v.begin(), v.end());
            return best_of ? v.front() : v[v.size() / 2];
          };
          const double wall_best2 = wall(*calibrated, 2, true), wall_median = wall(*calibrated, 10, false);
          auto fresh = make_hg(calibrated->threads());
          fresh->set_uva_share(near->share);
          (void)wall(*fresh, 1, true);  // wakes its threads, touches its staging
          const double fresh_median = wall(*fresh, 10, false);
          fresh.reset();
          hg->set_uva_share(near->share);
          const double default_median = wall(*hg, 10, false);
          hg->set_uva_share(0);
          std::printf(
              "%-7lld rows, %2.0f%% repeats: calibrated plan by wall clock: best of 2 %.3f ms, median of 10 %.3f ms "
              "(calibration timed %.3f ms); a fresh %d-thread gather %.3f ms; the %d-thread default gather %.3f ms\n",
              static_cast<long long>(items), repeat * 100, wall_best2, wall_median, near->host_ms,
              calibrated->threads(), fresh_median, hg->threads(), default_median);
        }
      }
      std::printf(
          "%-7lld rows, %2.0f%% repeats: fastest UVA %.3f ms, fastest host %.3f ms (%s); engine: UVA %.3f ms, "
          "host %.3f ms\n",
          static_cast<long long>(items), repeat * 100, std::min(plain, sorted), host_best, host_what.c_str(),
          uva_engine, host_engine);
      if (repeat == 0.0) best.push_back({items, uva_engine, host_engine, "", host_what});
    }
  }
  hg.reset();
  calibrated.reset();
}

// Threads and chunk sizes: how the host gather scales (random rows, fresh ids; every row; the engine's share).
bool KernelBench::HostGatherScaling() {
  for (int64_t n_rows : {int64_t{24576}, int64_t{196608}, int64_t{1} << 20}) {
    const int64_t items = n_rows / C * C;
    const int sets = Batches(items);
    int k = 0;
    FillIds(items, 0.0, sets);
    for (int th : {16, 24}) {
      for (int64_t min_chunk : {int64_t{1024}, int64_t{4096}}) {
        if (th > cores || (min_chunk != 1024 && n_rows > 196608)) continue;
        engram::client::HostGatherOptions o;
        o.threads = th;
        o.min_chunk_rows = min_chunk;
        auto g = engram::client::HostGather::Create({{seg, 0, rows, static_cast<const uint8_t*>(dseg)}}, {d_out},
                                                    static_cast<int32_t>(max_items / C), C, static_cast<int32_t>(D), o);
        if (!g.ok()) return false;
        for (double share : {0.0, engram::client::tuning_default::kHostGatherUvaShare}) {
          (*g)->set_uva_share(share);
          const double ms = MedianMs(
              [&] {
                if (!(*g)->Prefetch(ids.data() + (k++ % sets) * items, static_cast<int32_t>(items / C), C, s).ok() ||
                    !(*g)->Wait(0, s).ok()) {
                  std::exit(1);
                }
              },
              s, 10, 2);
          std::printf(
              "host gather %2d threads, chunks >= %4lld rows, every row, UVA share %.2f, %7lld rows %8.3f ms "
              "%7.2f GB/s  %.3f of H2D\n",
              th, static_cast<long long>(min_chunk), share, static_cast<long long>(items), ms, items * rb / ms / 1e6,
              items * rb / ms / 1e6 / h2d);
        }
      }
    }
  }
  return true;
}

// Host-gather variants side by side (what separates the pipeline from the CPU gather ceiling): every
// HostGatherOptions knob of the copy pipeline, each alone and together, against no knob set; every row, 0 and
// the engine's UVA share; fresh ids per call. "b2b" = batches back to back (threads and dispatcher may still be
// spinning); "idle" = 2 ms without work before each batch (everything asleep: a serving engine's case).
bool KernelBench::HostGatherVariants() {
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
      {.name = "all (nt fused issuer prewake dspin200)", .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
      {.name = "all, pf8", .prefetch = 8, .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
      {.name = "all, pf32", .prefetch = 32, .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
      {.name = "all, no nt", .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
      {.name = "all, chunks 256-8192", .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1, .min_chunk = 256},
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
    const int sets = Batches(items);
    FillIds(items, 0.0, sets);
    size_ids.emplace_back(ids.begin(), ids.begin() + items * sets);
  }
  cudaEvent_t ea, eb;
  CUDA_CHECK(cudaEventCreate(&ea));
  CUDA_CHECK(cudaEventCreate(&eb));
  // Median ms of `reps` batches (after 2 untimed), each after `idle_us` microseconds without work.
  // *pass_ms: the median host time of the threads' gather pass (HostGather::LayerStats::gather_ms).
  auto time_batches = [&](engram::client::HostGather& g, const std::vector<int32_t>& bids, int64_t items, int idle_us,
                          double* pass_ms) {
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
    if (!g.ok()) return false;
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
  return true;
}

// The automatic choice's table: per size, did the host-gather path (engine configuration) beat the UVA path?
void KernelBench::ChoiceTable() {
  std::printf("automatic choice table (ENGRAM_LOOKUP_PATH_TABLE format):\n");
  FILE* out_table = nullptr;
  if (const char* table = std::getenv("ENGRAM_LOOKUP_PATH_TABLE"); table != nullptr) out_table = std::fopen(table, "w");
  for (const auto& b : best) {
    std::printf("  %lld %s   (UVA engine default %.3f ms, host gather engine default %.3f ms)\n",
                static_cast<long long>(b.items), b.host < b.uva ? "host" : "uva", b.uva, b.host);
    if (out_table != nullptr)
      std::fprintf(out_table, "%lld %s\n", static_cast<long long>(b.items), b.host < b.uva ? "host" : "uva");
  }
  if (out_table != nullptr) std::fclose(out_table);
}

void KernelBench::EndPaths() { CUDA_CHECK(cudaFree(paths_scratch)); }

}  // namespace engram::bench
