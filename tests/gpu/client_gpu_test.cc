// libengram_client's CUDA backend: a private table registered in chunks and a DEVICE table on the GPU, driven by
// DeviceEngine (hash, lookup, prefetch) and compared with the CPU reference over the same records, bit for bit; and
// the daemon's shared segment registered read-only (cuMemHostRegister READ_ONLY on a PROT_READ mapping): rows the GPU
// lookup reads through that mapping equal the independent row oracle (tools/row_oracle.h). Exits 77 (ctest skip)
// without a GPU; a CUDA error fails.
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/engine/device_engine.h"
#include "client/fault_points.h"
#include "client/table/cuda_backend.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "gtest/gtest.h"
#include "model/layout.h"
#include "model/reference.h"
#include "model/token_map.h"
#include "nlohmann/json.hpp"
#include "shm/capacity.h"
#include "tests/gpu/gpu_util.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"
#include "tools/row_oracle.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using testing::DeviceBuffer;

TEST(GpuClientTest, PrivateAndDeviceTablesMatchTheCpuReference) {
  REQUIRE_GPU();
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 64;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  client::ClientOptions opts;
  opts.socket = dir / "no-daemon.sock";
  opts.timeout = std::chrono::milliseconds(200);
  opts.register_chunk_bytes = size_t{2} << 20;  // many chunks: exercises chunked registration
  auto c = client::Client::Create(opts);
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
  EXPECT_GT((*pinned)->register_seconds(), 0.0) << "the private table was registered (and timed)";
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
  ASSERT_TRUE(HashIdsCpu(ref.layout(), ref.token_map(), {tokens, pos, qsl, lookback, {}}, ids).ok());
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
      const auto& li = ref.layers()[static_cast<size_t>(l)];
      ASSERT_TRUE(LookupBf16Cpu({ref.records(l), li.row_begin, li.row_end, D}, layer_ids, want).ok());
      EXPECT_EQ(rows.Download(), want) << "layer " << l;
      std::vector<uint16_t> staged(want.size());
      CUDA_OK(cudaMemcpy(staged.data(), (*engine)->staging(l), staged.size() * 2, cudaMemcpyDeviceToHost));
      EXPECT_EQ(staged, want) << "prefetched layer " << l;
    }
    EXPECT_FALSE((*engine)->Lookup(L, did.get(), T, L * C, rows.get(), false).ok());
    EXPECT_FALSE((*engine)->Hash(dt.get(), dp.get(), dq.get(), nullptr, nullptr, T + 1, 2, did.get()).ok());
  }
}

// `bytes` of host memory from a 4 KiB boundary, inside `storage` (registration works on whole pages).
uint8_t* PageAligned(std::vector<uint8_t>* storage, size_t bytes) {
  storage->resize(bytes + 4096);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage->data()) + 4095) & ~uintptr_t{4095});
}

TEST(GpuClientTest, ChunkedRegistrationRollsBackOnFailure) {
  REQUIRE_GPU();
  const size_t bytes = size_t{20} << 20, chunk = size_t{2} << 20;
  std::vector<uint8_t> buf;
  uint8_t* p = PageAligned(&buf, bytes);
  int failed = -1;
  client::SetFaultHook(
      [](client::FaultPoint f, int64_t chunk) { return f == client::FaultPoint::kRegisterChunk && chunk == 3; });
  auto bad = client::HostRegistration::Register(p, bytes, chunk, &failed);
  client::SetFaultHook(nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(failed, 3);
  EXPECT_NE(bad.status().message().find("chunk 3"), std::string::npos) << bad.status();
  // Chunks 0..2 were unregistered: the whole range registers again (it would fail as already registered).
  auto good = client::HostRegistration::Register(p, bytes, chunk, &failed);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_GT((*good)->seconds(), 0.0);
}

// A registration released on a thread that never touched CUDA (no current context: an engine closed from a
// serving framework's worker thread) still unregisters its chunks: the same range registers again afterwards (it
// would fail as already registered if the pages had stayed pinned). On driver 580 cuMemHostUnregister needs no
// current context (this test passed with and without making the registering context current first,
// bench/logs/2026-11-30-s5-gpu_client_test-registration*.log).
TEST(GpuClientTest, RegistrationReleasedOnAThreadWithoutAContextUnregisters) {
  REQUIRE_GPU();
  const size_t bytes = size_t{8} << 20, chunk = size_t{2} << 20;
  std::vector<uint8_t> buf;
  uint8_t* p = PageAligned(&buf, bytes);
  int failed = -1;
  auto first = client::HostRegistration::Register(p, bytes, chunk, &failed);
  ASSERT_TRUE(first.ok()) << first.status();
  std::unique_ptr<client::HostRegistration> moved = std::move(*first);
  std::thread([&] { moved.reset(); }).join();
  auto again = client::HostRegistration::Register(p, bytes, chunk, &failed);
  ASSERT_TRUE(again.ok()) << again.status() << " (the chunks released on the other thread stayed registered)";
  EXPECT_EQ((*again)->chunks(), bytes / chunk);
}

// The threaded form (RegisterOptions::threads): a failing chunk still rolls back every chunk any worker registered
// (the whole range registers again afterwards) and names the chunk that failed; where no worker thread can start
// (pthread_create refused: here a default stack larger than the address space) the caller registers alone instead of
// letting std::thread's exception escape (a half-built pool of joinable threads is std::terminate).
TEST(GpuClientTest, ThreadedRegistrationRollsBackAndSurvivesRefusedThreads) {
  REQUIRE_GPU();
  const size_t bytes = size_t{20} << 20, chunk = size_t{2} << 20;
  std::vector<uint8_t> buf;
  uint8_t* p = PageAligned(&buf, bytes);
  client::RegisterOptions o;
  o.chunk_bytes = chunk;
  o.threads = 4;
  client::SetFaultHook(
      [](client::FaultPoint f, int64_t chunk) { return f == client::FaultPoint::kRegisterChunk && chunk == 3; });
  int failed = -1;
  auto bad = client::HostRegistration::Register(p, bytes, o, &failed);
  client::SetFaultHook(nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(failed, 3);
  EXPECT_NE(bad.status().message().find("chunk 3"), std::string::npos) << bad.status();
  {
    auto good = client::HostRegistration::Register(p, bytes, o, &failed);
    ASSERT_TRUE(good.ok()) << good.status() << " (a chunk of the failed registration stayed registered)";
    EXPECT_EQ((*good)->chunks(), bytes / chunk);
  }
  absl::StatusOr<std::unique_ptr<client::HostRegistration>> alone = absl::UnknownError("not run");
  bool refused = false;
  {
    testing::RefusedThreads no_threads;
    refused = no_threads.refused();
    try {
      alone = client::HostRegistration::Register(p, bytes, o, &failed);
    } catch (const std::exception& e) {
      alone = absl::InternalError(std::string("exception out of Register: ") + e.what());
    }
  }
  ASSERT_TRUE(refused) << "the huge default stack did not make pthread_create fail";
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ((*alone)->chunks(), bytes / chunk);
}

// A directory of /dev/shm of the test's own (engramd scans only its --shm-dir, so nothing else there is touched),
// removed with everything in it when the test ends.
struct ShmDir {
  std::string path;
  explicit ShmDir(const char* prefix) {
    std::string tmpl = std::string("/dev/shm/") + prefix + "-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path = tmpl;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// Attach through the daemon at opts.socket, retrying the connect until its socket is up (an event, not a sleep),
// for at most `limit`; the last result.
absl::StatusOr<std::unique_ptr<client::Table>> AttachWhenUp(const client::ClientOptions& opts,
                                                            const client::AttachRequest& req,
                                                            std::chrono::seconds limit) {
  absl::StatusOr<std::unique_ptr<client::Table>> table = absl::UnavailableError("the daemon never answered");
  testing::WaitFor(
      [&] {
        auto c = client::Client::Create(opts);
        if (!c.ok()) return false;
        table = (*c)->Attach(req);
        return table.ok();
      },
      limit);
  return table;
}

// A real engramd publishes into this test's own shm directory; a DP 2 replica attaches, maps the segment read-only
// and registers it with CUDA; the GPU lookup (bf16 and packed) reads rows through that registration, and every row
// equals the oracle's reading of the checkpoint files.
TEST(GpuClientTest, SharedSegmentRegisteredReadOnlyServesTheOraclesRows) {
  REQUIRE_GPU();
  testing::TempDir dir;
  // The segment lives where production puts it (a tmpfs), in this test's own subdirectory of /dev/shm.
  ShmDir shm_dir("engram-gpu-test");
  ASSERT_FALSE(shm_dir.path.empty());
  const std::string shm = shm_dir.path, sock = dir / "engramd.sock";
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 64;
  spec.seed = 11;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  testing::Process daemon(
      {testing::BinPath("../daemon/engramd"), "--checkpoint", spec.out_dir, "--shm-dir", shm, "--socket", sock},
      dir / "engramd.log");
  client::ClientOptions opts;
  opts.socket = sock;
  opts.timeout = std::chrono::milliseconds(60000);  // waits for the daemon to answer (it may still be loading)
  opts.register_chunk_bytes = size_t{8} << 20;      // several chunks
  client::AttachRequest req;
  req.checkpoint = spec.out_dir;
  req.dp_size = 2;
  req.shm_dir = shm;                             // the replica's view of the daemon's directory (SHM_NOT_VISIBLE check)
  req.dp_shared_memory = client::Choice::kTrue;  // a fallback is an error here
  auto table = AttachWhenUp(opts, req, std::chrono::seconds(120));
  ASSERT_TRUE(table.ok()) << table.status() << "\n" << daemon.Output();
  const auto& t = **table;
  ASSERT_EQ(t.mode(), client::Mode::kShared);
  ASSERT_EQ(t.backend(), client::Backend::kCuda);
  EXPECT_GT(t.register_seconds(), 0.0);

  std::string error;
  auto oracle = oracle::RowOracle::Open(spec.out_dir, &error);
  ASSERT_NE(oracle, nullptr) << error;
  const int L = static_cast<int>(t.layers().size());
  const int64_t D = t.head_dim(), rb = D + D / 32;
  std::mt19937_64 rng(5);
  const int T = 64, C = static_cast<int>(t.n_cols());
  auto engine = client::LookupEngine::Create(t, T, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  for (int l = 0; l < L; ++l) {
    const auto& li = t.layers()[static_cast<size_t>(l)];
    // [T, C] ids (stride C): the first and last rows, then random ones.
    std::vector<int32_t> ids = {static_cast<int32_t>(li.row_begin), static_cast<int32_t>(li.row_end - 1)};
    while (ids.size() < static_cast<size_t>(T * C)) {
      ids.push_back(static_cast<int32_t>(
          li.row_begin + static_cast<int64_t>(rng() % static_cast<uint64_t>(li.row_end - li.row_begin))));
    }
    const int N = T * C;
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<uint16_t> rows(static_cast<size_t>(N) * static_cast<size_t>(D));
    DeviceBuffer<uint8_t> packed(static_cast<size_t>(N) * static_cast<size_t>(rb));
    rows.Fill(0xFF);
    packed.Fill(0xAB);
    ASSERT_TRUE((*engine)->Lookup(l, d_ids.get(), T, C, rows.get(), false).ok());
    ASSERT_TRUE((*engine)->Lookup(l, d_ids.get(), T, C, packed.get(), true).ok());
    CUDA_OK(cudaDeviceSynchronize());
    const auto got = rows.Download();
    const auto got_packed = packed.Download();
    for (int i = 0; i < N; ++i) {
      auto rec = oracle->Record(li.layer_id, ids[static_cast<size_t>(i)], &error);
      ASSERT_TRUE(rec.has_value()) << error;
      ASSERT_TRUE(std::equal(rec->begin(), rec->end(), got_packed.begin() + static_cast<long>(i * rb)))
          << "packed row " << ids[static_cast<size_t>(i)] << " of layer " << li.layer_id;
      const auto want = oracle::DequantBf16Row(*rec, D);
      ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin() + static_cast<long>(i * D)))
          << "bf16 row " << ids[static_cast<size_t>(i)] << " of layer " << li.layer_id;
    }
  }
  // An engine sized for prefill batches times the host-gather path against the UVA gather at creation (its plan:
  // the share and threads per batch size) and serves the oracle's rows by whichever path it chose, from host ids.
  {
    const int TP = 512;
    auto big = client::LookupEngine::Create(t, TP, nullptr);
    ASSERT_TRUE(big.ok()) << big.status();
    std::vector<int32_t> hids(static_cast<size_t>(TP) * L * C);  // [T, L, C]
    for (int tok = 0; tok < TP; ++tok) {
      for (int l = 0; l < L; ++l) {
        const auto& li = t.layers()[static_cast<size_t>(l)];
        for (int c = 0; c < C; ++c) {
          hids[(static_cast<size_t>(tok) * L + l) * C + c] = static_cast<int32_t>(
              li.row_begin + static_cast<int64_t>(rng() % static_cast<uint64_t>(li.row_end - li.row_begin)));
        }
      }
    }
    ASSERT_TRUE((*big)->Prefetch(hids.data(), TP).ok());
    for (int l = 0; l < L; ++l) ASSERT_TRUE((*big)->Wait(l).ok());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(static_cast<size_t>(TP) * C * D);
    for (int l = 0; l < L; ++l) {
      const auto& li = t.layers()[static_cast<size_t>(l)];
      CUDA_OK(cudaMemcpy(got.data(), (*big)->staging(l), got.size() * 2, cudaMemcpyDeviceToHost));
      for (int i = 0; i < TP * C; ++i) {
        const int32_t id = hids[(static_cast<size_t>(i / C) * L + l) * C + i % C];
        auto rec = oracle->Record(li.layer_id, id, &error);
        ASSERT_TRUE(rec.has_value()) << error;
        const auto want = oracle::DequantBf16Row(*rec, D);
        ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin() + static_cast<long>(i * D)))
            << "prefetched row " << id << " of layer " << li.layer_id << " ("
            << client::LookupPathName((*big)->last_lookup_path()) << " path)";
      }
    }
  }
  table->reset();
  EXPECT_TRUE(daemon.Running()) << daemon.Output();
}

// A field of /proc/<pid>/status in bytes (its kB figure), -1 when absent.
int64_t StatusBytes(pid_t pid, const std::string& key) {
  std::ifstream in(pid > 0 ? "/proc/" + std::to_string(pid) + "/status" : "/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1) * 1024;
  }
  return -1;
}

// The real size: one DeepSeek-V4.1-Flash Engram layer (384,006,168 rows, 94.4 GiB of records at TP 1) from a sparse
// checkpoint, published by engramd into /dev/shm, attached SHARED and registered; rows of every pattern region, the
// table's last row and the holes next to the regions are looked up on the GPU and compared with the independent
// oracle's reading of the checkpoint, and the oracle's bytes of the regions with the generator's pattern. Neither
// the replica nor the daemon holds a private copy meanwhile. Skipped, saying why, where /dev/shm or the memory
// cannot hold the table.
TEST(GpuFullScale, ADeepSeekV41FlashLayerIsPublishedAttachedAndExact) {
  REQUIRE_GPU();
  auto like = tools::LikeModel("deepseek-v4.1-flash");
  ASSERT_TRUE(like.ok()) << like.status();
  tools::SyntheticSpec spec = *like;
  spec.layers = {1};
  spec.shards = 1;
  spec.seed = 23;
  const uint64_t need = uint64_t{384006168} * 264 + (uint64_t{4} << 30);  // the records and room to spare
  struct statvfs shm_fs {};
  const uint64_t shm_free =
      ::statvfs("/dev/shm", &shm_fs) == 0 ? static_cast<uint64_t>(shm_fs.f_bavail) * shm_fs.f_frsize : 0;
  const NodeMemory mem = ReadNodeMemory();
  if (shm_free < need || mem.available_bytes < need) {
    GTEST_SKIP() << "a full-size layer needs " << (need >> 30) << " GiB of /dev/shm and of available memory; this "
                 << "machine has " << (shm_free >> 30) << " GiB and " << (mem.available_bytes >> 30) << " GiB";
  }
  testing::TempDir dir;
  ShmDir shm_dir("engram-gpu-full");
  ASSERT_FALSE(shm_dir.path.empty());
  const std::string shm = shm_dir.path, sock = dir / "engramd.sock";
  spec.out_dir = dir / "ck";
  auto made = tools::WriteSyntheticCheckpoint(spec);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->table_bytes, uint64_t{384006168} * 264);
  testing::Process daemon(
      {testing::BinPath("../daemon/engramd"), "--checkpoint", spec.out_dir, "--shm-dir", shm, "--socket", sock},
      dir / "engramd.log");
  client::ClientOptions opts;
  opts.socket = sock;
  opts.timeout = std::chrono::milliseconds(300000);  // the daemon answers once the 94 GiB are published
  client::AttachRequest req;
  req.checkpoint = spec.out_dir;
  req.dp_size = 2;
  req.dp_shared_memory = client::Choice::kTrue;
  auto table = AttachWhenUp(opts, req, std::chrono::seconds(600));
  ASSERT_TRUE(table.ok()) << table.status() << "\n" << daemon.Output();
  const auto& t = **table;
  ASSERT_EQ(t.mode(), client::Mode::kShared);
  ASSERT_EQ(t.backend(), client::Backend::kCuda);
  ASSERT_EQ(t.layers().size(), 1u);
  const auto& li = t.layers()[0];
  ASSERT_EQ(li.row_end - li.row_begin, 384006168);
  const client::AttachTimes at = t.attach_times();
  std::printf("full-scale attach: %.2f s (populate %.2f, ticket %.2f, register %.2f)\n", at.total, at.populate,
              at.ticket, at.pin);
  // No second copy: the replica's private memory and the daemon's stay far below the table.
  EXPECT_LT(StatusBytes(0, "RssAnon"), int64_t{4} << 30);
  EXPECT_LT(StatusBytes(daemon.pid(), "RssAnon"), int64_t{4} << 30);

  // The rows to check: per region its first, middle and last row, and the row past it (a hole, unless the table
  // ends there); the table's last row is the last region's last.
  std::ifstream pf(spec.out_dir + "/" + tools::kPatternFileName);
  const nlohmann::json pattern = nlohmann::json::parse(pf, nullptr, false);
  ASSERT_FALSE(pattern.is_discarded());
  std::vector<int32_t> ids;
  std::vector<bool> in_region;
  int regions = 0;
  for (const auto& r : pattern["layers"][0]["regions"]) {
    const int64_t b = r["row_begin"], e = r["row_end"];
    ++regions;
    for (int64_t row : {b, b + (e - b) / 2, e - 1, e}) {
      if (row >= li.row_end) continue;
      ids.push_back(static_cast<int32_t>(row));
      in_region.push_back(row < e);
    }
  }
  EXPECT_GE(regions, 30);
  ASSERT_EQ(ids[ids.size() - 1], li.row_end - 1) << "the last region ends at the table's last row";
  const int64_t D = t.head_dim(), rb = D + D / 32;
  const int C = static_cast<int>(t.n_cols());
  const int T = static_cast<int>((ids.size() + static_cast<size_t>(C) - 1) / static_cast<size_t>(C));
  std::vector<int32_t> padded(static_cast<size_t>(T * C), -1);  // -1: a zero row
  std::copy(ids.begin(), ids.end(), padded.begin());
  auto engine = client::LookupEngine::Create(t, T, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  DeviceBuffer<int32_t> d_ids(padded);
  DeviceBuffer<uint16_t> rows(padded.size() * static_cast<size_t>(D));
  DeviceBuffer<uint8_t> packed(padded.size() * static_cast<size_t>(rb));
  rows.Fill(0xFF);
  packed.Fill(0xAB);
  ASSERT_TRUE((*engine)->Lookup(0, d_ids.get(), T, C, rows.get(), false).ok());
  ASSERT_TRUE((*engine)->Lookup(0, d_ids.get(), T, C, packed.get(), true).ok());
  CUDA_OK(cudaDeviceSynchronize());
  const auto got = rows.Download();
  const auto got_packed = packed.Download();
  std::string error;
  auto oracle = oracle::RowOracle::Open(spec.out_dir, &error);
  ASSERT_NE(oracle, nullptr) << error;
  int nonzero = 0;
  for (size_t i = 0; i < padded.size(); ++i) {
    std::vector<uint8_t> rec(static_cast<size_t>(rb), 0);
    if (i < ids.size()) {
      auto r = oracle->Record(li.layer_id, ids[i], &error);
      ASSERT_TRUE(r.has_value()) << error;
      rec = *r;
      const bool zero = std::all_of(rec.begin(), rec.end(), [](uint8_t v) { return v == 0; });
      if (in_region[i]) {
        // The checkpoint holds the generator's pattern there (weights then scales of row ids[i])...
        ASSERT_FALSE(zero) << "row " << ids[i] << " of a pattern region reads as a hole";
        for (int64_t j = 0; j < D; j += 37) {
          ASSERT_EQ(
              rec[static_cast<size_t>(j)],
              tools::SyntheticByte(spec.seed, "layers.1.engram.embed.weight",
                                   static_cast<uint64_t>(ids[i]) * static_cast<uint64_t>(D) + static_cast<uint64_t>(j),
                                   false, false));
        }
        ++nonzero;
      } else {
        ASSERT_TRUE(zero) << "row " << ids[i] << " past a region is not a hole";
      }
    }
    // ...and the GPU read exactly the checkpoint's bytes (a -1 id: zeros).
    ASSERT_TRUE(std::equal(rec.begin(), rec.end(), got_packed.begin() + static_cast<long>(i) * rb))
        << "packed row " << (i < ids.size() ? ids[i] : -1);
    const auto want = i < ids.size() ? oracle::DequantBf16Row(rec, D) : std::vector<uint16_t>(D, 0);
    ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin() + static_cast<long>(i) * D))
        << "bf16 row " << (i < ids.size() ? ids[i] : -1);
  }
  EXPECT_GE(nonzero, 3 * regions - 2);
  table->reset();
  EXPECT_TRUE(daemon.Running()) << daemon.Output();
}

}  // namespace
}  // namespace engram
