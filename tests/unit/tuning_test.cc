// The lookup engines' tuning (engram/tuning.h, client/tuning.h): a program's Set is strict and names the key, a
// record laid over another keeps its own knobs and takes the rest, the text lists exactly what is set, a client's
// ClientOptions::tuning reaches the tables it attaches over the environment's knobs, and the DP group's agreement
// (client/dp/agreement.h) reads every member's contribution alike. Oracles: the values and texts written here.
#include <cstdlib>
#include <string>
#include <vector>

#include "client/dp/agreement.h"
#include "client/engine/path_table.h"
#include "client/environment.h"
#include "client/tuning.h"
#include "engram/client.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram::client {
namespace {

TEST(Tuning, SetParsesEachKindAndTheTextListsWhatIsSet) {
  Tuning t;
  EXPECT_EQ(TuningText(t), "");
  ASSERT_TRUE(t.Set("host_gather_threads", " 12 ").ok());
  ASSERT_TRUE(t.Set("host_gather_uva_share", "0.3").ok());
  ASSERT_TRUE(t.Set("engine_calibrate", "Off").ok());
  ASSERT_TRUE(t.Set("lookup_path", "HOST").ok());
  ASSERT_TRUE(t.Set("dp_step_timeout_ms", "1500").ok());
  ASSERT_TRUE(t.Set("host_gather_cpus", "8-15,24").ok());
  EXPECT_EQ(t.host_gather_threads, 12);
  EXPECT_DOUBLE_EQ(t.host_gather_uva_share.value_or(-1), 0.3);
  EXPECT_EQ(t.engine_calibrate, false);
  EXPECT_EQ(t.lookup_path, "host");
  EXPECT_EQ(t.dp_step_timeout_ms, 1500);
  EXPECT_EQ(TuningText(t),
            "lookup_path=host,engine_calibrate=0,host_gather_threads=12,host_gather_cpus=8-15,24,"
            "host_gather_uva_share=0.3,dp_step_timeout_ms=1500");
}

TEST(Tuning, SetRefusesUnknownKeysAndBadValuesAndKeepsTheRecord) {
  Tuning t;
  ASSERT_TRUE(t.Set("host_gather_threads", "4").ok());
  const struct {
    const char *key, *value;
  } bad[] = {{"host_gather_dedup", "1"},       {"HOST_GATHER_THREADS", "4"},
             {"host_gather_threads", "-1"},    {"host_gather_threads", "4x"},
             {"host_gather_threads", ""},      {"host_gather_uva_share", "1.5"},
             {"host_gather_uva_share", "nan"}, {"engine_calibrate", "maybe"},
             {"lookup_path", "fastest"},       {"dp_a2a", "ring"},
             {"dp_form_timeout_ms", "0"},      {"dp_step_timeout_ms", "86400001"},
             {"lookup_path_table", "  "},      {"lookup_sort_variant", "-2"},
             {"lookup_sort_min_items", "-1"},  {"host_gather_cpus", "8-"},
             {"host_gather_cpus", "15-8"},     {"host_gather_cpus", "a,b"},
             {"host_gather_nt", "2"},          {"dp_nccl_blocking", "-1"}};
  for (const auto& b : bad) {
    SCOPED_TRACE(std::string(b.key) + "=" + b.value);
    const absl::Status st = t.Set(b.key, b.value);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(b.key), std::string::npos) << st.message();
  }
  EXPECT_EQ(TuningText(t), "host_gather_threads=4") << "a refused value changes nothing";
}

TEST(Tuning, TheZeroOneKnobsTakeFlagWords) {
  Tuning t;
  ASSERT_TRUE(t.Set("host_gather_nt", "off").ok());
  ASSERT_TRUE(t.Set("host_gather_fused", "Yes").ok());
  ASSERT_TRUE(t.Set("host_gather_issuer", "0").ok());
  ASSERT_TRUE(t.Set("host_gather_prewake", "true").ok());
  ASSERT_TRUE(t.Set("dp_nccl_blocking", "ON").ok());
  EXPECT_EQ(t.host_gather_nt, 0);
  EXPECT_EQ(t.host_gather_fused, 1);
  EXPECT_EQ(t.host_gather_issuer, 0);
  EXPECT_EQ(t.host_gather_prewake, 1);
  EXPECT_EQ(t.dp_nccl_blocking, 1);
}

// A program may assign the fields directly: Normalize (run by Client::Create) checks them as Set would.
TEST(Tuning, NormalizeChecksDirectAssignmentsAndLowersTheWords) {
  Tuning t;
  t.lookup_path = " HOST ";
  t.dp_a2a = "Graph";
  t.host_gather_threads = 8;
  t.host_gather_uva_share = 0.5;
  ASSERT_TRUE(t.Normalize().ok());
  EXPECT_EQ(t.lookup_path, "host");
  EXPECT_EQ(t.dp_a2a, "graph");
  EXPECT_EQ(t.host_gather_threads, 8);
  const struct {
    const char* key;
    void (*spoil)(Tuning&);
  } bad[] = {
      {"lookup_path", [](Tuning& x) { x.lookup_path = "fastest"; }},
      {"host_gather_uva_share", [](Tuning& x) { x.host_gather_uva_share = 1.5; }},
      {"host_gather_threads", [](Tuning& x) { x.host_gather_threads = -3; }},
      {"dp_step_timeout_ms", [](Tuning& x) { x.dp_step_timeout_ms = 0; }},
      {"host_gather_nt", [](Tuning& x) { x.host_gather_nt = 7; }},
      {"host_gather_cpus", [](Tuning& x) { x.host_gather_cpus = "1-"; }},
      {"lookup_path_table", [](Tuning& x) { x.lookup_path_table = " "; }},
  };
  for (const auto& b : bad) {
    Tuning u = t;
    b.spoil(u);
    const Tuning before = u;
    const absl::Status st = u.Normalize();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.key;
    EXPECT_NE(st.message().find(b.key), std::string::npos) << st.message();
    EXPECT_EQ(TuningText(u), TuningText(before)) << "a refused record is unchanged";
  }
  ClientOptions opts;
  opts.socket = "/nonexistent/engramd.sock";
  opts.tuning.host_gather_uva_share = -0.1;
  const auto c = Client::Create(opts);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("host_gather_uva_share"), std::string::npos) << c.status();
}

TEST(Tuning, OverKeepsItsOwnKnobsAndTakesTheRest) {
  Tuning mine, base;
  ASSERT_TRUE(mine.Set("host_gather_threads", "3").ok());
  ASSERT_TRUE(base.Set("host_gather_threads", "5").ok());
  ASSERT_TRUE(base.Set("lookup_path", "uva").ok());
  ASSERT_TRUE(base.Set("engine_calibrate", "0").ok());
  const Tuning t = mine.Over(base);
  EXPECT_EQ(t.host_gather_threads, 3);
  EXPECT_EQ(t.lookup_path, "uva");
  EXPECT_EQ(t.engine_calibrate, false);
  EXPECT_EQ(TuningText(Tuning{}.Over(Tuning{})), "");
}

// The keys as the documentation and the environment name them (written out here, not read from the code).
TEST(Tuning, TheKeysAreTheDocumentedOnes) {
  const std::vector<std::string> want = {
      "lookup_path",
      "lookup_path_table",
      "host_gather_min_items",
      "lookup_sort_min_items",
      "lookup_sort_variant",
      "lookup_sort_blocks",
      "engine_calibrate",
      "host_gather_threads",
      "host_gather_cpus",
      "host_gather_uva_share",
      "host_gather_prefetch",
      "host_gather_nt",
      "host_gather_fused",
      "host_gather_issuer",
      "host_gather_spin_us",
      "host_gather_dispatch_spin_us",
      "host_gather_pass_spin_us",
      "host_gather_prewake",
      "host_gather_issue_min_rows",
      "dp_form_timeout_ms",
      "dp_step_timeout_ms",
      "dp_chunk_kib",
      "dp_peer_max_slot",
      "dp_graph_max_slot",
      "dp_nccl_blocking",
      "dp_a2a",
  };
  EXPECT_EQ(Tuning::Keys(), want);
}

TEST(Tuning, KeysAreDistinctAndEachOneIsSettable) {
  const std::vector<std::string>& keys = Tuning::Keys();
  for (size_t i = 0; i < keys.size(); ++i) {
    for (size_t j = i + 1; j < keys.size(); ++j) EXPECT_NE(keys[i], keys[j]);
    Tuning t;
    const std::string value = keys[i] == "lookup_path" ? "uva" : keys[i] == "dp_a2a" ? "graph" : "1";
    EXPECT_TRUE(t.Set(keys[i], value).ok()) << keys[i];
    EXPECT_EQ(TuningText(t), keys[i] + "=" + value);
  }
}

// A real attach (no engramd: a private table on the CPU backend) carries the client's knobs over the environment's.
TEST(Tuning, ClientOptionsReachTheAttachedTableOverTheEnvironment) {
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 4;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  ::setenv("ENGRAM_HOST_GATHER_THREADS", "5", 1);
  ::setenv("ENGRAM_LOOKUP_PATH", "uva", 1);
  ReloadEnvironment();
  ClientOptions opts;
  opts.socket = dir / "none.sock";
  opts.timeout = std::chrono::milliseconds(100);
  opts.use_gpu = false;
  ASSERT_TRUE(opts.tuning.Set("host_gather_threads", "3").ok());
  auto c = Client::Create(opts);
  ASSERT_TRUE(c.ok());
  AttachRequest req;
  req.checkpoint = spec.out_dir;
  auto table = (*c)->Attach(req);
  ::unsetenv("ENGRAM_HOST_GATHER_THREADS");
  ::unsetenv("ENGRAM_LOOKUP_PATH");
  ReloadEnvironment();
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ((*table)->tuning().host_gather_threads, 3) << "the client's knob wins";
  EXPECT_EQ((*table)->tuning().lookup_path, "uva") << "the environment fills what the client left unset";
  EXPECT_EQ(TuningText((*table)->tuning()), "lookup_path=uva,host_gather_threads=3");
}

// The lookup path's choice from the tuning: a threshold, a table file, the built-in points; the forced path.
// The automatic choice reads the point nearest a batch on a log scale (ratios, not differences), the first of two
// equally near points, and none from an empty table.
TEST(PathTableFromTuning, TheNearestPointIsTakenOnALogScale) {
  const std::vector<PathPoint> points = {{1536, false}, {4096, true}, {9000, false}, {196608, true}};
  EXPECT_EQ(NearestPoint(points, 1)->items, 1536);
  EXPECT_EQ(NearestPoint(points, 6144)->items, 9000) << "9000/6144 = 1.46 is nearer than 6144/4096 = 1.5";
  EXPECT_EQ(NearestPoint(points, 5000)->items, 4096) << "5000/4096 = 1.22 against 9000/5000 = 1.8";
  EXPECT_EQ(NearestPoint(points, 1 << 30)->items, 196608);
  const std::vector<PathPoint> twice = {{2000, false}, {2000, true}};
  EXPECT_FALSE(NearestPoint(twice, 3000)->host) << "two points at one size: the first wins";
  EXPECT_EQ(NearestPoint(std::vector<PathPoint>{}, 2000), nullptr);
}

TEST(PathTableFromTuning, ThresholdThenFileThenBuiltIn) {
  Tuning t;
  const std::vector<PathPoint> built_in = PathTable(t);
  ASSERT_FALSE(built_in.empty());
  EXPECT_EQ(built_in.front().items, 1536);
  EXPECT_FALSE(built_in.front().host) << "decode sizes stay on the UVA kernels";
  testing::TempDir dir;
  const std::string file = dir / "paths.txt";
  testing::WriteFile(file, "2048 uva\n8192 host\n-5 host\n");
  ASSERT_TRUE(t.Set("lookup_path_table", file).ok());
  const std::vector<PathPoint> from_file = PathTable(t);
  ASSERT_EQ(from_file.size(), 2u) << "a non-positive size is skipped";
  EXPECT_EQ(from_file[0].items, 2048);
  EXPECT_FALSE(from_file[0].host);
  EXPECT_EQ(from_file[1].items, 8192);
  EXPECT_TRUE(from_file[1].host);
  Tuning missing;
  ASSERT_TRUE(missing.Set("lookup_path_table", dir / "none.txt").ok());
  EXPECT_EQ(PathTable(missing).size(), built_in.size()) << "an unreadable file gives the built-in points";
  ASSERT_TRUE(t.Set("host_gather_min_items", "100").ok());
  const std::vector<PathPoint> threshold = PathTable(t);
  ASSERT_EQ(threshold.size(), 1u) << "the threshold wins over the file";
  EXPECT_TRUE(threshold[0].threshold);
  EXPECT_EQ(threshold[0].items, 100);
  EXPECT_EQ(PathFromTuning(Tuning{}), LookupPath::kAuto);
  for (const char* host : {"host", "host_gather"}) {
    Tuning h;
    ASSERT_TRUE(h.Set("lookup_path", host).ok());
    EXPECT_EQ(PathFromTuning(h), LookupPath::kHostGather);
  }
  Tuning u;
  ASSERT_TRUE(u.Set("lookup_path", "uva").ok());
  EXPECT_EQ(PathFromTuning(u), LookupPath::kUva);
}

std::vector<int32_t> Concat(const std::vector<std::vector<int32_t>>& parts) {
  std::vector<int32_t> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

TEST(DpAgreement, ShardAndSplitFactsMustHoldForAllAndTheKnobsAreRankZeros) {
  Tuning zero, one;
  ASSERT_TRUE(zero.Set("dp_chunk_kib", "1024").ok());
  ASSERT_TRUE(zero.Set("dp_peer_max_slot", "64").ok());
  ASSERT_TRUE(one.Set("dp_chunk_kib", "8").ok());
  ASSERT_TRUE(one.Set("dp_a2a", "sequential").ok());
  ASSERT_TRUE(one.Set("dp_nccl_blocking", "1").ok());
  ASSERT_TRUE(one.Set("dp_graph_max_slot", "4").ok());  // rank 1 alone would not capture a slot of 16
  const auto all = Concat({DpAgreementMine(zero, true, true), DpAgreementMine(one, false, true)});
  const DpAgreement a = DecideDpAgreement(all, 2, 16);
  EXPECT_FALSE(a.all_on_gpu) << "member 1's shard is on the host";
  EXPECT_TRUE(a.all_split);
  EXPECT_EQ(a.chunk_bytes, 1024 * 1024) << "rank 0's chunk";
  EXPECT_EQ(a.peer_max_slot, 64);
  EXPECT_FALSE(a.sequential) << "rank 1's dp_a2a is not the group's";
  EXPECT_FALSE(a.blocking);
  EXPECT_TRUE(a.graph) << "auto: a slot of 16 is within rank 0's (default) graph limit, not rank 1's 4";
  // Rank 0's knob decides: with the members swapped, rank 1's 4 is now rank 0's.
  const DpAgreement b =
      DecideDpAgreement(Concat({DpAgreementMine(one, true, true), DpAgreementMine(zero, true, true)}), 2, 16);
  EXPECT_TRUE(b.sequential);
  EXPECT_TRUE(b.blocking);
  EXPECT_EQ(b.chunk_bytes, 8 * 1024);
  Tuning small_graphs;
  ASSERT_TRUE(small_graphs.Set("dp_graph_max_slot", "4").ok());
  EXPECT_FALSE(
      DecideDpAgreement(Concat({DpAgreementMine(small_graphs, true, true), DpAgreementMine(zero, true, true)}), 2, 16)
          .graph)
      << "rank 0 captures slots up to 4 only";
}

TEST(DpAgreement, TheFormFollowsTheSlotAndTheDefaults) {
  const auto defaults = Concat({DpAgreementMine(Tuning{}, true, false), DpAgreementMine(Tuning{}, true, true)});
  const DpAgreement small = DecideDpAgreement(defaults, 2, tuning_default::kDpGraphMaxSlot);
  EXPECT_TRUE(small.graph);
  EXPECT_TRUE(small.all_on_gpu);
  EXPECT_FALSE(small.all_split) << "member 0 cannot split";
  EXPECT_EQ(small.chunk_bytes, tuning_default::kDpChunkBytes);
  EXPECT_EQ(small.peer_max_slot, tuning_default::kDpPeerMaxSlot);
  const DpAgreement large = DecideDpAgreement(defaults, 2, tuning_default::kDpGraphMaxSlot + 1);
  EXPECT_FALSE(large.graph);
  EXPECT_FALSE(large.sequential);
  Tuning seq;
  ASSERT_TRUE(seq.Set("dp_a2a", "sequential").ok());
  EXPECT_TRUE(DecideDpAgreement(DpAgreementMine(seq, true, true), 1, 1).sequential);
  // A short or empty gather decides nothing rather than reading past it.
  const DpAgreement none = DecideDpAgreement({1, 2}, 2, 1);
  EXPECT_FALSE(none.all_on_gpu);
  EXPECT_FALSE(none.graph);
}

}  // namespace
}  // namespace engram::client
