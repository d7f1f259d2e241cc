// libengram_client's CUDA backend: a private table registered in chunks and a DEVICE table on the GPU, driven by
// DeviceEngine (hash, lookup, prefetch) and compared with the CPU reference over the same records, bit for bit.
// Skips cleanly without a GPU.
#include <cuda_runtime_api.h>

#include <random>

#include "client/cuda_backend.h"
#include "client/device_engine.h"
#include "client/lookup_engine.h"
#include "client/engram_client.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using testing::DeviceBuffer;

TEST(GpuClientTest, PrivateAndDeviceTablesMatchTheCpuReference) {
  SKIP_WITHOUT_GPU();
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 64;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  client::ClientOptions opts;
  opts.socket = dir / "no-daemon.sock";
  opts.timeout = std::chrono::milliseconds(200);
  opts.register_chunk_bytes = size_t{2} << 20;  // many chunks: exercises chunked registration
  auto c = client::Client::Connect(opts);
  ASSERT_TRUE(c.ok());
  client::AttachRequest req;
  req.checkpoint = spec.out_dir;
  req.dp_size = 2;
  req.tp_size = 2;
  req.tp_rank = 1;
  auto pinned = (*c)->Attach(req);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ((*pinned)->mode(), client::Mode::kPrivatePinned);
  EXPECT_EQ((*pinned)->backend(), client::Backend::kCuda);
  EXPECT_GE((*pinned)->register_seconds(), 0.0);
  req.cpu_offload = false;
  auto device = (*c)->Attach(req);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ((*device)->mode(), client::Mode::kDevice);
  EXPECT_EQ((*device)->records(0), nullptr) << "the DEVICE table keeps no host copy";

  std::mt19937_64 rng(std::random_device{}());
  const auto& ref = **pinned;
  const int T = 1000, L = static_cast<int>(ref.layers().size()), C = static_cast<int>(ref.n_cols());
  const int64_t D = ref.head_dim();
  std::vector<int32_t> tokens(T), qsl = {0, 400, T}, ids(static_cast<size_t>(T * L * C));
  std::vector<int64_t> pos(T);
  for (int i = 0; i < T; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(ref.token_map().raw_size()));
    pos[i] = i < 400 ? i : i - 400 + 7;
  }
  std::vector<int32_t> lookback(2 * (ref.layout().max_ngram() - 1), 3);
  ASSERT_TRUE(ref.Hash({tokens, pos, qsl, lookback, {}}, ids).ok());
  for (const auto* table : {pinned->get(), device->get()}) {
    auto engine = client::LookupEngine::Create(*table, T, nullptr);  // the CUDA backend's DeviceEngine
    ASSERT_TRUE(engine.ok()) << engine.status();
    DeviceBuffer<int32_t> dt(tokens), dq(qsl), dl(lookback), did(ids.size());
    DeviceBuffer<int64_t> dp(pos);
    DeviceBuffer<uint16_t> rows(static_cast<size_t>(T * C * D));
    did.Fill(0xA5);
    ASSERT_TRUE((*engine)->Hash(dt.get(), dp.get(), dq.get(), dl.get(), nullptr, T, 2, did.get()).ok());
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(did.Download(), ids);
    ASSERT_TRUE((*engine)->Prefetch(did.get(), T).ok());
    for (int l = 0; l < L; ++l) {
      ASSERT_TRUE((*engine)->Wait(l).ok());
      rows.Fill(0xFF);
      ASSERT_TRUE((*engine)->Lookup(l, did.get() + l * C, T, L * C, rows.get(), false).ok());
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<int32_t> layer_ids;
      for (int t = 0; t < T; ++t) {
        for (int col = 0; col < C; ++col) layer_ids.push_back(ids[static_cast<size_t>((t * L + l) * C + col)]);
      }
      std::vector<uint16_t> want(layer_ids.size() * static_cast<size_t>(D));
      ASSERT_TRUE(ref.Lookup(l, layer_ids, want).ok());
      EXPECT_EQ(rows.Download(), want) << "layer " << l;
      std::vector<uint16_t> staged(want.size());
      CUDA_OK(cudaMemcpy(staged.data(), (*engine)->staging(l), staged.size() * 2, cudaMemcpyDeviceToHost));
      EXPECT_EQ(staged, want) << "prefetched layer " << l;
    }
    EXPECT_FALSE((*engine)->Lookup(L, did.get(), T, L * C, rows.get(), false).ok());
    EXPECT_FALSE((*engine)->Hash(dt.get(), dp.get(), dq.get(), nullptr, nullptr, T + 1, 2, did.get()).ok());
  }
}

TEST(GpuClientTest, ChunkedRegistrationRollsBackOnFailure) {
  SKIP_WITHOUT_GPU();
  const size_t bytes = size_t{20} << 20, chunk = size_t{2} << 20;
  std::vector<uint8_t> buf(bytes + 4096);
  uint8_t* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 4095) & ~uintptr_t{4095});
  int failed = -1;
  auto bad = client::HostRegistration::Register(p, bytes, chunk, &failed, /*fail_at_chunk=*/3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(failed, 3);
  EXPECT_NE(bad.status().message().find("chunk 3"), std::string::npos) << bad.status();
  // Chunks 0..2 were unregistered: the whole range registers again (it would fail as already registered).
  auto good = client::HostRegistration::Register(p, bytes, chunk, &failed);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_GE((*good)->seconds(), 0.0);
}

}  // namespace
}  // namespace engram
