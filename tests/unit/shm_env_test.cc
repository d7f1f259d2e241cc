// The OS seam of shm/ (shm/env.h) and the segment file format (shm/segment.h), without root and without filling a
// real filesystem: a fault-injecting Env makes fallocate fail after the capacity probe passed, interrupts calls with
// EINTR, and shrinks what statvfs reports; headers are written, read back and refused when they lie.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "model/file_util.h"
#include "shm/capacity.h"
#include "shm/env.h"
#include "shm/segment.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using testing::TempDir;

// Fails chosen calls the way the kernel would.
class FaultEnv : public PosixEnv {
 public:
  int fallocate_error = 0;  // returned by PosixFallocate (e.g. ENOSPC)
  int eintr_budget = 0;     // the next N Open/Pread/PosixFallocate calls fail with EINTR first
  uint64_t statvfs_free_blocks = UINT64_MAX;
  int mlock_errno = 0;
  std::atomic<int> opens{0};

  int Open(const char* path, int flags, mode_t mode) override {
    ++opens;
    if (TakeEintr()) return -1;
    return PosixEnv::Open(path, flags, mode);
  }
  ssize_t Pread(int fd, void* buf, size_t n, off_t off) override {
    if (TakeEintr()) return -1;
    return PosixEnv::Pread(fd, buf, n, off);
  }
  int PosixFallocate(int fd, off_t off, off_t len) override {
    if (eintr_budget > 0) {
      --eintr_budget;
      return EINTR;
    }
    if (fallocate_error != 0) return fallocate_error;
    return PosixEnv::PosixFallocate(fd, off, len);
  }
  int Statvfs(const char* path, struct statvfs* out) override {
    const int r = PosixEnv::Statvfs(path, out);
    if (r == 0 && statvfs_free_blocks != UINT64_MAX) out->f_bavail = out->f_bfree = statvfs_free_blocks;
    return r;
  }
  int Mlock(const void* addr, size_t len) override {
    if (mlock_errno != 0) {
      errno = mlock_errno;
      return -1;
    }
    return PosixEnv::Mlock(addr, len);
  }

 private:
  bool TakeEintr() {
    if (eintr_budget <= 0) return false;
    --eintr_budget;
    errno = EINTR;
    return true;
  }
};

std::unique_ptr<SegmentWriter> MustCreate(const std::string& dir, uint64_t fp, Env* env, uint64_t data_bytes = 4096) {
  auto w = SegmentWriter::Create(dir, fp, 1, 0, "descriptor-bytes", data_bytes, 7, 3, env);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

TEST(ShmEnvTest, FallocateFailingAfterTheProbePassedIsResourceExhaustedAndLeavesNoFile) {
  TempDir dir;
  FaultEnv env;
  auto cap = ProbeShm(dir.path(), &env);
  ASSERT_TRUE(cap.ok()) << cap.status();
  ASSERT_GT(cap->free_bytes, uint64_t{1} << 20);  // the probe says there is room
  env.fallocate_error = ENOSPC;                   // and then there is not
  auto w = SegmentWriter::Create(dir.path(), 0xabc, 1, 0, "d", 1 << 20, 1, 1, &env);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kResourceExhausted) << w.status();
  EXPECT_NE(w.status().message().find("reserve"), std::string::npos) << w.status();
  EXPECT_TRUE(ListSegments(dir.path()).empty()) << "a failed reservation must not leave a file behind";
}

TEST(ShmEnvTest, EintrIsRetriedEverywhere) {
  TempDir dir;
  FaultEnv env;
  env.eintr_budget = 2;  // the create's open, then its fallocate
  auto w = MustCreate(dir.path(), 0x1234, &env);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(env.eintr_budget, 0);
  ASSERT_TRUE(w->Finish(0.5).ok());
  env.eintr_budget = 2;  // the header read's open and pread
  auto h = ReadSegmentHeader(w->path(), &env);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->fingerprint, 0x1234u);
  EXPECT_EQ(env.eintr_budget, 0);
}

// The /proc and /sys files the probe reads come through the Env: a made-up mountinfo, meminfo and hugetlb pool.
class ProcEnv : public PosixEnv {
 public:
  std::map<std::string, std::string> files;  // path -> text; other paths: the real file
  std::string real_dir;                      // what Realpath answers; "" = ENOENT
  int ReadSmallFile(const char* path, size_t max_bytes, std::string* out) override {
    auto it = files.find(path);
    if (it == files.end()) return PosixEnv::ReadSmallFile(path, max_bytes, out);
    *out = it->second;
    return 0;
  }
  int Realpath(const char* path, std::string* out) override {
    if (real_dir.empty()) {
      errno = ENOENT;
      return -1;
    }
    (void)path;
    *out = real_dir;
    return 0;
  }
};

TEST(ShmEnvTest, TheProcAndSysFilesOfTheProbeComeThroughTheEnv) {
  TempDir dir;
  ProcEnv env;
  env.real_dir = dir.path();
  env.files["/proc/self/mountinfo"] =
      "22 1 0:5 / / rw - ext4 /dev/sda1 rw\n"
      "40 22 0:40 / " +
      dir.path() + " rw,nosuid - tmpfs tmpfs rw,size=1024k,huge=within_size\n";
  env.files["/proc/meminfo"] =
      "MemTotal:       1000 kB\nMemAvailable:    600 kB\nHugePages_Free:      3\nHugepagesize:    2048 kB\n";
  auto cap = ProbeShm(dir.path(), &env);
  ASSERT_TRUE(cap.ok()) << cap.status();
  EXPECT_EQ(cap->fs_type, "tmpfs");
  EXPECT_EQ(cap->huge_pages, "within_size");
  EXPECT_EQ(cap->hugetlb_free_bytes, uint64_t{3} * 2048 * 1024);
  const NodeMemory m = ReadNodeMemory(&env);
  EXPECT_EQ(m.total_bytes, 1000u * 1024);
  EXPECT_EQ(m.available_bytes, 600u * 1024);
  const std::string pool = "/sys/kernel/mm/hugepages/hugepages-2048kB/";
  env.files[pool + "nr_hugepages"] = "10\n";
  env.files[pool + "free_hugepages"] = "7\n";
  env.files[pool + "resv_hugepages"] = "2\n";
  const HugePool p = ReadHugePool(2048 * 1024, &env);
  EXPECT_EQ(p.total_pages, 10u);
  EXPECT_EQ(p.available_pages, 5u);
  env.files[pool + "free_hugepages"] = "lots\n";  // unreadable counts are 0, never garbage
  EXPECT_EQ(ReadHugePool(2048 * 1024, &env).available_pages, 0u);
  env.files["/proc/meminfo"] = "MemTotal: x kB\n";
  EXPECT_EQ(ReadNodeMemory(&env).total_bytes, 0u);
  env.real_dir.clear();  // realpath fails: the directory does not exist
  EXPECT_EQ(ProbeShm(dir.path(), &env).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmEnvTest, ReadSmallFileReadsProcFilesToTheirEndAndIsBounded) {
  PosixEnv env;
  std::string text;
  ASSERT_EQ(env.ReadSmallFile("/proc/self/status", 1 << 20, &text), 0);  // stat says 0 bytes; the text is longer
  EXPECT_NE(text.find("Pid:"), std::string::npos);
  EXPECT_EQ(env.ReadSmallFile("/proc/self/status", 8, &text), -1);
  EXPECT_EQ(errno, EFBIG);
  EXPECT_EQ(env.ReadSmallFile("/nonexistent/file", 8, &text), -1);
  EXPECT_EQ(errno, ENOENT);
}

TEST(ShmEnvTest, MeminfoValuesParseOrAreAbsent) {
  const std::string t = "MemTotal:  16 kB\nHugePages_Free:\t4\nBad: kB\nHuge: 99999999999999999999999 kB\n";
  EXPECT_EQ(MeminfoValue(t, "MemTotal"), std::optional<uint64_t>(16));
  EXPECT_EQ(MeminfoValue(t, "HugePages_Free"), std::optional<uint64_t>(4));
  EXPECT_EQ(MeminfoValue(t, "Bad"), std::nullopt);
  EXPECT_EQ(MeminfoValue(t, "Huge"), std::nullopt);
  EXPECT_EQ(MeminfoValue(t, "Total"), std::nullopt);  // a key, not a suffix of one
  EXPECT_EQ(MeminfoValue("", "MemTotal"), std::nullopt);
  EXPECT_EQ(AvailableMemoryBytes("MemAvailable: 2 kB\n", "", "/nonexistent"), 2048u);
  EXPECT_EQ(AvailableMemoryBytes("", "", "/nonexistent"), ~uint64_t{0});
}

TEST(ShmEnvTest, StatvfsThroughTheEnvMakesAMountLookFull) {
  TempDir dir;
  FaultEnv env;
  env.statvfs_free_blocks = 3;
  auto cap = ProbeShm(dir.path(), &env);
  ASSERT_TRUE(cap.ok());
  struct statvfs real {};
  ASSERT_EQ(::statvfs(dir.path().c_str(), &real), 0);
  EXPECT_EQ(cap->free_bytes, 3 * real.f_frsize);
  EXPECT_FALSE(ProbeShm(dir / "missing", &env).ok());
}

TEST(SegmentHeaderTest, RoundTripsEveryField) {
  TempDir dir;
  auto w = MustCreate(dir.path(), 0xfeedface, Env::Default(), 3 * 4096);
  ASSERT_NE(w, nullptr);
  const std::string path = w->path();
  EXPECT_EQ(ReadSegmentHeader(path)->state, static_cast<uint32_t>(SegmentState::kCreating));
  w->SetLoading();
  EXPECT_EQ(ReadSegmentHeader(path)->state, static_cast<uint32_t>(SegmentState::kLoading));
  std::memset(w->data(), 0x5a, w->data_bytes());
  ASSERT_TRUE(w->Finish(1.25).ok());
  auto h = ReadSegmentHeader(path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(std::memcmp(h->magic, kSegmentMagic, 8), 0);
  EXPECT_EQ(h->version, kSegmentVersion);
  EXPECT_EQ(h->state, static_cast<uint32_t>(SegmentState::kReady));
  EXPECT_EQ(h->instance_id, 7u);
  EXPECT_EQ(h->epoch, 3u);
  EXPECT_EQ(h->fingerprint, 0xfeedfaceu);
  EXPECT_EQ(h->tp_size, 1u);
  EXPECT_EQ(h->tp_rank, 0u);
  EXPECT_EQ(h->desc_offset, kHeaderBytes);
  EXPECT_EQ(h->desc_bytes, std::strlen("descriptor-bytes"));
  EXPECT_EQ(h->data_offset % kDataAlign, 0u);
  EXPECT_EQ(h->data_bytes, 3u * 4096);
  EXPECT_EQ(h->total_bytes % kDataAlign, 0u);  // whole 2 MiB pages: the records, then less than a page of padding
  EXPECT_LT(h->total_bytes - (h->data_offset + h->data_bytes), kDataAlign);
  EXPECT_EQ(h->total_bytes, std::filesystem::file_size(path));
  EXPECT_DOUBLE_EQ(h->load_seconds, 1.25);
  EXPECT_GE(h->ready_unix_ms, h->created_unix_ms);
  auto r = SegmentReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->descriptor_bytes(), "descriptor-bytes");
  EXPECT_EQ((*r)->data()[0], 0x5a);
  EXPECT_EQ((*r)->data()[3 * 4096 - 1], 0x5a);
  ASSERT_TRUE(SetSegmentState(path, SegmentState::kRetired).ok());
  EXPECT_EQ((*r)->state(), SegmentState::kRetired) << "the state is shared through the mapping";
}

TEST(SegmentHeaderTest, RefusesTruncatedForeignAndLyingFiles) {
  TempDir dir;
  auto w = MustCreate(dir.path(), 0x77, Env::Default());
  ASSERT_TRUE(w->Finish(0).ok());
  const std::string good = w->path();
  const std::string bytes = testing::ReadFile(good);

  testing::WriteFile(dir / "short", bytes.substr(0, 100));
  EXPECT_EQ(ReadSegmentHeader(dir / "short").status().code(), absl::StatusCode::kDataLoss);

  std::string foreign = bytes;
  foreign[0] = 'X';
  testing::WriteFile(dir / "foreign", foreign);
  EXPECT_EQ(ReadSegmentHeader(dir / "foreign").status().code(), absl::StatusCode::kDataLoss);

  std::string version = bytes;
  version[8] = 99;
  testing::WriteFile(dir / "version", version);
  EXPECT_EQ(ReadSegmentHeader(dir / "version").status().code(), absl::StatusCode::kFailedPrecondition);

  testing::WriteFile(dir / "truncated", bytes.substr(0, bytes.size() - 4096));  // header says more than the file
  EXPECT_EQ(ReadSegmentHeader(dir / "truncated").status().code(), absl::StatusCode::kDataLoss);

  std::string desc = bytes;
  desc[kHeaderBytes] ^= 1;  // the descriptor no longer matches its checksum
  testing::WriteFile(dir / "desc", desc);
  EXPECT_TRUE(ReadSegmentHeader(dir / "desc").ok());
  EXPECT_EQ(SegmentReader::Open(dir / "desc").status().code(), absl::StatusCode::kDataLoss);
}

// Header sizes that only a wrapping sum would accept: a desc_bytes near 2^64 (desc_offset + desc_bytes wraps to a
// small number), a descriptor running into the records, records not on a 2 MiB page. Each is DataLoss from the
// header reader and from SegmentReader (which otherwise hashed desc_bytes bytes past its mapping: SIGSEGV).
TEST(SegmentHeaderTest, SizesThatWrapOrOverlapAreRefusedBeforeAnythingIsRead) {
  TempDir dir;
  auto w = MustCreate(dir.path(), 0x78, Env::Default());
  ASSERT_TRUE(w->Finish(0).ok());
  const std::string bytes = testing::ReadFile(w->path());
  auto with = [&](const std::string& name, size_t field, uint64_t v) {
    std::string b = bytes;
    std::memcpy(b.data() + field, &v, 8);
    testing::WriteFile(dir / name, b);
    return dir / name;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"wrapping desc_bytes", with("wrap", offsetof(SegmentHeader, desc_bytes), ~uint64_t{0} - kHeaderBytes + 1)},
      {"desc_bytes into the records",
       with("overlap", offsetof(SegmentHeader, desc_bytes), SegmentDataOffset(0) - kHeaderBytes + 1)},
      {"unaligned data_offset", with("unaligned", offsetof(SegmentHeader, data_offset), kHeaderBytes + 64)},
  };
  for (const auto& [what, path] : cases) {
    EXPECT_EQ(ReadSegmentHeader(path).status().code(), absl::StatusCode::kDataLoss) << what;
    auto r = SegmentReader::Open(path);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << what << ": " << r.status();
  }
}

// The header SegmentReader validated (read with pread) and the one in its mapping must be the same: here the file's
// desc_bytes is rewritten between the two (an Env whose Mmap writes first). A reader that used the mapping's sizes
// unchecked would hash a near-2^64 descriptor past its mapping.
class RewriteBeforeMapEnv : public PosixEnv {
 public:
  uint64_t desc_bytes = 0;
  void* Mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) override {
    const int w = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (w >= 0) {
      (void)!::pwrite(w, &desc_bytes, 8, offsetof(SegmentHeader, desc_bytes));
      ::close(w);
    }
    return PosixEnv::Mmap(addr, len, prot, flags, fd, offset);
  }
  std::string path;
};

TEST(SegmentHeaderTest, AHeaderRewrittenBetweenValidationAndMappingIsRefused) {
  TempDir dir;
  auto w = MustCreate(dir.path(), 0x79, Env::Default());
  ASSERT_TRUE(w->Finish(0).ok());
  RewriteBeforeMapEnv env;
  env.path = w->path();
  env.desc_bytes = ~uint64_t{0} - kHeaderBytes + 1;
  auto r = SegmentReader::Open(w->path(), &env);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
}

TEST(SegmentHeaderTest, SymlinksAndFifosAreRefusedWithoutHanging) {
  TempDir dir;
  auto w = MustCreate(dir.path(), 0x88, Env::Default());
  ASSERT_TRUE(w->Finish(0).ok());
  ASSERT_EQ(::symlink(w->path().c_str(), (dir / "link").c_str()), 0);
  EXPECT_FALSE(ReadSegmentHeader(dir / "link").ok());
  EXPECT_FALSE(SegmentReader::Open(dir / "link").ok());
  EXPECT_FALSE(SetSegmentState(dir / "link", SegmentState::kRetired).ok());
  EXPECT_EQ(ReadSegmentHeader(w->path())->state, static_cast<uint32_t>(SegmentState::kReady))
      << "a state write through a symlink must not reach the target";
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  EXPECT_FALSE(ReadSegmentHeader(dir / "fifo").ok());  // returns: O_NONBLOCK, then not a regular file
  EXPECT_FALSE(SetSegmentState(dir / "fifo", SegmentState::kRetired).ok());
}

TEST(SegmentHeaderTest, OnlyTheDaemonsOwnFilesAreAdoptable) {
  TempDir dir;
  auto w = MustCreate(dir.path(), 0x99, Env::Default());
  ASSERT_TRUE(w->Finish(0).ok());
  const std::string path = w->path();
  EXPECT_TRUE(ReadOwnedSegmentHeader(path, ::geteuid()).ok());
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);  // writable by others: anyone could rewrite its rows
  auto h = ReadOwnedSegmentHeader(path, ::geteuid());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kPermissionDenied) << h.status();
  EXPECT_TRUE(ReadSegmentHeader(path).ok()) << "the plain reader (status, tools) still reads it";
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  EXPECT_EQ(ReadOwnedSegmentHeader(path, ::geteuid() + 1).status().code(), absl::StatusCode::kPermissionDenied)
      << "a file owned by another uid is not ours";
}

TEST(SegmentNameTest, ParsesOnlyWhatItWrites) {
  uint64_t fp;
  int64_t n, r;
  EXPECT_TRUE(ParseSegmentName(SegmentName(0x0123456789abcdef, 4, 3), &fp, &n, &r));
  EXPECT_EQ(fp, 0x0123456789abcdefu);
  EXPECT_EQ(n, 4);
  EXPECT_EQ(r, 3);
  for (const char* bad : {"engram-0123456789abcdef-tp4of4", "engram-123-tp0of1", "engram-0123456789abcdef-tp0of1x",
                          "other-0123456789abcdef-tp0of1", "engram-0123456789ABCDEF-tp0of1", ""}) {
    EXPECT_FALSE(ParseSegmentName(bad, &fp, &n, &r)) << bad;
  }
}

// hugetlbfs without size= reports 0 blocks: the pool is the room (the daemon refused every publish as SHM_TOO_SMALL
// there); with size= the limit is the smaller of the mount's free blocks and what the pool can still back.
TEST(ShmCapacityTest, HugetlbfsRoomIsTheSizeLimitCappedByThePool) {
  const uint64_t mib2 = uint64_t{2} << 20;
  HugePool pool{mib2, 100, 40};
  ShmCapacity c;
  ApplyHugetlbfsLimits(0, 0, pool, c);  // no size=
  EXPECT_EQ(c.total_bytes, 100 * mib2);
  EXPECT_EQ(c.free_bytes, 40 * mib2);
  ApplyHugetlbfsLimits(64, 60, pool, c);  // size=128M worth of pages, 60 free, but the pool has 40
  EXPECT_EQ(c.total_bytes, 64 * mib2);
  EXPECT_EQ(c.free_bytes, 40 * mib2);
  ApplyHugetlbfsLimits(16, 10, pool, c);  // a small size= is the limit
  EXPECT_EQ(c.free_bytes, 10 * mib2);
  ApplyHugetlbfsLimits(0, 0, HugePool{mib2, 0, 0}, c);  // no pool at all: no room
  EXPECT_EQ(c.free_bytes, 0u);
}

// A hugetlbfs mount with min_size= and no size= has a subpool whose maximum is -1: statvfs reports 2^64-1 blocks and
// 2^64-1-used free ones. That is no limit (the pool is), not 2^64-1 pages times 2 MiB wrapped to a near-2^64 total.
TEST(ShmCapacityTest, HugetlbfsMinSizeWithoutSizeIsThePoolNotAWrappedProduct) {
  const uint64_t mib2 = uint64_t{2} << 20;
  HugePool pool{mib2, 100, 40};
  ShmCapacity c;
  ApplyHugetlbfsLimits(~uint64_t{0}, ~uint64_t{0} - 3, pool, c);
  EXPECT_EQ(c.total_bytes, 100 * mib2);
  EXPECT_EQ(c.free_bytes, 40 * mib2);
}

// The pool of the default huge page size agrees with /proc/meminfo's HugePages_Total (a second reader).
TEST(ShmCapacityTest, HugePoolOfTheDefaultSizeMatchesMeminfo) {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t total = 0, page_kb = 0;
  while (in >> key) {
    uint64_t v = 0;
    in >> v;
    if (key == "HugePages_Total:") total = v;
    if (key == "Hugepagesize:") page_kb = v;
    in.ignore(256, '\n');
  }
  if (page_kb == 0) GTEST_SKIP() << "no huge pages in /proc/meminfo";
  const HugePool p = ReadHugePool(page_kb * 1024);
  EXPECT_EQ(p.page_bytes, page_kb * 1024);
  EXPECT_EQ(p.total_pages, total);
  EXPECT_LE(p.available_pages, p.total_pages);
}

// MadviseInSlices: the slices tile [p, p + bytes) exactly, each starts a whole 2 MiB past p, at most one per GiB and
// per thread; a failing slice's errno is returned. The recording Env never touches memory (p is never dereferenced).
class SliceEnv : public PosixEnv {
 public:
  int Madvise(void* addr, size_t len, int advice) override {
    std::lock_guard<std::mutex> lock(mu);
    calls.push_back({reinterpret_cast<uintptr_t>(addr), len});
    EXPECT_EQ(advice, MADV_DONTNEED);
    if (fail_at != 0 && reinterpret_cast<uintptr_t>(addr) == fail_at) {
      errno = ENOMEM;
      return -1;
    }
    return 0;
  }
  std::mutex mu;
  std::vector<std::pair<uintptr_t, size_t>> calls;
  uintptr_t fail_at = 0;
};

TEST(MadviseInSlices, SlicesTileTheRangeOnWhole2MiBAndFailuresAreReported) {
  auto* const p = reinterpret_cast<uint8_t*>(uintptr_t{1} << 44);
  const uint64_t GiB = uint64_t{1} << 30;
  for (uint64_t bytes : {uint64_t{1}, uint64_t{10} << 20, 3 * GiB + 12345, 94 * GiB + 4096, 100 * GiB}) {
    for (int threads : {1, 4, 16}) {
      SliceEnv env;
      ASSERT_EQ(MadviseInSlices(&env, p, bytes, MADV_DONTNEED, threads), 0);
      std::sort(env.calls.begin(), env.calls.end());
      const uint64_t most = std::max<uint64_t>(1, std::min<uint64_t>(bytes / GiB, static_cast<uint64_t>(threads)));
      EXPECT_LE(env.calls.size(), most) << bytes << " bytes, " << threads << " threads";
      uint64_t at = 0;
      for (const auto& [addr, len] : env.calls) {
        const uint64_t off = addr - reinterpret_cast<uintptr_t>(p);
        EXPECT_EQ(off, at) << "no gap, no overlap";
        EXPECT_EQ(off % (uint64_t{2} << 20), 0u);
        at = off + len;
      }
      EXPECT_EQ(at, bytes) << "the whole range";
    }
  }
  SliceEnv failing;
  failing.fail_at = reinterpret_cast<uintptr_t>(p) + 0;  // the first slice
  EXPECT_EQ(MadviseInSlices(&failing, p, 8 * GiB, MADV_DONTNEED, 4), ENOMEM);
  EXPECT_EQ(failing.calls.size(), 4u) << "the other slices still run";
}

}  // namespace
}  // namespace engram
