// LookupEngine on the CPU backend (what CI has): the same calls as on the GPU, over host pointers. Its rows (bf16
// and packed, direct and prefetched into the staging buffers) equal the independent row oracle's reading of the
// checkpoint (tools/row_oracle.h), and the first rows also the generator's formula; its hash ids equal the Table's.
// Every misuse is a Status. Uses a private table (no daemon) built from a generated checkpoint.
#include <sys/stat.h>

#include <random>

#include "client/fault_points.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "gtest/gtest.h"
#include "model/fp8.h"
#include "model/layout.h"
#include "model/reference.h"
#include "model/token_map.h"
#include "tests/oracle.h"
#include "tests/test_util.h"
#include "tools/row_oracle.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

TEST(LookupEngineTest, CpuBackendRunsTheSameCallsAsTheGpu) {
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 8;
  spec.head_dim = 256;
  spec.hidden = 64;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  client::ClientOptions opts;
  opts.socket = dir / "none.sock";
  opts.timeout = std::chrono::milliseconds(100);
  opts.use_gpu = false;
  auto c = client::Client::Create(opts);
  client::AttachRequest req;
  req.checkpoint = spec.out_dir;
  req.dp_size = 2;
  auto table = (*c)->Attach(req);
  ASSERT_TRUE(table.ok()) << table.status();
  const auto& t = **table;
  EXPECT_EQ(t.backend(), client::Backend::kCpu);
  EXPECT_EQ(t.device_records(0), nullptr);
  EXPECT_EQ(t.col_begin(), 0);
  EXPECT_EQ(t.col_end(), t.n_cols());

  std::string oracle_error;
  auto oracle = oracle::RowOracle::Open(spec.out_dir, &oracle_error);
  ASSERT_NE(oracle, nullptr) << oracle_error;
  const int T = 64, L = static_cast<int>(t.layers().size()), C = static_cast<int>(t.n_cols());
  const int64_t D = t.head_dim();
  auto engine = client::LookupEngine::Create(t, T);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->backend(), client::Backend::kCpu);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> tokens(T), qsl = {0, 30, T}, ids(static_cast<size_t>(T * L * C), -9), want(ids.size());
  std::vector<int64_t> pos(T);
  for (int i = 0; i < T; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(t.token_map().raw_size()));
    pos[i] = i < 30 ? i : i - 30;
  }
  ASSERT_TRUE(HashIdsCpu(t.layout(), t.token_map(), {tokens, pos, qsl, {}, {}}, want).ok());
  ASSERT_TRUE((*engine)->Hash(tokens.data(), pos.data(), qsl.data(), nullptr, nullptr, T, 2, ids.data()).ok());
  EXPECT_EQ(ids, want);
  ASSERT_TRUE((*engine)->Prefetch(ids.data(), T).ok());
  for (int l = 0; l < L; ++l) {
    ASSERT_TRUE((*engine)->Wait(l).ok());
    std::vector<int32_t> flat;
    for (int i = 0; i < T; ++i) {
      for (int col = 0; col < C; ++col) flat.push_back(ids[static_cast<size_t>((i * L + l) * C + col)]);
    }
    // Expected rows from the oracle (packed records and their bf16 rows).
    const size_t rb = static_cast<size_t>(D + D / 32);
    std::vector<uint16_t> ref;
    std::vector<uint8_t> ref_packed;
    for (int32_t id : flat) {
      std::string error;
      auto rec = oracle->RecordAt(l, id, &error);
      ASSERT_TRUE(rec.has_value()) << error;
      ref_packed.insert(ref_packed.end(), rec->begin(), rec->end());
      const auto row = oracle::DequantBf16Row(*rec, D);
      ref.insert(ref.end(), row.begin(), row.end());
    }
    std::vector<uint16_t> got(ref.size(), 0xFFFF);
    ASSERT_TRUE((*engine)->Lookup(l, ids.data() + l * C, T, L * C, got.data(), false).ok());
    EXPECT_EQ(got, ref) << "layer " << l;
    EXPECT_TRUE(std::equal(ref.begin(), ref.end(), (*engine)->staging(l))) << "prefetched layer " << l;
    std::vector<uint8_t> packed(flat.size() * rb, 0xAB);
    ASSERT_TRUE((*engine)->Lookup(l, ids.data() + l * C, T, L * C, packed.data(), true).ok());
    EXPECT_EQ(packed, ref_packed) << "packed layer " << l;
    // The first looked-up row, byte for byte as the generator wrote it.
    const std::string base = "layers." + std::to_string(t.layers()[static_cast<size_t>(l)].layer_id) + ".engram.";
    for (int64_t j = 0; j < D; ++j) {
      ASSERT_EQ(
          packed[static_cast<size_t>(j)],
          tools::SyntheticByte(spec.seed, base + "embed.weight", static_cast<uint64_t>(flat[0] * D + j), false, false));
    }
    for (int64_t j = 0; j < D / 32; ++j) {
      ASSERT_EQ(packed[static_cast<size_t>(D + j)],
                tools::SyntheticByte(spec.seed, base + "embed.scale", static_cast<uint64_t>(flat[0] * (D / 32) + j),
                                     true, false));
    }
  }
  // Gate through the engine equals the float64 oracle.
  const int HC = 4, H = 64;
  auto hidden = testing::RandomBf16(rng, static_cast<size_t>(T * HC * H), 1.f);
  auto kv = testing::RandomBf16(rng, static_cast<size_t>(T * (HC + 1) * H), 1.f);
  auto q = testing::RandomBf16(rng, static_cast<size_t>(HC * H), 1.f),
       k = testing::RandomBf16(rng, static_cast<size_t>(HC * H), 1.f);
  std::vector<uint16_t> out(hidden.size(), 0xFFFF);
  ASSERT_TRUE(
      (*engine)->Gate({hidden.data(), kv.data(), q.data(), k.data(), nullptr, out.data(), T, HC, H, 1e-6f}).ok());
  EXPECT_LE(testing::GateViolation(T, HC, H, 1e-6, hidden, kv, q, k, {}, out), 0.0);
  // Misuse.
  EXPECT_FALSE((*engine)->Hash(tokens.data(), pos.data(), qsl.data(), nullptr, nullptr, T + 1, 2, ids.data()).ok());
  EXPECT_FALSE((*engine)->Hash(nullptr, pos.data(), qsl.data(), nullptr, nullptr, T, 2, ids.data()).ok());
  EXPECT_FALSE((*engine)->Lookup(L, ids.data(), T, L * C, out.data(), false).ok());
  EXPECT_FALSE((*engine)->Lookup(0, ids.data(), T, C - 1, out.data(), false).ok());
  EXPECT_FALSE((*engine)->Lookup(0, nullptr, T, L * C, out.data(), false).ok());
  EXPECT_FALSE((*engine)->Gate({}).ok());
  EXPECT_FALSE((*engine)->Wait(L).ok());
  std::vector<int32_t> bad = tokens;
  bad[3] = static_cast<int32_t>(t.token_map().raw_size());
  EXPECT_FALSE((*engine)->Hash(bad.data(), pos.data(), qsl.data(), nullptr, nullptr, T, 2, ids.data()).ok());
  EXPECT_FALSE(client::LookupEngine::Create(t, 0).ok());
}

// The CPU engine's staging, allocated on the first Prefetch, failing part way (layer 1 of its buffers): Prefetch
// says so and the engine is unchanged; once memory is there again, the next Prefetch works and its rows are right.
TEST(LookupEngineTest, AStagingAllocationThatFailsLeavesTheEngineWhole) {
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 4;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  client::ClientOptions opts;
  opts.socket = dir / "none.sock";
  opts.timeout = std::chrono::milliseconds(100);
  opts.use_gpu = false;
  auto c = client::Client::Create(opts);
  ASSERT_TRUE(c.ok()) << c.status();
  client::AttachRequest req;
  req.checkpoint = spec.out_dir;
  auto table = (*c)->Attach(req);
  ASSERT_TRUE(table.ok()) << table.status();
  const auto& t = **table;
  const int T = 8, L = static_cast<int>(t.layers().size()), C = static_cast<int>(t.n_cols());
  ASSERT_GE(L, 2) << "the fault is at the second layer's buffer";
  auto engine = client::LookupEngine::Create(t, T);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> tokens(T), qsl = {0, T}, ids(static_cast<size_t>(T * L * C), -9);
  std::vector<int64_t> pos(T);
  for (int i = 0; i < T; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(t.token_map().raw_size()));
    pos[i] = i;
  }
  ASSERT_TRUE((*engine)->Hash(tokens.data(), pos.data(), qsl.data(), nullptr, nullptr, T, 1, ids.data()).ok());
  client::SetFaultHook(
      [](client::FaultPoint p, int64_t arg) { return p == client::FaultPoint::kCpuStaging && arg == 1; });
  const absl::Status failed = (*engine)->Prefetch(ids.data(), T);
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  EXPECT_NE(failed.message().find("could not be allocated"), std::string::npos) << failed;
  EXPECT_EQ((*engine)->staging(0), nullptr) << "no buffer of a half-made staging is handed out";
  client::SetFaultHook(nullptr);
  ASSERT_TRUE((*engine)->Prefetch(ids.data(), T).ok());
  const int64_t D = t.head_dim();
  for (int l = 0; l < L; ++l) {
    ASSERT_NE((*engine)->staging(l), nullptr) << "layer " << l;
    std::vector<uint16_t> want(static_cast<size_t>(T * C * D), 0xFFFF);
    ASSERT_TRUE((*engine)->Lookup(l, ids.data() + l * C, T, L * C, want.data(), false).ok());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*engine)->staging(l))) << "prefetched layer " << l;
  }
}

TEST(LookupEngineTest, PleCheckpointsAreRefusedHonestly) {
  testing::TempDir dir;
  ::mkdir((dir / "ple").c_str(), 0755);
  testing::WriteFile(dir / "ple/config.json",
                     R"({"architectures": ["Qwen4ExpForCausalLM"], "ple_layer_ids": [0, 1], "hidden_size": 64})");
  std::string header = R"({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})";
  std::string le(8, '\0');
  for (int i = 0; i < 8; ++i) le[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  testing::WriteFile(dir / "ple/model.safetensors", le + header + "z");
  client::ClientOptions opts;
  opts.socket = dir / "none.sock";
  opts.timeout = std::chrono::milliseconds(100);
  auto c = client::Client::Create(opts);
  client::AttachRequest req;
  req.checkpoint = dir / "ple";
  auto table = (*c)->Attach(req);
  ASSERT_FALSE(table.ok());
  EXPECT_NE(table.status().message().find("MODEL_NOT_SHAREABLE"), std::string::npos) << table.status();
}

}  // namespace
}  // namespace engram
