// GPU kernels against the CPU reference (model/reference.h): fresh random inputs every run, outputs poisoned
// before each launch. Hash ids and lookup rows must be equal bit for bit; the gate within bf16 rounding of the
// float64 oracle and never NaN. Exits 77 (ctest skip) without a GPU; a CUDA error fails.
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "client/engine/prefetch.h"
#include "gtest/gtest.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"
#include "model/fp8.h"
#include "model/reference.h"
#include "tests/gpu/gpu_util.h"
#include "tests/oracle.h"
#include "tests/test_util.h"

extern char** environ;

namespace engram {
namespace {

using kernels::DeviceLayout;
using testing::DeviceBuffer;

// Token counts to cover; ENGRAM_GPU_QUICK=1 (used under compute-sanitizer) keeps the small ones.
std::vector<int> Sizes() {
  if (std::getenv("ENGRAM_GPU_QUICK")) return {1, 2, 4, 127};
  return {1, 2, 4, 127, 4096, 8192};
}

uint64_t Seed() {
  const uint64_t s = std::random_device{}();
  std::cout << "[ seed ] " << s << "\n";
  return s;
}

// A random batch of requests covering T tokens: random chunk starts, lookback with unknowns, DEAD spans.
struct Batch {
  std::vector<int32_t> tokens, qsl, lookback;
  std::vector<int64_t> positions;
  std::vector<uint8_t> dead;
};

Batch RandomBatch(std::mt19937_64& rng, int T, int64_t vocab, int64_t N) {
  Batch b;
  b.qsl.push_back(0);
  int left = T;
  while (left > 0) {
    const int n = std::min<int>(left, 1 + static_cast<int>(rng() % std::max(1, T / 3 + 1)));
    const int64_t start = static_cast<int64_t>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      b.tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
      b.positions.push_back(start + i);
      b.dead.push_back(rng() % 13 == 0);
    }
    for (int64_t k = 0; k < N - 1; ++k) {
      b.lookback.push_back(rng() % 5 == 0 ? -1 : static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
    }
    left -= n;
    b.qsl.push_back(static_cast<int32_t>(b.tokens.size()));
  }
  return b;
}

TokenMap RandomMap(std::mt19937_64& rng, int64_t raw, int64_t compressed) {
  std::vector<int32_t> ids(static_cast<size_t>(raw));
  for (int64_t i = 0; i < raw; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>(i < compressed ? i : rng() % compressed);
  return TokenMap::FromIds(ids);
}

TEST(GpuHashTest, EqualsTheCpuReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  for (const char* name : {"v41-flash", "bytelevel-hash", "three-layers-tiny-vocab", "nested-text-config"}) {
    auto cfg = LoadEngramConfig(testing::DataPath(std::string("configs/") + name + ".json"));
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    auto layout = Layout::Build(*cfg);
    ASSERT_TRUE(layout.ok());
    const int64_t cv = cfg->compressed_vocab_size;
    TokenMap map = RandomMap(rng, cv + cv / 3 + 3, cv);
    auto dl = DeviceLayout::Upload(*layout, map);
    ASSERT_TRUE(dl.ok()) << dl.status();
    for (int T : Sizes()) {
      SCOPED_TRACE(std::string(name) + " T=" + std::to_string(T));
      Batch b = RandomBatch(rng, T, map.raw_size(), layout->max_ngram());
      const size_t n_out = static_cast<size_t>(T * layout->n_layers() * layout->n_cols());
      std::vector<int32_t> want(n_out, -5);
      ASSERT_TRUE(HashIdsCpu(*layout, map, {b.tokens, b.positions, b.qsl, b.lookback, b.dead}, want).ok());
      DeviceBuffer<int32_t> tokens(b.tokens), qsl(b.qsl), lookback(b.lookback), out(n_out), err(1);
      DeviceBuffer<int64_t> pos(b.positions);
      DeviceBuffer<uint8_t> dead(b.dead);
      out.Fill(0xA5);
      err.Fill(0);
      kernels::HashArgs a{
          tokens.get(), pos.get(), qsl.get(), lookback.get(), dead.get(), T, static_cast<int32_t>(b.qsl.size() - 1),
          out.get(),    err.get()};
      CUDA_OK(kernels::LaunchHash((*dl)->view(), a, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_EQ(out.Download(), want);
      ASSERT_EQ(err.Download()[0], 0);
    }
  }
}

// A lookback dead mask (random flags, on known and unknown ids alike): the kernel equals the CPU reference, and the
// mask changes some ids (it is read).
TEST(GpuHashTest, DeadLookbackIdsEqualTheCpuReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  for (const char* name : {"v41-flash", "bytelevel-hash", "three-layers-tiny-vocab"}) {
    auto cfg = LoadEngramConfig(testing::DataPath(std::string("configs/") + name + ".json"));
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    auto layout = Layout::Build(*cfg);
    ASSERT_TRUE(layout.ok());
    const int64_t cv = cfg->compressed_vocab_size;
    TokenMap map = RandomMap(rng, cv + cv / 3 + 3, cv);
    auto dl = DeviceLayout::Upload(*layout, map);
    ASSERT_TRUE(dl.ok()) << dl.status();
    for (int T : Sizes()) {
      SCOPED_TRACE(std::string(name) + " T=" + std::to_string(T));
      Batch b = RandomBatch(rng, T, map.raw_size(), layout->max_ngram());
      std::vector<uint8_t> lookback_dead(b.lookback.size());
      for (auto& f : lookback_dead) f = rng() % 3 == 0;
      const size_t n_out = static_cast<size_t>(T * layout->n_layers() * layout->n_cols());
      std::vector<int32_t> want(n_out, -5), plain(n_out, -5);
      ASSERT_TRUE(
          HashIdsCpu(*layout, map, {b.tokens, b.positions, b.qsl, b.lookback, b.dead, lookback_dead}, want).ok());
      ASSERT_TRUE(HashIdsCpu(*layout, map, {b.tokens, b.positions, b.qsl, b.lookback, b.dead}, plain).ok());
      DeviceBuffer<int32_t> tokens(b.tokens), qsl(b.qsl), lookback(b.lookback), out(n_out), err(1);
      DeviceBuffer<int64_t> pos(b.positions);
      DeviceBuffer<uint8_t> dead(b.dead), lb_dead(lookback_dead);
      out.Fill(0xA5);
      err.Fill(0);
      kernels::HashArgs a{
          tokens.get(), pos.get(), qsl.get(), lookback.get(), dead.get(), T, static_cast<int32_t>(b.qsl.size() - 1),
          out.get(),    err.get()};
      a.lookback_dead = lb_dead.get();
      CUDA_OK(kernels::LaunchHash((*dl)->view(), a, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_EQ(out.Download(), want);
      ASSERT_EQ(err.Download()[0], 0);
      if (T >= 127) EXPECT_NE(want, plain) << "the mask changed no id";
      // A mask without lookback ids is misuse.
      kernels::HashArgs bad = a;
      bad.lookback = nullptr;
      EXPECT_EQ(kernels::LaunchHash((*dl)->view(), bad, nullptr), cudaErrorInvalidValue);
    }
  }
}

TEST(GpuHashTest, RaisesTheErrorFlagForIdsOutsideTheMap) {
  REQUIRE_GPU();
  auto cfg = LoadEngramConfig(testing::DataPath("configs/bytelevel-hash.json"));
  auto layout = Layout::Build(*cfg);
  std::mt19937_64 rng(Seed());
  TokenMap map = RandomMap(rng, 300, 256);
  auto dl = DeviceLayout::Upload(*layout, map);
  ASSERT_TRUE(dl.ok());
  std::vector<int32_t> tokens = {1, 2, 300, 4}, qsl = {0, 4};
  std::vector<int64_t> pos = {0, 1, 2, 3};
  DeviceBuffer<int32_t> dt(tokens), dq(qsl), out(4 * 18), err(1);
  DeviceBuffer<int64_t> dp(pos);
  err.Fill(0);
  kernels::HashArgs a{dt.get(), dp.get(), dq.get(), nullptr, nullptr, 4, 1, out.get(), err.get()};
  CUDA_OK(kernels::LaunchHash((*dl)->view(), a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(err.Download()[0], 1);
  kernels::HashArgs bad = a;
  bad.num_requests = 0;
  EXPECT_EQ(kernels::LaunchHash((*dl)->view(), bad, nullptr), cudaErrorInvalidValue);
}

// Random records for rows [row_begin, row_end), every scale byte included.
std::vector<uint8_t> RandomRecords(std::mt19937_64& rng, int64_t rows, int64_t D) {
  std::vector<uint8_t> r(static_cast<size_t>(rows * (D + D / 32)));
  for (auto& b : r) b = static_cast<uint8_t>(rng());
  return r;
}

// Ids: random inside and around the owned range, negatives, and the first and last row of every column bucket.
std::vector<int32_t> LookupIds(std::mt19937_64& rng, int T, int C, int64_t stride, int64_t begin, int64_t end,
                               const std::vector<int64_t>& edges) {
  std::vector<int32_t> ids(static_cast<size_t>(T * stride), 0);
  size_t e = 0;
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < C; ++c) {
      int64_t id;
      const uint64_t k = rng() % 16;
      if (k == 0)
        id = -1 - static_cast<int64_t>(rng() % 5);
      else if (k == 1)
        id = end + static_cast<int64_t>(rng() % 5);
      else if (k == 2)
        id = begin - 1;
      else if (k < 6 && !edges.empty())
        id = edges[e++ % edges.size()];
      else
        id = begin + static_cast<int64_t>(rng() % static_cast<uint64_t>(end - begin));
      ids[static_cast<size_t>(t * stride + c)] = static_cast<int32_t>(id);
    }
  }
  return ids;
}

enum class Residency { kDevice, kHostUva };

TEST(GpuLookupTest, EqualsTheCpuReferenceBitForBit) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  for (int64_t D : {256, 64, 512}) {
    const int64_t rb = D + D / 32, begin = 1000, rows = 50000, end = begin + rows;
    std::vector<uint8_t> records = RandomRecords(rng, rows, D);
    // Column buckets inside the owned range: edges are each bucket's first and last row.
    std::vector<int64_t> edges;
    for (int64_t b = begin; b < end; b += 4999) {
      edges.push_back(b);
      edges.push_back(std::min(b + 4998, end - 1));
    }
    for (Residency where : {Residency::kDevice, Residency::kHostUva}) {
      const uint8_t* table = nullptr;
      DeviceBuffer<uint8_t> dev_table(records.size());
      std::vector<uint8_t> host_copy;
      if (where == Residency::kDevice) {
        dev_table.Upload(records);
        table = dev_table.get();
      } else {
        host_copy = records;
        CUDA_OK(
            cudaHostRegister(host_copy.data(), host_copy.size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
        void* dptr = nullptr;
        CUDA_OK(cudaHostGetDevicePointer(&dptr, host_copy.data(), 0));
        table = static_cast<const uint8_t*>(dptr);
      }
      RecordTable cpu{records.data(), begin, end, D};
      for (int T : Sizes()) {
        for (int max_blocks : {0, 3}) {
          SCOPED_TRACE("D=" + std::to_string(D) + " T=" + std::to_string(T) + " uva=" +
                       std::to_string(where == Residency::kHostUva) + " max_blocks=" + std::to_string(max_blocks));
          const int C = 24;
          const int64_t stride = 48;  // the second layer's columns of a [T, 2, 24] hash output
          std::vector<int32_t> ids = LookupIds(rng, T, C, stride, begin, end, edges);
          std::vector<int32_t> flat;
          for (int t = 0; t < T; ++t) {
            for (int c = 0; c < C; ++c) flat.push_back(ids[static_cast<size_t>(t * stride + c)]);
          }
          std::vector<uint16_t> want(flat.size() * static_cast<size_t>(D));
          ASSERT_TRUE(LookupBf16Cpu(cpu, flat, want).ok());
          std::vector<uint8_t> want_packed(flat.size() * static_cast<size_t>(rb));
          ASSERT_TRUE(LookupPackedCpu(cpu, flat, want_packed).ok());
          DeviceBuffer<int32_t> d_ids(ids);
          DeviceBuffer<uint16_t> out(want.size());
          DeviceBuffer<uint8_t> out_packed(want_packed.size());
          // Large batches also go through the sorted (row-order) gather when given scratch.
          const bool sort = max_blocks == 0 && T >= 4096;
          const size_t scratch_bytes = sort ? kernels::LookupSortScratchBytes(static_cast<int64_t>(T) * C) : 0;
          DeviceBuffer<uint8_t> scratch(scratch_bytes);
          out.Fill(0xFF);
          out_packed.Fill(0xCD);
          kernels::LookupArgs a;
          a.records = table;
          a.row_begin = begin;
          a.row_end = end;
          a.head_dim = static_cast<int32_t>(D);
          a.ids = d_ids.get();
          a.num_tokens = T;
          a.num_cols = C;
          a.ids_stride = stride;
          a.out = out.get();
          a.max_blocks = max_blocks;
          a.sort_scratch = sort ? scratch.get() : nullptr;
          a.sort_scratch_bytes = scratch_bytes;
          CUDA_OK(kernels::LaunchLookup(a, nullptr));
          a.out = out_packed.get();
          a.packed = true;
          CUDA_OK(kernels::LaunchLookup(a, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          ASSERT_EQ(out.Download(), want);
          ASSERT_EQ(out_packed.Download(), want_packed);
        }
      }
      if (where == Residency::kHostUva) CUDA_OK(cudaHostUnregister(host_copy.data()));
    }
  }
}

TEST(GpuLookupTest, SortedGatherNeedsEnoughScratch) {
  REQUIRE_GPU();
  const int T = 1024, C = 24;
  std::vector<int32_t> ids(static_cast<size_t>(T * C), 3);
  // A host table (registered, read through UVA): only those are gathered in row order.
  std::vector<uint8_t> table(100 * 264, 1);
  CUDA_OK(cudaHostRegister(table.data(), table.size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
  void* host_table = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&host_table, table.data(), 0));
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<uint8_t> d_table(table), scratch(64);
  DeviceBuffer<uint16_t> out(ids.size() * 256);
  kernels::LookupArgs a;
  a.records = static_cast<const uint8_t*>(host_table);
  a.row_end = 100;
  a.head_dim = 256;
  a.ids = d_ids.get();
  a.num_tokens = T;
  a.num_cols = C;
  a.ids_stride = C;
  a.out = out.get();
  a.sort_scratch = scratch.get();
  a.sort_scratch_bytes = 64;
  const kernels::LookupTuning saved = kernels::GetLookupTuning();
  kernels::LookupTuning sort_all = saved;
  sort_all.sort_min_items = 1;  // this batch takes the sorted gather whatever the default threshold
  kernels::SetLookupTuning(sort_all);
  EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaErrorInvalidValue);
  // Records in HBM are never sorted: the same launch over a device copy of the table needs no scratch at all.
  a.records = d_table.get();
  EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  kernels::SetLookupTuning(saved);
  CUDA_OK(cudaHostUnregister(table.data()));
  EXPECT_GT(kernels::LookupSortScratchBytes(static_cast<int64_t>(T) * C), 4u * T * C * 4);
}

// Every variant of the row-order gather (grid-stride or block runs, 4 or 8 rows per warp), at every batch size
// from one item up (the threshold forced to 1), from a registered host table through UVA: the reference's bits.
TEST(GpuLookupTest, EveryRowOrderVariantEqualsTheCpuReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  const kernels::LookupTuning saved = kernels::GetLookupTuning();
  for (int64_t D : {256, 512}) {
    const int64_t begin = 700, rows = 40000, end = begin + rows;
    std::vector<uint8_t> records = RandomRecords(rng, rows, D);
    std::vector<uint8_t> host_copy = records;
    CUDA_OK(cudaHostRegister(host_copy.data(), host_copy.size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
    void* dptr = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&dptr, host_copy.data(), 0));
    const RecordTable cpu{records.data(), begin, end, D};
    const std::vector<int64_t> edges = {begin, end - 1};
    for (int T : {1, 5, 333, std::getenv("ENGRAM_GPU_QUICK") ? 600 : 5000}) {
      const int C = 24;
      const int64_t stride = 48;
      std::vector<int32_t> ids = LookupIds(rng, T, C, stride, begin, end, edges);
      std::vector<int32_t> flat;
      for (int t = 0; t < T; ++t) {
        for (int c = 0; c < C; ++c) flat.push_back(ids[static_cast<size_t>(t * stride + c)]);
      }
      std::vector<uint16_t> want(flat.size() * static_cast<size_t>(D));
      ASSERT_TRUE(LookupBf16Cpu(cpu, flat, want).ok());
      DeviceBuffer<int32_t> d_ids(ids);
      DeviceBuffer<uint16_t> out(want.size());
      const size_t scratch_bytes = kernels::LookupSortScratchBytes(static_cast<int64_t>(T) * C);
      DeviceBuffer<uint8_t> scratch(scratch_bytes);
      for (int variant = 0; variant < 4; ++variant) {
        SCOPED_TRACE("D=" + std::to_string(D) + " T=" + std::to_string(T) + " variant=" + std::to_string(variant));
        kernels::LookupTuning t = saved;
        t.sort_min_items = 1;
        t.sort_variant = variant;
        kernels::SetLookupTuning(t);
        ASSERT_EQ(kernels::GetLookupTuning().sort_variant, variant);
        out.Fill(0xFF);
        kernels::LookupArgs a;
        a.records = static_cast<const uint8_t*>(dptr);
        a.row_begin = begin;
        a.row_end = end;
        a.head_dim = static_cast<int32_t>(D);
        a.ids = d_ids.get();
        a.num_tokens = T;
        a.num_cols = C;
        a.ids_stride = stride;
        a.out = out.get();
        a.sort_scratch = scratch.get();
        a.sort_scratch_bytes = scratch_bytes;
        CUDA_OK(kernels::LaunchLookup(a, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        ASSERT_EQ(out.Download(), want);
      }
    }
    kernels::SetLookupTuning(saved);
    CUDA_OK(cudaHostUnregister(host_copy.data()));
  }
}

// Every shape of the plain gather (1, 2, 4, 8 rows in flight per warp x 1, 2, 4, 8 warps per block), bf16 and
// packed, head_dim 256 and 512 (and 64: the byte kernels, which take any shape), at decode sizes and past one
// persistent grid: the reference's bits, nothing written outside the output.
TEST(GpuLookupTest, EveryPlainShapeEqualsTheCpuReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  for (int64_t D : {256, 512, 64}) {
    const int64_t rb = D + D / 32, begin = 300, rows = 20000, end = begin + rows;
    std::vector<uint8_t> records = RandomRecords(rng, rows, D);
    std::vector<uint8_t> host_copy = records;
    CUDA_OK(cudaHostRegister(host_copy.data(), host_copy.size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
    void* dptr = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&dptr, host_copy.data(), 0));
    const RecordTable cpu{records.data(), begin, end, D};
    const std::vector<int64_t> edges = {begin, end - 1};
    for (int T : {1, 3, 64, 700}) {
      const int C = 24;
      const int64_t stride = 48;
      std::vector<int32_t> ids = LookupIds(rng, T, C, stride, begin, end, edges);
      std::vector<int32_t> flat;
      for (int t = 0; t < T; ++t) {
        for (int c = 0; c < C; ++c) flat.push_back(ids[static_cast<size_t>(t * stride + c)]);
      }
      std::vector<uint16_t> want(flat.size() * static_cast<size_t>(D));
      ASSERT_TRUE(LookupBf16Cpu(cpu, flat, want).ok());
      std::vector<uint8_t> want_packed(flat.size() * static_cast<size_t>(rb));
      ASSERT_TRUE(LookupPackedCpu(cpu, flat, want_packed).ok());
      DeviceBuffer<int32_t> d_ids(ids);
      // One guard row after each output: a shape that writes past its items shows there.
      DeviceBuffer<uint16_t> out(want.size() + static_cast<size_t>(D));
      DeviceBuffer<uint8_t> out_packed(want_packed.size() + static_cast<size_t>(rb));
      for (int r : {1, 2, 4, 8}) {
        for (int w : {1, 2, 4, 8}) {
          SCOPED_TRACE("D=" + std::to_string(D) + " T=" + std::to_string(T) + " rows=" + std::to_string(r) +
                       " warps=" + std::to_string(w));
          out.Fill(0xFF);
          out_packed.Fill(0xCD);
          kernels::LookupArgs a;
          a.records = static_cast<const uint8_t*>(dptr);
          a.row_begin = begin;
          a.row_end = end;
          a.head_dim = static_cast<int32_t>(D);
          a.ids = d_ids.get();
          a.num_tokens = T;
          a.num_cols = C;
          a.ids_stride = stride;
          a.out = out.get();
          a.plain_rows = r;
          a.plain_block_warps = w;
          CUDA_OK(kernels::LaunchLookup(a, nullptr));
          a.out = out_packed.get();
          a.packed = true;
          CUDA_OK(kernels::LaunchLookup(a, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          std::vector<uint16_t> got = out.Download();
          std::vector<uint8_t> got_packed = out_packed.Download();
          ASSERT_EQ(std::vector<uint16_t>(got.begin(), got.begin() + static_cast<int64_t>(want.size())), want);
          ASSERT_EQ(
              std::vector<uint8_t>(got_packed.begin(), got_packed.begin() + static_cast<int64_t>(want_packed.size())),
              want_packed);
          for (size_t i = want.size(); i < got.size(); ++i) ASSERT_EQ(got[i], 0xFFFF) << "bf16 guard " << i;
          for (size_t i = want_packed.size(); i < got_packed.size(); ++i) ASSERT_EQ(got_packed[i], 0xCD) << i;
        }
      }
    }
    CUDA_OK(cudaHostUnregister(host_copy.data()));
  }
}

TEST(GpuLookupTest, MisuseIsInvalidValue) {
  REQUIRE_GPU();
  kernels::LookupArgs a;
  a.head_dim = 100;
  EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaErrorInvalidValue);
  a.head_dim = 256;
  a.num_tokens = 4;
  a.num_cols = 2;
  a.ids_stride = 1;
  EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaErrorInvalidValue);
  a.ids_stride = 2;
  EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaErrorInvalidValue);  // null ids/out
  // A plain-gather shape other than 1, 2, 4, 8 (or 0, the default) is refused before anything runs.
  DeviceBuffer<int32_t> ids(std::vector<int32_t>(8, 0));
  DeviceBuffer<uint16_t> out(8 * 256);
  a.ids = ids.get();
  a.out = out.get();
  for (int32_t bad : {3, 16, -1}) {
    a.plain_rows = bad;
    EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaErrorInvalidValue) << bad;
    a.plain_rows = 0;
    a.plain_block_warps = bad;
    EXPECT_EQ(kernels::LaunchLookup(a, nullptr), cudaErrorInvalidValue) << bad;
    a.plain_block_warps = 0;
  }
  EXPECT_FALSE(kernels::ValidPlainShape(3, 0));
  EXPECT_TRUE(kernels::ValidPlainShape(8, 1));
}

using testing::RandomBf16;

TEST(GpuGateTest, AgreesWithTheFloat64Oracle) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  struct Shape {
    int T, HC, D;
  } shapes[] = {{1, 4, 5120}, {2, 4, 5120}, {4, 4, 5120}, {127, 4, 5120}, {4096, 4, 512}, {8192, 2, 256}, {3, 1, 8}};
  for (const auto& s : shapes) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " hc=" + std::to_string(s.HC) + " D=" + std::to_string(s.D));
    auto hidden = RandomBf16(rng, static_cast<size_t>(s.T) * s.HC * s.D, 1.0f);
    auto kv = RandomBf16(rng, static_cast<size_t>(s.T) * (s.HC + 1) * s.D, 0.5f);
    auto q = RandomBf16(rng, static_cast<size_t>(s.HC) * s.D, 1.0f);
    auto k = RandomBf16(rng, static_cast<size_t>(s.HC) * s.D, 1.0f);
    for (int t = 0; t < s.T; t += 3) {  // aligned keys: gates near 1
      std::copy_n(hidden.begin() + static_cast<long>(t) * s.HC * s.D, s.D,
                  kv.begin() + static_cast<long>(t) * (s.HC + 1) * s.D);
    }
    std::vector<uint8_t> mask(static_cast<size_t>(s.T));
    for (auto& m : mask) m = rng() % 7 == 0;
    DeviceBuffer<uint16_t> dh(hidden), dkv(kv), dq(q), dk(k), out(hidden.size());
    DeviceBuffer<uint8_t> dm(mask);
    out.Fill(0xFF);
    kernels::GateArgs a{dh.get(), dkv.get(), dq.get(), dk.get(), dm.get(), out.get(), s.T, s.HC, s.D, 1e-6f};
    CUDA_OK(kernels::LaunchGate(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    auto got = out.Download();
    EXPECT_LE(testing::GateViolation(s.T, s.HC, s.D, 1e-6, hidden, kv, q, k, mask, got), 0.0);
    // And against the CPU reference (fp32, different summation order): same bits almost everywhere.
    std::vector<uint16_t> cpu(hidden.size());
    ASSERT_TRUE(GateCpu({s.T, s.HC, s.D, 1e-6f}, hidden, kv, q, k, mask, cpu).ok());
    size_t differ = 0;
    for (size_t i = 0; i < cpu.size(); ++i) differ += cpu[i] != got[i];
    EXPECT_LE(differ, cpu.size() / 20) << "GPU and CPU gates differ in more than 5% of values";
  }
}

// A table in a /dev/shm segment, registered by this process and, at the same time, by a second process that runs
// its own lookup on it (tests/gpu/uva_lookup_helper.cc); both equal the CPU reference.
TEST(GpuLookupTest, SharedSegmentRegisteredByAnotherProcess) {
  REQUIRE_GPU();
  std::mt19937_64 rng(Seed());
  const int64_t D = 256, rb = 264, rows = 200000;
  // In this test's own subdirectory of /dev/shm (never a top-level engram-* name, which a production engramd's scan
  // would treat as its own debris); removed at the end.
  std::string shm_dir = "/dev/shm/engram-gputest-XXXXXX";
  ASSERT_NE(::mkdtemp(shm_dir.data()), nullptr);
  const std::string path = shm_dir + "/table";
  std::vector<uint8_t> records = RandomRecords(rng, rows, D);
  testing::WriteFile(path, std::string(records.begin(), records.end()));
  int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  void* map = ::mmap(nullptr, records.size(), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(map, MAP_FAILED);
  CUDA_OK(cudaHostRegister(map, records.size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
  void* dptr = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&dptr, map, 0));

  const int T = 4096, C = 24;
  std::vector<int32_t> ids(static_cast<size_t>(T * C));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % (rows + 10)) - 5;
  testing::TempDir tmp;
  testing::WriteFile(tmp / "ids.bin", std::string(reinterpret_cast<char*>(ids.data()), ids.size() * 4));
  char self[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const std::string helper = std::string(self).substr(0, std::string(self).rfind('/')) + "/uva_lookup_helper";
  std::vector<std::string> args = {helper, path, std::to_string(rows), tmp / "ids.bin", tmp / "out.bin"};
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t pid;
  ASSERT_EQ(::posix_spawn(&pid, helper.c_str(), nullptr, nullptr, argv.data(), environ), 0) << helper;

  // Meanwhile, this process looks up through its own registration.
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<uint16_t> out(ids.size() * D);
  out.Fill(0xFF);
  kernels::LookupArgs a;
  a.records = static_cast<const uint8_t*>(dptr);
  a.row_begin = 0;
  a.row_end = rows;
  a.head_dim = static_cast<int32_t>(D);
  a.ids = d_ids.get();
  a.num_tokens = T;
  a.num_cols = C;
  a.ids_stride = C;
  a.out = out.get();
  CUDA_OK(kernels::LaunchLookup(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "helper failed: " << status;

  std::vector<uint16_t> want(ids.size() * D);
  ASSERT_TRUE(LookupBf16Cpu({records.data(), 0, rows, D}, ids, want).ok());
  EXPECT_EQ(out.Download(), want);
  std::string theirs = testing::ReadFile(tmp / "out.bin");
  ASSERT_EQ(theirs.size(), want.size() * 2);
  EXPECT_EQ(std::memcmp(theirs.data(), want.data(), theirs.size()), 0);
  CUDA_OK(cudaHostUnregister(map));
  ::munmap(map, records.size());
  ::unlink(path.c_str());
  ::rmdir(shm_dir.c_str());
  (void)rb;
}

}  // namespace
}  // namespace engram
