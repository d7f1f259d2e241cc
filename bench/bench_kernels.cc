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
//              (ENGRAM_BENCH_PATHS_ONLY=1: the ceilings, the every-path lookups and the crossover alone)
// Usage: bench_kernels FLASH_CONFIG_JSON [TABLE_GIB]   (prints a table; times are medians of CUDA-event timings)
// main (below) runs the sections in the order they print; bench/bench_kernels.h holds the state they share (set up
// here), the other bench_kernels_*.cc files the sections.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_kernels.h"
#include "bench/cuda_check.h"
#include "bench/gpu_timing.h"
#include "kernels/engram_kernels.h"

namespace engram::bench {

// --- Ceilings -------------------------------------------------------------------------------------------------
void KernelBench::Ceilings() {
  void* pinned = nullptr;
  CUDA_CHECK(cudaMallocHost(&pinned, kCeil));
  FillRandom(static_cast<uint8_t*>(pinned), kCeil, threads);
  CUDA_CHECK(cudaMalloc(&d0, kCeil));
  CUDA_CHECK(cudaMalloc(&d1, kCeil));
  const double h2d_ms =
      MedianMs([&] { CUDA_CHECK(cudaMemcpyAsync(d0, pinned, kCeil, cudaMemcpyHostToDevice, s)); }, s, 5);
  const double d2d_ms =
      MedianMs([&] { CUDA_CHECK(cudaMemcpyAsync(d1, d0, kCeil, cudaMemcpyDeviceToDevice, s)); }, s, 10);
  h2d = kCeil / h2d_ms / 1e6;
  d2d = 2.0 * kCeil / d2d_ms / 1e6;
  std::printf("ceiling  H2D pinned memcpy %.1f GB/s   D2D copy %.0f GB/s (read + write)\n", h2d, d2d);
  CUDA_CHECK(cudaFreeHost(pinned));
}

// --- The shared segment: a file in shm_dir, filled, registered mapped and read-only --------------------------------
bool KernelBench::MapSegment(double table_gib) {
  seg_bytes = static_cast<size_t>(table_gib * (1ull << 30)) / rb * rb;
  rows = static_cast<int64_t>(seg_bytes / rb);
  const char* shm_dir_env = std::getenv("ENGRAM_BENCH_SHM_DIR");
  shm_dir = shm_dir_env != nullptr && *shm_dir_env != '\0' ? shm_dir_env : "/dev/shm";
  // ENGRAM_BENCH_HG_VARIANTS_ONLY=1: the ceilings, then only the host-gather variants (a short run for tuning).
  const char* variants_env = std::getenv("ENGRAM_BENCH_HG_VARIANTS_ONLY");
  variants_only = variants_env != nullptr && std::string(variants_env) == "1";
  // ENGRAM_BENCH_PATHS_ONLY=1: the ceilings, then only the every-path lookups beside the engine's calibrated plan.
  const char* paths_env = std::getenv("ENGRAM_BENCH_PATHS_ONLY");
  paths_only = paths_env != nullptr && std::string(paths_env) == "1";
  path = shm_dir + "/engram-bench-" + std::to_string(::getpid());
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(seg_bytes)) != 0) {
    std::perror("segment");
    return false;
  }
  seg = static_cast<uint8_t*>(::mmap(nullptr, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  if (seg == MAP_FAILED) return false;
  auto t0 = std::chrono::steady_clock::now();
  FillRandom(seg, seg_bytes, threads);
  const double fill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  CUDA_CHECK(cudaHostRegister(seg, seg_bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly));
  const double reg_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  return true;
}

void KernelBench::AllocLookupBuffers() {
  ids.assign(static_cast<size_t>(max_items), 0);
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_ids), max_items * 4));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_out), max_items * D * 2));
  default_tuning = engram::kernels::GetLookupTuning();
}

void KernelBench::Unmap() {
  hash_layout.reset();
  CUDA_CHECK(cudaHostUnregister(seg));
  ::munmap(seg, seg_bytes);
  ::unlink(path.c_str());
}

void KernelBench::Lookup(const uint8_t* table, int64_t table_rows, int64_t items, bool packed, int max_blocks,
                         void* scratch, size_t scratch_bytes, const int32_t* ids_at) {
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
}

void KernelBench::NewIds(int64_t table_rows) {
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(table_rows));
  CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
}

// Repeats: each item copies an earlier item of its batch with probability 0.45 (the share of repeated lookups
// measured on real text); otherwise a uniformly random row. `sets` batches side by side (fresh ids per call).
void KernelBench::FillIds(int64_t items, double repeat, int sets) {
  std::uniform_real_distribution<double> u(0, 1);
  for (int k = 0; k < sets; ++k) {
    int32_t* b = ids.data() + k * items;
    for (int64_t i = 0; i < items; ++i) {
      b[i] = i > 0 && u(rng) < repeat ? b[rng() % i] : static_cast<int32_t>(rng() % static_cast<uint64_t>(rows));
    }
  }
  CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), items * sets * 4, cudaMemcpyHostToDevice));
}

void KernelBench::Tune(int64_t sort_min_items, int variant, bool sort_only, int blocks) {
  engram::kernels::LookupTuning t = default_tuning;
  t.sort_min_items = sort_min_items;
  t.sort_variant = variant;
  t.sort_only = sort_only;
  if (blocks >= 0) t.sort_blocks = blocks;
  engram::kernels::SetLookupTuning(t);
}

// Fresh ids per call: consecutive calls take consecutive batches of the random ids in d_ids (up to 16), so that a
// small batch's rows are not still in L2 and the TLBs from the call before (a repeated batch flatters them).
int KernelBench::Batches(int64_t items) const { return static_cast<int>(std::min<int64_t>(16, max_items / items)); }

void KernelBench::Gate(int t, cudaStream_t st) {
  engram::kernels::GateArgs g{hidden, kv, qk, qk, nullptr, gout, t, HC, HD, 1e-6f};
  CUDA_CHECK(engram::kernels::LaunchGate(g, st));
}

}  // namespace engram::bench

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
  engram::bench::KernelBench b;
  CUDA_CHECK(cudaStreamCreateWithFlags(&b.s, cudaStreamNonBlocking));
  b.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  b.Ceilings();
  if (!b.MapSegment(table_gib)) return 1;
  b.AllocLookupBuffers();
  if (b.paths_only) {
    b.BeginPaths();
    b.LookupPaths();
    b.ChoiceTable();
    b.EndPaths();
    b.Unmap();
    return 0;
  }
  if (!b.variants_only) {
    b.UvaLookup();
    b.UvaRowOrder();
    b.UvaGridSize();
    b.UvaLatency();
  }
  b.BeginPaths();
  if (!b.variants_only) {  // (the variants then run alone: no idle engines' pools and buffers beside them)
    b.LookupPaths();
    if (!b.HostGatherScaling()) return 1;
  }
  if (!b.HostGatherVariants()) return 1;
  if (b.variants_only) {
    b.EndPaths();
    b.Unmap();
    return 0;
  }
  b.ChoiceTable();
  b.EndPaths();
  b.GateKernel();
  b.HbmLookup();
  if (!b.Hash(argv[1])) return 1;
  if (!b.PrefetchBesideMain()) return 1;
  if (!b.HostGatherBesideMain()) return 1;
  b.Unmap();
  return 0;
}
