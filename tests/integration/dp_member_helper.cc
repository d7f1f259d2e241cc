// dp_member_helper: one DP_SHARDED replica for the group-lifecycle tests, scripted so that a test can make a member
// leave, give up or rejoin at a known point while its session (its lease) lives on. It attaches through
// libengram_client (embedding_across_dp, dp_shared_memory false: DP_SHARDED on the CPU backend) with one session
// for the whole run, then runs its commands in order, printing one flushed JSON line each:
//   engine       makes the table's DP engine (joins a group): {"engine": "ok"} or {"engine_error": ..., "code": ...}
//   step         one group step of --tokens random tokens (Prefetch), every row checked against the checkpoint
//                through the independent row oracle: {"step": "ok", "verified": N, "mismatches": M} or
//                {"step_error": ...}
//   close        destroys the engine (which leaves the group): {"closed": true}
//   wait PATH    waits until PATH exists (the test's go signal): {"waited": PATH}
//   hold         sleeps until killed, the session held: {"holding": true}
// Then {"done": true} and exit 0; exit 1 only when the attach fails. Errors of a command are reported, not fatal:
// the tests read what happened. Usage:
//   dp_member_helper SOCKET CHECKPOINT DP_SIZE DP_RANK TOKENS COMMAND...
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/dp/plan.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "model/token_map.h"
#include "nlohmann/json.hpp"
#include "tools/row_oracle.h"

namespace {

using nlohmann::json;

void Say(const json& j) { std::cout << j.dump() << std::endl; }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: dp_member_helper SOCKET CHECKPOINT DP_SIZE DP_RANK TOKENS COMMAND...\n";
    return 2;
  }
  engram::client::ClientOptions opts;
  opts.socket = argv[1];
  opts.timeout = std::chrono::milliseconds(10000);
  engram::client::AttachRequest req;
  req.checkpoint = argv[2];
  req.dp_size = std::atoi(argv[3]);
  req.dp_rank = std::atoi(argv[4]);
  req.embedding_across_dp = true;
  req.dp_shared_memory = engram::client::Choice::kFalse;
  const int32_t T = std::atoi(argv[5]);
  auto client = engram::client::Client::Create(opts);
  if (!client.ok()) {
    Say({{"error", std::string(client.status().message())}});
    return 1;
  }
  auto table = (*client)->Attach(req);
  if (!table.ok() || (*table)->mode() != engram::client::Mode::kDpSharded) {
    Say({{"error", table.ok() ? "not DP_SHARDED" : std::string(table.status().message())}});
    return 1;
  }
  const auto& t = **table;
  std::string oracle_error;
  auto oracle = engram::oracle::RowOracle::Open(req.checkpoint, &oracle_error);
  if (!oracle) {
    Say({{"error", oracle_error}});
    return 1;
  }
  auto plan = engram::client::PlanDpSharded(t.layout(), 1, 0, req.dp_size, req.dp_rank, 0);
  auto host = engram::client::LookupEngine::CreateOnHost(t, std::max(T, 1));
  if (!plan.ok() || !host.ok()) {
    Say({{"error", "plan or host engine"}});
    return 1;
  }
  const int64_t D = t.head_dim(), L = static_cast<int64_t>(t.layers().size()), C = t.n_cols();
  std::mt19937_64 rng(std::random_device{}());
  std::unique_ptr<engram::client::LookupEngine> engine;
  for (int i = 6; i < argc; ++i) {
    const std::string cmd = argv[i];
    if (cmd == "engine") {
      auto e = engram::client::LookupEngine::Create(t, std::max(T, 1), nullptr);
      if (e.ok()) {
        engine = std::move(*e);
        Say({{"engine", "ok"}});
      } else {
        Say({{"engine_error", std::string(e.status().message())},
             {"code", absl::StatusCodeToString(e.status().code())}});
      }
    } else if (cmd == "step") {
      if (!engine) {
        Say({{"step_error", "no engine"}});
        continue;
      }
      std::vector<int32_t> tokens(static_cast<size_t>(T)), qsl = {0, T}, ids(static_cast<size_t>(T * L * C));
      std::vector<int64_t> pos(static_cast<size_t>(T));
      for (int32_t k = 0; k < T; ++k) {
        tokens[static_cast<size_t>(k)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(t.token_map().raw_size()));
        pos[static_cast<size_t>(k)] = k;
      }
      if (auto st = (*host)->Hash(tokens.data(), pos.data(), qsl.data(), nullptr, nullptr, T, 1, ids.data());
          !st.ok()) {
        Say({{"step_error", std::string(st.message())}});
        continue;
      }
      if (auto st = engine->Prefetch(ids.data(), T); !st.ok()) {
        Say({{"step_error", std::string(st.message())}, {"code", absl::StatusCodeToString(st.code())}});
        continue;
      }
      int64_t verified = 0, mismatches = 0;
      for (int64_t l = 0; l < L; ++l) {
        const uint16_t* rows = engine->staging(static_cast<int>(l));
        for (int64_t tok = 0; tok < T; ++tok) {
          for (int64_t c = 0; c < C; ++c) {
            const int32_t id = ids[static_cast<size_t>((tok * L + l) * C + c)];
            std::string error;
            auto rec = oracle->Record(t.layers()[static_cast<size_t>(l)].layer_id, id, &error);
            const bool in_group = c >= plan->group_col_begin && c < plan->group_col_end;
            std::vector<uint16_t> want(static_cast<size_t>(D), in_group ? 0xFFFF : 0);
            if (in_group && rec) want = engram::oracle::DequantBf16Row(*rec, D);
            ++verified;
            mismatches += !std::equal(want.begin(), want.end(), rows + (tok * C + c) * D);
          }
        }
      }
      Say({{"step", "ok"}, {"verified", verified}, {"mismatches", mismatches}});
    } else if (cmd == "close") {
      engine.reset();
      Say({{"closed", true}});
    } else if (cmd == "wait" && i + 1 < argc) {
      const std::string path = argv[++i];
      struct stat st {};
      while (::stat(path.c_str(), &st) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      Say({{"waited", path}});
    } else if (cmd == "hold") {
      Say({{"holding", true}});
      while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
    } else {
      Say({{"unknown_command", cmd}});
    }
  }
  engine.reset();
  Say({{"done", true}});
  return 0;
}
