// Capacity probe of a shared-memory directory: what the daemon checks before it creates any segment, and what
// `engramctl plan` and `status` show. Reads statvfs (total/free bytes), the mount's filesystem type and `huge=`
// policy from /proc/self/mountinfo, the hugetlb pool (/proc/meminfo) and RLIMIT_MEMLOCK; statvfs goes through the
// Env (shm/env.h), so tests can make a mount look full.
//
// Pure function of the system state; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "shm/env.h"

namespace engram {

struct ShmCapacity {
  std::string path;
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
  std::string fs_type;      // "tmpfs", "hugetlbfs", ... ("" when unknown)
  std::string huge_pages;   // tmpfs huge= option ("never" when absent), or "hugetlbfs"
  uint64_t hugetlb_free_bytes = 0;
  uint64_t memlock_limit = 0;  // RLIMIT_MEMLOCK soft limit, UINT64_MAX when unlimited
  uint64_t device = 0;         // st_dev of the directory: replicas compare it with their own view
  uint64_t inode = 0;
};

// NotFound when the directory does not exist (reason SHM_MISSING upstream).
absl::StatusOr<ShmCapacity> ProbeShm(const std::string& dir, Env* env = Env::Default());

}  // namespace engram
