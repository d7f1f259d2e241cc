// GroupRegistry (daemon/group_registry.h), in-process: explicit leaves (a formed and a forming group break naming
// the member and its reason, the others are told, the session may join again; refused leaves change nothing), a
// session's end while forming (forgotten, not broken), updates carrying each member's join id, and the registry
// never held while a member is notified: a member whose notification blocks does not stall status, other joins or
// leaves, while each member still gets its group's updates in the order they were decided. Blocking is a latch the
// test opens; the bounds below are deadlines for a hang, not timings.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "daemon/group_registry.h"
#include "gtest/gtest.h"

namespace engram::daemon {
namespace {

using engram::v1::GroupUpdate;
using engram::v1::ServerMessage;

engram::v1::Hello MakeHello(int dp_rank, int dp_size = 2) {
  engram::v1::Hello h;
  h.set_fingerprint(0x1234);
  h.set_tp_size(1);
  h.set_dp_size(dp_size);
  h.set_dp_rank(dp_rank);
  h.set_local_dp_size(dp_size);
  h.mutable_config()->set_embedding_across_dp(true);
  return h;
}

engram::v1::GroupJoin MakeJoin(int rank, uint64_t join_id = 0) {
  engram::v1::GroupJoin j;
  j.set_transport("host");
  j.set_max_tokens(8);
  j.set_join_id(join_id);
  if (rank == 0) j.set_rendezvous("/engram-dp-1-x");
  return j;
}

// What one member was sent.
struct Inbox {
  std::mutex mu;
  std::vector<GroupUpdate> got;
  GroupRegistry::Notify notify() {
    return [this](const ServerMessage& m) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(m.group_update());
    };
  }
  std::vector<GroupUpdate> all() {
    std::lock_guard<std::mutex> lock(mu);
    return got;
  }
};

// A member whose stream blocks: its first notification (each one, with `every`) waits until Open(); Entered() says
// whether the first one arrived (within 30 s).
struct BlockedMember {
  std::promise<void> latch, entered;
  std::shared_future<void> open = latch.get_future().share();
  GroupRegistry::Notify notify(bool every) {
    return [this, every, first = std::make_shared<bool>(true)](const ServerMessage&) {
      const bool was_first = *first;
      if (was_first) {
        *first = false;
        entered.set_value();
      }
      if (every || was_first) open.wait();
    };
  }
  bool Entered() { return entered.get_future().wait_for(std::chrono::seconds(30)) == std::future_status::ready; }
  void Open() { latch.set_value(); }
};

engram::v1::GroupLeave MakeLeave(const std::string& reason, const std::string& group = "", uint64_t gen = 0) {
  engram::v1::GroupLeave l;
  l.set_reason(reason);
  l.set_group(group);
  l.set_generation(gen);
  return l;
}

TEST(GroupRegistryTest, ALeaveBreaksAFormedGroupNamingTheMemberAndTheSessionMayJoinAgain) {
  GroupRegistry r;
  Inbox a, b;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0, 7), a.notify()).ok());
  ASSERT_TRUE(r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1, 9), b.notify()).ok());
  ASSERT_EQ(a.all().size(), 1u);
  const GroupUpdate formed = a.all()[0];
  EXPECT_EQ(formed.state(), GroupUpdate::FORMED);
  EXPECT_EQ(formed.join_id(), 7u);
  EXPECT_EQ(b.all()[0].join_id(), 9u);

  auto left = r.LeaveGroup("lease-b", MakeLeave("engine closed", formed.group(), formed.generation()));
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->group(), formed.group());
  EXPECT_EQ(left->generation(), formed.generation());
  // a is told, naming b and its reason; b (the leaver) is told nothing more.
  ASSERT_EQ(a.all().size(), 2u);
  const GroupUpdate broken = a.all()[1];
  EXPECT_EQ(broken.state(), GroupUpdate::BROKEN);
  EXPECT_EQ(broken.left_pid(), 101);
  EXPECT_EQ(broken.left_dp_rank(), 1);
  EXPECT_EQ(broken.join_id(), 7u);
  EXPECT_NE(broken.detail().find("member dp rank 1 (edp rank 1, pid 101) left: engine closed"), std::string::npos)
      << broken.detail();
  EXPECT_EQ(b.all().size(), 1u);
  // Status: broken, the member listed as left with its reason.
  auto groups = r.Groups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].state(), "BROKEN");
  ASSERT_EQ(groups[0].members_size(), 2);
  EXPECT_FALSE(groups[0].members(0).left());
  EXPECT_TRUE(groups[0].members(1).left());
  EXPECT_EQ(groups[0].members(1).left_reason(), "engine closed");

  // b may join again (a new group under the key: a must leave the broken one before it joins again).
  Inbox b2;
  EXPECT_EQ(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0), a.notify()).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1, 10), b2.notify()).ok());
  // The broken group went to the history when b's join replaced it: a is no longer a member of anything.
  EXPECT_EQ(r.LeaveGroup("lease-a", MakeLeave("bye")).status().code(), absl::StatusCode::kFailedPrecondition);
  Inbox a2;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0, 8), a2.notify()).ok());
  ASSERT_EQ(b2.all().size(), 1u);
  EXPECT_EQ(b2.all()[0].state(), GroupUpdate::FORMED);
  EXPECT_EQ(b2.all()[0].join_id(), 10u);
  EXPECT_GT(b2.all()[0].generation(), formed.generation());
}

TEST(GroupRegistryTest, ALeaveBreaksAFormingGroupButASessionEndOnlyForgetsTheMember) {
  GroupRegistry r;
  Inbox a, b;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0, 3), PeerCred(100, 1, 1), MakeJoin(0), a.notify()).ok());
  ASSERT_TRUE(r.Join("lease-b", MakeHello(1, 3), PeerCred(101, 1, 1), MakeJoin(1), b.notify()).ok());
  // b's session ends while forming: forgotten, a waits on (another process may take dp rank 1).
  r.Leave("lease-b");
  EXPECT_TRUE(a.all().empty());
  ASSERT_EQ(r.Groups().size(), 1u);
  EXPECT_EQ(r.Groups()[0].state(), "FORMING");
  EXPECT_EQ(r.Groups()[0].members_size(), 1);
  // c joins as dp rank 1 and gives up: a's wait ends at once, naming c and why.
  Inbox c;
  ASSERT_TRUE(r.Join("lease-c", MakeHello(1, 3), PeerCred(102, 1, 1), MakeJoin(1), c.notify()).ok());
  ASSERT_TRUE(r.LeaveGroup("lease-c", MakeLeave("gave up waiting")).ok());
  ASSERT_EQ(a.all().size(), 1u);
  EXPECT_EQ(a.all()[0].state(), GroupUpdate::BROKEN);
  EXPECT_NE(a.all()[0].detail().find("pid 102) left before the group formed: gave up waiting"), std::string::npos)
      << a.all()[0].detail();
  // a leaves too: every member left, the group is history, still listed.
  ASSERT_TRUE(r.LeaveGroup("lease-a", MakeLeave("done")).ok());
  auto groups = r.Groups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].state(), "BROKEN");
  EXPECT_EQ(groups[0].left_pid(), 102);
}

// Two deployments of one checkpoint with one DP layout on a node: another uid's always forms its own group (it can
// neither take nor squat the first's key); the same uid's needs its own name (ENGRAM_DP_GROUP), and without one is
// refused with a message that says so.
TEST(GroupRegistryTest, DeploymentsAreScopedByUidAndName) {
  GroupRegistry r;
  Inbox a, b, c, d, e, f, g;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0), a.notify()).ok());
  // Another uid at the same ranks: a group of its own, forming beside the first.
  ASSERT_TRUE(r.Join("lease-c", MakeHello(0), PeerCred(200, 2, 2), MakeJoin(0), c.notify()).ok());
  ASSERT_TRUE(r.Join("lease-d", MakeHello(1), PeerCred(201, 2, 2), MakeJoin(1), d.notify()).ok());
  ASSERT_TRUE(r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1), b.notify()).ok());
  ASSERT_EQ(a.all().size(), 1u);
  ASSERT_EQ(c.all().size(), 1u);
  EXPECT_EQ(a.all()[0].state(), GroupUpdate::FORMED);
  EXPECT_EQ(c.all()[0].state(), GroupUpdate::FORMED);
  EXPECT_NE(a.all()[0].group(), c.all()[0].group());
  EXPECT_NE(a.all()[0].group().find("u1/"), std::string::npos) << a.all()[0].group();
  // The same uid again, unnamed: the message names the way out.
  const absl::Status clash = r.Join("lease-e", MakeHello(0), PeerCred(102, 1, 1), MakeJoin(0), e.notify());
  EXPECT_EQ(clash.code(), absl::StatusCode::kAlreadyExists) << clash;
  EXPECT_NE(clash.message().find("ENGRAM_DP_GROUP"), std::string::npos) << clash;
  // A forming group's rank taken by another deployment of the uid.
  GroupRegistry r2;
  Inbox a2, e2;
  ASSERT_TRUE(r2.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0), a2.notify()).ok());
  const absl::Status taken = r2.Join("lease-e", MakeHello(0), PeerCred(102, 1, 1), MakeJoin(0), e2.notify());
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists) << taken;
  EXPECT_NE(taken.message().find("ENGRAM_DP_GROUP"), std::string::npos) << taken;
  EXPECT_NE(taken.message().find("pid 100 (dp rank 0)"), std::string::npos) << taken;
  // Named: its own group.
  auto named0 = MakeJoin(0), named1 = MakeJoin(1);
  named0.set_name("second");
  named1.set_name("second");
  ASSERT_TRUE(r.Join("lease-f", MakeHello(0), PeerCred(103, 1, 1), named0, f.notify()).ok());
  ASSERT_TRUE(r.Join("lease-g", MakeHello(1), PeerCred(104, 1, 1), named1, g.notify()).ok());
  ASSERT_EQ(f.all().size(), 1u);
  EXPECT_EQ(f.all()[0].state(), GroupUpdate::FORMED);
  EXPECT_EQ(f.all()[0].group().rfind("second/u1/", 0), 0u) << f.all()[0].group();
}

TEST(GroupRegistryTest, RefusedLeavesChangeNothing) {
  GroupRegistry r;
  Inbox a, b, c;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0), a.notify()).ok());
  ASSERT_TRUE(r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1), b.notify()).ok());
  auto named = MakeJoin(0);
  named.set_name("other");
  ASSERT_TRUE(r.Join("lease-c", MakeHello(0), PeerCred(102, 1, 1), named, c.notify()).ok());
  const GroupUpdate formed = a.all().at(0);
  const auto before = r.Groups();

  EXPECT_EQ(r.LeaveGroup("lease-none", MakeLeave("x")).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.LeaveGroup("lease-c", MakeLeave("x", formed.group())).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(r.LeaveGroup("lease-c", MakeLeave("x", "no-such-group")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.LeaveGroup("lease-a", MakeLeave("x", formed.group(), formed.generation() + 100)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.LeaveGroup("lease-a", MakeLeave(std::string(kMaxLeaveReasonBytes + 1, 'x'))).status().code(),
            absl::StatusCode::kInvalidArgument);

  const auto after = r.Groups();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].DebugString(), before[i].DebugString());
  EXPECT_EQ(a.all().size(), 1u);
  EXPECT_EQ(b.all().size(), 1u);
  EXPECT_TRUE(c.all().empty());
}

// A member whose stream blocks (its notification never returns until the latch opens) stalls only the call that
// notifies it: status and another group's join and leave go on. With the notifications sent under the registry's
// lock, Groups() would wait for the latch.
TEST(GroupRegistryTest, ABlockedMemberDoesNotStallTheRegistry) {
  GroupRegistry r;
  BlockedMember a;
  Inbox b;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0), a.notify(/*every=*/true)).ok());
  // b's join forms the group and notifies a: that call blocks in a's notification.
  auto forming = std::async(std::launch::async, [&] {
    return r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1), b.notify());
  });
  ASSERT_TRUE(a.Entered());
  // Meanwhile the registry serves everyone else.
  auto others = std::async(std::launch::async, [&] {
    Inbox c, d;
    auto j = MakeJoin(0);
    j.set_name("second");
    auto k = MakeJoin(1);
    k.set_name("second");
    bool ok = r.Join("lease-c", MakeHello(0), PeerCred(102, 1, 1), j, c.notify()).ok() &&
              r.Join("lease-d", MakeHello(1), PeerCred(103, 1, 1), k, d.notify()).ok() &&
              r.LeaveGroup("lease-d", MakeLeave("bye")).ok();
    return ok && r.Groups().size() == 2 && c.all().size() == 2;
  });
  const bool served = others.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  a.Open();  // let the blocked call finish whatever happened
  ASSERT_TRUE(served) << "the registry stalled behind a blocked member's notification";
  EXPECT_TRUE(others.get());
  EXPECT_TRUE(forming.get().ok());
  EXPECT_EQ(b.all().size(), 1u);
}

// Updates reach each member in the order the registry decided them, though they are sent outside its lock by
// different threads: b's FORMED is held up (the thread sending it blocks in a's notification first), a's session
// ends meanwhile, and b still gets FORMED before BROKEN (the other way round, b would give up before learning the
// group, e.g. the host region's name it must clean up).
TEST(GroupRegistryTest, AMemberGetsFormedBeforeBroken) {
  GroupRegistry r;
  BlockedMember a;
  Inbox b;
  ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0), a.notify(/*every=*/false)).ok());
  auto forming = std::async(std::launch::async, [&] {
    return r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1), b.notify());
  });
  ASSERT_TRUE(a.Entered());
  auto leaving = std::async(std::launch::async, [&] { r.Leave("lease-a"); });
  // The leave's BROKEN waits for the FORMED still being sent (give it a moment to overtake if it could; whether
  // it does is what the order below checks, not how long anything took).
  (void)leaving.wait_for(std::chrono::seconds(2));
  a.Open();
  ASSERT_EQ(leaving.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(forming.get().ok());
  const auto got = b.all();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].state(), GroupUpdate::FORMED);
  EXPECT_EQ(got[1].state(), GroupUpdate::BROKEN);
}

// A broken host group's region is removed only when it is the group's own: a member may name any region of the
// DP form as its rendezvous, and a daemon running as root must not remove another tenant's. The Env stands in for
// /dev/shm (the region's owner as Lstat reports it; removals recorded, never made).
class RegionEnv : public PosixEnv {
 public:
  explicit RegionEnv(uint32_t owner) : owner_(owner) {}
  int Lstat(const char* path, struct stat* st) override {
    if (std::string(path) != "/dev/shm/engram-dp-1-x") return PosixEnv::Lstat(path, st);
    *st = {};
    st->st_mode = S_IFREG | 0600;
    st->st_uid = owner_;
    return 0;
  }
  int ShmUnlink(const char* name) override {
    std::lock_guard<std::mutex> lock(mu);
    unlinked.push_back(name);
    return 0;
  }
  std::mutex mu;
  std::vector<std::string> unlinked;

 private:
  uint32_t owner_;
};

TEST(GroupRegistryTest, ABrokenGroupsRegionIsRemovedOnlyWhenItIsTheGroupsOwn) {
  for (uint32_t owner : {1u, 2u}) {  // the group's members are uid 1
    RegionEnv env(owner);
    {
      GroupRegistry r(&env);
      Inbox a, b;
      ASSERT_TRUE(r.Join("lease-a", MakeHello(0), PeerCred(100, 1, 1), MakeJoin(0, 7), a.notify()).ok());
      ASSERT_TRUE(r.Join("lease-b", MakeHello(1), PeerCred(101, 1, 1), MakeJoin(1, 9), b.notify()).ok());
      r.Leave("lease-a");
      r.Leave("lease-b");
      // Replaced by a new group under the same key, the broken one retires.
      Inbox c;
      ASSERT_TRUE(r.Join("lease-c", MakeHello(0), PeerCred(102, 1, 1), MakeJoin(0, 8), c.notify()).ok());
    }
    std::lock_guard<std::mutex> lock(env.mu);
    if (owner == 1) {
      EXPECT_NE(std::find(env.unlinked.begin(), env.unlinked.end(), "/engram-dp-1-x"), env.unlinked.end())
          << "the group's own region goes with it";
    } else {
      EXPECT_TRUE(env.unlinked.empty()) << "uid 2's region was removed for a group of uid 1";
    }
  }
}

}  // namespace
}  // namespace engram::daemon
