// The cold-cache fill (io/cold_prefetch.h) and the probe it rests on (SafetensorsFile::ReadIfCached): a probe
// that copies the cached prefix of a range and stops at the first page not cached, whoever owns the file (mincore
// tells a non-owner that everything is cached); a prefetch that makes a job's ranges resident before its worker goes
// on, stays within its window, and does not read again what is cached; a fill from a dropped page cache that streams
// the table through the readers and gives the same records and checksums as a fill with no readers (and rows equal to
// the independent row oracle's); a cached checkpoint that starts no readers; a file truncated under a cold fill that
// is an error naming the file, not a hang.
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <random>
#include <thread>

#include "io/cold_prefetch.h"
#include "io/shard_records.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"
#include "tools/row_oracle.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using engram::testing::TempDir;

// Writes every file of the checkpoint to disk and asks the kernel to drop its pages. Returns why the test cannot
// run (empty when the tables' pages did leave: the precondition, without which there is nothing cold to read).
std::string DropCheckpointCache(const std::string& dir, const Checkpoint& ckpt) {
  engram::testing::DropPageCache(dir);
  std::vector<uint8_t> probe(64 << 10);
  for (int64_t l = 0; l < ckpt.config().n_layers(); ++l) {
    const EngramTensors t = ckpt.engram(l);
    auto cached = t.embed_weight.file->ReadIfCached(*t.embed_weight.info, 0, probe.data(), probe.size());
    if (!cached.ok()) return "this file system cannot say what is cached: " + std::string(cached.status().message());
    if (*cached == probe.size()) return "the kernel kept the pages (POSIX_FADV_DONTNEED ignored)";
  }
  return "";
}

#define SKIP_UNLESS_DROPPED(dir, ckpt)                                        \
  if (const std::string why = DropCheckpointCache(dir, ckpt); !why.empty()) { \
    GTEST_SKIP() << why;                                                      \
  }

// The ranges of jobs of 3 MiB of weights (every other 3 MiB: the jobs are not one contiguous range) and a little of
// the scales, over both layers.
std::vector<std::vector<PrefetchRange>> GappedJobs(const Checkpoint& ckpt) {
  std::vector<std::vector<PrefetchRange>> jobs;
  for (int64_t l = 0; l < ckpt.config().n_layers(); ++l) {
    const EngramTensors t = ckpt.engram(l);
    const uint64_t wb = t.embed_weight.info->bytes(), sb = t.embed_scale.info->bytes();
    for (uint64_t at = 0; at + (3 << 20) <= wb; at += 6 << 20) {
      jobs.push_back({{t.embed_weight.file, t.embed_weight.info, at, 3 << 20},
                      {t.embed_scale.file, t.embed_scale.info, at / 32, std::min<uint64_t>(1 << 10, sb - at / 32)}});
    }
  }
  return jobs;
}

// How many pages of the job's ranges a read would have to fetch from disk, asked of the kernel two ways on this
// test's own descriptors (this process owns the files), neither through the product's ReadIfCached: a page is cold
// only when mincore reports it missing and a read of it that may not wait (preadv2 RWF_NOWAIT) comes up short. Either
// alone made resident pages look cold: mincore answers by a folio's up-to-date flag, and a read that may not wait
// stops at a cached page that carries the kernel's readahead mark (io/cold_prefetch.h).
struct Pages {
  uint64_t cold = 0, total = 0;
};

Pages ColdPages(const std::vector<PrefetchRange>& job) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  Pages p;
  std::vector<uint8_t> buf(page);
  for (const auto& r : job) {
    if (r.bytes == 0) continue;
    const uint64_t begin = r.tensor->begin + r.offset, end = begin + r.bytes, first = begin / page * page;
    const uint64_t len = end - first, n = (len + page - 1) / page;
    p.total += n;
    const int fd = ::open(r.file->path().c_str(), O_RDONLY | O_CLOEXEC);
    void* m = fd < 0 ? MAP_FAILED : ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(first));
    std::vector<unsigned char> vec(n, 0);
    if (m == MAP_FAILED || ::mincore(m, len, vec.data()) != 0) {
      p.cold += n;  // cannot tell: counted cold
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        if ((vec[i] & 1) != 0) continue;
        const uint64_t from = std::max(begin, first + i * page), to = std::min(end, first + (i + 1) * page);
        uint64_t done = 0;
        while (done < to - from) {
          iovec v{buf.data() + done, static_cast<size_t>(to - from - done)};
          const ssize_t got = ::preadv2(fd, &v, 1, static_cast<off_t>(from + done), RWF_NOWAIT);
          if (got < 0 && errno == EINTR) continue;
          if (got <= 0) break;
          done += static_cast<uint64_t>(got);
        }
        if (done < to - from) ++p.cold;
      }
    }
    if (m != MAP_FAILED) ::munmap(m, len);
    if (fd >= 0) ::close(fd);
  }
  return p;
}

bool Cached(const std::vector<PrefetchRange>& job) { return ColdPages(job).cold == 0; }

// The kernel may drop a few pages the readers have just read (seen under load on a two-core VM: up to 8 of the 4,600
// pages of these jobs, for good): at most 1% of the jobs' pages may be cold. Readers that read nothing left 73% of
// them cold (the rest is the kernel's own readahead), and 39% when half the jobs were cached before.
void ExpectMostlyResident(const Pages& p, const char* what) {
  EXPECT_GT(p.total, 0u);
  EXPECT_LE(p.cold * 100, p.total) << p.cold << " of " << p.total << " pages " << what << " are not in memory";
}

struct Fixture {
  TempDir tmp;
  std::shared_ptr<const Checkpoint> ckpt;
  uint64_t seed = 11;
};

// ~40 MiB of tables over two files: several 64K-row jobs per layer, and weight ranges of more than one 8 MiB block.
std::unique_ptr<Fixture> MakeCheckpoint() {
  auto f = std::make_unique<Fixture>();
  tools::SyntheticSpec spec;
  spec.out_dir = f->tmp.path();
  spec.table_mib = 40;
  spec.seed = f->seed;
  spec.shards = 2;
  spec.threads = 2;
  EXPECT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  auto ckpt = Checkpoint::Open(f->tmp.path());
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (ckpt.ok()) f->ckpt = *ckpt;
  return f;
}

// Every row of the checkpoint as one fill (both layers, back to back), with what a fill without readers gives.
struct WholeFill {
  std::vector<LayerRows> rows;
  int64_t record_bytes = 0;
  uint64_t total = 0;            // bytes of records
  std::vector<uint8_t> records;  // from a fill without readers (when `reference` was asked for)
  std::vector<uint64_t> sums;
};

WholeFill MakeWholeFill(const Checkpoint& ckpt, bool reference) {
  WholeFill w;
  w.record_bytes = ckpt.config().head_dim + ckpt.config().head_dim / 32;
  for (int64_t l = 0; l < ckpt.config().n_layers(); ++l) {
    const int64_t n = ckpt.config().num_embeddings[static_cast<size_t>(l)];
    w.rows.push_back({l, 0, n, w.total});
    w.total += static_cast<uint64_t>(n * w.record_bytes);
  }
  if (reference) {
    ShardFillOptions plain;
    plain.cold_readers = 0;
    plain.drop_cache = false;
    w.records.assign(w.total, 0xAB);
    EXPECT_TRUE(ReadShardRecords(ckpt, w.rows, w.records.data(), 2, &w.sums, nullptr, plain).ok());
  }
  return w;
}

TEST(ReadIfCached, CopiesTheCachedPrefixAndStopsAtTheFirstPageNotCached) {
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  SKIP_UNLESS_DROPPED(f->tmp.path(), *f->ckpt);
  const EngramTensors t = f->ckpt->engram(0);
  const SafetensorsFile& file = *t.embed_weight.file;
  const TensorInfo& w = *t.embed_weight.info;
  const uint64_t at = 1 << 20, n = 5000;
  std::vector<uint8_t> got(n, 0xEE), want(n);
  auto cold = file.ReadIfCached(w, at, got.data(), n);
  ASSERT_TRUE(cold.ok()) << cold.status();
  EXPECT_LT(*cold, n) << "nothing was read since the drop";
  ASSERT_TRUE(file.ReadRange(w, at, want.data(), n).ok());
  auto warm = file.ReadIfCached(w, at, got.data(), n);
  ASSERT_TRUE(warm.ok()) << warm.status();
  EXPECT_EQ(*warm, n);
  EXPECT_TRUE(got == want) << "the cached read gave other bytes than a plain read";
  auto empty = file.ReadIfCached(w, 7, got.data(), 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, 0u);
  auto outside = file.ReadIfCached(w, w.bytes() - 10, got.data(), 11);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(outside.status().message().find(w.name), std::string::npos) << outside.status();
}

// As a process that neither owns the files nor may write them (engramd's user under systemd, reading a checkpoint
// that root or a download job wrote): the cold checkpoint still looks cold. With mincore it looked cached to such a
// process, and no reader ever started. Needs root (to drop to another uid in a child).
TEST(ReadIfCached, AColdCheckpointLooksColdToAProcessThatDoesNotOwnIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  SKIP_UNLESS_DROPPED(f->tmp.path(), *f->ckpt);
  const auto jobs = GappedJobs(*f->ckpt);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The files stay open (descriptors from the parent); only the identity changes.
    if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    ::_exit(ColdPrefetch::WorthStarting(jobs) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3)
    GTEST_SKIP() << "root here may not change its uid (no CAP_SETUID, or uid 65534 unmapped)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a non-owner saw the cold checkpoint as cached";
}

TEST(ColdPrefetch, AJobsRangesAreResidentWhenItsWorkerGoesOnAndReadersStayInTheirWindow) {
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  SKIP_UNLESS_DROPPED(f->tmp.path(), *f->ckpt);
  auto jobs = GappedJobs(*f->ckpt);
  ASSERT_GT(jobs.size(), 4u);
  EXPECT_TRUE(ColdPrefetch::WorthStarting(jobs));
  const auto copy = jobs;
  constexpr int64_t kWindow = 2;
  std::atomic<int> outside_window{0};
  ColdPrefetch prefetch(std::move(jobs), 2, kWindow, [&](size_t job, size_t started) {
    if (static_cast<int64_t>(job) >= static_cast<int64_t>(started) + kWindow) ++outside_window;
  });
  // One worker that stops for a while after its first job: readers that ignored the window would read ahead into
  // the jobs nobody started meanwhile.
  uint64_t bytes = 0;
  Pages pages;
  for (size_t j = 0; j < copy.size(); ++j) {
    prefetch.WaitForJob(j);
    const Pages p = ColdPages(copy[j]);
    pages.cold += p.cold;
    pages.total += p.total;
    for (const auto& r : copy[j]) bytes += r.bytes;
    if (j == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  ExpectMostlyResident(pages, "of the jobs, each when its worker went on,");
  EXPECT_EQ(outside_window.load(), 0) << "a reader read a block more than the window past the jobs started";
  EXPECT_EQ(prefetch.bytes_streamed(), bytes) << "every block handled";
  EXPECT_LE(prefetch.bytes_read(), bytes);
  EXPECT_FALSE(prefetch.gave_up().has_value());
  EXPECT_FALSE(ColdPrefetch::WorthStarting(copy)) << "everything was read: a second fill would start no readers";
}

// Half the jobs cached before the prefetch: the readers read from disk at most the other half's bytes.
// The window: 4 GiB of jobs, or a quarter of the free memory if less, but at least two jobs per worker; and the free
// memory read here is some positive amount no larger than MemAvailable (read here a second way).
TEST(ColdPrefetch, TheWindowFollowsTheFreeMemory) {
  constexpr uint64_t kJob = 16 << 20;
  EXPECT_EQ(ColdPrefetch::WindowJobsFor(kJob, 4, uint64_t{1} << 40), 256);  // 4 GiB / 16 MiB
  EXPECT_EQ(ColdPrefetch::WindowJobsFor(kJob, 4, uint64_t{2} << 30), 32);   // 2 GiB free: 512 MiB
  EXPECT_EQ(ColdPrefetch::WindowJobsFor(kJob, 4, 0), 8);                    // none free: two jobs per worker
  EXPECT_EQ(ColdPrefetch::WindowJobsFor(kJob, 0, 0), 2);
  EXPECT_EQ(ColdPrefetch::WindowJobsFor(0, 4, uint64_t{1} << 40), int64_t{4} << 30);  // degenerate job size
  const uint64_t free_bytes = ColdPrefetch::FreeMemoryBytes();
  EXPECT_GT(free_bytes, 0u);
  std::string meminfo = engram::testing::ReadFile("/proc/meminfo");
  const size_t at = meminfo.find("MemAvailable:");
  ASSERT_NE(at, std::string::npos);
  const uint64_t available = std::stoull(meminfo.substr(at + 13)) * 1024;
  EXPECT_LE(free_bytes, available + (uint64_t{256} << 20)) << "MemAvailable moves between the two reads";
}

TEST(ColdPrefetch, WhatIsCachedIsNotReadAgain) {
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  SKIP_UNLESS_DROPPED(f->tmp.path(), *f->ckpt);
  auto jobs = GappedJobs(*f->ckpt);
  ASSERT_GT(jobs.size(), 4u);
  uint64_t uncached = 0, all = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (const auto& r : jobs[j]) {
      all += r.bytes;
      if (j % 2 == 0) {
        std::vector<uint8_t> buf(r.bytes);
        ASSERT_TRUE(r.file->ReadRange(*r.tensor, r.offset, buf.data(), r.bytes).ok());
      } else {
        uncached += r.bytes;
      }
    }
  }
  const auto copy = jobs;
  ColdPrefetch prefetch(std::move(jobs), 2, 1000);
  for (size_t j = 0; j < copy.size(); ++j) prefetch.WaitForJob(j);
  Pages pages;
  for (const auto& job : copy) {
    const Pages p = ColdPages(job);
    pages.cold += p.cold;
    pages.total += p.total;
  }
  ExpectMostlyResident(pages, "of the jobs after the prefetch");
  EXPECT_LE(prefetch.bytes_read(), uncached) << "cached blocks were read from disk again";
  EXPECT_EQ(prefetch.bytes_streamed(), all) << "every block handled, cached or not";
}

TEST(ColdPrefetch, AColdFillStreamsThroughTheReadersAndGivesTheSameRecords) {
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  const Checkpoint& ckpt = *f->ckpt;
  const WholeFill w = MakeWholeFill(ckpt, /*reference=*/true);  // no readers, whatever the cache holds
  const auto& [rows, rb, total, want, want_sums] = w;
  ASSERT_GT(rows[0].row_end, kChecksumChunkRows) << "the test wants more than one job per layer";

  SKIP_UNLESS_DROPPED(f->tmp.path(), ckpt);
  for (int readers : {1, 3}) {
    // A cold start for each reader count; a kernel that keeps the pages this time (seen under a loaded machine's
    // I/O) leaves nothing to measure: skipped, as the first drop's guard does, rather than failed.
    SKIP_UNLESS_DROPPED(f->tmp.path(), ckpt);
    ShardFillOptions cold;
    cold.cold_readers = readers;
    cold.drop_cache = false;
    std::atomic<uint64_t> prefetched{0};
    cold.prefetched_bytes = &prefetched;
    std::vector<uint8_t> got(total, 0xCD);
    std::vector<uint64_t> got_sums;
    std::atomic<uint64_t> done{0};
    ASSERT_TRUE(ReadShardRecords(ckpt, rows, got.data(), 2, &got_sums, &done, cold).ok());
    EXPECT_TRUE(got == want) << readers << " readers: other bytes";
    EXPECT_EQ(got_sums, want_sums);
    EXPECT_EQ(done.load(), total / static_cast<uint64_t>(rb));
    EXPECT_EQ(prefetched.load(), total) << readers << " readers: every byte of the tables streamed through them";
  }
  // Cached now: a fill starts no readers. What the fill reads is resident by this test's own oracle first (the
  // kernel may let pages go between the fills under load: then there is nothing cached to test, and it is skipped).
  std::vector<PrefetchRange> whole;
  for (int64_t l = 0; l < ckpt.config().n_layers(); ++l) {
    const EngramTensors t = ckpt.engram(l);
    whole.push_back({t.embed_weight.file, t.embed_weight.info, 0, t.embed_weight.info->bytes()});
    whole.push_back({t.embed_scale.file, t.embed_scale.info, 0, t.embed_scale.info->bytes()});
  }
  if (!Cached(whole)) GTEST_SKIP() << "the kernel let some of the table's pages go after the cold fills";
  ShardFillOptions warm;
  std::atomic<uint64_t> prefetched{0};
  warm.prefetched_bytes = &prefetched;
  warm.drop_cache = false;
  std::vector<uint8_t> again(total);
  ASSERT_TRUE(ReadShardRecords(ckpt, rows, again.data(), 2, nullptr, nullptr, warm).ok());
  EXPECT_EQ(prefetched.load(), 0u);
  EXPECT_TRUE(again == want);

  // The rows against the independent oracle (its own reader of the files), sampled.
  std::string error;
  auto oracle = oracle::RowOracle::Open(f->tmp.path(), &error);
  ASSERT_NE(oracle, nullptr) << error;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 64; ++i) {
    const size_t l = rng() % rows.size();
    const int64_t row = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows[l].row_end));
    auto rec = oracle->RecordAt(static_cast<int64_t>(l), row, &error);
    ASSERT_TRUE(rec.has_value()) << error;
    const uint8_t* at = want.data() + rows[l].dst_offset + static_cast<uint64_t>(row * rb);
    ASSERT_TRUE(std::equal(rec->begin(), rec->end(), at)) << "layer " << l << " row " << row;
  }
}

// Readers started before the fill (as a publish starts them before it reserves the segment): null when there is
// nothing to do (no readers asked, a cached checkpoint, rows of a layer the checkpoint lacks); otherwise the fill uses
// them (even with its own cold_readers 0) and gives the same records as a fill without readers.
TEST(ColdPrefetch, ReadersStartedBeforeTheFillAreTheOnesItUses) {
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  const Checkpoint& ckpt = *f->ckpt;
  const WholeFill w = MakeWholeFill(ckpt, /*reference=*/true);
  const auto& [rows, rb, total, want, want_sums] = w;
  EXPECT_EQ(StartColdPrefetch(ckpt, rows, 2, 2), nullptr) << "cached: nothing to read";

  SKIP_UNLESS_DROPPED(f->tmp.path(), ckpt);
  EXPECT_EQ(StartColdPrefetch(ckpt, rows, 2, 0), nullptr);
  EXPECT_EQ(StartColdPrefetch(ckpt, {{7, 0, 10, 0}}, 2, 2), nullptr);
  std::unique_ptr<ColdPrefetch> prefetch = StartColdPrefetch(ckpt, rows, 2, 2);
  ASSERT_NE(prefetch, nullptr);
  ShardFillOptions fill;
  fill.cold_readers = 0;
  fill.drop_cache = false;
  fill.cold_prefetch = prefetch.get();
  std::atomic<uint64_t> prefetched{0};
  fill.prefetched_bytes = &prefetched;
  std::vector<uint8_t> got(total);
  std::vector<uint64_t> got_sums;
  ASSERT_TRUE(ReadShardRecords(ckpt, rows, got.data(), 2, &got_sums, nullptr, fill).ok());
  EXPECT_TRUE(got == want);
  EXPECT_EQ(got_sums, want_sums);
  EXPECT_EQ(prefetched.load(), total);
  EXPECT_EQ(prefetched.load(), prefetch->bytes_streamed());
}

TEST(ColdPrefetch, AFileTruncatedUnderAColdFillIsAnErrorNamingItNotAHang) {
  auto f = MakeCheckpoint();
  ASSERT_NE(f->ckpt, nullptr);
  const Checkpoint& ckpt = *f->ckpt;
  const WholeFill w = MakeWholeFill(ckpt, /*reference=*/false);
  SKIP_UNLESS_DROPPED(f->tmp.path(), ckpt);
  // Layer 1's weights lose their second half after the checkpoint was opened.
  const EngramTensors t = ckpt.engram(1);
  const uint64_t cut = t.embed_weight.info->begin + t.embed_weight.info->bytes() / 2;
  ASSERT_EQ(::truncate(t.embed_weight.file->path().c_str(), static_cast<off_t>(cut)), 0);
  ShardFillOptions cold;
  cold.cold_readers = 2;
  cold.drop_cache = false;
  std::vector<uint8_t> dst(w.total);
  absl::Status st = ReadShardRecords(ckpt, w.rows, dst.data(), 2, nullptr, nullptr, cold);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find(t.embed_weight.file->path()), std::string::npos) << st;
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st;
}

}  // namespace
}  // namespace engram
