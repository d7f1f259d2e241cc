#include "client/dp/host_transport.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/log.h"

namespace engram::client {
namespace {

constexpr uint64_t kMagic = 0x31505044'4d475245ull;  // "ERGMDPP1"
constexpr size_t kReasonBytes = 512;

struct Header {
  uint64_t magic;
  DpRegionShape shape;
  std::atomic<uint32_t> ready;
  std::atomic<uint32_t> aborted;
  char reason[kReasonBytes];
  DpMemberSlot members[kMaxDpMembers];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the region's atomics are shared between processes");

size_t AlignUp(size_t x) { return (x + 4095) & ~size_t{4095}; }

Header* HeaderOf(uint8_t* base) { return reinterpret_cast<Header*>(base); }

}  // namespace

absl::StatusOr<std::unique_ptr<DpHostRegion>> DpHostRegion::Reserve() {
  // Only a name: nothing is created before the group formed, so a rank 0 that dies while the group forms leaves
  // nothing behind. 64 random bits and the pid; Init creates it with O_EXCL.
  std::unique_ptr<DpHostRegion> r(new DpHostRegion());
  std::random_device rd;
  r->name_ = absl::StrFormat("%s%d-%08x%08x", kDpRegionPrefix, ::getpid(), rd(), rd());
  r->unlinked_ = true;  // nothing to unlink yet
  return r;
}

bool DpHostRegion::IsRegionName(const std::string& name) { return IsDpRegionName(name); }

void DpHostRegion::RemoveName(const std::string& name) {
  if (IsRegionName(name)) ::shm_unlink(name.c_str());
}

absl::Status DpHostRegion::Map(size_t bytes, bool create) {
  if (create && ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size the DP exchange region to ", bytes, " bytes: ", std::strerror(errno)));
  }
  // Reserved, not sparse: where /dev/shm cannot hold it (a container's 64 MiB default) this is an error here, not
  // a SIGBUS in every member at its first step.
  if (create) {
    const int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
      return absl::ResourceExhaustedError(
          absl::StrCat("/dev/shm cannot hold the DP exchange region (", bytes, " bytes: ", std::strerror(rc),
                       "): give the containers a larger /dev/shm (--shm-size, or an emptyDir of medium Memory)"));
    }
    if (rc != 0) {  // a /dev/shm that cannot reserve: the region stays sparse, and a full /dev/shm means SIGBUS
      Log().warn(
          "engram: event=dp_region_not_reserved bytes={} errno={} detail=\"posix_fallocate: {}: the region "
          "is sparse; if /dev/shm fills, members die of SIGBUS at a step\"",
          bytes, rc, std::strerror(rc));
    }
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map the DP exchange region: ", std::strerror(errno)));
  }
  base_ = static_cast<uint8_t*>(p);
  bytes_ = bytes;
  return absl::OkStatus();
}

namespace {
struct Geometry {
  size_t ids_off, ids_bytes, rec_off, rec_bytes, total;
};
Geometry GeometryOf(const DpRegionShape& s) {
  Geometry g;
  g.ids_off = AlignUp(sizeof(Header));
  g.ids_bytes = AlignUp(static_cast<size_t>(s.slot) * s.layers * s.cols * sizeof(int32_t));
  g.rec_off = g.ids_off + g.ids_bytes * static_cast<size_t>(s.members);
  g.rec_bytes = AlignUp(static_cast<size_t>(s.layers) * s.slot * s.part * s.record_bytes);
  g.total = g.rec_off + g.rec_bytes * static_cast<size_t>(s.members) * static_cast<size_t>(s.members);
  return g;
}
absl::Status CheckShape(const DpRegionShape& s) {
  if (s.members < 1 || s.members > kMaxDpMembers || s.slot < 1 || s.layers < 1 || s.cols < 1 || s.part < 1 ||
      s.record_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("DP exchange region: bad shape (%d members, slot %d)", s.members, s.slot));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status DpHostRegion::Init(const DpRegionShape& shape, int32_t me) {
  if (auto st = CheckShape(shape); !st.ok()) return st;
  if (fd_ >= 0) return absl::FailedPreconditionError("the DP exchange region was initialised already");
  fd_ = ::shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create the DP exchange region ", name_, " in /dev/shm: ", std::strerror(errno)));
  }
  unlinked_ = false;  // this member created the name: it removes it
  const Geometry g = GeometryOf(shape);
  if (auto st = Map(g.total, /*create=*/true); !st.ok()) return st;
  shape_ = shape;
  me_ = me;
  ids_off_ = g.ids_off;
  ids_bytes_ = g.ids_bytes;
  rec_off_ = g.rec_off;
  rec_bytes_ = g.rec_bytes;
  Header* h = HeaderOf(base_);
  h->magic = kMagic;
  h->shape = shape;
  h->aborted.store(0);
  for (int32_t r = 0; r < shape.members; ++r) h->members[r].phase.store(0);
  member(me).pid = ::getpid();
  h->ready.store(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DpHostRegion>> DpHostRegion::Open(const std::string& name, const DpRegionShape& shape,
                                                                 int32_t me, const BrokenFn& broken,
                                                                 std::chrono::milliseconds timeout) {
  if (auto st = CheckShape(shape); !st.ok()) return st;
  if (!IsRegionName(name)) {
    return absl::InvalidArgumentError("the DP group's rendezvous is not a host-transport region name");
  }
  std::unique_ptr<DpHostRegion> r(new DpHostRegion());
  r->name_ = name;
  r->unlinked_ = true;  // rank 0 owns the name
  const Geometry g = GeometryOf(shape);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Rank 0 sizes the region after the group formed: wait for the size, then for its ready flag.
  while (true) {
    if (auto why = broken()) return absl::AbortedError(*why);
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the DP group's rank 0 did not set up the exchange region ", name, " in time"));
    }
    if (r->fd_ < 0) r->fd_ = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    struct stat st {};
    if (r->fd_ >= 0 && ::fstat(r->fd_, &st) == 0 && static_cast<size_t>(st.st_size) >= g.total) break;
    if (r->fd_ < 0 && errno != ENOENT) {
      return absl::PermissionDeniedError(absl::StrCat("cannot open the DP exchange region ", name, ": ",
                                                      std::strerror(errno),
                                                      " (the group's replicas must share /dev/shm and a uid)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // The region must be this uid's own and nobody else's to write: a region another uid created (and named as the
  // rendezvous) could feed this member rows.
  struct stat own {};
  if (::fstat(r->fd_, &own) != 0 || own.st_uid != ::geteuid() || (own.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("the DP exchange region ", name, " is not this uid's own private object (owner uid ", own.st_uid,
                     ", mode ", absl::StrFormat("%o", own.st_mode & 0777), "): refused"));
  }
  if (auto st = r->Map(g.total, /*create=*/false); !st.ok()) return st;
  Header* h = HeaderOf(r->base_);
  while (h->ready.load(std::memory_order_acquire) == 0) {
    if (auto why = broken()) return absl::AbortedError(*why);
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError("the DP exchange region was never initialised by rank 0");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (h->magic != kMagic || !(h->shape == shape)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the DP exchange region ", name,
                     " has another shape than this member expects (members disagree on the "
                     "checkpoint or topology)"));
  }
  r->shape_ = shape;
  r->me_ = me;
  r->ids_off_ = g.ids_off;
  r->ids_bytes_ = g.ids_bytes;
  r->rec_off_ = g.rec_off;
  r->rec_bytes_ = g.rec_bytes;
  r->member(me).pid = ::getpid();
  return r;
}

DpHostRegion::~DpHostRegion() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
  Unlink();
}

void DpHostRegion::Unlink() {
  if (!unlinked_ && !name_.empty()) ::shm_unlink(name_.c_str());
  unlinked_ = true;
}

DpMemberSlot& DpHostRegion::member(int32_t r) { return HeaderOf(base_)->members[r]; }
int32_t* DpHostRegion::ids(int32_t r) {
  return reinterpret_cast<int32_t*>(base_ + ids_off_ + ids_bytes_ * static_cast<size_t>(r));
}
uint8_t* DpHostRegion::records(int32_t src, int32_t dst) {
  return base_ + rec_off_ + rec_bytes_ * (static_cast<size_t>(src) * shape_.members + static_cast<size_t>(dst));
}

void DpHostRegion::Publish(uint64_t phase) { member(me_).phase.store(phase, std::memory_order_release); }

void DpHostRegion::Abort(const std::string& why) {
  if (base_ == nullptr) return;  // not mapped (yet): no member reads it
  Header* h = HeaderOf(base_);
  uint32_t expected = 0;
  if (h->aborted.compare_exchange_strong(expected, 2)) {  // 2: writing the reason
    std::snprintf(h->reason, kReasonBytes, "%s", why.c_str());
    h->aborted.store(1, std::memory_order_release);
  }
}

absl::Status DpHostRegion::WaitAll(uint64_t phase, const BrokenFn& broken, std::chrono::milliseconds timeout) {
  Header* h = HeaderOf(base_);
  const auto start = std::chrono::steady_clock::now();
  auto all_reached = [&] {
    for (int32_t r = 0; r < shape_.members; ++r) {
      if (member(r).phase.load(std::memory_order_acquire) < phase) return false;
    }
    return true;
  };
  for (uint64_t spin = 0;; ++spin) {
    if (all_reached()) return absl::OkStatus();
    if (spin < 2000) continue;  // a step's partner is usually microseconds away
    // A member that finished this step and then left (closed its engine: it aborts the region and leaves the group)
    // published its phase first: look again before calling the step failed.
    const uint32_t ab = h->aborted.load(std::memory_order_acquire);
    if (ab != 0) {
      if (all_reached()) return absl::OkStatus();
      while (h->aborted.load(std::memory_order_acquire) == 2) sched_yield();
      return absl::AbortedError(absl::StrCat("DP exchange aborted by the group: ", h->reason));
    }
    if (auto why = broken()) {
      if (all_reached()) return absl::OkStatus();
      Abort(*why);
      return absl::AbortedError(*why);
    }
    if (std::chrono::steady_clock::now() - start > timeout) {
      // Name the members that stalled (stopped, or formed and never stepped), not only that one did.
      std::string who;
      stalled_.clear();
      for (int32_t r = 0; r < shape_.members; ++r) {
        const uint64_t at = member(r).phase.load(std::memory_order_acquire);
        if (at >= phase) continue;
        stalled_.push_back(r);
        absl::StrAppend(&who, who.empty() ? "" : ", ", "edp rank ", r, " (pid ", member(r).pid, ", at phase ", at, ")");
      }
      const std::string why =
          absl::StrCat("DP group member ", who.empty() ? "?" : who, " did not reach step phase ", phase, " within ",
                       timeout.count(), " ms (ENGRAM_DP_STEP_TIMEOUT_MS): stalled or stopped");
      Abort(why);
      return absl::DeadlineExceededError(why);
    }
    if (spin < 4000) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 20000 ? 20 : 200));
    }
  }
}

}  // namespace engram::client
