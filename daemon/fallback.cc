#include "daemon/fallback.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_format.h"
#include "base/utf8.h"

namespace engram::daemon {

using engram::v1::FallbackReason;

namespace {

std::string GiB(uint64_t b) { return absl::StrFormat("%.1f GiB", static_cast<double>(b) / (1ull << 30)); }
std::string MiB(uint64_t b) { return absl::StrFormat("%.0f MiB", static_cast<double>(b) / (1ull << 20)); }

}  // namespace

engram::v1::Reason MakeReason(FallbackReason code, const std::string& hint) {
  engram::v1::Reason r;
  r.set_code(code);
  r.set_hint(hint);
  return r;
}

std::string ReasonName(FallbackReason code) { return engram::v1::FallbackReason_Name(code); }

std::string ModeName(engram::v1::Mode mode) { return engram::v1::Mode_Name(mode); }

std::string EchoOf(const std::string& s, size_t max) {
  return Printable(s.size() <= max ? s : Utf8Prefix(s, max) + "...");
}

int DpGroupSize(const engram::v1::Hello& h) {
  const int dp = std::max(1, h.dp_size());
  return std::gcd(dp, h.local_dp_size() > 0 ? h.local_dp_size() : dp);
}

Decision Decide(const engram::v1::Hello& h, const NodeView& node) {
  Decision d;
  const auto& cfg = h.config();
  const bool cpu_offload = cfg.cpu_offload() != engram::v1::DISABLED;
  auto add = [&](FallbackReason code, const std::string& hint) { d.reasons.push_back(MakeReason(code, hint)); };

  if (!node.model_shareable) {
    add(engram::v1::MODEL_NOT_SHAREABLE,
        "Qwen4Exp PLE tables are ETP-sharded and follow cpu_offload only; they are never shared across DP");
  }
  if (!cpu_offload) {
    add(engram::v1::CPU_OFFLOAD_DISABLED,
        "cpu_offload is false: tables live on the GPU; drop --engram-config.cpu_offload false (or "
        "VLLM_PLE_CPU_OFFLOAD=0) to share host tables");
  }
  if (cfg.dp_shared_memory() == engram::v1::DISABLED) {
    add(engram::v1::DP_SHARED_MEMORY_DISABLED,
        "dp_shared_memory is false: this replica does not share the node's table");
  }
  if (h.elastic_ep()) {
    add(engram::v1::ELASTIC_EP, "elastic expert parallelism is not supported with dp_shared_memory");
  }
  if (!node.checkpoint_served) {
    add(engram::v1::FINGERPRINT_MISMATCH,
        absl::StrFormat("the daemon serves no checkpoint with fingerprint %016x (%s): load it with `engramctl load "
                        "--checkpoint DIR`, or check that replica and daemon read the same files",
                        h.fingerprint(), EchoOf(h.checkpoint())));
  }
  if (!node.shm_exists) {
    add(engram::v1::SHM_MISSING,
        absl::StrFormat("%s does not exist on this node: mount a tmpfs there or start engramd with --shm-dir",
                        node.shm_path));
  } else if (node.shm_too_small) {
    add(engram::v1::SHM_TOO_SMALL,
        absl::StrFormat("%s holds %s free, the tables need %s: run the container with --ipc=host or "
                        "--shm-size, or give engramd a larger --shm-dir",
                        node.shm_path,
                        node.shm_free_bytes < (1ull << 30) ? MiB(node.shm_free_bytes) : GiB(node.shm_free_bytes),
                        GiB(node.tables_bytes)));
  }
  // SHM_NOT_VISIBLE is not the daemon's to decide: a replica that reaches the socket receives the segment's
  // descriptor whatever its mount or IPC namespace; only the client knows when neither that nor the path worked.
  if (node.segment_failed && node.checkpoint_served && !node.shm_too_small) {
    add(engram::v1::SEGMENT_NOT_READY, "the daemon could not load this shard: " + node.segment_error);
  }
  if (d.reasons.empty()) {
    d.share = true;
    d.mode = engram::v1::SHARED;
    return d;
  }
  // The node's copy is the daemon's, so neither the replica's dp_size nor how many of its DP group run on this node
  // matters to sharing: a DP 1 engine, or one of a group spanning nodes, shares like any other. Those two only decide
  // the fallback below: a replica that cannot share and asked for embedding_across_dp splits the table over a
  // node-local group of gcd(dp_size, local_dp_size) >= 2 replicas (not with elastic EP), else holds its own.
  if (cfg.embedding_across_dp() && !h.elastic_ep()) {
    if (DpGroupSize(h) >= 2) {
      d.mode = engram::v1::DP_SHARDED;
      return d;
    }
    if (h.dp_size() <= 1) {
      add(engram::v1::DP_SIZE_ONE, "data_parallel_size is 1: embedding_across_dp has no group to split the table over");
    } else {
      add(engram::v1::NOT_COLOCATED,
          absl::StrFormat("%d of %d DP replicas run on this node, which holds no embedding_across_dp group of two "
                          "or more (gcd %d)",
                          h.local_dp_size(), h.dp_size(), DpGroupSize(h)));
    }
  }
  d.mode = cpu_offload ? engram::v1::PRIVATE_PINNED : engram::v1::DEVICE;
  return d;
}

}  // namespace engram::daemon
