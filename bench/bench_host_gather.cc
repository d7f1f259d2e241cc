// bench_host_gather: the CPU half of the host-gather path (client/engine/host_gather_plan.h) without a GPU: random 264
// B rows gathered from a /dev/shm segment (4 KiB pages, as the shared table) by a GatherPool into plain memory, per
// batch the plan pass + the chunked gather (today) or one fused pass, for each gather variant (software prefetch
// distance, non-temporal stores), and the pool's pass latency with sleeping workers, spinning workers, and after a
// Wake() hint. Fresh ids per batch (rotating over several random batches); the variants run round robin, and each
// line's last column is its speed relative to today's (the first line) in the same run: only relative numbers mean
// anything on a shared or small machine (bench_kernels measures the real path against H2D on the GPU machine).
// Usage: bench_host_gather [TABLE_GIB=2] [THREADS=half the cores] [REPS=7]
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/engine/host_gather_plan.h"

namespace {

using engram::client::GatherCopy;
using engram::client::GatherPlan;
using engram::client::GatherPool;

double NowMs() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = argc > 2 ? std::atoi(argv[2]) : engram::client::DefaultGatherThreads(cores);
  const int reps = argc > 3 ? std::max(1, std::atoi(argv[3])) : 7;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int64_t rb = 264, C = 24;
  const size_t seg_bytes = static_cast<size_t>(gib * (1ull << 30)) / rb * rb;
  const int64_t rows = static_cast<int64_t>(seg_bytes / rb);
  const std::string path = "/dev/shm/engram-bench-hg-" + std::to_string(::getpid());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(seg_bytes)) != 0) {
    std::perror("segment");
    return 1;
  }
  auto* seg = static_cast<uint8_t*>(::mmap(nullptr, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ::unlink(path.c_str());
  if (seg == MAP_FAILED) return 1;
  GatherPool pool(threads, {}, 200);
  pool.Run([&](int w) {  // first touch (every page mapped in this process, as after registration)
    const engram::client::Range r = engram::client::SplitRange(static_cast<int64_t>(seg_bytes / 8), threads, w);
    auto* q = reinterpret_cast<uint64_t*>(seg);
    for (int64_t i = r.begin; i < r.end; ++i) q[i] = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  });
  std::printf("table %.1f GiB in /dev/shm (%lld rows of %lld B), %d gather threads of %d cores\n",
              seg_bytes / 1073741824.0, static_cast<long long>(rows), static_cast<long long>(rb), threads, cores);

  const int64_t max_items = int64_t{1} << 20;
  // Destination: plain memory, page aligned, touched once (the pinned staging is reused across batches).
  auto* dst = static_cast<uint8_t*>(std::aligned_alloc(4096, static_cast<size_t>(max_items * rb)));
  std::memset(dst, 0, static_cast<size_t>(max_items * rb));
  std::vector<int32_t> index(static_cast<size_t>(max_items));
  GatherPlan plan;
  plan.rows.resize(static_cast<size_t>(max_items));
  std::mt19937_64 rng(11);

  struct Variant {
    const char* name;
    bool fused;
    GatherCopy how;
  };
  const Variant variants[] = {
      {"today: plan pass + gather, prefetch 16", false, {16, false}},
      {"prefetch 0", false, {0, false}},
      {"prefetch 4", false, {4, false}},
      {"prefetch 8", false, {8, false}},
      {"prefetch 32", false, {32, false}},
      {"non-temporal stores, prefetch 16", false, {16, true}},
      {"fused pass, prefetch 16", true, {16, false}},
      {"fused pass, non-temporal, prefetch 16", true, {16, true}},
      {"fused pass, non-temporal, prefetch 8", true, {8, true}},
      {"fused pass, non-temporal, prefetch 32", true, {32, true}},
  };
  std::printf("\n%-44s %9s %-9s %9s %s\n", "variant", "rows", "time", "GB/s", "vs today");
  for (const int64_t n : {int64_t{24576}, int64_t{196608}, int64_t{1048560}}) {
    const int sets = static_cast<int>(std::clamp<int64_t>((int64_t{4} << 20) / n, 1, 16));
    std::vector<int32_t> ids(static_cast<size_t>(n * sets));
    for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows));
    const int64_t chunk0 = engram::client::PlanChunkRows(n, threads, 1024, 8192);
    const int64_t chunk = chunk0 > 8 ? (chunk0 + 7) / 8 * 8 : chunk0;
    const int64_t n_chunks = (n + chunk - 1) / chunk;
    const size_t nv = sizeof(variants) / sizeof(variants[0]);
    std::vector<std::vector<double>> ms(nv);
    int k = 0;
    // Round robin over the variants, rep by rep: a drift of the machine's load hits every variant alike.
    for (int r = 0; r < reps + 1; ++r) {
      for (size_t vi = 0; vi < nv; ++vi) {
        const Variant& v = variants[vi];
        const int32_t* b = ids.data() + (k++ % sets) * n;
        const double t0 = NowMs();
        if (!v.fused) {  // PlanIdentity: the plan in a pass of its own over the pool
          pool.Run([&](int w) {
            const engram::client::Range rr = engram::client::SplitRange(n, threads, w);
            engram::client::PlanIdentityRange(b, static_cast<int32_t>(C), C, 0, rows, rr.begin, rr.end,
                                              plan.rows.data(), index.data());
          });
        }
        std::atomic<int64_t> next{0};
        pool.Run([&](int) {
          for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            const int64_t begin = c * chunk, end = std::min(n, begin + chunk);
            if (v.fused) {
              engram::client::PlanIdentityRange(b, static_cast<int32_t>(C), C, 0, rows, begin, end, plan.rows.data(),
                                                index.data());
            }
            engram::client::GatherRecords(seg, rb, plan.rows.data(), begin, end, dst, v.how);
          }
        });
        if (r > 0) ms[vi].push_back(NowMs() - t0);  // the first round is a warm-up
      }
    }
    const double today = Median(ms[0]);
    for (size_t vi = 0; vi < nv; ++vi) {
      const double m = Median(ms[vi]);
      std::printf("%-44s %9lld %7.3f ms %7.2f  %.2fx\n", variants[vi].name, static_cast<long long>(n), m,
                  n * rb / m / 1e6, today / m);
    }
    // Spot check: the last batch's rows are in place.
    const int32_t* b = ids.data() + ((k - 1) % sets) * n;
    for (int64_t i = 0; i < n; i += 997) {
      if (std::memcmp(dst + i * rb, seg + static_cast<int64_t>(b[i]) * rb, rb) != 0) {
        std::printf("MISMATCH at item %lld\n", static_cast<long long>(i));
        return 1;
      }
    }
  }

  // The pool's fixed cost: an empty pass with the workers asleep, spinning, and woken by a hint 50 us before.
  std::printf("\npool pass latency (%d threads), median of 200:\n", threads);
  auto pass = [&](const std::function<void()>& before) {
    std::vector<double> us;
    for (int i = 0; i < 200; ++i) {
      before();
      const double t0 = NowMs();
      pool.Run([](int) {});
      us.push_back((NowMs() - t0) * 1e3);
    }
    return Median(us);
  };
  const double asleep = pass([] { std::this_thread::sleep_for(std::chrono::microseconds(600)); });
  const double spinning = pass([] {});
  const double hinted = pass([&] {
    std::this_thread::sleep_for(std::chrono::microseconds(600));
    pool.Wake();
    const double t = NowMs();
    while (NowMs() - t < 0.05) {
    }
  });
  std::printf("  workers asleep %.1f us, spinning %.1f us, woken by Wake() 50 us before %.1f us\n", asleep, spinning,
              hinted);
  std::free(dst);
  ::munmap(seg, seg_bytes);
  return 0;
}
