// Decide (daemon/fallback.h), in-process: a clean hello shares; every fallback reason, alone, with the mode it
// leads to and a hint; embedding_across_dp falls back to DP_SHARDED where a node-local DP group exists.
#include <functional>
#include <set>
#include <string>

#include "daemon/fallback.h"
#include "gtest/gtest.h"

namespace engram::daemon {
namespace {

using engram::v1::FallbackReason;
using engram::v1::Mode;

// A hello and a node that share: DP 4 on one node, offload on, the checkpoint served.
engram::v1::Hello CleanHello() {
  engram::v1::Hello h;
  h.set_fingerprint(0x1234);
  h.set_checkpoint("/ckpt");
  h.set_tp_size(1);
  h.set_dp_size(4);
  h.set_dp_rank(1);
  h.set_local_dp_size(4);
  return h;
}

NodeView CleanNode() {
  NodeView n;
  n.checkpoint_served = true;
  n.shm_path = "/dev/shm";
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
      {"elastic ep", [](auto& h, auto&) { h.set_elastic_ep(true); }, engram::v1::ELASTIC_EP, engram::v1::PRIVATE_PINNED,
       "elastic"},
      {"fingerprint", [](auto&, auto& n) { n.checkpoint_served = false; }, engram::v1::FINGERPRINT_MISMATCH,
       engram::v1::PRIVATE_PINNED, "engramctl load"},
      {"shm missing", [](auto&, auto& n) { n.shm_exists = false; }, engram::v1::SHM_MISSING, engram::v1::PRIVATE_PINNED,
       "--shm-dir"},
      {"shm too small",
       [](auto&, auto& n) {
         n.shm_too_small = true;
         n.shm_free_bytes = 1 << 20;
       },
       engram::v1::SHM_TOO_SMALL, engram::v1::PRIVATE_PINNED, "--shm-size"},
      {"segment failed",
       [](auto&, auto& n) {
         n.segment_failed = true;
         n.segment_error = "disk on fire";
       },
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

TEST(DecideTest, ShmTooSmallNamesNoSegmentFailure) {
  auto h = CleanHello();
  NodeView n = CleanNode();
  n.shm_too_small = true;
  n.segment_failed = true;  // the failure is the capacity: one reason, not two
  EXPECT_EQ(Codes(Decide(h, n)), std::set<FallbackReason>{engram::v1::SHM_TOO_SMALL});
}

// Visibility of the shm directory is the client's to find out (descriptor, then path): the daemon never decides
// SHM_NOT_VISIBLE, whatever shm directory a replica would see.
TEST(DecideTest, TheDaemonNeverDecidesShmNotVisible) {
  Decision d = Decide(CleanHello(), CleanNode());
  EXPECT_TRUE(d.share);
  NodeView n = CleanNode();
  n.shm_exists = false;
  EXPECT_EQ(Codes(Decide(CleanHello(), n)), std::set<FallbackReason>{engram::v1::SHM_MISSING});
}

TEST(DecideTest, EveryReasonThatAppliesIsNamed) {
  auto h = CleanHello();
  h.set_elastic_ep(true);
  h.mutable_config()->set_cpu_offload(engram::v1::DISABLED);
  NodeView n = CleanNode();
  n.checkpoint_served = false;
  Decision d = Decide(h, n);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::ELASTIC_EP, engram::v1::CPU_OFFLOAD_DISABLED,
                                                engram::v1::FINGERPRINT_MISMATCH}));
  EXPECT_EQ(d.mode, engram::v1::DEVICE);
}

// The node's copy is the daemon's: a replica shares whatever its DP layout (a DP 1 engine started on its own, one
// member of a DP group that spans nodes, an odd split), with no reason named.
TEST(DecideTest, EveryDpLayoutShares) {
  struct Layout {
    int dp, rank, local;
  } layouts[] = {{1, 0, 1}, {1, 0, 0}, {16, 9, 8}, {4, 3, 2}, {3, 1, 2}, {8, 7, 1}, {2, 1, 0}};
  for (bool across : {false, true}) {
    for (const auto& l : layouts) {
      auto h = CleanHello();
      h.set_dp_size(l.dp);
      h.set_dp_rank(l.rank);
      h.set_local_dp_size(l.local);
      h.mutable_config()->set_embedding_across_dp(across);
      for (auto shared : {engram::v1::AUTO, engram::v1::ENABLED}) {
        h.mutable_config()->set_dp_shared_memory(shared);
        Decision d = Decide(h, CleanNode());
        EXPECT_TRUE(d.share) << "dp " << l.dp << " local " << l.local << " across " << across;
        EXPECT_EQ(d.mode, engram::v1::SHARED);
        EXPECT_TRUE(d.reasons.empty()) << "dp " << l.dp << ": " << d.reasons[0].hint();
      }
    }
  }
}

// DP_SIZE_ONE and NOT_COLOCATED say why no embedding_across_dp group formed, for a replica that could not share.
TEST(DecideTest, DpLayoutReasonsNameTheMissingDpShardedGroup) {
  auto h = CleanHello();
  h.mutable_config()->set_cpu_offload(engram::v1::DISABLED);
  h.mutable_config()->set_embedding_across_dp(true);
  h.set_dp_size(1);
  h.set_dp_rank(0);
  h.set_local_dp_size(1);
  Decision d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::DEVICE);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::CPU_OFFLOAD_DISABLED, engram::v1::DP_SIZE_ONE}));
  h.set_dp_size(3);
  h.set_local_dp_size(2);  // gcd 1: no group of two on this node
  d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::DEVICE);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::CPU_OFFLOAD_DISABLED, engram::v1::NOT_COLOCATED}));
  // Without embedding_across_dp the DP layout is never a reason.
  h.mutable_config()->set_embedding_across_dp(false);
  d = Decide(h, CleanNode());
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::CPU_OFFLOAD_DISABLED}));
}

TEST(DecideTest, EmbeddingAcrossDpFallsBackToDpShardedWhereItCan) {
  // Sharing refused (tables on the GPU): a DP group of 4 replicas on the node runs DP_SHARDED.
  auto h = CleanHello();
  h.mutable_config()->set_embedding_across_dp(true);
  h.mutable_config()->set_cpu_offload(engram::v1::DISABLED);
  Decision d = Decide(h, CleanNode());
  EXPECT_FALSE(d.share);
  EXPECT_EQ(d.mode, engram::v1::DP_SHARDED);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::CPU_OFFLOAD_DISABLED}));
  // Sharing disabled by the replica's own config: DP_SHARDED, and the reason says so.
  h = CleanHello();
  h.mutable_config()->set_embedding_across_dp(true);
  h.mutable_config()->set_dp_shared_memory(engram::v1::DISABLED);
  d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::DP_SHARDED);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::DP_SHARED_MEMORY_DISABLED}));
  // Not with elastic EP (docs/math.md section 9): a table of its own, never DP_SHARDED_NOT_BUILT.
  h.set_elastic_ep(true);
  d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::PRIVATE_PINNED);
  EXPECT_FALSE(Codes(d).count(engram::v1::DP_SHARDED_NOT_BUILT));
  // A node-local group of one (dp 4, but gcd(4, 3 local) = 1): nothing to shard across.
  h = CleanHello();
  h.mutable_config()->set_embedding_across_dp(true);
  h.mutable_config()->set_dp_shared_memory(engram::v1::DISABLED);
  h.set_local_dp_size(3);
  d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::PRIVATE_PINNED);
  EXPECT_TRUE(Codes(d).count(engram::v1::NOT_COLOCATED));
  // Two groups of two on a node holding 2 of 4 replicas: DP_SHARDED, and the layout is no reason.
  h.set_local_dp_size(2);
  d = Decide(h, CleanNode());
  EXPECT_EQ(d.mode, engram::v1::DP_SHARDED);
  EXPECT_EQ(Codes(d), (std::set<FallbackReason>{engram::v1::DP_SHARED_MEMORY_DISABLED}));
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
