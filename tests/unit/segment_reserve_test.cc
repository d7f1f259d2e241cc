// How a segment's memory is reserved and filled (shm/segment.h SegmentReserve, PopulateForWrite; daemon/publisher.h):
// with kWriters only the header and the last page are reserved up front and the filling threads populate the data's
// pages, an out-of-room populate is ResourceExhausted (never SIGBUS) and leaves no file, a kernel without
// MADV_POPULATE_WRITE gets the whole reservation, kAuto reserves the whole file outside hugetlbfs and lets the
// filling threads populate it on hugetlbfs; the file is whole 2 MiB pages (records end less than one page
// before it), and a segment published into a hugetlbfs mount is readable, verifiable and retirable (skipped where
// no such mount has free 2 MiB pages; ENGRAM_TEST_HUGETLBFS_DIR names one).
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "daemon/publisher.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "model/tokenizer.h"
#include "shm/capacity.h"
#include "shm/env.h"
#include "shm/segment.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace engram {
namespace {

using testing::TempDir;

// Records every fallocate; MADV_POPULATE_WRITE answers `populate_errno` (0: the real call) except for the 4 KiB
// support probe when `probe_ok`.
class PopulateEnv : public PosixEnv {
 public:
  int populate_errno = 0;
  bool probe_ok = true;
  std::vector<std::pair<off_t, off_t>> fallocates;

  int PosixFallocate(int fd, off_t off, off_t len) override {
    fallocates.emplace_back(off, len);
    return PosixEnv::PosixFallocate(fd, off, len);
  }
  int Madvise(void* addr, size_t len, int advice) override {
    if (advice == MADV_POPULATE_WRITE && populate_errno != 0 && !(probe_ok && len == 4096)) {
      errno = populate_errno;
      return -1;
    }
    return PosixEnv::Madvise(addr, len, advice);
  }
};

constexpr uint64_t kData = (uint64_t{5} << 20) + 3 * 264;

// The directory is on hugetlbfs (its block size is a huge page): the tests that need a 4 KiB tmpfs skip there.
bool OnHugetlbfs(const std::string& dir) {
  struct statvfs vfs {};
  return ::statvfs(dir.c_str(), &vfs) == 0 && vfs.f_bsize > 4096;
}

// A 64 KiB-page kernel (aarch64, e.g. a Grace host) as far as the segment code can tell: the system page is 64 KiB,
// a tmpfs reports it as its block size and as its files', and madvise refuses a range that does not start on one
// (EINVAL), measured from the segment's mapping (on such a kernel every mapping starts on a 64 KiB page).
// MADV_POPULATE_WRITE is otherwise a no-op here (a tmpfs with room: the writes fault their pages in).
class BigPageEnv : public PosixEnv {
 public:
  static constexpr size_t kPage = 65536;
  std::atomic<uintptr_t> base{0};
  std::atomic<int> populates{0}, misaligned{0};
  size_t PageBytes() override { return kPage; }
  int Statvfs(const char* path, struct statvfs* out) override {
    const int r = PosixEnv::Statvfs(path, out);
    out->f_bsize = kPage;
    return r;
  }
  int Fstat(int fd, struct stat* st) override {  // a file's block size there is the system page too
    const int r = PosixEnv::Fstat(fd, st);
    st->st_blksize = kPage;
    return r;
  }
  void* Mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) override {
    void* p = PosixEnv::Mmap(addr, len, prot, flags, fd, offset);
    if (p != MAP_FAILED) base = reinterpret_cast<uintptr_t>(p);
    return p;
  }
  int Madvise(void* addr, size_t len, int advice) override {
    if (advice != MADV_POPULATE_WRITE) return PosixEnv::Madvise(addr, len, advice);
    ++populates;
    if ((reinterpret_cast<uintptr_t>(addr) - base.load()) % kPage != 0) {
      ++misaligned;
      errno = EINVAL;
      return -1;
    }
    return 0;
  }
};

TEST(SegmentReserveTest, WritersReserveOnlyTheHeaderAndTheLastPageThenPopulateWhatTheyWrite) {
  TempDir dir;
  PopulateEnv env;
  auto w = SegmentWriter::Create(dir.path(), 0x51, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kWriters);
  ASSERT_TRUE(w.ok()) << w.status();
  if (!(*w)->populate_data()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (the whole file was reserved)";
  const uint64_t total = SegmentFileBytes(4, kData);
  EXPECT_EQ(total % kDataAlign, 0u);
  EXPECT_EQ(std::filesystem::file_size((*w)->path()), total);
  ASSERT_EQ(env.fallocates.size(), 2u);
  EXPECT_EQ(static_cast<uint64_t>(env.fallocates[0].first + env.fallocates[0].second), SegmentDataOffset(4));
  EXPECT_EQ(static_cast<uint64_t>(env.fallocates[1].first + env.fallocates[1].second), total);
  for (const auto& [off, len] : env.fallocates) EXPECT_LT(static_cast<uint64_t>(len), kData) << "data not reserved";
  ASSERT_TRUE(PopulateForWrite((*w)->data(), kData, &env).ok());
  for (uint64_t i = 0; i < kData; ++i) (*w)->data()[i] = static_cast<uint8_t>(i * 7);
  ASSERT_TRUE((*w)->Finish(0.1).ok());
  auto r = SegmentReader::Open((*w)->path());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->file_bytes(), total);
  EXPECT_EQ((*r)->header().data_offset % kDataAlign, 0u);
  EXPECT_EQ((*r)->header().data_bytes, kData);
  EXPECT_LT(total - (*r)->header().data_offset - kData, kDataAlign);
  for (uint64_t i = 0; i < kData; i += 4093) ASSERT_EQ((*r)->data()[i], static_cast<uint8_t>(i * 7)) << i;
}

TEST(SegmentReserveTest, WithoutPopulateWriteTheWholeFileIsReserved) {
  TempDir dir;
  PopulateEnv env;
  env.populate_errno = EINVAL;  // a kernel before 5.14
  env.probe_ok = false;
  auto w = SegmentWriter::Create(dir.path(), 0x52, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kWriters);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE((*w)->populate_data());
  ASSERT_FALSE(env.fallocates.empty());
  EXPECT_EQ(env.fallocates.back().first, 0);
  EXPECT_EQ(static_cast<uint64_t>(env.fallocates.back().second), SegmentFileBytes(4, kData));
}

TEST(SegmentReserveTest, AutoReservesTheWholeFileOutsideHugetlbfs) {
  TempDir dir;
  if (OnHugetlbfs(dir.path())) GTEST_SKIP() << dir.path() << " is on hugetlbfs";
  PopulateEnv env;
  auto w = SegmentWriter::Create(dir.path(), 0x55, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kAuto);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE((*w)->huge_pages());
  EXPECT_FALSE((*w)->populate_data());
  ASSERT_EQ(env.fallocates.size(), 1u);
  EXPECT_EQ(env.fallocates[0].first, 0);
  EXPECT_EQ(static_cast<uint64_t>(env.fallocates[0].second), SegmentFileBytes(4, kData));
}

// A huge=always tmpfs as the segment code sees it: the filesystem's block size is the base page (statvfs) but the
// file's is a 2 MiB huge page (fstat).
class HugeTmpfsEnv : public PopulateEnv {
 public:
  int Fstat(int fd, struct stat* st) override {
    const int r = PopulateEnv::Fstat(fd, st);
    st->st_blksize = 2 << 20;
    return r;
  }
};

// kAuto on a huge-page tmpfs: the filling threads populate their ranges (kWriters), only the header and the last
// huge page are fallocated; a failed populate then fails the fill cleanly (as on hugetlbfs).
TEST(SegmentReserveTest, AutoLetsTheWritersPopulateOnAHugePageTmpfs) {
  TempDir dir;
  if (OnHugetlbfs(dir.path())) GTEST_SKIP() << dir.path() << " is on hugetlbfs";
  HugeTmpfsEnv env;
  auto w = SegmentWriter::Create(dir.path(), 0x57, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kAuto);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->page_bytes(), uint64_t{2} << 20);
  EXPECT_TRUE((*w)->huge_pages());
  EXPECT_TRUE((*w)->populate_data()) << "a huge-page tmpfs was reserved whole";
  const uint64_t total = SegmentFileBytes(4, kData);
  ASSERT_EQ(env.fallocates.size(), 2u);
  EXPECT_EQ(env.fallocates[0].first, 0);
  EXPECT_EQ(static_cast<uint64_t>(env.fallocates[0].second), SegmentDataOffset(4));
  EXPECT_EQ(static_cast<uint64_t>(env.fallocates[1].first), total - (uint64_t{2} << 20));
  env.populate_errno = ENOSPC;
  EXPECT_EQ(PopulateForWrite((*w)->data(), 65536, &env).code(), absl::StatusCode::kResourceExhausted);
}

TEST(SegmentReserveTest, PopulateWithoutRoomIsResourceExhausted) {
  TempDir dir;
  PopulateEnv env;
  env.populate_errno = EFAULT;  // what madvise answers where a write fault would have been SIGBUS
  auto w = SegmentWriter::Create(dir.path(), 0x53, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kWriters);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->populate_data());
  const absl::Status st = PopulateForWrite((*w)->data() + 100, 5000, &env);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("no room"), std::string::npos) << st;
}

TEST(SegmentReserveTest, RecordsEndingAWholePageBeforeTheEndAreRefused) {
  TempDir dir;
  auto w = SegmentWriter::Create(dir.path(), 0x54, 1, 0, "desc", 4096, 1, 1);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Finish(0).ok());
  const std::string path = (*w)->path();
  ASSERT_TRUE(ReadSegmentHeader(path).ok());
  // Grow the file by one more 2 MiB page and say so in the header: sizes agree, but the padding is a whole page.
  const uint64_t total = SegmentFileBytes(4, 4096) + kDataAlign;
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(total)), 0);
  ASSERT_EQ(::pwrite(fd, &total, 8, offsetof(SegmentHeader, total_bytes)), 8);
  ::close(fd);
  auto h = ReadSegmentHeader(path);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss) << h.status();
}

// Publish through an Env whose populate fails after the probe: the publish fails as out of room, no file is left.
class PublishReserveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tools::SyntheticSpec spec;
    spec.out_dir = dir_ / "ck";
    spec.table_mib = 3;
    ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
    auto ck = Checkpoint::Open(spec.out_dir);
    ASSERT_TRUE(ck.ok()) << ck.status();
    ckpt_ = *ck;
    auto layout = Layout::Build(ckpt_->config());
    ASSERT_TRUE(layout.ok());
    layout_ = std::make_unique<Layout>(*layout);
    auto tok = Tokenizer::Load(ckpt_->tokenizer_path());
    ASSERT_TRUE(tok.ok());
    map_ = std::make_unique<TokenMap>(TokenMap::Build(*tok));
  }
  // The bytes of a TP1 shard's records (every row of every layer), counted from the layout.
  uint64_t RecordBytes() const {
    auto shard = layout_->Shard(1, 0);
    EXPECT_TRUE(shard.ok()) << shard.status();
    if (!shard.ok()) return 0;
    uint64_t rows = 0;
    for (size_t l = 0; l < shard->row_end.size(); ++l) {
      rows += static_cast<uint64_t>(shard->row_end[l] - shard->row_begin[l]);
    }
    return rows * static_cast<uint64_t>(ckpt_->config().record_bytes());
  }
  TempDir dir_;
  std::shared_ptr<const Checkpoint> ckpt_;
  std::unique_ptr<Layout> layout_;
  std::unique_ptr<TokenMap> map_;
};

TEST_F(PublishReserveTest, APopulateFailureFailsThePublishAsOutOfRoomAndLeavesNoFile) {
  const std::string shm = dir_ / "shm";
  std::filesystem::create_directories(shm);
  PopulateEnv env;
  env.populate_errno = ENOMEM;
  daemon::PublishTuning writers;
  writers.reserve = SegmentReserve::kWriters;  // what a hugetlbfs directory gets
  auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, &env, writers);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(ListSegments(shm).empty());
}

// The same forced kWriters, passed in (daemon::PublishTuning) with the environment unset: the populate failure shows
// that Publish used it (kAuto would reserve this tmpfs whole and succeed).
TEST_F(PublishReserveTest, AnExplicitTuningIsUsedWithoutTheEnvironment) {
  const std::string shm = dir_ / "shm";
  std::filesystem::create_directories(shm);
  ::unsetenv("ENGRAM_PUBLISH_RESERVE");
  PopulateEnv env;
  env.populate_errno = ENOMEM;
  daemon::PublishTuning tuning;
  tuning.reserve = SegmentReserve::kWriters;
  auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, &env, tuning);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

// Streamed stores forced on (ENGRAM_PUBLISH_NT=1's tuning) and off: the two segments hold the same records byte for
// byte, read back by plain file reads (not the writer's mapping), and each passes its recomputed checksums.
TEST_F(PublishReserveTest, StreamedAndPlainStoresPublishTheSameRecords) {
  std::vector<std::string> data;
  for (int nt : {1, 0}) {
    const std::string shm = dir_ / ("shm-nt" + std::to_string(nt));
    std::filesystem::create_directories(shm);
    daemon::PublishTuning tuning;
    tuning.stream_stores = nt;
    tuning.drop_cache = daemon::PublishTuning::DropCache::kKeep;
    auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 3, nullptr, Env::Default(), tuning);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->streamed_bytes > 0, nt == 1) << "the tuning reached the fill";
    const uint64_t records = RecordBytes();
    EXPECT_EQ(r->streamed_bytes, nt == 1 ? records : 0) << "every record streamed, or none";
    EXPECT_TRUE(daemon::VerifyChecksums(r->path, 2).ok()) << "nt " << nt;
    std::ifstream f(r->path, std::ios::binary);
    data.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    ASSERT_GT(data.back().size(), 4096u);
  }
  // The headers differ only where the instance, epoch or timings do; the records (after the header) are equal.
  auto header = SegmentReader::Open(std::string(dir_ / "shm-nt0") + "/" + ListSegments(dir_ / "shm-nt0").at(0));
  ASSERT_TRUE(header.ok()) << header.status();
  const uint64_t off = (*header)->header().data_offset, n = (*header)->header().data_bytes;
  ASSERT_EQ(data[0].size(), data[1].size());
  ASSERT_LE(off + n, data[0].size());
  EXPECT_TRUE(data[0].compare(off, n, data[1], off, n) == 0) << "streamed stores changed the records";
}

// The defaults end to end: on a 4 KiB tmpfs the file is reserved whole and written with plain stores; on a huge-page
// tmpfs (as the segment code sees one: HugeTmpfsEnv) the filling threads populate their pages and stream their stores.
TEST_F(PublishReserveTest, DefaultsFollowThePageSize) {
  if (OnHugetlbfs(dir_.path())) GTEST_SKIP() << dir_.path() << " is on hugetlbfs";
  daemon::PublishTuning tuning;  // the defaults, whatever the environment says
  tuning.drop_cache = daemon::PublishTuning::DropCache::kKeep;
  for (bool huge : {false, true}) {
    const std::string shm = dir_ / (huge ? "shm-huge" : "shm-4k");
    std::filesystem::create_directories(shm);
    PopulateEnv small;
    HugeTmpfsEnv big;
    Env* env = huge ? static_cast<Env*>(&big) : static_cast<Env*>(&small);
    auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, env, tuning);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->page_bytes, huge ? uint64_t{2} << 20 : uint64_t{4096});
    EXPECT_EQ(r->populated, huge);
    EXPECT_EQ(r->streamed_bytes > 0, huge);
    EXPECT_TRUE(daemon::VerifyChecksums(r->path, 2).ok()) << "huge " << huge;
  }
}

// A publish from a checkpoint that is not in the page cache streams it through the cold-cache readers, and reports
// what they read (PublishResult::prefetched_bytes, engramd's publish_done log); with the readers tuned off (or the
// checkpoint cached) they read nothing. Both segments pass their checksums.
TEST_F(PublishReserveTest, AColdCheckpointIsReadByTheColdReadersUnlessTunedOff) {
  for (int readers : {2, 0}) {
    const std::string shm = dir_ / ("shm-cold" + std::to_string(readers));
    std::filesystem::create_directories(shm);
    engram::testing::DropPageCache(dir_ / "ck");
    const EngramTensors t = ckpt_->engram(0);
    std::vector<uint8_t> probe(4096);
    auto cached = t.embed_weight.file->ReadIfCached(*t.embed_weight.info, 0, probe.data(), probe.size());
    if (!cached.ok()) GTEST_SKIP() << "this file system cannot say what is cached: " << cached.status();
    if (*cached == probe.size()) GTEST_SKIP() << "the kernel kept the pages (POSIX_FADV_DONTNEED ignored)";
    daemon::PublishTuning tuning;
    tuning.cold_readers = readers;
    tuning.drop_cache = daemon::PublishTuning::DropCache::kKeep;
    auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, Env::Default(), tuning);
    ASSERT_TRUE(r.ok()) << r.status();
    // Every record's bytes streamed through the readers (weights and scales: a record's bytes), or none.
    const uint64_t records = RecordBytes();
    EXPECT_EQ(r->prefetched_bytes, readers > 0 ? records : 0) << readers << " readers";
    EXPECT_TRUE(daemon::VerifyChecksums(r->path, 2).ok()) << readers << " readers";
  }
  // Cached now (the publish above read it all): no reader reads.
  const std::string shm = dir_ / "shm-warm";
  std::filesystem::create_directories(shm);
  daemon::PublishTuning tuning;
  tuning.drop_cache = daemon::PublishTuning::DropCache::kKeep;
  auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, Env::Default(), tuning);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefetched_bytes, 0u);
}

// PublishTuning::FromEnv: each diagnosis knob's values, and the product's defaults when none is set.
TEST(PublishTuningTest, FromEnvReadsEachKnob) {
  using Drop = daemon::PublishTuning::DropCache;
  const auto unset_all = [] {
    for (const char* k : {"ENGRAM_PUBLISH_RESERVE", "ENGRAM_PUBLISH_DROP_CACHE", "ENGRAM_PUBLISH_SUB_ROWS",
                          "ENGRAM_PUBLISH_NT", "ENGRAM_PUBLISH_COLD_READERS"}) {
      ::unsetenv(k);
    }
  };
  unset_all();
  daemon::PublishTuning t = daemon::PublishTuning::FromEnvironment();
  EXPECT_EQ(t.reserve, SegmentReserve::kAuto);
  EXPECT_EQ(t.drop_cache, Drop::kAuto);  // chosen per publish (ChooseDropCache)
  EXPECT_FALSE(t.sub_rows.has_value());
  EXPECT_EQ(t.stream_stores, -1);
  EXPECT_FALSE(t.cold_readers.has_value());
  EXPECT_TRUE(t.removed.empty());
  ::setenv("ENGRAM_PUBLISH_DIRECT_READ", "1", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().removed, std::vector<std::string>{"ENGRAM_PUBLISH_DIRECT_READ"});
  ::unsetenv("ENGRAM_PUBLISH_DIRECT_READ");
  ::setenv("ENGRAM_PUBLISH_COLD_READERS", "0", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().cold_readers.value_or(-1), 0);
  ::setenv("ENGRAM_PUBLISH_COLD_READERS", "4", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().cold_readers.value_or(-1), 4);
  ::setenv("ENGRAM_PUBLISH_COLD_READERS", "-3", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().cold_readers.value_or(-1), 0);
  ::setenv("ENGRAM_PUBLISH_NT", "0", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().stream_stores, 0);
  ::setenv("ENGRAM_PUBLISH_NT", "1", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().stream_stores, 1);
  ::setenv("ENGRAM_PUBLISH_NT", "7", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().stream_stores, 1);
  // Streamed stores by default only into huge pages (on 4 KiB pages they did not win: bench/RESULTS.md "Publish").
  // (a 64 KiB system page is not huge: On64KiBPageKernelsTmpfsIsNotHugetlbfsAndPopulatesWholePages)
  EXPECT_FALSE(daemon::PublishStreamsStores(-1, /*huge_pages=*/false));
  EXPECT_TRUE(daemon::PublishStreamsStores(-1, true));
  EXPECT_TRUE(daemon::PublishStreamsStores(1, false));
  EXPECT_FALSE(daemon::PublishStreamsStores(0, true));
  ::setenv("ENGRAM_PUBLISH_RESERVE", "whole", 1);
  ::setenv("ENGRAM_PUBLISH_DROP_CACHE", "inline", 1);
  ::setenv("ENGRAM_PUBLISH_SUB_ROWS", "4096", 1);
  t = daemon::PublishTuning::FromEnvironment();
  EXPECT_EQ(t.reserve, SegmentReserve::kWhole);
  EXPECT_EQ(t.drop_cache, Drop::kInline);
  EXPECT_EQ(t.sub_rows.value_or(0), 4096);
  ::setenv("ENGRAM_PUBLISH_RESERVE", "writers", 1);
  ::setenv("ENGRAM_PUBLISH_DROP_CACHE", "0", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().reserve, SegmentReserve::kWriters);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().drop_cache, Drop::kKeep);
  ::setenv("ENGRAM_PUBLISH_RESERVE", "bogus", 1);
  ::setenv("ENGRAM_PUBLISH_DROP_CACHE", "1", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().reserve, SegmentReserve::kAuto);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().drop_cache, Drop::kAfterReady);
  ::setenv("ENGRAM_PUBLISH_DROP_CACHE", "after", 1);
  EXPECT_EQ(daemon::PublishTuning::FromEnvironment().drop_cache, Drop::kAfterReady);
  unset_all();
}

// engramd's default publish workers (--threads 0), which bench_daemon takes too: the hardware's threads, at most 32.
TEST(PublishTuningTest, DefaultPublishThreadsIsTheHardwaresAtMost32) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(daemon::DefaultPublishThreads(), std::clamp(hw, 1, 32));
}

// On a 64 KiB-page kernel a tmpfs's block size is its (base) page, not a huge page: kAuto reserves the whole file
// there (it took it for hugetlbfs); and a forced kWriters publish populates whole 64 KiB pages (it widened each range
// to 4 KiB only, and madvise refused every start off a 64 KiB page: every publish failed with EINVAL).
TEST_F(PublishReserveTest, On64KiBPageKernelsTmpfsIsNotHugetlbfsAndPopulatesWholePages) {
  const std::string shm = dir_ / "shm";
  std::filesystem::create_directories(shm);
  {
    BigPageEnv env;
    auto w = SegmentWriter::Create(shm, 0x56, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kAuto);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_FALSE((*w)->populate_data()) << "a 64 KiB-page tmpfs was taken for hugetlbfs";
    EXPECT_FALSE((*w)->huge_pages()) << "a 64 KiB system page was taken for a huge page";
  }
  {
    BigPageEnv env;
    auto w = SegmentWriter::Create(shm, 0x57, 1, 0, "desc", kData, 1, 1, &env, SegmentReserve::kWriters);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->populate_data());
    const absl::Status st = PopulateForWrite((*w)->data() + 70000, 5000, &env);
    EXPECT_TRUE(st.ok()) << st;
  }
  BigPageEnv env;
  daemon::PublishTuning writers;
  writers.reserve = SegmentReserve::kWriters;
  auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, &env, writers);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(env.populates.load(), 1);
  EXPECT_EQ(env.misaligned.load(), 0);
  EXPECT_TRUE(daemon::VerifyChecksums(r->path, 2).ok());
}

// A process that cannot start threads (pthread_create EAGAIN: RLIMIT_NPROC, or no address space for a stack, made
// here with a 2 GiB default stack under a 1 GiB address-space margin) still publishes: the fill runs on the calling
// thread and the cache drop after READY runs inline. Before, std::thread's std::system_error escaped Publish (in
// engramd's publish loop: std::terminate, the daemon gone). In a forked child: the limits stay there.
TEST_F(PublishReserveTest, APublishWhereNoThreadCanStartStillSucceeds) {
  const std::string shm = dir_ / "shm";
  std::filesystem::create_directories(shm);
  auto child = [&] {
    std::ifstream statm("/proc/self/statm");
    uint64_t vm_pages = 0;
    statm >> vm_pages;
    const rlim_t limit =
        static_cast<rlim_t>(vm_pages * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) + (uint64_t{1} << 30));
    struct rlimit rl {
      limit, limit
    };
    if (::setrlimit(RLIMIT_AS, &rl) != 0) std::_Exit(3);
    pthread_attr_t attr;
    ::pthread_attr_init(&attr);
    ::pthread_attr_setstacksize(&attr, size_t{2} << 30);
    if (::pthread_setattr_default_np(&attr) != 0) std::_Exit(4);
    pthread_t t;
    if (::pthread_create(
            &t, nullptr, [](void*) -> void* { return nullptr; }, nullptr) == 0)
      std::_Exit(5);
    ::unsetenv("ENGRAM_PUBLISH_DROP_CACHE");  // the default: dropped after READY
    auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 4);
    if (!r.ok()) std::_Exit(6);
    std::_Exit(daemon::VerifyChecksums(r->path, 4).ok() ? 0 : 7);
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
}

// ENGRAM_PUBLISH_SUB_ROWS is a diagnosis knob read from the environment: a value far beyond a job's rows is capped
// (its buffer of rows x head_dim bytes could not be allocated: std::bad_alloc out of Publish, std::terminate in
// engramd's publish loop), and the segment is the same as with the default step.
TEST_F(PublishReserveTest, AHugeSubRowsKnobIsCappedNotAnAllocationFailure) {
  const std::string shm = dir_ / "shm";
  std::filesystem::create_directories(shm);
  ::setenv("ENGRAM_PUBLISH_SUB_ROWS", "1000000000000", 1);
  absl::StatusOr<daemon::PublishResult> r = absl::UnknownError("not run");
  try {
    r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2);
  } catch (const std::exception& e) {
    r = absl::InternalError(std::string("exception out of Publish: ") + e.what());
  }
  ::unsetenv("ENGRAM_PUBLISH_SUB_ROWS");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(daemon::VerifyChecksums(r->path, 2).ok());
}

// A hugetlbfs directory this process may write, with free 2 MiB pages in the pool (shm/capacity.h ReadHugePool, the
// daemon's own reader); "" if none.
std::string HugetlbfsDir() {
  if (const char* d = std::getenv("ENGRAM_TEST_HUGETLBFS_DIR"); d != nullptr && *d != '\0') return d;
  constexpr uint64_t kHugePage = uint64_t{2} << 20;
  if (ReadHugePool(kHugePage).available_pages < 8) return "";
  std::ifstream mounts("/proc/mounts");
  for (std::string line; std::getline(mounts, line);) {
    std::istringstream f(line);
    std::string dev, mnt, type, opts;
    f >> dev >> mnt >> type >> opts;
    if (type != "hugetlbfs" || ::access(mnt.c_str(), W_OK) != 0) continue;
    struct statfs sfs {};
    if (::statfs(mnt.c_str(), &sfs) == 0 && static_cast<uint64_t>(sfs.f_bsize) == kHugePage) return mnt;
  }
  return "";
}

TEST_F(PublishReserveTest, ASegmentInHugetlbfsIsPublishedReadVerifiedAndRetired) {
  const std::string root = HugetlbfsDir();
  if (root.empty()) GTEST_SKIP() << "no writable hugetlbfs mount with free 2 MiB pages (ENGRAM_TEST_HUGETLBFS_DIR)";
  struct statfs sfs {};
  ASSERT_EQ(::statfs(root.c_str(), &sfs), 0);
  ASSERT_EQ(static_cast<unsigned long>(sfs.f_type), 0x958458f6ul) << root << " is not hugetlbfs";
  std::string tmpl = root + "/engram-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << root;
  const std::string shm = tmpl;
  struct Cleanup {
    std::string d;
    ~Cleanup() { std::filesystem::remove_all(d); }
  } cleanup{shm};
  PopulateEnv env;
  auto r = daemon::Publish(*ckpt_, *layout_, *map_, 1, 0, shm, 1, 1, 2, nullptr, &env);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes % kDataAlign, 0u);
  // On hugetlbfs the filling threads populate the data: only the header and the last page were fallocated.
  ASSERT_EQ(env.fallocates.size(), 2u);
  for (const auto& [off, len] : env.fallocates) EXPECT_LE(static_cast<uint64_t>(len), kDataAlign);
  EXPECT_EQ(std::filesystem::file_size(r->path), r->bytes);
  auto reader = SegmentReader::Open(r->path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->state(), SegmentState::kReady);
  EXPECT_TRUE(daemon::VerifyChecksums(r->path, 2).ok());
  reader->reset();
  ASSERT_TRUE(SetSegmentState(r->path, SegmentState::kRetired).ok());  // hugetlbfs has no write(2)
  auto h = ReadSegmentHeader(r->path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->state, static_cast<uint32_t>(SegmentState::kRetired));
}

}  // namespace
}  // namespace engram

namespace engram {
namespace {

// The page size a SegmentWriter sees for an 8 MiB segment in a fresh tmpfs mounted with `huge` (in a child of its
// own mount namespace: nothing is mounted for anyone else); 0 when this machine cannot mount one (no privilege).
uint64_t WriterPageOnTmpfs(const std::string& huge) {
  int fds[2];
  if (::pipe(fds) != 0) return 0;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    uint64_t page = 0;
    testing::TempDir dir;
    if (::unshare(CLONE_NEWNS) == 0 && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
        ::mount("tmpfs", dir.path().c_str(), "tmpfs", 0, ("size=64m,huge=" + huge).c_str()) == 0) {
      auto w = SegmentWriter::Create(dir.path(), 0x57, 1, 0, "desc", uint64_t{8} << 20, 1, 1);
      page = w.ok() ? (*w)->page_bytes() : 1;
      w = absl::InternalError("released");
      ::umount(dir.path().c_str());
    }
    (void)!::write(fds[1], &page, sizeof page);
    std::_Exit(0);
  }
  ::close(fds[1]);
  uint64_t page = 0;
  if (::read(fds[0], &page, sizeof page) != sizeof page) page = 0;
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return page;
}

// A huge=within_size tmpfs (the shipped mount) gives a segment huge pages once the file is sized: the writer must
// see them (and take the huge-page publish path), as on huge=always. Skipped where this machine cannot mount a
// tmpfs, or gives shmem no huge pages at all.
TEST(SegmentPages, AWithinSizeTmpfsIsSeenAsHugePages) {
  const uint64_t always = WriterPageOnTmpfs("always");
  if (always == 0) GTEST_SKIP() << "cannot mount a tmpfs in a private mount namespace here";
  if (always <= 4096) GTEST_SKIP() << "this kernel gives tmpfs no huge pages (huge=always: " << always << ")";
  EXPECT_EQ(WriterPageOnTmpfs("within_size"), always);
  EXPECT_EQ(WriterPageOnTmpfs("never"), 4096u);
}

}  // namespace
}  // namespace engram
