// bench_dp: the DP-sharded exchange on two GPUs of one host, per tokens-per-rank, each path next to its
// ceilings measured in the same run:
//   all-to-all   the collective path (the product default: the pipelined step (own columns read in place, ids to
//                each member, records packed, sent and unpacked chunk by chunk), replayed as a CUDA graph up to
//                kDefaultGraphMaxSlot tokens per rank; client/dp/nccl_exchange.h), and its variants side by side
//                (--variants: "seq" the sequential form, a number the pipelined form enqueued call by call with that
//                chunk size in KiB, 0 one chunk; a leading g: the same as a replayed CUDA graph)
//   peer         the NVLink peer-read path (each GPU reads the other's shard directly)
//   a2a ceiling  NCCL grouped send/recv of exactly the records the collective path moves (no lookup, no unpack)
//   peer gather  the lookup kernel reading the same rows from the peer GPU's shard (no placement)
//   UVA shared   the dp_shared_memory topology: the lookup of the same tokens (every column) from one pinned host
//                table through UVA, sorted gather for large batches as the engine does
// One process per GPU, as replicas run (forked before any CUDA call; rank 0's ncclUniqueId goes to rank 1 through a
// pipe; peer shards are mapped through CUDA IPC as the engine maps them); each child reports its times through a
// pipe and the parent prints the slower rank's.
// Synthetic shards: 24 columns x 2 layers, `rows` rows per column (default 2^20: 3.3 GB per layer and GPU), random
// ids. Times are per step (both layers), mean of --iters after warm-up. Usage:
//   bench_dp [--tokens 1,4,64,512,4096,8192] [--iters 50] [--rows 1048576] [--uva-rows 1048576]
//            [--variants seq,32768,g32768,g16384,g8192,g4096,g2048,g0]   (a trailing c: own columns on a concurrent
//            side stream) [--uneven 1]   (rank 1's all-to-all steps with fewer tokens than the slot: memcheck)
// Besides each variant's step time (GPU, between events) it prints the host's time to enqueue one step.
#include <cuda_runtime_api.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda_check.h"
#include "client/dp/nccl_exchange.h"
#include "kernels/engram_kernels.h"

namespace {

using engram::client::DpExchangeShape;
using engram::client::DpNcclExchange;
using engram::client::NcclApi;
using engram::client::ShardLayer;

constexpr int kL = 2, kC = 24, kD = 256, kRb = 264, kMembers = 2, kMaxVariants = 12;

struct Result {
  double a2a = 0, peer = 0, a2a_ceiling = 0, peer_gather = 0, uva = 0;
  double record_bytes = 0;
  double variant_ms[kMaxVariants] = {}, variant_host_ms[kMaxVariants] = {};
  int variant_chunks[kMaxVariants] = {};
  double ceiling_host_ms = 0;
};

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> v;
  size_t p = 0;
  while (p < s.size()) {
    size_t q = s.find(',', p);
    v.push_back(std::stoi(s.substr(p, q == std::string::npos ? std::string::npos : q - p)));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return v;
}

// Mean milliseconds per call of `f` on `stream` (and, in *host_ms, of the host's time to enqueue it).
template <typename F>
double TimeMs(cudaStream_t stream, int iters, F f, const char* what, double* host_ms = nullptr) {
  for (int i = 0; i < 3; ++i) f();
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaEventRecord(a, stream));
  const auto h0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  const auto h1 = std::chrono::steady_clock::now();
  if (host_ms != nullptr) *host_ms = std::chrono::duration<double, std::milli>(h1 - h0).count() / iters;
  CUDA_CHECK(cudaEventRecord(b, stream));
  CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> tokens = {1, 4, 64, 512, 4096, 8192};
  int iters = 50;
  int64_t rows = int64_t{1} << 20, uva_rows = int64_t{1} << 20;
  bool uneven = false;  // rank 1 steps the all-to-all forms with T - ceil(T / 3) tokens (0 at T = 1), slot T
  std::vector<std::string> variants = {"seq", "32768", "g32768", "g16384", "g8192", "g4096", "g2048", "g0"};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--tokens")
      tokens = ParseList(v);
    else if (k == "--variants") {
      variants.clear();
      for (size_t p = 0; p <= v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        variants.push_back(v.substr(p, q - p));
        p = q + 1;
      }
      if (variants.size() > static_cast<size_t>(kMaxVariants)) variants.resize(kMaxVariants);
    } else if (k == "--iters")
      iters = std::stoi(v);
    else if (k == "--rows")
      rows = std::stoll(v);
    else if (k == "--uva-rows")
      uva_rows = std::stoll(v);
    else if (k == "--uneven")
      uneven = std::stoi(v) != 0;
  }
  // Fork first: CUDA must not be initialised in the parent.
  int id_pipe[2], res_pipe[2][2];
  if (::pipe(id_pipe) != 0 || ::pipe(res_pipe[0]) != 0 || ::pipe(res_pipe[1]) != 0) return 1;
  pid_t kids[kMembers];
  for (int g = 0; g < kMembers; ++g) {
    kids[g] = ::fork();
    if (kids[g] != 0) continue;
    // Child g: GPU g.
    auto api = NcclApi::Get();
    if (!api.ok()) {
      std::fprintf(stderr, "%s\n", std::string(api.status().message()).c_str());
      ::_exit(1);
    }
    const NcclApi* nccl = *api;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < kMembers) {
      std::fprintf(stderr, "bench_dp needs two GPUs (found %d)\n", n);
      ::_exit(77);
    }
    CUDA_CHECK(cudaSetDevice(g));
    ncclUniqueId id;
    if (g == 0) {
      nccl->GetUniqueId(&id);
      for (int k = 1; k < kMembers; ++k) {
        if (::write(id_pipe[1], &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) ::_exit(1);
      }
      std::fprintf(stderr,
                   "bench_dp: NCCL %d, %d GPUs, %lld rows per column (shard %.2f GB per layer and GPU), %d "
                   "iterations\n",
                   nccl->version, n, static_cast<long long>(rows), 12.0 * rows * kRb / 1e9, iters);
    } else if (::read(id_pipe[0], &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) {
      ::_exit(1);
    }
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // This GPU's shard: both layers in one allocation (exported to the peer through CUDA IPC).
    const int64_t shard_rows = 12 * rows;
    std::vector<uint8_t> pattern(static_cast<size_t>(std::min<int64_t>(shard_rows, 1 << 16)) * kRb);
    std::mt19937_64 rng(g + 1);
    for (size_t i = 0; i < pattern.size(); ++i) {
      // e4m3 values, ue8m0 scales near 127 (finite rows).
      pattern[i] = (i % kRb) < kD ? static_cast<uint8_t>(rng() & 0x77) : static_cast<uint8_t>(120 + rng() % 8);
    }
    uint8_t* base = nullptr;
    const size_t layer_bytes = static_cast<size_t>(shard_rows) * kRb;
    CUDA_CHECK(cudaMalloc(&base, layer_bytes * kL));
    for (size_t off = 0; off < layer_bytes * kL; off += pattern.size()) {
      CUDA_CHECK(cudaMemcpy(base + off, pattern.data(), std::min(pattern.size(), layer_bytes * kL - off),
                            cudaMemcpyHostToDevice));
    }
    std::vector<ShardLayer> shard;
    for (int l = 0; l < kL; ++l) shard.push_back({base + l * layer_bytes, 12 * g * rows, 12 * (g + 1) * rows});
    // The dp_shared_memory table for the UVA comparison: every column, pinned host memory (rank 0 only).
    uint8_t* uva = nullptr;
    const size_t uva_bytes = static_cast<size_t>(kC) * uva_rows * kRb * kL;
    if (g == 0) {
      CUDA_CHECK(cudaHostAlloc(&uva, uva_bytes, cudaHostAllocMapped));
      for (size_t off = 0; off < uva_bytes; off += pattern.size()) {
        std::memcpy(uva + off, pattern.data(), std::min(pattern.size(), uva_bytes - off));
      }
    }
    auto comm = DpNcclExchange::InitComm(id, kMembers, g, nullptr, std::chrono::seconds(120));
    // As the engine does (ENGRAM_DP_NCCL_BLOCKING, default 0): =1 runs the steps on a blocking twin.
    const char* blocking_env = std::getenv("ENGRAM_DP_NCCL_BLOCKING");
    const bool blocking = blocking_env != nullptr && std::atoi(blocking_env) != 0;
    if (comm.ok() && blocking) {
      comm = DpNcclExchange::BlockingTwin(*comm, g, nullptr, std::chrono::seconds(120));
    }
    if (!comm.ok()) {
      std::fprintf(stderr, "comm: %s\n", std::string(comm.status().message()).c_str());
      ::_exit(1);
    }
    if (g == 0) {
      std::printf("NCCL communicator for the steps: %s\n", blocking ? "blocking twin" : "non-blocking");
    }
    const int maxT = *std::max_element(tokens.begin(), tokens.end());
    int32_t *ids = nullptr, *uva_ids = nullptr;
    uint16_t* out[kL];
    CUDA_CHECK(cudaMalloc(&ids, static_cast<size_t>(maxT) * kL * kC * 4));
    CUDA_CHECK(cudaMalloc(&uva_ids, static_cast<size_t>(maxT) * kL * kC * 4));
    for (auto& o : out) CUDA_CHECK(cudaMalloc(&o, static_cast<size_t>(maxT) * kC * kD * 2));
    void* sort_scratch = nullptr;
    const size_t sort_bytes = engram::kernels::LookupSortScratchBytes(static_cast<int64_t>(maxT) * kC);
    CUDA_CHECK(cudaMalloc(&sort_scratch, sort_bytes));
    {
      std::vector<int32_t> h(static_cast<size_t>(maxT) * kL * kC), hu(h.size());
      for (int64_t t = 0; t < maxT; ++t) {
        for (int l = 0; l < kL; ++l) {
          for (int c = 0; c < kC; ++c) {
            const int64_t r = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
            h[static_cast<size_t>((t * kL + l) * kC + c)] = static_cast<int32_t>(c * rows + r);
            hu[static_cast<size_t>((t * kL + l) * kC + c)] = static_cast<int32_t>(c * uva_rows + r % uva_rows);
          }
        }
      }
      CUDA_CHECK(cudaMemcpy(ids, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(uva_ids, hu.data(), hu.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<Result> results(tokens.size());
    std::vector<ShardLayer> peer_shard;
    for (size_t ti = 0; ti < tokens.size(); ++ti) {
      const int T = tokens[ti];
      const int Ta = uneven && g == 1 ? T - (T + 2) / 3 : T;  // the all-to-all steps' token count on this rank
      DpExchangeShape shape;
      shape.members = kMembers;
      shape.me = g;
      shape.slot = T;
      shape.layers = kL;
      shape.cols = kC;
      shape.head_dim = kD;
      shape.col_begin = {0, 12};
      shape.col_end = {12, 24};
      shape.group_col_begin = 0;
      shape.group_col_end = 24;
      shape.graph = T <= DpExchangeShape::kDefaultGraphMaxSlot;  // the product default (client/dp/dp_device_engine.cc)
      auto x = DpNcclExchange::Create(shape, *comm, false, stream, shard, nullptr, std::chrono::seconds(60));
      if (!x.ok()) {
        std::fprintf(stderr, "exchange: %s\n", std::string(x.status().message()).c_str());
        ::_exit(1);
      }
      Result& res = results[ti];
      void* outs[kL] = {out[0], out[1]};
      // The all-to-all variants side by side (each its own exchange: buffers, streams, chunking).
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        DpExchangeShape vs = shape;
        vs.sequential = variants[vi] == "seq";
        vs.own_concurrent = !variants[vi].empty() && variants[vi].back() == 'c';
        vs.graph = !variants[vi].empty() && variants[vi][0] == 'g';
        if (!vs.sequential) vs.chunk_bytes = std::stoll(variants[vi].substr(vs.graph ? 1 : 0)) << 10;
        auto vx = DpNcclExchange::Create(vs, *comm, false, stream, shard, nullptr, std::chrono::seconds(60));
        if (!vx.ok()) {
          std::fprintf(stderr, "exchange: %s\n", std::string(vx.status().message()).c_str());
          ::_exit(1);
        }
        res.variant_chunks[vi] = vs.sequential ? 1 : (*vx)->chunks(kL);
        res.variant_ms[vi] = TimeMs(
            stream, iters,
            [&] {
              auto st = (*vx)->Step(ids, kL * kC, kC, Ta, 0, kL, outs, false, false, stream);
              if (!st.ok()) {
                std::fprintf(stderr, "step: %s\n", std::string(st.message()).c_str());
                ::_exit(1);
              }
            },
            "all-to-all variant", &res.variant_host_ms[vi]);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        std::fprintf(stderr, "rank %d tokens %d variant %s: %.1f us (host %.1f us, %d chunks)\n", g, T,
                     variants[vi].c_str(), res.variant_ms[vi] * 1e3, res.variant_host_ms[vi] * 1e3,
                     res.variant_chunks[vi]);
      }
      if (auto st = (*x)->ExchangePeerShards(base); !st.ok()) {
        std::fprintf(stderr, "peer shards: %s\n", std::string(st.message()).c_str());
        ::_exit(1);
      }
      res.record_bytes = static_cast<double>(kL) * T * 12 * kRb;  // what this rank sends (and receives)
      auto step = [&](bool peer) {
        auto st = (*x)->Step(ids, kL * kC, kC, peer ? T : Ta, 0, kL, outs, false, peer, stream);
        if (!st.ok()) {
          std::fprintf(stderr, "step: %s\n", std::string(st.message()).c_str());
          ::_exit(1);
        }
      };
      res.a2a = TimeMs(
          stream, iters, [&] { step(false); }, "all-to-all path");
      res.peer = TimeMs(
          stream, iters, [&] { step(true); }, "peer path");
      // The all-to-all alone, of the same bytes.
      uint8_t *sb = nullptr, *rbuf = nullptr;
      const size_t chunk = static_cast<size_t>(res.record_bytes);
      CUDA_CHECK(cudaMalloc(&sb, chunk));
      CUDA_CHECK(cudaMalloc(&rbuf, chunk));
      res.a2a_ceiling = TimeMs(
          stream, iters,
          [&] {
            nccl->GroupStart();
            nccl->Send(sb, chunk, ncclUint8, 1 - g, *comm, stream);
            nccl->Recv(rbuf, chunk, ncclUint8, 1 - g, *comm, stream);
            ncclResult_t st = nccl->GroupEnd();
            while (st == ncclInProgress) nccl->CommGetAsyncError(*comm, &st);
          },
          "all-to-all ceiling", &res.ceiling_host_ms);
      cudaFree(sb);
      cudaFree(rbuf);
      // The peer gather alone: the peer's 12 columns of both layers for my T tokens, straight from its HBM (the
      // mapping the exchange opened).
      res.peer_gather = TimeMs(
          stream, iters,
          [&] {
            for (int l = 0; l < kL; ++l) {
              engram::kernels::LookupArgs a;
              const ShardLayer& src = (*x)->peer_shard(1 - g, l);
              a.records = src.records;
              a.row_begin = src.row_begin;
              a.row_end = src.row_end;
              a.head_dim = kD;
              a.ids = ids + l * kC + 12 * (1 - g);
              a.num_tokens = T;
              a.num_cols = 12;
              a.ids_stride = kL * kC;
              a.out = out[l];
              engram::kernels::LaunchLookup(a, stream);
            }
          },
          "peer gather");
      if (g == 0) {
        res.uva = TimeMs(
            stream, iters,
            [&] {
              for (int l = 0; l < kL; ++l) {
                engram::kernels::LookupArgs a;
                a.records = uva + static_cast<size_t>(l) * kC * uva_rows * kRb;
                a.row_begin = 0;
                a.row_end = kC * uva_rows;
                a.head_dim = kD;
                a.ids = uva_ids + l * kC;
                a.num_tokens = T;
                a.num_cols = kC;
                a.ids_stride = kL * kC;
                a.out = out[l];
                a.sort_scratch = sort_scratch;
                a.sort_scratch_bytes = sort_bytes;
                engram::kernels::LaunchLookup(a, stream);
              }
            },
            "UVA lookup");
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    const size_t bytes = results.size() * sizeof(Result);
    if (::write(res_pipe[g][1], results.data(), bytes) != static_cast<ssize_t>(bytes)) ::_exit(1);
    ::_exit(0);
  }
  std::vector<std::vector<Result>> results(kMembers, std::vector<Result>(tokens.size()));
  int rc = 0;
  for (int g = 0; g < kMembers; ++g) {
    const size_t bytes = tokens.size() * sizeof(Result);
    size_t got = 0;
    while (got < bytes) {
      const ssize_t r =
          ::read(res_pipe[g][0], reinterpret_cast<char*>(results[static_cast<size_t>(g)].data()) + got, bytes - got);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    int st = 0;
    ::waitpid(kids[g], &st, 0);
    if (got != bytes || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::printf("rank %d failed (exit %d)\n", g, WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
      rc = 1;
    }
  }
  if (rc != 0) return rc;
  std::printf("\n%-8s %-12s %-12s %-14s %-10s %-12s %-14s %-12s %s\n", "tokens", "a2a path us", "peer path us",
              "a2a ceiling us", "a2a GB/s", "path/ceil", "peer gather us", "UVA shared us", "fastest");
  for (size_t ti = 0; ti < tokens.size(); ++ti) {
    // The slower rank's time is the step's.
    Result r;
    for (const auto& m : results) {
      r.a2a = std::max(r.a2a, m[ti].a2a);
      r.peer = std::max(r.peer, m[ti].peer);
      r.a2a_ceiling = std::max(r.a2a_ceiling, m[ti].a2a_ceiling);
      r.peer_gather = std::max(r.peer_gather, m[ti].peer_gather);
      r.uva = std::max(r.uva, m[ti].uva);
      r.record_bytes = m[ti].record_bytes;
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        r.variant_ms[vi] = std::max(r.variant_ms[vi], m[ti].variant_ms[vi]);
        r.variant_host_ms[vi] = std::max(r.variant_host_ms[vi], m[ti].variant_host_ms[vi]);
        r.variant_chunks[vi] = m[ti].variant_chunks[vi];
      }
      r.ceiling_host_ms = std::max(r.ceiling_host_ms, m[ti].ceiling_host_ms);
    }
    const double best_dp = std::min(r.a2a, r.peer);
    std::printf("%-8d %-12.1f %-12.1f %-14.1f %-10.1f %-12.2f %-14.1f %-12.1f %s\n", tokens[ti], r.a2a * 1e3,
                r.peer * 1e3, r.a2a_ceiling * 1e3, r.record_bytes / (r.a2a_ceiling * 1e-3) / 1e9, r.a2a_ceiling / r.a2a,
                r.peer_gather * 1e3, r.uva * 1e3,
                r.uva < best_dp ? "UVA shared" : (r.peer < r.a2a ? "DP peer" : "DP all-to-all"));
  }
  // Every all-to-all variant: step time (GPU), ceiling / step, host enqueue time per step, chunks.
  std::printf(
      "\nall-to-all variants (us per step, the slower rank; ratio = a2a ceiling / step; host = enqueue time; "
      "k = chunks)\n%-8s %-16s",
      "tokens", "ceiling (host)");
  for (const auto& v : variants) {
    std::printf(" %-28s", (v == "seq"    ? std::string("sequential")
                           : v[0] == 'g' ? "graph " + v.substr(1) + " KiB"
                                         : "chunk " + v + " KiB")
                              .c_str());
  }
  std::printf("\n");
  for (size_t ti = 0; ti < tokens.size(); ++ti) {
    Result r;
    for (const auto& m : results) {
      r.a2a_ceiling = std::max(r.a2a_ceiling, m[ti].a2a_ceiling);
      r.ceiling_host_ms = std::max(r.ceiling_host_ms, m[ti].ceiling_host_ms);
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        r.variant_ms[vi] = std::max(r.variant_ms[vi], m[ti].variant_ms[vi]);
        r.variant_host_ms[vi] = std::max(r.variant_host_ms[vi], m[ti].variant_host_ms[vi]);
        r.variant_chunks[vi] = m[ti].variant_chunks[vi];
      }
    }
    char head[64];
    std::snprintf(head, sizeof(head), "%.1f (%.1f)", r.a2a_ceiling * 1e3, r.ceiling_host_ms * 1e3);
    std::printf("%-8d %-16s", tokens[ti], head);
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      char cell[64];
      std::snprintf(cell, sizeof(cell), "%.1f %.2f h%.1f k%d", r.variant_ms[vi] * 1e3, r.a2a_ceiling / r.variant_ms[vi],
                    r.variant_host_ms[vi] * 1e3, r.variant_chunks[vi]);
      std::printf(" %-28s", cell);
    }
    std::printf("\n");
  }
  return 0;
}
