// bench_register: what it costs a replica to register a shared segment for the GPU (cuMemHostRegister of a
// read-only MAP_SHARED mapping, DEVICEMAP | READ_ONLY, through client/table/cuda_backend.h's HostRegistration), on each
// page kind named on the command line, variant by variant, side by side in one run:
//   seq            one call for the whole file on a fresh mapping (page tables built inside the call)
//   seq+pf         MADV_POPULATE_READ first (what the client does before its ticket), then one call; the
//                  population and the registration are timed apart: this is today's client, the baseline
//   T x C GiB      prefaulted, then chunks of C GiB registered from T threads (HostRegistration's threads option)
//   T x C, no pf   the same without the prefault
//   rw DEVICEMAP   the writer's own read-write mapping, DEVICEMAP only (how the reference figure is taken)
//   runtime        the ceiling: one plain cudaHostRegister(Mapped | ReadOnly) of the same bytes, prefaulted
//   each C GiB     prefaulted, chunks of C GiB registered one after another, each chunk's time printed (does the
//                  cost of a chunk grow with what is registered already?)
// Each line: population seconds, registration seconds (and per 16 GiB), ms/GiB, unregister seconds, the ratio to the
// same kind's seq+pf registration in this run and to the reference single-process figure given for that kind.
// Usage: bench_register [--gib N] [--kind LABEL:DIR:REF_S]... [--threads 2,4,8,16] [--chunks-gib 1,2,4]
//                       [--file PATH] [--only NAME,NAME]
//   --file measures an existing file read-only instead (e.g. a segment engramd published: the first page is
//   skipped, as a replica maps it); --only keeps the variants whose names start with one of the given words.
//   DIR is a directory on the mount to measure (a tmpfs with huge=never or huge=always, or a hugetlbfs mount: the
//   file is then sized in whole huge pages and written through the mapping); REF_S is a reference time in seconds
//   per 16 GiB for that kind (0: none), e.g. a plain cudaHostRegister in one process (bench/RESULTS.md
//   "Registration and attach": about 0.64 s on 4 KiB shm).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/fault_points.h"
#include "client/table/cuda_backend.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
constexpr double kGiB = 1073741824.0;
constexpr unsigned long kHugetlbfsMagic = 0x958458f6;

std::vector<int> IntList(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::atoi(x.c_str()));
  return v;
}

long MeminfoKb(const char* key) {
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + std::strlen(key));
  }
  return -1;
}

// madvise over [p, p + n) from `threads` threads (slices aligned to 2 MiB); the first error, 0 if none.
int ParallelMadvise(uint8_t* p, size_t n, int advice, int threads) {
  std::vector<std::thread> pool;
  std::vector<int> err(static_cast<size_t>(threads), 0);
  constexpr size_t kAlign = size_t{2} << 20;
  const size_t part = (n / static_cast<size_t>(threads) + kAlign - 1) / kAlign * kAlign;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const size_t b = std::min(n, part * static_cast<size_t>(t)), e = std::min(n, part * static_cast<size_t>(t + 1));
      if (e > b && ::madvise(p + b, e - b, advice) != 0) err[static_cast<size_t>(t)] = errno;
    });
  }
  for (auto& th : pool) th.join();
  for (int e : err) {
    if (e != 0) return e;
  }
  return 0;
}

struct Kind {
  std::string label, dir;
  double measured_s = 0;  // the reference seconds per 16 GiB (REF_S)
};

struct Variant {
  std::string name;
  int prefault_threads = 0;  // 0: no prefault
  int threads = 1;
  size_t chunk = 0;        // 0: the whole file
  bool rw = false;         // the writer's mapping, DEVICEMAP only (raw driver call)
  bool runtime = false;    // cudaHostRegister (the runtime API) in one call
  bool per_chunk = false;  // chunks one after another through the driver, each timed
};

using RegFn = CUresult (*)(void*, size_t, unsigned int);
using UnregFn = CUresult (*)(void*);

// One variant on a read-only mapping p of `bytes`: prefault, register, unregister. reg_s < 0 on failure (err set).
struct Timing {
  double pf_s = 0, reg_s = -1, unreg_s = 0;
  std::string err;
};
Timing RunReadOnly(uint8_t* p, size_t bytes, const Variant& v, RegFn raw_reg, UnregFn raw_unreg) {
  Timing t;
  if (v.prefault_threads > 0) {
    auto tp = Clock::now();
    if (int e = ParallelMadvise(p, bytes, MADV_POPULATE_READ, v.prefault_threads); e != 0) {
      std::printf("prefault: %s\n", std::strerror(e));
    }
    t.pf_s = Since(tp);
  }
  auto tr = Clock::now();
  if (v.runtime) {
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
    t.reg_s = Since(tr);
    if (e != cudaSuccess) {
      t.err = cudaGetErrorString(e);
      cudaGetLastError();
      t.reg_s = -1;
      return t;
    }
    tr = Clock::now();
    cudaHostUnregister(p);
    t.unreg_s = Since(tr);
    return t;
  }
  if (v.per_chunk) {
    std::vector<void*> done;
    std::string line;
    for (size_t off = 0; off < bytes; off += v.chunk) {
      const size_t n = std::min(v.chunk, bytes - off);
      auto tc = Clock::now();
      const CUresult e = raw_reg(p + off, n, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY);
      const double s = Since(tc);
      if (e != CUDA_SUCCESS) {
        t.err = "chunk at " + std::to_string(off) + ": CUresult " + std::to_string(static_cast<int>(e));
        break;
      }
      done.push_back(p + off);
      char b[32];
      std::snprintf(b, sizeof b, "%s%.0f", line.empty() ? "" : " ", s * 1000 * kGiB / static_cast<double>(n));
      line += b;
    }
    t.reg_s = t.err.empty() ? Since(tr) : -1;
    std::printf("    ms/GiB of each chunk in order: %s\n", line.c_str());
    tr = Clock::now();
    for (void* c : done) raw_unreg(c);
    t.unreg_s = Since(tr);
    return t;
  }
  int failed = -1;
  engram::client::RegisterOptions o;
  o.chunk_bytes = v.chunk == 0 ? bytes : v.chunk;
  o.threads = v.threads;
  auto r = engram::client::HostRegistration::Register(p, bytes, o, &failed);
  t.reg_s = Since(tr);
  if (!r.ok()) {
    t.err = std::string(r.status().message());
    t.reg_s = -1;
  }
  tr = Clock::now();
  r = absl::InternalError("released");
  t.unreg_s = Since(tr);
  return t;
}

// --file: every variant on a fresh read-only mapping of an existing file, from its second 4 KiB page (a segment's
// records; the first page is its header).
void RunOnFile(const std::string& path, const std::vector<Variant>& variants, int repeat, RegFn raw_reg,
               UnregFn raw_unreg) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    std::printf("file %s: %s\n", path.c_str(), std::strerror(errno));
    return;
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  std::printf("file %s: %.2f GiB (blocks %.2f GiB)\n", path.c_str(), file_bytes / kGiB,
              static_cast<double>(st.st_blocks) * 512 / kGiB);
  std::printf("(last column: the variant's registration time / the plain cudaHostRegister's, run first)\n");
  std::vector<Variant> order;
  for (const Variant& v : variants) {
    if (v.runtime) order.insert(order.begin(), v);
    if (!v.runtime && !v.rw) order.push_back(v);
  }
  double base = 0;
  for (const Variant& v : order) {
    for (int rep = 0; rep < repeat; ++rep) {
      auto* m = static_cast<uint8_t*>(::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0));
      if (m == MAP_FAILED) {
        std::printf("map: %s\n", std::strerror(errno));
        return;
      }
      const size_t bytes = file_bytes - 4096;
      Timing t = RunReadOnly(m + 4096, bytes, v, raw_reg, raw_unreg);
      ::munmap(m, file_bytes);
      if (t.reg_s < 0) {
        std::printf("%-10s %-30s FAILED: %s\n", "file", v.name.c_str(), t.err.c_str());
        continue;
      }
      if (v.runtime && base == 0) base = t.reg_s;
      std::printf("%-10s %-30s %8.3f %8.3f %10.3f %8.1f %8.3f %9.2f\n", "file", v.name.c_str(), t.pf_s, t.reg_s,
                  t.reg_s * 16 * kGiB / bytes, t.reg_s * 1000 / (bytes / kGiB), t.unreg_s,
                  base > 0 ? t.reg_s / base : 0.0);
      std::fflush(stdout);
    }
  }
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 16;
  std::vector<Kind> kinds;
  std::vector<int> threads_list = {2, 4, 8, 16}, chunks_gib = {1, 2, 4};
  int repeat = 1;
  std::string file;
  std::vector<std::string> only;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--file") file = v;
    if (a == "--only") {
      std::stringstream ss(v);
      for (std::string x; std::getline(ss, x, ',');) only.push_back(x);
    }
    if (a == "--gib") gib = std::atof(v.c_str());
    if (a == "--threads") threads_list = IntList(v);
    if (a == "--chunks-gib") chunks_gib = IntList(v);
    if (a == "--repeat") repeat = std::max(1, std::atoi(v.c_str()));
    if (a == "--kind") {
      Kind k;
      const size_t c1 = v.find(':'), c2 = v.find(':', c1 + 1);
      k.label = v.substr(0, c1);
      k.dir = v.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
      if (c2 != std::string::npos) k.measured_s = std::atof(v.c_str() + c2 + 1);
      kinds.push_back(k);
    }
  }
  if (!file.empty()) kinds = {{"file", file, 0}};
  if (kinds.empty()) kinds.push_back({"4k-shm", "/dev/shm", 0.64});
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("bench_register: no GPU\n");
    return 77;
  }
  cudaFree(nullptr);
  RegFn raw_reg = nullptr;
  UnregFn raw_unreg = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuMemHostRegister", reinterpret_cast<void**>(&raw_reg), 12000, cudaEnableDefault,
                                   &q);
  cudaGetDriverEntryPointByVersion("cuMemHostUnregister", reinterpret_cast<void**>(&raw_unreg), 12000,
                                   cudaEnableDefault, &q);
  const size_t want = static_cast<size_t>(gib * kGiB);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int pf_threads = std::min(16, cores);
  std::printf("bench_register: %.1f GiB, %d cores, %d prefault threads\n", gib, cores, pf_threads);

  std::vector<Variant> variants;
  variants.push_back({"seq", 0, 1, 0, false});
  variants.push_back({"seq+pf", 1, 1, 0, false});
  for (int c : chunks_gib) {
    for (int t : threads_list) {
      if (static_cast<double>(t) * c > gib) continue;  // more threads than chunks: the same as fewer
      variants.push_back({std::to_string(t) + "thr x " + std::to_string(c) + "GiB +pf16", pf_threads, t,
                          static_cast<size_t>(c) << 30, false});
    }
  }
  for (int t : threads_list) {
    if (t >= 8) variants.push_back({std::to_string(t) + "thr x 1GiB no pf", 0, t, size_t{1} << 30, false});
  }
  if (file.empty()) variants.push_back({"rw DEVICEMAP", pf_threads, 1, 0, true});
  variants.push_back({"runtime cudaHostRegister +pf16", pf_threads, 1, 0, false, true});
  for (int c : chunks_gib) {
    variants.push_back(
        {"each " + std::to_string(c) + "GiB +pf16", pf_threads, 1, static_cast<size_t>(c) << 30, false, false, true});
  }
  if (!only.empty()) {
    std::vector<Variant> kept;
    for (const auto& v : variants) {
      for (const auto& o : only) {
        if (v.name.rfind(o, 0) == 0) {
          kept.push_back(v);
          break;
        }
      }
    }
    variants = kept;
  }

  // The rollback with threads: chunk 5 of 16 fails while other threads register theirs; the error names chunk 5 and
  // no chunk stays registered (the whole range registers again afterwards).
  {
    const size_t n = size_t{32} << 20;
    auto* buf = static_cast<uint8_t*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    std::memset(buf, 1, n);
    int failed = -1;
    engram::client::SetFaultHook([](engram::client::FaultPoint f, int64_t chunk) {
      return f == engram::client::FaultPoint::kRegisterChunk && chunk == 5;
    });
    auto bad = engram::client::HostRegistration::Register(buf, n, {size_t{2} << 20, 8}, &failed);
    engram::client::SetFaultHook(nullptr);
    auto good = engram::client::HostRegistration::Register(buf, n, {size_t{2} << 20, 8}, &failed);
    std::printf("rollback check (16 chunks, 8 threads, chunk 5 fails): %s, failed chunk %d, re-register %s\n",
                bad.ok() ? "UNEXPECTED SUCCESS" : std::string(bad.status().message()).c_str(), failed,
                good.ok() ? "ok" : std::string(good.status().message()).c_str());
    good = absl::InternalError("released");
    ::munmap(buf, n);
  }
  std::printf("%-10s %-30s %8s %8s %10s %8s %8s %9s %9s\n", "kind", "variant", "pf_s", "reg_s", "reg/16GiB", "ms/GiB",
              "unreg_s", "vs_seqpf", "vs_MEAS");
  for (const Kind& k : kinds) {
    struct statfs sfs {};
    if (::statfs(k.dir.c_str(), &sfs) != 0) {
      std::printf("%s: %s: %s (skipped)\n", k.label.c_str(), k.dir.c_str(), std::strerror(errno));
      continue;
    }
    const bool hugetlb = static_cast<unsigned long>(sfs.f_type) == kHugetlbfsMagic;
    if (!file.empty()) {
      RunOnFile(file, variants, repeat, raw_reg, raw_unreg);
      continue;
    }
    const std::string path = k.dir + "/bench-register-" + std::to_string(::getpid());
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
      std::printf("%s: create %s: %s (skipped)\n", k.label.c_str(), path.c_str(), std::strerror(errno));
      continue;
    }
    struct stat st {};
    ::fstat(fd, &st);
    const size_t page = hugetlb ? static_cast<size_t>(st.st_blksize) : 4096;
    const size_t bytes = (want + page - 1) / page * page;
    const long shmem_huge0 = MeminfoKb("ShmemHugePages:"), hugetlb_free0 = MeminfoKb("HugePages_Free:");
    auto t0 = Clock::now();
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      std::printf("%s: ftruncate %zu: %s (skipped)\n", k.label.c_str(), bytes, std::strerror(errno));
      ::close(fd);
      ::unlink(path.c_str());
      continue;
    }
    auto* w = static_cast<uint8_t*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (w == MAP_FAILED) {
      std::printf("%s: map %zu: %s (skipped)\n", k.label.c_str(), bytes, std::strerror(errno));
      ::close(fd);
      ::unlink(path.c_str());
      continue;
    }
    // First touch from 16 threads (as a publish would), then a pattern written.
    if (int e = ParallelMadvise(w, bytes, MADV_POPULATE_WRITE, pf_threads); e != 0) {
      std::printf("%s: populate: %s (skipped)\n", k.label.c_str(), std::strerror(e));
      ::munmap(w, bytes);
      ::close(fd);
      ::unlink(path.c_str());
      continue;
    }
    const double fill_s = Since(t0);
    const long shmem_huge1 = MeminfoKb("ShmemHugePages:"), hugetlb_free1 = MeminfoKb("HugePages_Free:");
    for (size_t off = 0; off < bytes; off += 4096) w[off] = static_cast<uint8_t>(off >> 12);
    std::printf(
        "%-10s %s (%s, page %zu KiB): %.2f GiB, first touch from %d threads %.2f s = %.1f GiB/s; "
        "ShmemHugePages +%ld MiB, HugePages_Free -%ld\n",
        k.label.c_str(), k.dir.c_str(), hugetlb ? "hugetlbfs" : "tmpfs", page >> 10, bytes / kGiB, pf_threads, fill_s,
        bytes / kGiB / fill_s, (shmem_huge1 - shmem_huge0) >> 10, hugetlb_free0 - hugetlb_free1);
    double base_reg = 0;
    for (const Variant& v : variants) {
      for (int rep = 0; rep < repeat; ++rep) {
        uint8_t* p = w;
        if (!v.rw) {
          p = static_cast<uint8_t*>(::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0));
          if (p == MAP_FAILED) {
            std::printf("map: %s\n", std::strerror(errno));
            return 1;
          }
        }
        double pf_s = 0;
        if (v.prefault_threads > 0) {
          auto tp = Clock::now();
          if (int e = ParallelMadvise(p, bytes, v.rw ? MADV_POPULATE_WRITE : MADV_POPULATE_READ, v.prefault_threads);
              e != 0) {
            std::printf("prefault: %s\n", std::strerror(e));
          }
          pf_s = Since(tp);
        }
        double reg_s = 0, unreg_s = 0;
        std::string err;
        if (v.runtime || v.per_chunk) {
          Timing t =
              RunReadOnly(p, bytes, {v.name, 0, v.threads, v.chunk, false, v.runtime, v.per_chunk}, raw_reg, raw_unreg);
          reg_s = t.reg_s;
          unreg_s = t.unreg_s;
          err = t.err;
          ::munmap(p, bytes);
        } else if (v.rw) {
          auto tr = Clock::now();
          const CUresult e = raw_reg(p, bytes, CU_MEMHOSTREGISTER_DEVICEMAP);
          reg_s = Since(tr);
          if (e != CUDA_SUCCESS) err = "CUresult " + std::to_string(static_cast<int>(e));
          tr = Clock::now();
          if (e == CUDA_SUCCESS) raw_unreg(p);
          unreg_s = Since(tr);
        } else {
          int failed = -1;
          engram::client::RegisterOptions o;
          o.chunk_bytes = v.chunk == 0 ? bytes : v.chunk;
          o.threads = v.threads;
          auto tr = Clock::now();
          auto r = engram::client::HostRegistration::Register(p, bytes, o, &failed);
          reg_s = Since(tr);
          if (!r.ok()) err = std::string(r.status().message());
          tr = Clock::now();
          r = absl::InternalError("released");
          unreg_s = Since(tr);
          ::munmap(p, bytes);
        }
        if (!err.empty()) {
          std::printf("%-10s %-30s FAILED: %s\n", k.label.c_str(), v.name.c_str(), err.c_str());
          continue;
        }
        if (v.name == "seq+pf" && rep == 0) base_reg = reg_s;
        const double per16 = reg_s * 16 * kGiB / bytes;
        std::printf("%-10s %-30s %8.3f %8.3f %10.3f %8.1f %8.3f %9.2f %9.2f\n", k.label.c_str(), v.name.c_str(), pf_s,
                    reg_s, per16, reg_s * 1000 / (bytes / kGiB), unreg_s, base_reg > 0 ? reg_s / base_reg : 0.0,
                    k.measured_s > 0 ? per16 / k.measured_s : 0.0);
        std::fflush(stdout);
      }
    }
    ::munmap(w, bytes);
    ::close(fd);
    ::unlink(path.c_str());
  }
  return 0;
}
