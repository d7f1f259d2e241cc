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
#include <filesystem>
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

// Whether a read of every byte of the job's ranges would be served from memory, asked two ways of the kernel on this
// test's own descriptors (this process owns the files), neither through the product's ReadIfCached: a range is cold
// only when both say so. mincore on a mapping reports a page by its folio's up-to-date flag, and a large folio can be
// readable block by block without that flag (seen under load: 3-8 pages of a 769-page range, for good); a read that
// may not wait (preadv2 RWF_NOWAIT) stops at a cached page that carries the kernel's readahead mark (also seen under
// load). Either alone made a resident job look cold.
bool MincoreResident(int fd, uint64_t begin, uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t first = begin / page * page, len = begin + bytes - first;
  void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(first));
  if (m == MAP_FAILED) return false;
  std::vector<unsigned char> vec((len + page - 1) / page);
  const bool ok = ::mincore(m, len, vec.data()) == 0 &&
                  std::all_of(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; });
  ::munmap(m, len);
  return ok;
}

bool ReadsWithoutWaiting(int fd, uint64_t begin, uint64_t bytes) {
  std::vector<uint8_t> buf(bytes);
  uint64_t done = 0;
  while (done < bytes) {
    iovec v{buf.data() + done, static_cast<size_t>(bytes - done)};
    const ssize_t n = ::preadv2(fd, &v, 1, static_cast<off_t>(begin + done), RWF_NOWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<uint64_t>(n);
  }
  return true;
}

bool Cached(const std::vector<PrefetchRange>& job) {
  for (const auto& r : job) {
    const int fd = ::open(r.file->path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const uint64_t begin = r.tensor->begin + r.offset;
    const bool resident = MincoreResident(fd, begin, r.bytes) || ReadsWithoutWaiting(fd, begin, r.bytes);
    ::close(fd);
    if (!resident) return false;
  }
  return true;
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
  int not_resident = 0;
  for (size_t j = 0; j < copy.size(); ++j) {
    prefetch.WaitForJob(j);
    if (!Cached(copy[j])) ++not_resident;
    for (const auto& r : copy[j]) bytes += r.bytes;
    if (j == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  EXPECT_EQ(not_resident, 0);
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
  for (const auto& job : copy) EXPECT_TRUE(Cached(job));
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
  // Cached now: a fill starts no readers. Each file is read once more, start to end, as a checkpoint that was just
  // downloaded or read is: the readers' concurrent reads can leave the kernel's readahead marks on cached pages, at
  // which a read that may not wait stops (seen under load: every sample then looked cold), and a sequential read
  // clears them.
  for (const auto& e : std::filesystem::directory_iterator(f->tmp.path())) {
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0) << e.path();
    std::vector<uint8_t> buf(8 << 20);
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    ::close(fd);
  }
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
