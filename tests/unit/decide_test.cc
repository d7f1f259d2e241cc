// Decide (daemon/fallback.h), in-process: a clean hello shares; every fallback reason, alone, with the mode it
// leads to and a hint; embedding_across_dp never decides a mode no replica can run (DP_SHARDED_NOT_BUILT).
#include <functional>
#include <set>
#include <string>

#include "daemon/fallback.h"
#include "gtest/gtest.h"

namespace engram::daemon {
namespace {

using engram::v1::FallbackReason;
using engram::v1::Mode;

constexpr uint64_t kDev = 42, kIno = 4242;

// A hello and a node that share: DP 4 on one node, offload on, the daemon's shm seen, the checkpoint served.
engram::v1::Hello CleanHello() {
  engram::v1::Hello h;
  h.set_fingerprint(0x1234);
  h.set_checkpoint("/ckpt");
  h.set_tp_size(1);
  h.set_dp_size(4);
  h.set_dp_rank(1);
  h.set_local_dp_size(4);
  h.set_shm_visible(true);
  h.set_shm_dev(kDev);
  h.set_shm_ino(kIno);
  return h;
}

NodeView CleanNode() {
  NodeView n;
  n.checkpoint_served = true;
  n.shm_path = "/dev/shm";
  n.shm_dev = kDev;
  n.shm_ino = kIno;
  n.shm_free_bytes = uint64_t{64} << 30;
  n.tables_bytes = uint64_t{8} << 30;
  return n;
}

std::set<FallbackReason> Codes(const Decision& d) {
  std::set<FallbackReason> out;
  for (const auto& r : d.reasons) out.insert(r.code());
  return out;
}

TEST(DecideTest, CleanHelloShares) {
  Decision d = Decide(CleanHello(), CleanNode());
  EXPECT_TRUE(d.share);
  EXPECT_EQ(d.mode, engram::v1::SHARED);
  EXPECT_TRUE(d.reasons.empty());
}

TEST(DecideTest, LocalDpSizeZeroMeansUnknownAndStillShares) {
  auto h = CleanHello();
  h.set_local_dp_size(0);
  EXPECT_TRUE(Decide(h, CleanNode()).share);
}

struct Case {
  std::string name;
  std::function<void(engram::v1::Hello&, NodeView&)> apply;
  FallbackReason reason;
  Mode mode;
  std::string hint_part;  // the hint says what to do about it
};

TEST(DecideTest, EveryReasonAloneWithItsMode) {
  const Case cases[] = {
      {"ple", [](auto&, auto& n) { n.model_shareable = false; }, engram::v1::MODEL_NOT_SHAREABLE,
       engram::v1::PRIVATE_PINNED, "never shared"},
      {"cpu_offload false", [](auto& h, auto&) { h.mutable_config()->set_cpu_offload(engram::v1::DISABLED); },
       engram::v1::CPU_OFFLOAD_DISABLED, engram::v1::DEVICE, "cpu_offload"},
      {"dp 1", [](auto& h, auto&) { h.set_dp_size(1); h.set_dp_rank(0); h.set_local_dp_size(1); },
       engram::v1::DP_SIZE_ONE, engram::v1::PRIVATE_PINNED, "data_parallel_size is 1"},
      {"not colocated", [](auto& h, auto&) { h.set_local_dp_size(2); }, engram::v1::NOT_COLOCATED,
       engram::v1::PRIVATE_PINNED, "2 of 4 DP replicas"},
      {"elastic ep", [](auto& h, auto&) { h.set_elastic_ep(true); }, engram::v1::ELASTIC_EP,
       engram::v1::PRIVATE_PINNED, "elastic"},
      {"fingerprint", [](auto&, auto& n) { n.checkpoint_served = false; }, engram::v1::FINGERPRINT_MISMATCH,
       engram::v1::PRIVATE_PINNED, "engramctl load"},
      {"shm missing", [](auto&, auto& n) { n.shm_exists = false; }, engram::v1::SHM_MISSING,
       engram::v1::PRIVATE_PINNED, "--shm-dir"},
      {"shm too small", [](auto&, auto& n) { n.shm_too_small = true; n.shm_free_bytes = 1 << 20; },
       engram::v1::SHM_TOO_SMALL, engram::v1::PRIVATE_PINNED, "--shm-size"},
      {"shm invisible", [](auto& h, auto&) { h.set_shm_visible(false); }, engram::v1::SHM_NOT_VISIBLE,
       engram::v1::PRIVATE_PINNED, "--ipc=host"},
      {"other shm inode", [](auto& h, auto&) { h.set_shm_ino(kIno + 1); }, engram::v1::SHM_NOT_VISIBLE,
       engram::v1::PRIVATE_PINNED, "--ipc=host"},
      {"other shm device", [](auto& h, auto&) { h.set_shm_dev(kDev + 1); }, engram::v1::SHM_NOT_VISIBLE,
       engram::v1::PRIVATE_PINNED, "--ipc=host"},
      {"segment failed", [](auto&, auto& n) { n.segment_failed = true; n.segment_error = "disk on fire"; },
       engram::v1::SEGMENT_NOT_READY, engram::v1::PRIVATE_PINNED, "disk on fire"},
  };
  for (const auto& c : cases) {
    auto h = CleanHello();
    NodeView n = CleanNode();
    c.apply(h, n);
    Decision d = Decide(h, n);
    EXPECT_FALSE(d.share) << c.name;
    EXPECT_EQ(d.mode, c.mode) << c.name << ": " << ModeName(d.mode);
    EXPECT_EQ(Codes(d), std::set<FallbackReason>{c.reason}) << c.name;
    ASSERT_EQ(d.reasons.size(), 1u) << c.name;
    EXPECT_NE(d.reasons[0].hint().find(c.hint_part), std::string::npos) << c.name << ": " << d.reasons[0].hint();
  }
}

TEST(DecideTest, ShmTooSmallNamesNoSegmentFailureAndMissingShmHidesVisibility) {
  auto h = CleanHello();
  NodeView n = CleanNode();
  n.shm_too_small = true;
  n.segment_failed = true;  // the failure is the capacity: one reason, not two
  EXPECT_EQ(Codes(Decide(h, n)), std::set<FallbackReason>{engram::v1::SHM_TOO_SMALL});
  n = CleanNode();
  n.shm_exists = false;
  h.set_shm_visible(false);
  EXPECT_EQ(Codes(Decide(h, n)), std::set<FallbackReason>{engram::v1::SHM_MISSING});
}

TEST(DecideTest, EveryReasonThatAppliesIsNamed) {
  auto h = CleanHello();
  h.set_dp_size(1);
  h.set_dp_rank(0);
  h.set_local_dp_size(1);
  h.set_elastic_ep(true);
  h.mutable_config()->set_cpu_offload(engram::v1::DISABLED);
  NodeView n = CleanNode();
  n.checkpoint_served = false;
  Decision d = Decide(h, n);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::DP_SIZE_ONE, engram::v1::ELASTIC_EP,
                                                engram::v1::CPU_OFFLOAD_DISABLED, engram::v1::FINGERPRINT_MISMATCH}));
  EXPECT_EQ(d.mode, engram::v1::DEVICE);
}

TEST(DecideTest, EmbeddingAcrossDpFallsBackToAPrivateTableWithDpShardedNotBuilt) {
  auto h = CleanHello();
  h.mutable_config()->set_embedding_across_dp(true);
  h.set_shm_visible(false);
  Decision d = Decide(h, CleanNode());
  EXPECT_FALSE(d.share);
  EXPECT_EQ(d.mode, engram::v1::PRIVATE_PINNED) << "never DP_SHARDED: the collective is not built";
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::SHM_NOT_VISIBLE, engram::v1::DP_SHARDED_NOT_BUILT}));
  EXPECT_EQ(d.reasons.back().code(), engram::v1::DP_SHARDED_NOT_BUILT);
  EXPECT_NE(d.reasons.back().hint().find("collective"), std::string::npos);
  // The same with the tables on the GPU: DEVICE.
  h.mutable_config()->set_cpu_offload(engram::v1::DISABLED);
  d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::DEVICE);
  EXPECT_TRUE(Codes(d).count(engram::v1::DP_SHARDED_NOT_BUILT));
}

TEST(DecideTest, EmbeddingAcrossDpSharesWhenSharingWorks) {
  auto h = CleanHello();
  h.mutable_config()->set_embedding_across_dp(true);
  Decision d = Decide(h, CleanNode());
  EXPECT_TRUE(d.share);
  EXPECT_EQ(d.mode, engram::v1::SHARED);
  EXPECT_TRUE(d.reasons.empty());
}

TEST(DecideTest, CpuOffloadAutoAndEnabledKeepHostTables) {
  for (auto choice : {engram::v1::AUTO, engram::v1::ENABLED}) {
    auto h = CleanHello();
    h.mutable_config()->set_cpu_offload(choice);
    h.set_elastic_ep(true);
    EXPECT_EQ(Decide(h, CleanNode()).mode, engram::v1::PRIVATE_PINNED);
  }
}

TEST(DecideTest, Names) {
  EXPECT_EQ(ReasonName(engram::v1::SHM_NOT_VISIBLE), "SHM_NOT_VISIBLE");
  EXPECT_EQ(ModeName(engram::v1::PRIVATE_PINNED), "PRIVATE_PINNED");
  auto r = MakeReason(engram::v1::REGISTER_FAILED, "hint");
  EXPECT_EQ(r.code(), engram::v1::REGISTER_FAILED);
  EXPECT_EQ(r.hint(), "hint");
}

}  // namespace
}  // namespace engram::daemon
