#include "shm/capacity.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "model/file_util.h"

namespace engram {
namespace {

// The mountinfo entry whose mount point is the longest prefix of `dir` (dir must be canonical).
void ReadMountInfo(const std::string& dir, ShmCapacity& out, Env* env) {
  std::string text;
  if (env->ReadSmallFile("/proc/self/mountinfo", size_t{16} << 20, &text) != 0) return;
  std::istringstream in(text);
  std::string line;
  size_t best = 0;
  while (std::getline(in, line)) {
    // id parent major:minor root mount-point options ... - fstype source super-options
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() < 10) continue;
    const std::string& mp = f[4];
    if (!(dir == mp || (dir.rfind(mp, 0) == 0 && (mp == "/" || dir[mp.size()] == '/')))) continue;
    if (mp.size() < best) continue;
    size_t dash = 6;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash + 3 >= f.size()) continue;  // need fstype, source and super options after "-"
    best = mp.size();
    out.fs_type = f[dash + 1];
    out.huge_pages = out.fs_type == "hugetlbfs" ? "hugetlbfs" : "never";
    for (absl::string_view o : absl::StrSplit(f[dash + 3], ',')) {
      if (absl::StartsWith(o, "huge=")) out.huge_pages = std::string(o.substr(5));
    }
  }
}

std::string Meminfo(Env* env) {
  std::string text;
  return env->ReadSmallFile("/proc/meminfo", 1 << 20, &text) == 0 ? text : std::string();
}

uint64_t HugetlbFreeBytes(Env* env) {
  const std::string text = Meminfo(env);
  return MeminfoValue(text, "HugePages_Free").value_or(0) * MeminfoValue(text, "Hugepagesize").value_or(0) * 1024;
}

uint64_t ReadCount(Env* env, const std::string& path) {
  std::string text;
  uint64_t v = 0;
  if (env->ReadSmallFile(path.c_str(), 4096, &text) != 0) return 0;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) ? v : 0;
}

}  // namespace

NodeMemory ReadNodeMemory(Env* env) {
  const std::string text = Meminfo(env);
  return {MeminfoValue(text, "MemTotal").value_or(0) * 1024, MeminfoValue(text, "MemAvailable").value_or(0) * 1024};
}

bool SegmentsOnHugePages(const ShmCapacity& c) {
  return c.fs_type == "hugetlbfs" || c.huge_pages == "always" || c.huge_pages == "within_size";
}

std::optional<std::string> ShmPagesWarning(const ShmCapacity& c, uint64_t table_bytes) {
  if (c.fs_type != "tmpfs" && c.fs_type != "hugetlbfs") {
    return absl::StrCat(c.path, " is on ", c.fs_type.empty() ? "an unknown file system" : c.fs_type,
                        ", not in memory (tmpfs or hugetlbfs): the segments' pages are file pages the kernel may write "
                        "back and evict; give engramd a tmpfs (systemd/var-lib-engram-shm.mount)");
  }
  if (SegmentsOnHugePages(c) || table_bytes <= kSmallPagesWarnBytes) return std::nullopt;
  const double gib = static_cast<double>(table_bytes) / 1073741824.0;
  return absl::StrFormat(
      "%s is to hold %.1f GiB of segments on 4 KiB pages (tmpfs huge=%s): each replica's attach costs about 75 ms "
      "per GiB of its TP shard (7 s for a 94 GiB shard) against about 31 ms on huge pages, and a publish is about "
      "4x slower; mount a tmpfs with huge=always (systemd/var-lib-engram-shm.mount) and point shm_dir at it",
      c.path, gib, c.huge_pages.empty() ? "never" : c.huge_pages);
}

uint64_t MappingOverheadBytes(uint64_t bytes, bool huge_pages) {
  const uint64_t page = huge_pages ? uint64_t{2} << 20 : 4096;
  return (bytes + page - 1) / page * 16;
}

HugePool ReadHugePool(uint64_t page_bytes, Env* env) {
  HugePool p;
  p.page_bytes = page_bytes;
  const std::string dir = absl::StrCat("/sys/kernel/mm/hugepages/hugepages-", page_bytes / 1024, "kB/");
  p.total_pages = ReadCount(env, dir + "nr_hugepages");
  const uint64_t free_pages = ReadCount(env, dir + "free_hugepages"), reserved = ReadCount(env, dir + "resv_hugepages");
  p.available_pages = free_pages > reserved ? free_pages - reserved : 0;
  return p;
}

void ApplyHugetlbfsLimits(uint64_t vfs_blocks, uint64_t vfs_bavail, const HugePool& pool, ShmCapacity& c) {
  const uint64_t pool_free = pool.available_pages * pool.page_bytes;
  // No size= on the mount: the pool is the limit. The kernel reports 0 blocks without a subpool, and 2^64-1 (its
  // -1, "no maximum") where min_size= alone made one; a count whose bytes do not fit in 64 bits is no limit either.
  if (vfs_blocks == 0 || pool.page_bytes == 0 || vfs_blocks > UINT64_MAX / pool.page_bytes) {
    c.total_bytes = pool.total_pages * pool.page_bytes;
    c.free_bytes = pool_free;
    return;
  }
  c.total_bytes = vfs_blocks * pool.page_bytes;
  c.free_bytes = std::min(vfs_bavail * pool.page_bytes, pool_free);
}

absl::StatusOr<ShmCapacity> ProbeShm(const std::string& dir, Env* env) {
  ShmCapacity c;
  std::string real;
  if (env->Realpath(dir.c_str(), &real) != 0) {
    return absl::NotFoundError(absl::StrCat(dir, ": shared-memory directory does not exist"));
  }
  c.path = real;
  struct stat st {};
  if (env->Stat(real.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  }
  c.device = st.st_dev;
  c.inode = st.st_ino;
  struct statvfs vfs {};
  if (RetryEintr([&] { return env->Statvfs(real.c_str(), &vfs); }) != 0) {
    return absl::InternalError(absl::StrCat(dir, ": statvfs failed: ", std::strerror(errno)));
  }
  c.total_bytes = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  c.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  ReadMountInfo(c.path, c, env);
  c.hugetlb_free_bytes = HugetlbFreeBytes(env);
  if (c.fs_type == "hugetlbfs") {
    // statvfs counts in the mount's huge pages (f_bsize is the page size) and says nothing without size=.
    ApplyHugetlbfsLimits(static_cast<uint64_t>(vfs.f_blocks), static_cast<uint64_t>(vfs.f_bavail),
                         ReadHugePool(static_cast<uint64_t>(vfs.f_bsize), env), c);
  }
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    c.memlock_limit = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(rl.rlim_cur);
  }
  return c;
}

}  // namespace engram
