// The host-gather lookup path (client/engine/host_gather.h) on a GPU: rows written into the staging buffers equal the
// CPU reference (model/reference.h LookupBf16Cpu) bit for bit, for several layers with a strided id array, ids outside
// a layer's rows (zeros), repeated rows (fetched once with de-duplication), with and without de-duplication, 1 and
// several threads, batches of 0, 1 and many tokens back to back (buffer reuse), every variant of the copy pipeline
// (prefetch distance, non-temporal stores, fused plan, copy issuer, wake-up); Wait orders the main stream; a
// Prefetch during CUDA graph capture is refused; bad inputs are errors. Through DeviceEngine (a private table of a
// synthetic checkpoint): every path (automatic, forced UVA, forced host gather with host or device ids) fills the
// staging buffers with the CPU reference's rows, and the path taken is the one asked for. Exits 77 (ctest skip) without
// a GPU. ENGRAM_GPU_QUICK=1 shrinks the batches (compute-sanitizer).
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "client/engine/device_engine.h"
#include "client/engine/host_gather.h"
#include "client/environment.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "gtest/gtest.h"
#include "model/reference.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using client::HostGather;
using client::HostGatherOptions;
using client::HostLayer;
using testing::DeviceBuffer;

bool Quick() { return std::getenv("ENGRAM_GPU_QUICK") != nullptr; }

struct Fixture {
  static constexpr int64_t kD = 256, kRb = 264, kRows = 60000, kBegin = 5000;
  static constexpr int32_t kL = 2, kC = 24;
  std::vector<std::vector<uint8_t>> host;  // per layer: records of rows [kBegin, kBegin + kRows)
  std::vector<HostLayer> layers;
  explicit Fixture(std::mt19937_64& rng) : host(kL) {
    for (int l = 0; l < kL; ++l) {
      host[l].resize(static_cast<size_t>(kRows * kRb));
      for (auto& b : host[l]) b = static_cast<uint8_t>(rng());
      layers.push_back({host[l].data(), kBegin, kBegin + kRows});
    }
  }
  // ids [T, L, C]: a third repeat an earlier id, a few fall outside [kBegin, kBegin + kRows).
  std::vector<int32_t> Ids(std::mt19937_64& rng, int32_t T) const {
    std::vector<int32_t> ids(static_cast<size_t>(T) * kL * kC);
    for (size_t i = 0; i < ids.size(); ++i) {
      const uint64_t r = rng() % 100;
      if (i > 0 && r < 33)
        ids[i] = ids[rng() % i];
      else if (r < 36)
        ids[i] = static_cast<int32_t>(rng() % (kBegin + kRows + 3000));  // some out of range
      else
        ids[i] = static_cast<int32_t>(kBegin + rng() % kRows);
    }
    return ids;
  }
  std::vector<uint16_t> Expected(const std::vector<int32_t>& ids, int32_t T, int l) const {
    std::vector<int32_t> flat;
    for (int32_t t = 0; t < T; ++t) {
      for (int c = 0; c < kC; ++c) flat.push_back(ids[static_cast<size_t>((t * kL + l) * kC + c)]);
    }
    std::vector<uint16_t> out(flat.size() * kD);
    const RecordTable rt{host[static_cast<size_t>(l)].data(), kBegin, kBegin + kRows, kD};
    EXPECT_TRUE(LookupBf16Cpu(rt, flat, out).ok());
    return out;
  }
};

// The copy pipeline's variants (HostGatherOptions: prefetch distance, non-temporal stores, fused plan, copy issuer,
// wake-up): each must serve the same rows. Explicit values, so the environment's knobs do not change what runs.
struct PipelineVariant {  // today's settings unless named
  const char* name;
  int32_t prefetch = 16, nt = 0, fused = 0, issuer = 0, spin = 200, dspin = 0, prewake = 0, issue_min = 0,
          pass_spin = 200;
  HostGatherOptions Options() const {
    HostGatherOptions o;
    o.prefetch_rows = prefetch;
    o.stream_stores = nt;
    o.fused = fused;
    o.copy_issuer = issuer;
    o.spin_us = spin;
    o.dispatch_spin_us = dspin;
    o.prewake = prewake;
    o.issue_min_rows = issue_min;
    o.pass_spin_us = pass_spin;
    return o;
  }
};
const PipelineVariant kPipelineVariants[] = {
    {.name = "today"},
    {.name = "no prefetch, no spin", .prefetch = 0, .spin = 0},
    {.name = "non-temporal", .nt = 1},
    {.name = "fused, pass spin", .prefetch = 8, .fused = 1, .pass_spin = 20000},
    {.name = "issuer", .prefetch = 32, .issuer = 1},
    {.name = "all", .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1},
    {.name = "all, copies >= 700 rows", .nt = 1, .fused = 1, .issuer = 1, .dspin = 200, .prewake = 1, .issue_min = 700},
    {.name = "fused issuer only, copies >= 500 rows", .fused = 1, .issuer = 1, .issue_min = 500},
};

// One batch end to end: poisons the outputs on `s` first (the unpack must be ordered after it), prefetches `ids` (T
// tokens), and checks each layer (last first when `reverse`) bit for bit against the CPU reference; `each(l)` then
// checks that layer's stats.
void CheckBatch(HostGather& g, const Fixture& f, const std::vector<uint16_t*>& outs, int32_t max_tokens,
                const std::vector<int32_t>& ids, int32_t T, cudaStream_t s, bool reverse,
                const std::function<void(int)>& each) {
  for (auto* p : outs) {
    CUDA_OK(cudaMemsetAsync(p, 0xAB, static_cast<size_t>(max_tokens) * Fixture::kC * Fixture::kD * 2, s));
  }
  ASSERT_TRUE(g.Prefetch(ids.data(), T, Fixture::kL * Fixture::kC, s).ok());
  for (int i = 0; i < Fixture::kL; ++i) {
    const int l = reverse ? Fixture::kL - 1 - i : i;
    ASSERT_TRUE(g.Wait(l, s).ok());
    std::vector<uint16_t> got(static_cast<size_t>(T) * Fixture::kC * Fixture::kD);
    CUDA_OK(cudaMemcpyAsync(got.data(), outs[static_cast<size_t>(l)], got.size() * 2, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    const std::vector<uint16_t> want = f.Expected(ids, T, l);
    ASSERT_EQ(got.size(), want.size());
    size_t bad = 0;
    for (size_t k = 0; k < got.size(); ++k) bad += got[k] != want[k];
    ASSERT_EQ(bad, 0u) << "layer " << l << ": " << bad << " bf16 values differ";
    each(l);
  }
}

TEST(GpuHostGatherTest, RowsEqualTheCpuReferenceBitForBit) {
  REQUIRE_GPU();
  std::mt19937_64 rng(std::random_device{}());
  const Fixture f(rng);
  const int32_t max_tokens = Quick() ? 300 : 4096;
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> out;
  std::vector<uint16_t*> out_ptrs;
  for (int l = 0; l < Fixture::kL; ++l) {
    out.push_back(
        std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(max_tokens) * Fixture::kC * Fixture::kD));
    out_ptrs.push_back(out.back()->get());
  }
  cudaStream_t main_stream;
  CUDA_OK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  for (const PipelineVariant& v : kPipelineVariants) {
    for (int threads : {1, 4}) {
      if (threads == 1 && &v != &kPipelineVariants[0]) continue;  // one thread: today's pipeline only (test time)
      {
        HostGatherOptions opt = v.Options();
        opt.threads = threads;
        opt.min_chunk_rows = 256;  // several chunks even in small batches
        auto g =
            HostGather::Create(f.layers, out_ptrs, max_tokens, Fixture::kC, static_cast<int32_t>(Fixture::kD), opt);
        ASSERT_TRUE(g.ok()) << g.status();
        EXPECT_EQ((*g)->threads(), threads);
        EXPECT_EQ((*g)->options().stream_stores, v.nt);
        EXPECT_EQ((*g)->options().fused, v.fused);
        EXPECT_EQ((*g)->options().copy_issuer, v.issuer);
        for (int32_t T : {max_tokens, 1, 0, 77, max_tokens}) {
          SCOPED_TRACE(::testing::Message() << v.name << " threads " << threads << " T " << T);
          const std::vector<int32_t> ids = f.Ids(rng, T);
          ASSERT_NO_FATAL_FAILURE(
              CheckBatch(**g, f, out_ptrs, max_tokens, ids, T, main_stream, /*reverse=*/true, [&](int l) {
                const auto st = (*g)->stats(l);
                EXPECT_EQ(st.items, static_cast<int64_t>(T) * Fixture::kC);
                EXPECT_GE(st.gather_ms, 0.0);
                if (T > 0) EXPECT_GT(st.gather_ms, 0.0) << "the gather pass's host time is measured";
                EXPECT_EQ(st.rows_moved, st.items);
              }));
        }
      }
    }
  }
  CUDA_OK(cudaStreamDestroy(main_stream));
}

// Split batches: the last share of the tokens is served by the UVA row-order gather (device mapping of the same
// registered records) while the threads gather the rest; every row still equals the reference, and the stats say
// how many items each side served.
TEST(GpuHostGatherTest, SplitBatchesEqualTheCpuReferenceBitForBit) {
  REQUIRE_GPU();
  std::mt19937_64 rng(std::random_device{}());
  Fixture f(rng);
  for (int l = 0; l < Fixture::kL; ++l) {
    auto& h = f.host[static_cast<size_t>(l)];
    CUDA_OK(cudaHostRegister(h.data(), h.size(), cudaHostRegisterMapped | cudaHostRegisterReadOnly));
    void* d = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&d, h.data(), 0));
    f.layers[static_cast<size_t>(l)].device_records = static_cast<const uint8_t*>(d);
  }
  const int32_t max_tokens = Quick() ? 300 : 4096;
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> out;
  std::vector<uint16_t*> out_ptrs;
  for (int l = 0; l < Fixture::kL; ++l) {
    out.push_back(
        std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(max_tokens) * Fixture::kC * Fixture::kD));
    out_ptrs.push_back(out.back()->get());
  }
  cudaStream_t main_stream;
  CUDA_OK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  for (const PipelineVariant* v : {&kPipelineVariants[0], &kPipelineVariants[5], &kPipelineVariants[7]}) {
    {
      HostGatherOptions opt = v->Options();
      opt.threads = 3;
      opt.min_chunk_rows = 256;
      auto g = HostGather::Create(f.layers, out_ptrs, max_tokens, Fixture::kC, static_cast<int32_t>(Fixture::kD), opt);
      ASSERT_TRUE(g.ok()) << g.status();
      for (double share : {0.3, 1.0, 0.0, 0.5}) {
        (*g)->set_uva_share(share);
        for (int32_t T : {max_tokens, 1, 0, 77, max_tokens}) {
          SCOPED_TRACE(::testing::Message() << v->name << " share " << share << " T " << T);
          const std::vector<int32_t> ids = f.Ids(rng, T);
          ASSERT_NO_FATAL_FAILURE(
              CheckBatch(**g, f, out_ptrs, max_tokens, ids, T, main_stream, /*reverse=*/false, [&](int l) {
                const auto st = (*g)->stats(l);
                const int64_t uva_tokens = std::llround(T * share);
                EXPECT_EQ(st.uva_items, uva_tokens * Fixture::kC);
                EXPECT_EQ(st.rows_moved, st.items);
              }));
        }
      }
      ASSERT_TRUE((*g)->Sync().ok());
    }
  }
  CUDA_OK(cudaStreamDestroy(main_stream));
  for (auto& h : f.host) CUDA_OK(cudaHostUnregister(h.data()));
}

TEST(GpuHostGatherTest, RefusesCaptureAndBadInputs) {
  REQUIRE_GPU();
  std::mt19937_64 rng(5);
  const Fixture f(rng);
  DeviceBuffer<uint16_t> o0(64 * Fixture::kC * Fixture::kD), o1(64 * Fixture::kC * Fixture::kD);
  auto g = HostGather::Create(f.layers, {o0.get(), o1.get()}, 64, Fixture::kC, static_cast<int32_t>(Fixture::kD));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_GE((*g)->threads(), 1);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::vector<int32_t> ids = f.Ids(rng, 64);
  EXPECT_EQ((*g)->Prefetch(ids.data(), 65, 48, s).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*g)->Prefetch(nullptr, 4, 48, s).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*g)->Prefetch(ids.data(), 4, 47, s).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*g)->Wait(2, s).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*g)->Wait(0, s).ok());  // before any batch: nothing to wait for
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const auto captured = (*g)->Prefetch(ids.data(), 4, 48, s);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  EXPECT_EQ(captured.code(), absl::StatusCode::kFailedPrecondition) << captured;
  if (graph != nullptr) cudaGraphDestroy(graph);
  EXPECT_EQ(HostGather::Create(f.layers, {o0.get()}, 64, Fixture::kC, 256).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostGather::Create(f.layers, {o0.get(), o1.get()}, 64, Fixture::kC, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  CUDA_OK(cudaStreamDestroy(s));
}

TEST(GpuHostGatherTest, EngineTakesTheChosenPathAndEveryPathServesTheReferenceRows) {
  REQUIRE_GPU();
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 64;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  client::ClientOptions opts;
  opts.socket = dir / "no-daemon.sock";
  opts.timeout = std::chrono::milliseconds(200);
  // The automatic choice takes the host path for this batch: a knob set on the client, not in the environment.
  ASSERT_TRUE(opts.tuning.Set("host_gather_min_items", "100").ok());
  // A fixed row-order threshold reaches every launch: the direct lookups, the side-stream prefetch, the UVA share.
  ASSERT_TRUE(opts.tuning.Set("lookup_sort_min_items", "777").ok());
  auto c = client::Client::Create(opts);
  ASSERT_TRUE(c.ok());
  client::AttachRequest req;
  req.checkpoint = spec.out_dir;
  req.dp_size = 2;
  req.tp_size = 2;
  req.tp_rank = 1;  // rows of a TP shard: row ranges that do not start at 0
  auto table = (*c)->Attach(req);
  ASSERT_TRUE(table.ok()) << table.status();
  const auto& t = **table;
  ASSERT_EQ(t.backend(), client::Backend::kCuda);
  const int L = static_cast<int>(t.layers().size()), C = static_cast<int>(t.n_cols());
  const int64_t D = t.head_dim();
  const int T = Quick() ? 64 : 2000;
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> ids(static_cast<size_t>(T) * L * C);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& li = t.layers()[(i / static_cast<size_t>(C)) % static_cast<size_t>(L)];
    ids[i] =
        i > 0 && rng() % 3 == 0
            ? ids[i - static_cast<size_t>(L * C)]  // repeats (earlier token, same layer)
            : static_cast<int32_t>(li.row_begin - 5 +
                                   static_cast<int64_t>(rng() % static_cast<uint64_t>(li.row_end - li.row_begin + 10)));
    if (i < static_cast<size_t>(L * C)) ids[i] = static_cast<int32_t>(li.row_begin);
  }
  ASSERT_EQ(t.tuning().host_gather_min_items.value_or(0), 100);
  auto engine = client::LookupEngine::Create(t, T, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  DeviceBuffer<int32_t> did(ids);
  auto check = [&](const char* what) {
    for (int l = 0; l < L; ++l) {
      ASSERT_TRUE((*engine)->Wait(l).ok());
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<int32_t> layer_ids;
      for (int tok = 0; tok < T; ++tok) {
        for (int col = 0; col < C; ++col) layer_ids.push_back(ids[static_cast<size_t>((tok * L + l) * C + col)]);
      }
      std::vector<uint16_t> want(layer_ids.size() * static_cast<size_t>(D)), got(want.size());
      const auto& li = t.layers()[static_cast<size_t>(l)];
      ASSERT_TRUE(LookupBf16Cpu({t.records(l), li.row_begin, li.row_end, D}, layer_ids, want).ok());
      CUDA_OK(cudaMemcpy(got.data(), (*engine)->staging(l), got.size() * 2, cudaMemcpyDeviceToHost));
      ASSERT_EQ(got, want) << what << ", layer " << l;
      CUDA_OK(cudaMemset((*engine)->staging(l), 0xCD, got.size() * 2));  // the next path must rewrite it all
    }
  };
  ASSERT_TRUE((*engine)->Prefetch(ids.data(), T).ok());  // host ids, auto: host gather
  EXPECT_EQ((*engine)->last_lookup_path(), client::LookupPath::kHostGather);
  check("auto, host ids");
  ASSERT_TRUE((*engine)->Prefetch(did.get(), T).ok());  // device ids, auto: UVA
  EXPECT_EQ((*engine)->last_lookup_path(), client::LookupPath::kUva);
  check("auto, device ids");
  ASSERT_TRUE((*engine)->SetLookupPath(client::LookupPath::kUva).ok());
  ASSERT_TRUE((*engine)->Prefetch(ids.data(), T).ok());
  EXPECT_EQ((*engine)->last_lookup_path(), client::LookupPath::kUva);
  check("forced UVA, host ids");
  ASSERT_TRUE((*engine)->SetLookupPath(client::LookupPath::kHostGather).ok());
  ASSERT_TRUE((*engine)->Prefetch(did.get(), T).ok());
  EXPECT_EQ((*engine)->last_lookup_path(), client::LookupPath::kHostGather);
  check("forced host gather, device ids");
  // Forced host gather under graph capture is refused; the automatic choice captures the UVA kernel.
  auto* dev = dynamic_cast<client::DeviceEngine*>(engine->get());
  ASSERT_NE(dev, nullptr);
  EXPECT_EQ(dev->sort_min_items(false, false), 777);
  EXPECT_EQ(dev->sort_min_items(true, true), 777);
  EXPECT_EQ(dev->prefetch_sort_min_items(), 777);
  ASSERT_NE(dev->host_gather(), nullptr);
  EXPECT_EQ(dev->host_gather()->options().uva_sort_min_items, 777);
  EXPECT_NE(dev->choice().find(" tuning=host_gather_min_items=100,lookup_sort_min_items=777"), std::string::npos)
      << dev->choice();
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto captured = client::LookupEngine::Create(t, T, s);
  ASSERT_TRUE(captured.ok());
  ASSERT_TRUE((*captured)->SetLookupPath(client::LookupPath::kHostGather).ok());
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const auto refused = (*captured)->Prefetch(did.get(), T);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  if (graph != nullptr) cudaGraphDestroy(graph);
  captured->reset();
  CUDA_OK(cudaStreamDestroy(s));
  // A DEVICE table has no host records: the host path is refused.
  req.cpu_offload = false;
  auto device = (*c)->Attach(req);
  ASSERT_TRUE(device.ok()) << device.status();
  auto dengine = client::LookupEngine::Create(**device, 16, nullptr);
  ASSERT_TRUE(dengine.ok());
  EXPECT_EQ((*dengine)->SetLookupPath(client::LookupPath::kHostGather).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace engram
