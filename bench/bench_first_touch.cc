// bench_first_touch: the ceiling for publishing into a mount: `threads` threads copying into a fresh file of N GiB
// on that mount through one shared mapping, each thread taking the page faults of the blocks it writes (the
// first-touch copy a publish is compared with), and the same after the whole file was reserved first (fallocate,
// what the publisher does on a tmpfs). The source is a per-thread 8 MiB buffer that stays in the cache, so the
// figure is the mount's page-allocation and store rate, not a read rate. The file is removed afterwards.
// Usage: bench_first_touch --dir DIR --gib N [--threads T] [--reserve 0|1]
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
constexpr double kGiB = 1073741824.0;
constexpr size_t kBlock = size_t{8} << 20;

// One copy of `bytes` into a fresh file in `dir`; the seconds, or a negative value with the reason printed.
double CopyOnce(const std::string& dir, size_t bytes, int threads, bool reserve, double* reserve_s) {
  const std::string path = dir + "/bench-first-touch-" + std::to_string(::getpid());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::printf("create %s: %s\n", path.c_str(), std::strerror(errno));
    return -1;
  }
  const auto t0 = Clock::now();
  int err = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (err == 0 && reserve) err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  *reserve_s = Since(t0);
  auto* p = err == 0 ? static_cast<uint8_t*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0))
                     : static_cast<uint8_t*>(MAP_FAILED);
  if (p == MAP_FAILED) {
    std::printf("size/map %zu bytes: %s\n", bytes, std::strerror(err != 0 ? err : errno));
    ::close(fd);
    ::unlink(path.c_str());
    return -1;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::vector<uint8_t> src(kBlock, static_cast<uint8_t>(0x5A + t));
      for (size_t b = next++; b * kBlock < bytes; b = next++) {
        const size_t off = b * kBlock;
        std::memcpy(p + off, src.data(), std::min(kBlock, bytes - off));
      }
    });
  }
  for (auto& th : pool) th.join();
  const double s = Since(t0);
  ::munmap(p, bytes);
  ::close(fd);
  ::unlink(path.c_str());
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  double gib = 16;
  int threads = static_cast<int>(std::min(32u, std::max(1u, std::thread::hardware_concurrency())));
  int reserve = -1;  // -1: both
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--dir") dir = v;
    if (a == "--gib") gib = std::atof(v.c_str());
    if (a == "--threads") threads = std::max(1, std::atoi(v.c_str()));
    if (a == "--reserve") reserve = std::atoi(v.c_str());
  }
  if (dir.empty() || gib <= 0) {
    std::fprintf(stderr, "usage: bench_first_touch --dir DIR --gib N [--threads T] [--reserve 0|1]\n");
    return 2;
  }
  const size_t bytes = static_cast<size_t>(gib * kGiB) / kBlock * kBlock;
  for (int r : {0, 1}) {
    if (reserve >= 0 && r != reserve) continue;
    double reserve_s = 0;
    const double s = CopyOnce(dir, bytes, threads, r == 1, &reserve_s);
    if (s < 0) return 1;
    std::printf("first-touch copy into %s, %.2f GiB, %d threads%s: %.2f s = %.2f GiB/s%s\n", dir.c_str(), bytes / kGiB,
                threads, r ? ", reserved first (fallocate)" : "", s, bytes / kGiB / s,
                r ? (" (fallocate " + std::to_string(reserve_s) + " s)").c_str() : "");
  }
  return 0;
}
