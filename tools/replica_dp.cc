// engram-replica's DP_SHARDED run (tools/replica.h): batches of random tokens through the table's group engine,
// the returned rows checked against the checkpoint.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <random>
#include <thread>

#include "client/dp/plan.h"
#include "engram/lookup_engine.h"
#include "model/token_map.h"

#ifdef ENGRAM_HAVE_CUDA
#include <cuda_runtime_api.h>

#endif
#include "nlohmann/json.hpp"
#include "tools/replica.h"

namespace engram::tools::replica {

using nlohmann::json;

int RunDpSharded(const engram::client::Table& t, engram::oracle::RowOracle* oracle, int64_t T, int64_t batches,
                 int64_t verify, const engram::client::AttachRequest& req, int64_t hold) {
  const int64_t D = t.head_dim(), L = static_cast<int64_t>(t.layers().size()), C = t.n_cols();
  auto fail = [](const std::string& what, const absl::Status& st) {
    std::cout << json{{"error", what + ": " + std::string(st.message())}, {"code", absl::StatusCodeToString(st.code())}}
                     .dump()
              << std::endl;
    return 1;
  };
  auto plan =
      engram::client::PlanDpSharded(t.layout(), req.tp_size, req.tp_rank, req.dp_size, req.dp_rank, req.local_dp_size);
  if (!plan.ok()) return fail("plan", plan.status());
  const int32_t max_tokens = static_cast<int32_t>(std::max<int64_t>(T, 1));
  auto host = engram::client::LookupEngine::CreateOnHost(t, max_tokens);
  if (!host.ok()) return fail("host engine", host.status());
  auto engine = engram::client::LookupEngine::Create(t, max_tokens, nullptr);
  if (!engine.ok()) return fail("DP engine", engine.status());
  std::cout << json{{"dp_group_formed", true}, {"edp", plan->edp}, {"edp_rank", plan->edp_rank}}.dump() << std::endl;
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> tokens(static_cast<size_t>(T)), qsl = {0, static_cast<int32_t>(T)},
                                                       ids(static_cast<size_t>(T * L * C));
  std::vector<int64_t> pos(static_cast<size_t>(T));
  int64_t verified = 0, mismatches = 0;
  double busy = 0;
  // CUDA backend: the ids go to the GPU, the exchange runs there (NCCL / NVLink), the rows come back to be checked.
  const bool cuda = t.backend() == engram::client::Backend::kCuda;
  int32_t* dev_ids = nullptr;
  std::vector<uint16_t> dev_rows;
#ifdef ENGRAM_HAVE_CUDA
  if (cuda) {
    cudaMalloc(reinterpret_cast<void**>(&dev_ids), std::max<size_t>(ids.size(), 1) * 4);
    dev_rows.resize(static_cast<size_t>(T * C * D));
  }
#endif
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < T; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(t.token_map().raw_size()));
      pos[static_cast<size_t>(i)] = i;
    }
    if (auto st = (*host)->Hash(tokens.data(), pos.data(), qsl.data(), nullptr, nullptr, static_cast<int32_t>(T), 1,
                                ids.data());
        !st.ok()) {
      return fail("hash", st);
    }
    const auto t0 = std::chrono::steady_clock::now();
#ifdef ENGRAM_HAVE_CUDA
    if (cuda) cudaMemcpy(dev_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
#endif
    if (auto st = (*engine)->Prefetch(cuda ? dev_ids : ids.data(), static_cast<int32_t>(T)); !st.ok()) {
      return fail("step", st);
    }
#ifdef ENGRAM_HAVE_CUDA
    if (cuda) {
      // Prefetch only enqueues on CUDA (the exchange runs on the engine's side stream): time until every layer's
      // rows are in staging, i.e. Wait joins each layer into the engine's stream and that stream drains.
      for (int64_t l = 0; l < L; ++l) {
        if (auto st = (*engine)->Wait(static_cast<int>(l)); !st.ok()) return fail("wait", st);
      }
      cudaStreamSynchronize(nullptr);
    }
#endif
    busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Every row when the budget allows, else a random sample of `verify` per batch and layer.
    const int64_t n = T * C;
    for (int64_t l = 0; l < L && n > 0; ++l) {
      if (auto st = (*engine)->Wait(static_cast<int>(l)); !st.ok()) return fail("wait", st);
      const uint16_t* rows = (*engine)->staging(static_cast<int>(l));
#ifdef ENGRAM_HAVE_CUDA
      if (cuda) {
        if (cudaMemcpy(dev_rows.data(), rows, dev_rows.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
          return fail("copy back", absl::InternalError("cudaMemcpy of the staging rows failed"));
        }
        if (auto st = (*engine)->Wait(static_cast<int>(l)); !st.ok()) return fail("wait", st);
        rows = dev_rows.data();
      }
#endif
      const int64_t checks = verify >= n ? n : verify;
      for (int64_t k = 0; k < checks; ++k) {
        const int64_t idx = verify >= n ? k : static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
        const int64_t tok = idx / C, c = idx % C;
        const int32_t id = ids[static_cast<size_t>((tok * L + l) * C + c)];
        const bool in_group = c >= plan->group_col_begin && c < plan->group_col_end;
        const std::vector<uint16_t> want =
            in_group ? RowFromCheckpoint(oracle, t.layers()[static_cast<size_t>(l)].layer_id, id, D)
                     : std::vector<uint16_t>(static_cast<size_t>(D), 0);
        ++verified;
        mismatches += !std::equal(want.begin(), want.end(), rows + idx * D);
      }
    }
  }
  json out = {{"mode", engram::client::ModeName(t.mode())},
              {"backend", engram::client::BackendName(t.backend())},
              {"reasons", json::array()},
              {"edp", plan->edp},
              {"edp_rank", plan->edp_rank},
              {"columns", {t.col_begin(), t.col_end()}},
              {"steps", batches},
              {"verified", verified},
              {"mismatches", mismatches},
              {"tokens_per_s", busy > 0 ? static_cast<double>(T * batches) / busy : 0.0}};
  for (const auto& r : t.reasons()) out["reasons"].push_back(engram::client::ReasonName(r.code));
  if (hold > 0) {  // the group and its lease stay while the replica holds, as in the other modes
    std::cout << json{{"attached", true}, {"mode", out["mode"]}}.dump() << std::endl;
    std::this_thread::sleep_for(std::chrono::seconds(hold));
  }
  std::cout << out.dump() << std::endl;
  return mismatches == 0 ? 0 : 1;
}

}  // namespace engram::tools::replica
