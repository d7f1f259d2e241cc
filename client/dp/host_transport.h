// DpHostRegion: the host transport of the DP-sharded exchange (client/dp/dp_engine.h) between the replica processes
// of one group on one node, for the CPU backend (CI, machines without a GPU). One shared-memory region per group:
// the rank-0 member picks a fresh name (Reserve: nothing is created yet) whose bytes travel through engramd as the
// group's rendezvous (the way an ncclUniqueId does); once the group formed it creates it (shm_open, O_EXCL, 0600),
// sizes and initialises it, the others open it, and after the first barrier the name is unlinked (the mapping
// lives on). The name exists only between the group forming and every member having mapped it; a member that gives
// up in that window removes it (RemoveName, whoever created it), and a member that dies in it (rank 0 included)
// breaks the group, so the others give up and remove it: nothing is left in /dev/shm (client/dp/dp_engine.cc).
//
// Layout: a header (shape, an abort flag with its reason, and per member: its step phase, token count, pid and the
// step's layer range), then per member its gathered-ids area [slot, layers, cols] int32, then per (source, dest)
// pair the source's packed records for the dest's tokens [layers, slot, part, record_bytes]. A step is two
// barriers: publish ids -> all published (the all-gather is reading the others' areas) -> look up and write the
// records for every dest -> all written (the all-to-all is reading one's own column of areas). Members only ever
// write their own areas. WaitAll polls the members' phases (spin, then yield, then short sleeps) and gives up when
// the region's abort flag is set (any member failing a step sets it), when the group is broken (engramd said a member
// left, or this lease ended) or at the step timeout, so no member hangs. Thread-compatible (one engine thread).
#pragma once

#include "shm/dp_region_name.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace engram::client {

inline constexpr int32_t kMaxDpMembers = 64;
using engram::kDpRegionPrefix;  // every region's name: /engram-dp-<pid>-<random> (shm/dp_region_name.h)

struct DpRegionShape {
  int32_t members = 0, slot = 0, layers = 0, cols = 0, record_bytes = 0, part = 0;  // part: most columns a member owns
  bool operator==(const DpRegionShape&) const = default;
};

struct alignas(64) DpMemberSlot {
  std::atomic<uint64_t> phase;
  int32_t count;  // tokens this step
  int32_t pid;
  int32_t l0, nl;  // the step's layers [l0, l0 + nl)
};

class DpHostRegion {
 public:
  using BrokenFn = std::function<std::optional<std::string>()>;

  // Rank 0, before it joins: a fresh name, not created yet; name() is the rendezvous.
  static absl::StatusOr<std::unique_ptr<DpHostRegion>> Reserve();
  // Rank 0 once the group formed: create (O_EXCL), size, map and initialise. The name is this object's to unlink.
  absl::Status Init(const DpRegionShape& shape, int32_t me);
  // Whether `name` has the form of a region name (the prefix, one path component).
  static bool IsRegionName(const std::string& name);
  // Removes region `name` from /dev/shm (if it is a region name and exists): a member giving up before every member
  // mapped the region, whoever created it.
  static void RemoveName(const std::string& name);
  // The others once the group formed: open rank 0's region and wait (at most `timeout`, or until `broken`) until it
  // is initialised with this shape.
  static absl::StatusOr<std::unique_ptr<DpHostRegion>> Open(const std::string& name, const DpRegionShape& shape,
                                                            int32_t me, const BrokenFn& broken,
                                                            std::chrono::milliseconds timeout);
  ~DpHostRegion();

  const std::string& name() const { return name_; }
  bool mapped() const { return base_ != nullptr; }
  void Unlink();
  size_t bytes() const { return bytes_; }

  DpMemberSlot& member(int32_t r);
  int32_t* ids(int32_t r);                     // [slot, layers, cols]
  uint8_t* records(int32_t src, int32_t dst);  // [layers, slot, part, record_bytes]

  void Publish(uint64_t phase);
  // Every member reached `phase`; Aborted (the region's reason, or the group's), or DeadlineExceeded.
  absl::Status WaitAll(uint64_t phase, const BrokenFn& broken, std::chrono::milliseconds timeout);
  // After WaitAll's DeadlineExceeded: the edp ranks that had not reached the phase (named to engramd as stalled).
  const std::vector<int32_t>& stalled() const { return stalled_; }
  // Marks the region aborted with `why` (first reason wins), so every member's WaitAll fails at once.
  void Abort(const std::string& why);

 private:
  std::vector<int32_t> stalled_;
  DpHostRegion() = default;
  absl::Status Map(size_t bytes, bool create);
  std::string name_;
  int fd_ = -1;
  bool unlinked_ = false;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  DpRegionShape shape_;
  int32_t me_ = 0;
  size_t ids_off_ = 0, rec_off_ = 0, ids_bytes_ = 0, rec_bytes_ = 0;
};

}  // namespace engram::client
