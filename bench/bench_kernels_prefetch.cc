// bench_kernels' main-stream sections (KernelBench, bench/bench_kernels.h): the gate kernel against the D2D
// ceiling (the busy main stream of the prefetch sections), the hash of 8192 tokens on the V4.1-Flash layout, and
// the 8192-token lookup of 2 layers beside 60 gate kernels on the main stream, by the kernels' side-stream prefetcher
// (three grid sizes) and by the host gather (no UVA share and the engine's). GateKernel allocates the gate's buffers
// (filled from the ceiling copies' d0); Hash uploads the layout and leaves its output (KernelBench::hash_out) as the
// prefetcher's ids; each prefetch section makes and drops its own prefetcher, host gather and output buffers.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_kernels.h"
#include "bench/cuda_check.h"
#include "bench/gpu_timing.h"
#include "client/engine/host_gather.h"
#include "client/engine/prefetch.h"
#include "client/tuning.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/token_map.h"

namespace engram::bench {

// Side-stream prefetch of 8192 tokens (2 layers) during a busy main stream (gate kernels, HBM-bound).
void KernelBench::GateKernel() {
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&hidden), size_t{T} * HC * HD * 2));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&kv), size_t{T} * (HC + 1) * HD * 2));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&qk), size_t{HC} * HD * 2));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&gout), size_t{T} * HC * HD * 2));
  CUDA_CHECK(cudaMemcpy(hidden, d0, size_t{T} * HC * HD * 2, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemcpy(kv, d0, size_t{T} * (HC + 1) * HD * 2, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemset(qk, 0x3F, size_t{HC} * HD * 2));
  std::printf("\n%-44s %-12s %-12s %s\n", "gate (D=5120, hc=4)", "time", "GB/s", "vs D2D");
  for (int t : {4096, 8192}) {
    const double ms = MedianMs([&] { Gate(t, s); }, s, 20, 3);
    const double bytes = double(t) * (HC * HD * 2 * 2 + (HC + 1) * HD * 2);  // hidden in+out, kv in
    std::printf("T=%-42d %8.3f ms  %8.0f     %.3f of D2D\n", t, ms, bytes / ms / 1e6, bytes / ms / 1e6 / d2d);
  }
}

// Hash, V4.1-Flash layout.
bool KernelBench::Hash(const char* config_json) {
  auto cfg = engram::LoadEngramConfig(config_json);
  if (!cfg.ok()) return false;
  auto layout = engram::Layout::Build(*cfg);
  std::vector<int32_t> map_ids(static_cast<size_t>(cfg->compressed_vocab_size));
  for (size_t i = 0; i < map_ids.size(); ++i) map_ids[i] = static_cast<int32_t>(i);
  auto map = engram::TokenMap::FromIds(map_ids);
  auto dl = engram::kernels::DeviceLayout::Upload(*layout, map);
  if (!dl.ok()) return false;
  std::vector<int32_t> tok(T), qsl = {0, T / 2, T};
  std::vector<int64_t> pos(T);
  for (int i = 0; i < T; ++i) {
    tok[i] = static_cast<int32_t>(rng() % map_ids.size());
    pos[i] = i < T / 2 ? i : i - T / 2 + 100;
  }
  int32_t *dt, *dq;
  int64_t* dp;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dt), T * 4));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dq), 12));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dp), T * 8));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&hash_out), size_t{T} * 48 * 4));
  CUDA_CHECK(cudaMemcpy(dt, tok.data(), T * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dq, qsl.data(), 12, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dp, pos.data(), T * 8, cudaMemcpyHostToDevice));
  engram::kernels::HashArgs h{dt, dp, dq, nullptr, nullptr, T, 2, hash_out, nullptr};
  const double ms = MedianMs([&] { CUDA_CHECK(engram::kernels::LaunchHash((*dl)->view(), h, s)); }, s, 100, 10);
  std::printf("hash T=8192, 2 layers x 24 columns               %8.2f us\n", ms * 1e3);
  hash_layout = std::move(*dl);  // uploaded until Unmap, through the prefetch sections
  return true;
}

// Prefetch during a busy main stream: main = 10 gate kernels of T=8192.
bool KernelBench::PrefetchBesideMain() {
  for (int blocks : {0, 8, 16}) {
    engram::kernels::Prefetcher p;
    std::vector<engram::kernels::LayerTable> tables = {
        {static_cast<const uint8_t*>(dseg), 0, rows / 2},
        {static_cast<const uint8_t*>(dseg) + (rows / 2) * rb, 0, rows / 2}};
    if (auto st = p.Init(tables, T, 24, static_cast<int32_t>(D), blocks); !st.ok()) {
      std::printf("prefetcher: %s\n", std::string(st.message()).c_str());
      return false;
    }
    // hash ids for the prefetch: random in range
    std::vector<int32_t> pid(size_t{T} * 48);
    for (auto& v : pid) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows / 2));
    CUDA_CHECK(cudaMemcpy(hash_out, pid.data(), pid.size() * 4, cudaMemcpyHostToDevice));
    auto busy = [&] {  // longer than the lookup, as the earlier layers of a real model are
      for (int i = 0; i < 60; ++i) Gate(T, s);
    };
    const double alone = MedianMs(busy, s, 10, 2);
    const double side_alone = MedianMs(
        [&] {
          (void)p.Prefetch(hash_out, T, s);
          (void)p.Wait(1, s);
        },
        s, 10, 2);
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> with;
    int finished_first = 0;
    for (int r = 0; r < 10; ++r) {
      CUDA_CHECK(cudaEventRecord(a, s));
      (void)p.Prefetch(hash_out, T, s);
      busy();
      CUDA_CHECK(cudaEventRecord(b, s));
      CUDA_CHECK(cudaEventSynchronize(b));
      // Both events are complete now; the lookup finished first when its event is not later than the main one.
      float order = -1;
      if (cudaEventQuery(p.layer_event(1)) == cudaSuccess)
        CUDA_CHECK(cudaEventElapsedTime(&order, p.layer_event(1), b));
      finished_first += order >= 0;
      (void)p.Wait(1, s);
      float m = 0;
      CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
      with.push_back(m);
      CUDA_CHECK(cudaStreamSynchronize(s));
    }
    std::sort(with.begin(), with.end());
    std::printf("\nprefetch, background grid %s blocks: 8192 tokens x 2 layers (UVA) alone %.3f ms\n",
                blocks ? std::to_string(blocks).c_str() : "default", side_alone);
    std::printf(
        "  main stream (60 gates T=8192) alone %.3f ms, with the prefetch %.3f ms: slowed %.1f%%; "
        "lookup done before the main stream in %d/10 runs\n",
        alone, with[with.size() / 2], (with[with.size() / 2] / alone - 1) * 100, finished_first);
  }
  return true;
}

// The host-gather path beside the same busy main stream: CPU threads and copy engines, the unpack on the GPU
// (and, with the engine's UVA share, the row-order kernel on part of the tokens).
bool KernelBench::HostGatherBesideMain() {
  for (double share : {0.0, engram::client::tuning_default::kHostGatherUvaShare}) {
    uint16_t *o0 = nullptr, *o1 = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&o0), size_t{T} * 24 * D * 2));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&o1), size_t{T} * 24 * D * 2));
    engram::client::HostGatherOptions ho;
    ho.uva_share = share;
    auto g = engram::client::HostGather::Create(
        {{seg, 0, rows / 2, static_cast<const uint8_t*>(dseg)},
         {seg + (rows / 2) * rb, 0, rows / 2, static_cast<const uint8_t*>(dseg) + (rows / 2) * rb}},
        {o0, o1}, T, 24, static_cast<int32_t>(D), ho);
    if (!g.ok()) return false;
    std::vector<int32_t> hid(size_t{T} * 48);
    for (auto& v : hid) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows / 2));
    auto busy = [&] {
      for (int i = 0; i < 60; ++i) Gate(T, s);
    };
    const double alone = MedianMs(busy, s, 10, 2);
    const double side_alone = MedianMs(
        [&] {
          if (!(*g)->Prefetch(hid.data(), T, 48, s).ok() || !(*g)->Wait(1, s).ok()) std::exit(1);
        },
        s, 10, 2);
    const double with = MedianMs(
        [&] {
          if (!(*g)->Prefetch(hid.data(), T, 48, s).ok()) std::exit(1);
          busy();
          if (!(*g)->Wait(1, s).ok()) std::exit(1);
        },
        s, 10, 2);
    std::printf("\nprefetch, host gather (%d threads, UVA share %.2f): 8192 tokens x 2 layers alone %.3f ms\n",
                (*g)->threads(), share, side_alone);
    std::printf("  main stream (60 gates T=8192) alone %.3f ms, with the host-gather prefetch %.3f ms: slowed %.1f%%\n",
                alone, with, (with / alone - 1) * 100);
    g->reset();
    CUDA_CHECK(cudaFree(o0));
    CUDA_CHECK(cudaFree(o1));
  }
  return true;
}

}  // namespace engram::bench
