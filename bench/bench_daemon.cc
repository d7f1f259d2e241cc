// bench_daemon: engramd's costs against ceilings measured in the same run.
//   publish   Publish() of a TP1 segment from a page-cached synthetic checkpoint, vs the same threads doing a
//             single-pass copy of the same bytes into a fresh shm file (first touch included), and vs plain memcpy
//   adopt     a restarted daemon's start-to-settled time on an existing READY segment (and per 16 GiB)
//   attach    session round trip (hello -> grant) against a running engramd
//   status    Status RPC latency with 64 sessions attached
//   mounts   with --shm LABEL:DIR (repeatable; e.g. a huge=always tmpfs, a hugetlbfs mount): on each, the first-touch
//            ceiling (ftruncate, map, the same threads copying the bytes in: pages faulted in parallel) and the old
//            fallocate-first copy, then Publish() variants side by side (pages populated by the filling threads;
//            the whole file fallocated first; 4096-row steps; --threads2; on the last mount the product default:
//            reserve auto, cache dropped after READY), each as GiB/s and the ratio to the first-touch copy into the
//            same mount with the same threads. With --only-mounts 1 nothing else runs.
//            --threads2 N adds a first-touch copy and a publish with N threads.
//   cold     the checkpoint not in the page cache: a sequential read of its files (the disk ceiling) and Publish()
//            with 0, 1, 4 and 2 (the default) cold-cache readers (io/cold_prefetch.h). --only-cold 1: only this.
// Usage: bench_daemon [--gib N] [--threads N] [--engramd PATH] [--shm LABEL:DIR]... [--threads2 N] [--only-mounts 1]
//                     [--only-cold 1]
// --threads defaults to engramd's publish workers (daemon/publisher.h DefaultPublishThreads).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/coordinator.h"
#include "daemon/options.h"
#include "daemon/publisher.h"
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"
#include "tools/synthetic.h"
#include "xxhash.h"
#if defined(ENGRAM_XXH_DISPATCH)
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#endif

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void ParallelCopy(uint8_t* dst, const uint8_t* src, size_t n, int threads) {
  std::vector<std::thread> pool;
  const size_t part = (n / threads + 4095) / 4096 * 4096;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=] {
      const size_t b = std::min(n, part * t), e = std::min(n, part * (t + 1));
      if (e > b) std::memcpy(dst + b, src + b, e - b);
    });
  }
  for (auto& th : pool) th.join();
}

// A copy of `src` into a fresh file in `dir` by `threads` threads: `fallocate` first (SegmentReserve::kWhole) or not
// (first touch: each thread's page faults allocate and zero its pages). GiB/s from open to the last byte.
double CopyInto(const std::string& dir, const uint8_t* src, size_t bytes, int threads, bool fallocate) {
  const std::string path = dir + "/probe";
  const size_t size = (bytes + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);
  const auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return 0;
  const int e =
      fallocate ? ::posix_fallocate(fd, 0, static_cast<off_t>(size)) : ::ftruncate(fd, static_cast<off_t>(size));
  auto* dst = static_cast<uint8_t*>(::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  if (e != 0 || dst == MAP_FAILED) {
    std::printf("probe in %s failed (%s)\n", dir.c_str(), std::strerror(e != 0 ? e : errno));
    ::unlink(path.c_str());
    return 0;
  }
  ParallelCopy(dst, src, bytes, threads);
  const double gibs = bytes / 1073741824.0 / Since(t0);
  ::munmap(dst, size);
  ::unlink(path.c_str());
  return gibs;
}

// One thread hashing a cache-resident 270 KB buffer (a publish step's records) with XXH3 as compiled into libxxhash
// (SSE2 on x86-64) and through its runtime dispatch (what io/shard_records.cc calls): GiB/s of each.
void PrintHashRates() {
  std::vector<uint8_t> buf(1024 * 264);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + 7);
  using Update = XXH_errorcode (*)(XXH3_state_t*, const void*, size_t);
  auto rate = [&](Update update) {
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    const int reps = 4096;  // ~1 GiB
    const auto t0 = Clock::now();
    for (int r = 0; r < reps; ++r) update(st, buf.data(), buf.size());
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return std::make_pair(buf.size() * static_cast<double>(reps) / 1073741824.0 / Since(t0), h);
  };
  const auto plain = rate(&XXH3_64bits_update);
#if defined(ENGRAM_XXH_DISPATCH)
  const auto dispatched = rate(&XXH3_64bits_update_dispatch);
  std::printf("XXH3 one thread, 270 KB in cache: %.1f GiB/s as built, %.1f GiB/s through the runtime dispatch%s\n",
              plain.first, dispatched.first, plain.second == dispatched.second ? "" : " (HASHES DIFFER)");
#else
  std::printf("XXH3 one thread, 270 KB in cache: %.1f GiB/s (this libxxhash has no runtime dispatch)\n", plain.first);
#endif
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Not cached: the checkpoint's pages dropped (fadvise) before each step. The disk ceiling is a plain read of every
// file, one sequential reader per file in 8 MiB reads, timed before and after the publishes; then Publish() with the
// cold-cache readers off (the workers read for themselves), and with 1, 2 (the default) and 4
// readers, each as GiB/s of records and the ratio to the better disk read. The last publish (the default) stays for
// the adopt step.
void ColdPublishes(const engram::Checkpoint& ckpt, const engram::Layout& layout, const engram::TokenMap& map,
                   const std::string& ckpt_dir, const std::string& shm, int threads, uint64_t bytes,
                   uint64_t file_bytes) {
  auto drop = [&] {
    for (const auto& e : std::filesystem::directory_iterator(ckpt_dir)) {
      int f = ::open(e.path().c_str(), O_RDONLY);
      ::fdatasync(f);
      ::posix_fadvise(f, 0, 0, POSIX_FADV_DONTNEED);
      ::close(f);
    }
  };
  auto disk_read = [&] {
    drop();
    const auto t0 = Clock::now();
    std::vector<std::thread> readers;
    for (const auto& e : std::filesystem::directory_iterator(ckpt_dir)) {
      readers.emplace_back([f = e.path().string()] {
        std::vector<char> buf(8 << 20);
        int fd = ::open(f.c_str(), O_RDONLY);
        while (::read(fd, buf.data(), buf.size()) > 0) {
        }
        ::close(fd);
      });
    }
    for (auto& th : readers) th.join();
    return file_bytes / 1073741824.0 / Since(t0);
  };
  const double disk_before = disk_read();
  struct Run {
    const char* name;
    int readers;
  };
  std::vector<std::pair<const char*, double>> results;
  const Run runs[] = {{"no cold readers (workers read, as before)", 0},
                      {"1 cold reader", 1},
                      {"4 cold readers", 4},
                      {"2 cold readers (the default)", 2}};
  for (size_t i = 0; i < std::size(runs); ++i) {
    drop();
    engram::daemon::PublishTuning tuning = engram::daemon::PublishTuning::FromEnvironment();
    tuning.cold_readers = runs[i].readers;
    auto r =
        engram::daemon::Publish(ckpt, layout, map, 1, 0, shm, 1, 1, threads, nullptr, engram::Env::Default(), tuning);
    if (!r.ok()) {
      std::printf("cold     %s: FAILED: %s\n", runs[i].name, std::string(r.status().message()).c_str());
      continue;
    }
    results.emplace_back(runs[i].name, bytes / 1073741824.0 / r->seconds);
    std::printf("cold     publish not cached, %s: %.2f s, %.2f GiB streamed by the readers\n", runs[i].name, r->seconds,
                r->prefetched_bytes / 1073741824.0);
    std::fflush(stdout);
    if (i + 1 < std::size(runs)) ::unlink(r->path.c_str());
  }
  const double disk_after = disk_read();
  const double disk = std::max(disk_before, disk_after);
  std::printf("cold     disk read of the checkpoint %.2f GiB/s (before) / %.2f GiB/s (after)\n", disk_before,
              disk_after);
  for (const auto& [name, g] : results) {
    std::printf("cold     publish not cached, %s: %.2f GiB/s = %.2f of the disk\n", name, g, g / disk);
  }
  drop();
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 2;
  int threads = engram::daemon::DefaultPublishThreads();  // engramd's default (--threads 0)
  std::string engramd = std::filesystem::path(argv[0]).parent_path().string() + "/../daemon/engramd";
  std::vector<std::pair<std::string, std::string>> mounts;
  bool only_mounts = false;
  bool only_cold = false;
  int threads2 = 0;  // a second thread count for the mounts' first-touch copy and publish (0: none)
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--shm") {
      const std::string v = argv[i + 1];
      const size_t c = v.find(':');
      mounts.emplace_back(v.substr(0, c), c == std::string::npos ? v : v.substr(c + 1));
    }
    if (a == "--threads2") threads2 = std::atoi(argv[i + 1]);
    if (a == "--only-mounts") only_mounts = std::atoi(argv[i + 1]) != 0;
    if (a == "--only-cold") only_cold = std::atoi(argv[i + 1]) != 0;
    if (a == "--gib") gib = std::atof(argv[i + 1]);
    if (a == "--threads") threads = std::atoi(argv[i + 1]);
    if (a == "--engramd") engramd = argv[i + 1];
  }
  spdlog::set_level(spdlog::level::warn);
  const std::string work = "/tmp/engram-bench-" + std::to_string(::getpid());
  const std::string shm = "/dev/shm/engram-bench-" + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  std::filesystem::create_directories(shm);
  std::printf("bench_daemon: %.1f GiB of tables, %d threads\n", gib, threads);

  engram::tools::SyntheticSpec spec;
  spec.out_dir = work + "/ck";
  spec.table_mib = gib * 1024;
  spec.threads = threads;
  auto gen = engram::tools::WriteSyntheticCheckpoint(spec);
  if (!gen.ok()) return 1;
  // Page-cache the checkpoint (read it once).
  {
    std::vector<char> buf(8 << 20);
    for (const auto& e : std::filesystem::directory_iterator(spec.out_dir)) {
      int fd = ::open(e.path().c_str(), O_RDONLY);
      while (::read(fd, buf.data(), buf.size()) > 0) {
      }
      ::close(fd);
    }
  }
  auto ckpt = engram::Checkpoint::Open(spec.out_dir);
  auto layout = engram::Layout::Build((*ckpt)->config());
  auto tok = engram::Tokenizer::Load((*ckpt)->tokenizer_path());
  engram::TokenMap map = engram::TokenMap::Build(*tok);
  const size_t bytes = gen->table_bytes;
  if (only_cold) {
    ColdPublishes(**ckpt, *layout, map, spec.out_dir, shm, threads, bytes, gen->file_bytes);
    std::filesystem::remove_all(work);
    std::filesystem::remove_all(shm);
    return 0;
  }

  if (!mounts.empty()) {
    PrintHashRates();
    // Per mount: ceilings, then publish variants. The checkpoint (read once above) stays cached
    // (PublishTuning::DropCache::kKeep) until the last variant of the last mount, which runs the product's default
    // (dropping the cache behind the reader).
    std::unique_ptr<uint8_t[]> src_mem(new uint8_t[bytes]);  // filled in parallel, not zeroed by one thread
    uint8_t* const src = src_mem.get();
    {
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          for (size_t o = bytes * t / threads; o < bytes * (t + 1) / threads; o += 4096) {
            src[o] = static_cast<uint8_t>(o >> 12);
          }
        });
      }
      for (auto& th : pool) th.join();
    }
    using Tuning = engram::daemon::PublishTuning;
    using engram::SegmentReserve;
    const auto tuning = [](SegmentReserve reserve, Tuning::DropCache drop, int64_t sub_rows) {
      Tuning t;
      t.reserve = reserve;
      t.drop_cache = drop;
      t.sub_rows = sub_rows;
      return t;
    };
    struct Variant {
      std::string name;
      Tuning tuning;
      int threads;
    };
    const Tuning writers = tuning(SegmentReserve::kWriters, Tuning::DropCache::kKeep, 1024);
    std::vector<Variant> variants = {
        {"populate by the filling threads (kWriters: the default on huge pages)", writers, threads},
        {"fallocate first (kWhole: the default on 4 KiB pages)",
         tuning(SegmentReserve::kWhole, Tuning::DropCache::kKeep, 1024), threads},
        {"populate, 4096-row steps", tuning(SegmentReserve::kWriters, Tuning::DropCache::kKeep, 4096), threads}};
    {
      // The default fill (records packed and hashed in the cache, then written with non-temporal stores: no
      // read-for-ownership of the segment's fresh lines, as the first-touch copy's memcpy streams its stores too)
      // against plain stores.
      Tuning packed = Tuning{};
      packed.drop_cache = Tuning::DropCache::kKeep;
      variants.push_back({"reserve auto, packed, non-temporal stores on huge pages (default)", packed, threads});
      Tuning always = packed;
      always.stream_stores = 1;
      variants.push_back(
          {"reserve auto, packed, non-temporal stores on any page (ENGRAM_PUBLISH_NT=1)", always, threads});
      Tuning plain = packed;
      plain.stream_stores = 0;
      variants.push_back({"reserve auto, packed, plain stores (ENGRAM_PUBLISH_NT=0)", plain, threads});
    }
    if (threads2 > 0) variants.push_back({"populate, " + std::to_string(threads2) + " threads", writers, threads2});
    for (size_t m = 0; m < mounts.size(); ++m) {
      const auto& [label, dir_root] = mounts[m];
      const std::string dir = dir_root + "/engram-bench-" + std::to_string(::getpid());
      std::filesystem::create_directories(dir);
      // The first copy into a fresh huge-page mount also pays the kernel's first assembly of its huge pages (session
      // 5 measured 8.9 GiB/s cold, 40+ warm): the ceiling is the better of two.
      const double first_touch_cold = CopyInto(dir, src, bytes, threads, false);
      const double first_touch = std::max(first_touch_cold, CopyInto(dir, src, bytes, threads, false));
      const double falloc = CopyInto(dir, src, bytes, threads, true);
      const double first_touch2 = threads2 > 0 ? CopyInto(dir, src, bytes, threads2, false) : 0;
      std::printf(
          "\n[%s] %s: first-touch copy %.2f GiB/s (ceiling, %d threads, better of two: %.2f first; %.2f "
          "GiB/s with %d); fallocate-first copy %.2f GiB/s (%.2f)\n",
          label.c_str(), dir_root.c_str(), first_touch, threads, first_touch_cold, first_touch2, threads2, falloc,
          first_touch > 0 ? falloc / first_touch : 0.0);
      std::vector<Variant> vs = variants;
      if (m + 1 == mounts.size()) {
        vs.push_back({"product default (reserve auto; cache dropped after READY)", Tuning{}, threads});
      }
      for (const Variant& v : vs) {
        auto r = engram::daemon::Publish(**ckpt, *layout, map, 1, 0, dir, 1, 1, v.threads, nullptr,
                                         engram::Env::Default(), v.tuning);
        if (!r.ok()) {
          std::printf("[%s] publish, %s: FAILED: %s\n", label.c_str(), v.name.c_str(),
                      std::string(r.status().message()).c_str());
          continue;
        }
        const double g = bytes / 1073741824.0 / r->seconds;
        const double ceiling = v.threads == threads ? first_touch : first_touch2;
        std::printf("[%s] publish %.2f GiB, %s: %.2f s = %.2f GiB/s = %.2f of the first-touch copy (%d threads)\n",
                    label.c_str(), bytes / 1073741824.0, v.name.c_str(), r->seconds, g, ceiling > 0 ? g / ceiling : 0.0,
                    v.threads);
        std::fflush(stdout);
        ::unlink(r->path.c_str());
      }
      std::filesystem::remove_all(dir);
    }
    if (only_mounts) {
      std::filesystem::remove_all(work);
      std::filesystem::remove_all(shm);
      return 0;
    }
  }

  // Ceilings: plain memcpy between warm buffers, and a single-pass copy into a fresh shm file (first touch).
  std::vector<uint8_t> src(bytes, 1), warm(bytes, 2);
  auto t0 = Clock::now();
  ParallelCopy(warm.data(), src.data(), bytes, threads);
  const double memcpy_gibs = bytes / 1073741824.0 / Since(t0);
  std::vector<uint8_t>().swap(warm);  // keep the footprint of the probe like the publish's
  const std::string probe = shm + "/probe";
  // The same steps as a publish minus the checkpoint reads: reserve (fallocate), map, copy.
  t0 = Clock::now();
  int fd = ::open(probe.c_str(), O_RDWR | O_CREAT, 0600);
  (void)::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  auto* dst = static_cast<uint8_t*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  const double reserve_s = Since(t0);
  ParallelCopy(dst, src.data(), bytes, threads);
  const double shm_gibs = bytes / 1073741824.0 / Since(t0);
  std::printf("probe: fallocate + map %.2f s, total %.2f s\n", reserve_s, bytes / 1073741824.0 / shm_gibs);
  ::munmap(dst, bytes);
  ::unlink(probe.c_str());
  std::vector<uint8_t>().swap(src);

  // Publish (page cache dropped behind the reader, so re-warm before each run).
  auto publish = engram::daemon::Publish(**ckpt, *layout, map, 1, 0, shm, 1, 1, threads);
  if (!publish.ok()) {
    std::fprintf(stderr, "%s\n", std::string(publish.status().message()).c_str());
    return 1;
  }
  const double cold_s = publish->seconds;
  ::unlink(publish->path.c_str());
  {
    std::vector<char> buf(8 << 20);
    for (const auto& e : std::filesystem::directory_iterator(spec.out_dir)) {
      int f = ::open(e.path().c_str(), O_RDONLY);
      while (::read(f, buf.data(), buf.size()) > 0) {
      }
      ::close(f);
    }
  }
  publish = engram::daemon::Publish(**ckpt, *layout, map, 1, 0, shm, 1, 1, threads);
  const double pub_gibs = bytes / 1073741824.0 / publish->seconds;
  std::printf("\nceiling  memcpy warm->warm %.2f GiB/s; single-pass copy into a fresh shm file %.2f GiB/s\n",
              memcpy_gibs, shm_gibs);
  std::printf(
      "publish  %.2f GiB in %.2f s = %.2f GiB/s: %.2f of the shm copy, %.2f of memcpy "
      "(first run, partly cold cache: %.2f s)\n",
      bytes / 1073741824.0, publish->seconds, pub_gibs, pub_gibs / shm_gibs, pub_gibs / memcpy_gibs, cold_s);

  ::unlink(publish->path.c_str());
  ColdPublishes(**ckpt, *layout, map, spec.out_dir, shm, threads, bytes, gen->file_bytes);

  // Adopt: a daemon start on the READY segment.
  engram::daemon::Options opts;
  opts.checkpoints = {spec.out_dir};
  opts.shm_dir = shm;
  opts.threads = threads;
  {
    t0 = Clock::now();
    engram::daemon::Coordinator st(opts);
    (void)st.Start();
    st.WaitSettled(std::chrono::seconds(60));
    const double adopt = Since(t0);
    auto status = st.Status();
    std::printf(
        "adopt    start to READY %.3f s for %.2f GiB (%s) = %.3f s per 16 GiB if it scaled with size "
        "(it does not: headers only)\n",
        adopt, bytes / 1073741824.0, status.segments(0).origin().c_str(), adopt / (bytes / 17179869184.0));
  }

  // Attach and status against a real engramd.
  const std::string sock = work + "/engramd.sock";
  std::vector<std::string> args = {engramd,    "--checkpoint", spec.out_dir,  "--shm-dir", shm,
                                   "--socket", sock,           "--log-level", "warn"};
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, engramd.c_str(), nullptr, nullptr, cargs.data(), environ) != 0) return 1;
  auto stub = engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + sock, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext ctx;
    engram::v1::StatusReply r;
    if (stub->Status(&ctx, engram::v1::StatusRequest(), &r).ok() && r.segments_size() &&
        r.segments(0).state() == "READY")
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  engram::v1::ClientMessage hello;
  auto* h = hello.mutable_hello();
  h->set_fingerprint((*ckpt)->Fingerprint());
  h->set_tp_size(1);
  h->set_dp_size(4);
  std::vector<double> rtt;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    engram::v1::ServerMessage m;
    t0 = Clock::now();
    s->Write(hello);
    s->Read(&m);
    rtt.push_back(Since(t0));
    ctx.TryCancel();
    s->Finish();
  }
  std::printf("attach   session round trip hello -> grant (incl. the token map in the descriptor): median %.0f us\n",
              Median(rtt) * 1e6);
  // 64 sessions held open, then Status latency.
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>>> held;
  for (int i = 0; i < 64; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    held.push_back(stub->Session(ctxs.back().get()));
    held.back()->Write(hello);
    engram::v1::ServerMessage m;
    held.back()->Read(&m);
  }
  std::vector<double> lat;
  int replicas = 0;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext ctx;
    engram::v1::StatusReply r;
    t0 = Clock::now();
    stub->Status(&ctx, engram::v1::StatusRequest(), &r);
    lat.push_back(Since(t0));
    replicas = r.replicas_size();
  }
  std::printf("status   with %d sessions attached: median %.0f us\n", replicas, Median(lat) * 1e6);
  for (auto& c : ctxs) c->TryCancel();
  for (auto& s : held) s->Finish();
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  std::filesystem::remove_all(work);
  std::filesystem::remove_all(shm);
  return 0;
}
