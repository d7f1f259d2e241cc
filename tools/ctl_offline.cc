#include "tools/ctl_offline.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <optional>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "client/dp/plan.h"
#include "daemon/fallback.h"
#include "model/checkpoint.h"
#include "model/file_util.h"
#include "model/layout.h"
#include "model/reference.h"
#include "model/token_map.h"
#include "nlohmann/json.hpp"
#include "shm/capacity.h"
#include "tools/args.h"

namespace engram::tools {
namespace {

using nlohmann::json;

int Usage(const std::string& msg) {
  std::cerr << "engramctl: " << msg << "\n";
  return 2;
}

int Fail(const absl::Status& st) {
  std::cerr << "engramctl: " << st.message() << "\n";
  return 1;
}

std::string GiB(uint64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1ull << 30)); }

// Config from --checkpoint (validating tensors) or --config.
absl::StatusOr<EngramConfig> ConfigFrom(const Args& a, bool validate_tensors) {
  if (a.Has("--checkpoint")) {
    auto ck = Checkpoint::Open(a.Get("--checkpoint"));
    if (!ck.ok()) return ck.status();
    if (validate_tensors && (*ck)->config().kind == ModelKind::kEngram) {
      if (auto st = (*ck)->ValidateEngramTensors(); !st.ok()) return st;
    }
    return (*ck)->config();
  }
  return LoadEngramConfig(a.Get("--config"));
}

// embedding_across_dp: every rank's shard (tp_rank * edp + edp_rank) and what one step moves for it with `tokens`
// tokens on every rank (client/dp/plan.h).
absl::StatusOr<json> DpShardedPlanJson(const Layout& layout, int64_t tp, int64_t dp, int64_t local, int64_t tokens) {
  json ranks = json::array();
  int64_t edp = 0;
  for (int64_t t = 0; t < tp; ++t) {
    for (int64_t d = 0; d < dp; ++d) {
      auto p = client::PlanDpSharded(layout, tp, t, dp, d, local);
      if (!p.ok()) return p.status();
      edp = p->edp;
      const auto b = client::DpShardedStepBytes(layout, *p, std::vector<int64_t>(static_cast<size_t>(p->edp), tokens),
                                                p->edp_rank);
      ranks.push_back({{"tp_rank", t},
                       {"dp_rank", d},
                       {"edp_rank", p->edp_rank},
                       {"group", p->group_index},
                       {"shard", p->shard_index},
                       {"columns", {p->owned.col_begin, p->owned.col_end}},
                       {"shard_bytes", p->table_bytes},
                       {"step_bytes",
                        {{"ids_sent", b.ids_sent},
                         {"ids_received", b.ids_received},
                         {"records_sent", b.records_sent},
                         {"records_received", b.records_received},
                         {"total", b.total()}}}});
    }
  }
  return json{{"edp", edp}, {"shards", tp * edp}, {"tokens_per_rank", tokens}, {"ranks", ranks}};
}

}  // namespace

int CmdPlan(int argc, char** argv) {
  Args a;
  if (auto st =
          a.Parse(argc, argv, 2,
                  {"--checkpoint", "--config", "--tp", "--shm-dir", "--dp", "--local-dp", "--cpu-offload", "--tokens"},
                  {"--json", "--elastic-ep", "--embedding-across-dp"});
      !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (a.Has("--checkpoint") == a.Has("--config")) return Usage("plan needs exactly one of --checkpoint or --config");
  auto tp = a.GetInt("--tp", 1);
  if (!tp.ok()) return Usage(std::string(tp.status().message()));
  auto cfg = ConfigFrom(a, /*validate_tensors=*/true);
  if (!cfg.ok()) return Fail(cfg.status());
  if (cfg->kind == ModelKind::kPle) {
    return Fail(absl::UnimplementedError(absl::StrCat(
        cfg->architecture, " declares PLE layers [", absl::StrJoin(cfg->layer_ids, ", "),
        "]: PLE tables are ETP-sharded and follow cpu_offload only (never shared across DP, reason "
        "MODEL_NOT_SHAREABLE); their hashing is not public, so engram cannot lay them out or serve them")));
  }
  auto layout = Layout::Build(*cfg);
  if (!layout.ok()) return Fail(layout.status());
  json shards = json::array();
  std::vector<ShardRange> ranges;
  for (int64_t r = 0; r < *tp; ++r) {
    auto s = layout->Shard(*tp, r);
    if (!s.ok()) return Fail(s.status());
    ranges.push_back(*s);
  }
  const std::string shm_dir = a.Get("--shm-dir", "/dev/shm");
  auto cap = ProbeShm(shm_dir);
  const uint64_t needed = static_cast<uint64_t>(layout->table_bytes());

  json out;
  out["architecture"] = cfg->architecture;
  out["compressed_vocab"] = cfg->compressed_vocab_size;
  out["table_bytes"] = layout->table_bytes();
  out["tp"] = *tp;
  out["layers"] = json::array();
  for (int64_t l = 0; l < layout->n_layers(); ++l) {
    out["layers"].push_back({{"layer_id", cfg->layer_ids[l]},
                             {"rows", layout->rows(l)},
                             {"primes", layout->primes(l)},
                             {"offsets", layout->offsets(l)},
                             {"multipliers", layout->multipliers(l)}});
  }
  for (const auto& s : ranges) {
    // A shard's row range as the span of global rows it covers across layers: [first, last) of layer 0 when one
    // layer, otherwise per-layer ranges concatenate; the bytes count all of them.
    shards.push_back({{"tp_rank", s.tp_rank},
                      {"columns", {s.col_begin, s.col_end}},
                      {"rows", {s.row_begin.front(), s.row_end.front()}},
                      {"bytes", s.bytes(layout->record_bytes())}});
  }
  out["shards"] = shards;
  // The node's memory: the tables (one copy, in the shm directory) and what every replica process holds to map and
  // register its shard (page tables and the driver's pinned-page list; per DP replica, all TP shards: the table).
  auto local_replicas = a.GetInt("--local-dp", a.GetInt("--dp", 1).value_or(1));
  if (!local_replicas.ok() || *local_replicas < 1 || *local_replicas > 4096) {
    return Usage("--dp and --local-dp want integers in [1, 4096]");
  }
  const bool huge = cap.ok() && SegmentsOnHugePages(*cap);
  const NodeMemory mem = ReadNodeMemory();
  const uint64_t overhead = static_cast<uint64_t>(*local_replicas) * MappingOverheadBytes(needed, huge);
  out["node_memory"] = {{"total_bytes", mem.total_bytes},
                        {"available_bytes", mem.available_bytes},
                        {"tables_bytes", needed},
                        {"dp_replicas", *local_replicas},
                        {"huge_pages", huge},
                        {"mapping_bytes", overhead},
                        {"fits", mem.total_bytes >= needed + overhead}};
  out["node_shm"] = {{"path", cap.ok() ? cap->path : shm_dir},
                     {"total_bytes", cap.ok() ? cap->total_bytes : 0},
                     {"free_bytes", cap.ok() ? cap->free_bytes : 0},
                     {"needed_bytes", needed},
                     {"fits", cap.ok() && cap->free_bytes >= needed}};
  // With --dp: would dp_shared_memory work on this node for this topology, and if not, why (the daemon's own rule).
  std::optional<daemon::Decision> verdict;
  if (a.Has("--dp")) {
    auto dp = a.GetInt("--dp", 1);
    auto local = a.GetInt("--local-dp", dp.value_or(1));
    if (!dp.ok() || !local.ok()) return Usage("--dp and --local-dp want integers");
    engram::v1::Hello h;
    h.set_tp_size(static_cast<int32_t>(*tp));
    h.set_dp_size(static_cast<int32_t>(*dp));
    h.set_local_dp_size(static_cast<int32_t>(*local));
    h.set_elastic_ep(a.Has("--elastic-ep"));
    h.mutable_config()->set_cpu_offload(a.Get("--cpu-offload", "true") == "false" ? engram::v1::DISABLED
                                                                                  : engram::v1::ENABLED);
    h.mutable_config()->set_embedding_across_dp(a.Has("--embedding-across-dp"));
    daemon::NodeView node;
    node.checkpoint_served = true;
    node.shm_path = shm_dir;
    node.shm_exists = cap.ok();
    node.tables_bytes = needed;
    if (cap.ok()) {
      node.shm_free_bytes = cap->free_bytes;
      node.shm_too_small = cap->free_bytes < needed;
    }
    verdict = daemon::Decide(h, node);
    json reasons = json::array(), hints = json::array();
    for (const auto& r : verdict->reasons) {
      reasons.push_back(engram::v1::FallbackReason_Name(r.code()));
      hints.push_back(r.hint());
    }
    out["dp_shared_memory"] = {{"works", verdict->share},
                               {"mode", engram::v1::Mode_Name(verdict->mode)},
                               {"reasons", reasons},
                               {"hints", hints}};
  }
  if (a.Has("--embedding-across-dp")) {
    auto dp = a.GetInt("--dp", 1);
    auto local = a.GetInt("--local-dp", dp.value_or(1));
    auto tokens = a.GetInt("--tokens", 4096);
    if (!dp.ok() || !local.ok() || !tokens.ok() || *tokens < 0)
      return Usage("--dp, --local-dp, --tokens want integers");
    auto plan = DpShardedPlanJson(*layout, *tp, *dp, *local, *tokens);
    if (!plan.ok()) return Fail(plan.status());
    out["embedding_across_dp"] = *plan;
  }
  if (a.Has("--json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::cout << absl::StrFormat("%s  compressed vocab %d  %d layers x %d columns, records of %d bytes\n",
                               cfg->architecture, cfg->compressed_vocab_size, layout->n_layers(), layout->n_cols(),
                               layout->record_bytes());
  std::cout << absl::StrFormat("tables: %d rows, %s (%d bytes)\n\n", layout->total_rows(), GiB(needed), needed);
  std::cout << absl::StrFormat("%-8s %-10s %-14s %-26s %s\n", "layer", "rows", "multiplier[0]", "primes", "");
  for (int64_t l = 0; l < layout->n_layers(); ++l) {
    std::cout << absl::StrFormat("%-8d %-10d %-14d %d .. %d\n", cfg->layer_ids[l], layout->rows(l),
                                 layout->multipliers(l)[0], layout->primes(l).front(), layout->primes(l).back());
  }
  std::cout << absl::StrFormat("\n%-8s %-10s %-40s %s\n", "tp_rank", "columns", "rows (per layer)", "bytes");
  for (const auto& s : ranges) {
    std::vector<std::string> rows;
    for (size_t l = 0; l < s.row_begin.size(); ++l) rows.push_back(absl::StrCat(s.row_begin[l], "-", s.row_end[l]));
    std::cout << absl::StrFormat("%-8d %-10s %-40s %s\n", s.tp_rank, absl::StrCat(s.col_begin, "-", s.col_end),
                                 absl::StrJoin(rows, " "), GiB(static_cast<uint64_t>(s.bytes(layout->record_bytes()))));
  }
  if (cap.ok()) {
    std::cout << absl::StrFormat("\nshm %s (%s, huge=%s): %s free of %s, needs %s: %s\n", cap->path, cap->fs_type,
                                 cap->huge_pages, GiB(cap->free_bytes), GiB(cap->total_bytes), GiB(needed),
                                 cap->free_bytes >= needed ? "fits, dp_shared_memory can share one copy per node"
                                                           : "DOES NOT FIT: replicas would fall back (SHM_TOO_SMALL)");
  } else {
    std::cout << "\nshm " << shm_dir << ": " << cap.status().message() << " (replicas would fall back: SHM_MISSING)\n";
  }
  std::cout << absl::StrFormat(
      "node memory %s: tables %s + %s for %d DP replica%s to map and register them (%s pages): %s\n",
      GiB(mem.total_bytes), GiB(needed), GiB(overhead), *local_replicas, *local_replicas == 1 ? "" : "s",
      huge ? "2 MiB" : "4 KiB",
      mem.total_bytes >= needed + overhead ? "fits"
      : mem.total_bytes >= needed          ? "DOES NOT FIT: one copy fits, but not with every replica's mappings"
                                           : "DOES NOT FIT: the node cannot hold one copy of the tables");
  if (auto why = cap.ok() ? ShmPagesWarning(*cap, needed) : std::nullopt) std::cout << "  " << *why << "\n";
  if (out.contains("embedding_across_dp")) {
    const json& p = out["embedding_across_dp"];
    std::cout << absl::StrFormat(
        "\nembedding_across_dp: %d shards (TP %d x DP group of %d), %d tokens per rank per step\n",
        p["shards"].get<int64_t>(), *tp, p["edp"].get<int64_t>(), p["tokens_per_rank"].get<int64_t>());
    std::cout << absl::StrFormat("%-8s %-8s %-6s %-10s %-12s %-14s %s\n", "tp_rank", "dp_rank", "shard", "columns",
                                 "shard bytes", "step bytes", "(ids out/in, records out/in)");
    for (const auto& r : p["ranks"]) {
      const json& b = r["step_bytes"];
      std::cout << absl::StrFormat(
          "%-8d %-8d %-6d %-10s %-12s %-14s %s\n", r["tp_rank"].get<int64_t>(), r["dp_rank"].get<int64_t>(),
          r["shard"].get<int64_t>(), absl::StrCat(r["columns"][0].get<int64_t>(), "-", r["columns"][1].get<int64_t>()),
          GiB(r["shard_bytes"].get<uint64_t>()), absl::StrFormat("%.2f MiB", b["total"].get<double>() / 1048576.0),
          absl::StrFormat("%d / %d, %d / %d", b["ids_sent"].get<int64_t>(), b["ids_received"].get<int64_t>(),
                          b["records_sent"].get<int64_t>(), b["records_received"].get<int64_t>()));
    }
  }
  if (verdict) {
    if (verdict->share) {
      std::cout << "\ndp_shared_memory: works here: one copy of each TP shard for all DP replicas of this node\n";
    } else {
      std::cout << "\ndp_shared_memory: would fall back to " << engram::v1::Mode_Name(verdict->mode) << ":\n";
      for (const auto& r : verdict->reasons) {
        std::cout << "  " << engram::v1::FallbackReason_Name(r.code()) << ": " << r.hint() << "\n";
      }
    }
  }
  return 0;
}

int CmdTokenMap(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--tokenizer", "--out"}, {"--json"}); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--tokenizer")) return Usage("tokenmap needs --tokenizer FILE");
  auto tok = Tokenizer::Load(a.Get("--tokenizer"));
  if (!tok.ok()) return Fail(tok.status());
  TokenMap map = TokenMap::Build(*tok);
  if (a.Has("--out")) {
    if (auto st = WriteFileAtomic(a.Get("--out"), map.Bytes()); !st.ok()) return Fail(st);
  }
  json out = {{"raw", map.raw_size()}, {"compressed", map.compressed_size()}, {"sha256", map.Sha256Hex()}};
  if (a.Has("--json")) {
    std::cout << out.dump() << "\n";
  } else {
    std::cout << "raw ids        " << map.raw_size() << "\ncompressed ids " << map.compressed_size()
              << "\nsha256         " << map.Sha256Hex() << "\n";
  }
  return 0;
}

int CmdHash(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--checkpoint", "--config", "--tokenizer", "--tokens", "--dead"}, {"--json"});
      !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (a.Has("--checkpoint") == a.Has("--config")) return Usage("hash needs exactly one of --checkpoint or --config");
  if (a.Has("--config") && !a.Has("--tokenizer")) return Usage("hash --config needs --tokenizer FILE");
  if (!a.Has("--tokens")) return Usage("hash needs --tokens a,b,...");
  auto tokens64 = ParseIntList("--tokens", a.Get("--tokens"));
  if (!tokens64.ok()) return Usage(std::string(tokens64.status().message()));
  std::vector<uint8_t> dead;
  if (a.Has("--dead")) {
    auto d = ParseIntList("--dead", a.Get("--dead"));
    if (!d.ok()) return Usage(std::string(d.status().message()));
    if (d->size() != tokens64->size()) return Usage("--dead needs one 0/1 flag per token");
    for (int64_t v : *d) dead.push_back(v != 0);
  }
  std::vector<int32_t> tokens;
  for (int64_t v : *tokens64) {
    if (v < INT32_MIN || v > INT32_MAX) return Usage(absl::StrCat("token ", v, " is not an int32"));
    tokens.push_back(static_cast<int32_t>(v));
  }
  auto cfg = ConfigFrom(a, /*validate_tensors=*/false);
  if (!cfg.ok()) return Fail(cfg.status());
  auto layout = Layout::Build(*cfg);
  if (!layout.ok()) return Fail(layout.status());
  const std::string tok_path = a.Has("--checkpoint") ? a.Get("--checkpoint") + "/tokenizer.json" : a.Get("--tokenizer");
  auto tok = Tokenizer::Load(tok_path);
  if (!tok.ok()) return Fail(tok.status());
  TokenMap map = TokenMap::Build(*tok);
  if (auto st = map.CheckAgainst(*cfg); !st.ok()) return Fail(st);

  const int64_t T = static_cast<int64_t>(tokens.size());
  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) positions[static_cast<size_t>(i)] = i;
  std::vector<int32_t> qsl = {0, static_cast<int32_t>(T)};
  std::vector<int32_t> ids(static_cast<size_t>(T * layout->n_layers() * layout->n_cols()));
  HashBatch batch{tokens, positions, qsl, {}, dead};
  if (auto st = HashIdsCpu(*layout, map, batch, ids); !st.ok()) return Fail(st);
  json out;
  out["layers"] = json::array();
  for (int64_t l = 0; l < layout->n_layers(); ++l) {
    json rows = json::array();
    for (int64_t t = 0; t < T; ++t) {
      auto* p = ids.data() + (t * layout->n_layers() + l) * layout->n_cols();
      rows.push_back(std::vector<int32_t>(p, p + layout->n_cols()));
    }
    out["layers"].push_back({{"layer_id", cfg->layer_ids[l]}, {"ids", rows}});
  }
  if (a.Has("--json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  for (const auto& l : out["layers"]) {
    std::cout << "layer " << l["layer_id"] << "\n";
    for (size_t t = 0; t < l["ids"].size(); ++t) {
      std::cout << absl::StrFormat("  token %-4d %-8d %s\n", t, tokens[t], l["ids"][t].dump());
    }
  }
  return 0;
}

}  // namespace engram::tools
