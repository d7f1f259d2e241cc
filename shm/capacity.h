// Capacity probe of a shared-memory directory: what the daemon checks before it creates any segment, and what
// `engramctl plan` and `status` show. Reads statvfs (total/free bytes), the mount's filesystem type and `huge=`
// policy from /proc/self/mountinfo, the hugetlb pool (/proc/meminfo, its sysfs counts) and RLIMIT_MEMLOCK. Every
// read (realpath, stat, statvfs, the /proc and /sys files) goes through the Env (shm/env.h), so tests can make a
// mount look full, another file system, or on huge pages.
//
// On hugetlbfs the room is the mount's size= limit capped by its page size's free pool (without size= the kernel
// reports no blocks at all, and the pool is the whole answer). Pure function of the system state; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "shm/env.h"

namespace engram {

struct ShmCapacity {
  std::string path;
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
  std::string fs_type;     // "tmpfs", "hugetlbfs", ... ("" when unknown)
  std::string huge_pages;  // tmpfs huge= option ("never" when absent), or "hugetlbfs"
  uint64_t hugetlb_free_bytes = 0;
  uint64_t memlock_limit = 0;  // RLIMIT_MEMLOCK soft limit, UINT64_MAX when unlimited
  uint64_t device = 0;         // st_dev of the directory: replicas compare it with their own view
  uint64_t inode = 0;
};

// The node's memory (/proc/meminfo MemTotal and MemAvailable; zeros when unreadable).
struct NodeMemory {
  uint64_t total_bytes = 0;
  uint64_t available_bytes = 0;
};
NodeMemory ReadNodeMemory(Env* env = Env::Default());

// Whether segments published in a directory with these properties sit on huge pages: hugetlbfs, or a tmpfs whose
// huge= option gives them (always, within_size; not advise: the segment's space is reserved before any mapping
// advises it, and measured so it stays on 4 KiB pages).
bool SegmentsOnHugePages(const ShmCapacity& c);

// What one replica process holds, besides the shared pages, to map and register `bytes` of a segment: its page
// tables and the driver's list of the pinned pages, 8 bytes per page each (4 KiB pages: 4 MiB per GiB; 2 MiB pages:
// 8 KiB per GiB).
uint64_t MappingOverheadBytes(uint64_t bytes, bool huge_pages);

// What engramd warns about at start for a shm directory holding `table_bytes` of segments, or nothing: a directory
// that is not in memory (neither tmpfs nor hugetlbfs), or segments of more than kSmallPagesWarnBytes on 4 KiB pages,
// with the cost measured on an H200 host at 94 GiB (bench/RESULTS.md "Full scale").
inline constexpr uint64_t kSmallPagesWarnBytes = uint64_t{4} << 30;
std::optional<std::string> ShmPagesWarning(const ShmCapacity& c, uint64_t table_bytes);

// NotFound when the directory does not exist (reason SHM_MISSING upstream).
absl::StatusOr<ShmCapacity> ProbeShm(const std::string& dir, Env* env = Env::Default());

// The hugetlb pool of one page size (/sys/kernel/mm/hugepages/hugepages-<kB>kB): pages the kernel holds, pages
// neither in use nor promised to a mapping (free - reserved).
struct HugePool {
  uint64_t page_bytes = 0;
  uint64_t total_pages = 0;
  uint64_t available_pages = 0;
};
HugePool ReadHugePool(uint64_t page_bytes, Env* env = Env::Default());

// What a hugetlbfs mount can hold: its size= limit when it has one (statvfs blocks, in huge pages), never more
// than the pool can still back; without size= the kernel reports 0 blocks and the pool alone is the limit.
// Sets total_bytes and free_bytes.
void ApplyHugetlbfsLimits(uint64_t vfs_blocks, uint64_t vfs_bavail, const HugePool& pool, ShmCapacity& c);

}  // namespace engram
