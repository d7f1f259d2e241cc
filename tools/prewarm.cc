// engram-prewarm: registers a published segment with CUDA once and lets it go, so that the node's first replica
// does not pay what the machine's first large registration costs (bench/RESULTS.md "First attach").
// engramd runs it as a child process (daemon/prewarm.h): a driver fault here ends this process, never the daemon.
//
//   engram-prewarm --segment PATH   map the file read-only, populate, cuMemHostRegister (DEVICEMAP | READ_ONLY) in
//                                   the replica's chunks, unregister
//   engram-prewarm --scratch-mib N  the same over N MiB of anonymous memory (what a machine pays once, apart from
//                                   any file's pages)
//
// Prints one line of key=value pairs and exits 0 (done), 3 (no usable GPU: `reason=`), 1 (failed: `error=`) or
// 2 (bad usage); `error=` and `reason=` take the rest of the line. Single-threaded apart from the registration's own
// workers.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/strings/str_format.h"
#include "client/table/cuda_backend.h"
#include "engram/version.h"
#include "tools/args.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int Fail(const std::string& what) {
  std::cout << "error=" << what << "\n";  // the rest of the line
  return 1;
}

void Usage() {
  std::cerr << "usage: engram-prewarm --segment PATH [--chunk-gib N]\n"
               "       engram-prewarm --scratch-mib N [--chunk-gib N]\n"
               "       engram-prewarm --version | --help\n"
               "  registers the memory with CUDA (read-only, mapped for the device) and unregisters it; prints\n"
               "  populate_seconds= register_seconds= unregister_seconds= bytes=; exit 3 when there is no usable GPU\n"
               "  --chunk-gib: the registration's chunk (default 16, the client's register_chunk_bytes)\n";
}

}  // namespace

int main(int argc, char** argv) {
  engram::tools::Args a;
  auto st = a.Parse(argc, argv, 1, {"--segment", "--scratch-mib", "--chunk-gib"}, {"--help", "--version"});
  if (st.ok() && a.Has("--version")) {
    std::cout << "engram-prewarm " << ENGRAM_VERSION_STRING << "\n";
    return 0;
  }
  if (st.ok()) st = a.RequireInts({"--scratch-mib"}, 1, int64_t{1} << 30);
  if (st.ok()) st = a.RequireInts({"--chunk-gib"}, 1, 511);
  if (!st.ok() || a.Has("--help") || a.Has("--segment") == a.Has("--scratch-mib") || !a.positional().empty()) {
    if (!st.ok()) std::cerr << "engram-prewarm: " << st.message() << "\n";
    Usage();
    return a.Has("--help") && st.ok() ? 0 : 2;
  }
  // engramd's child: it goes with its parent (a daemon killed outright leaves no registration running).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  std::string why;
  if (engram::client::ProbeCuda(&why) != engram::client::CudaState::kUsable) {
    std::cout << "reason=" << why << "\n";
    return 3;
  }
  size_t bytes = 0;
  void* p = MAP_FAILED;
  if (a.Has("--segment")) {
    const std::string path = a.Get("--segment");
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return Fail(absl::StrFormat("open %s: %s", path, std::strerror(errno)));
    struct stat s {};
    if (::fstat(fd, &s) != 0 || !S_ISREG(s.st_mode) || s.st_size <= 0) {
      ::close(fd);
      return Fail(absl::StrFormat("%s is not a non-empty regular file", path));
    }
    bytes = static_cast<size_t>(s.st_size);
    p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return Fail(absl::StrFormat("mmap of %s: %s", path, std::strerror(errno)));
  } else {
    bytes = static_cast<size_t>(*a.GetInt("--scratch-mib", 1)) << 20;
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return Fail(absl::StrFormat("mmap of %d anonymous bytes: %s", bytes, std::strerror(errno)));
    ::madvise(p, bytes, MADV_HUGEPAGE);  // best effort: the segments live on huge pages too
  }
  // The replica populates its page tables before it registers (client/table/tables.cc): so does this.
  const auto t_pop = Clock::now();
  ::madvise(p, bytes, a.Has("--segment") ? MADV_POPULATE_READ : MADV_POPULATE_WRITE);  // best effort
  const double populate = Since(t_pop);
  engram::client::RegisterOptions ro;
  ro.chunk_bytes = static_cast<size_t>(*a.GetInt("--chunk-gib", 16)) << 30;
  int failed = -1;
  auto reg = engram::client::HostRegistration::Register(p, bytes, ro, &failed);
  if (!reg.ok()) {
    ::munmap(p, bytes);
    return Fail(std::string(reg.status().message()));
  }
  const double registered = (*reg)->seconds();
  const auto t_unreg = Clock::now();
  reg->reset();
  const double unregistered = Since(t_unreg);
  ::munmap(p, bytes);
  std::cout << absl::StrFormat("populate_seconds=%.3f register_seconds=%.3f unregister_seconds=%.3f bytes=%d\n",
                               populate, registered, unregistered, bytes);
  return 0;
}
