#include "client/environment.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"

namespace engram::client {
namespace {

struct Reader {
  const std::function<const char*(const char*)>& lookup;

  std::string Text(const char* name) const {
    const char* v = lookup(name);
    return v == nullptr ? std::string() : std::string(v);
  }
  std::optional<int64_t> Int(const char* name) const {
    int64_t x = 0;
    const std::string v = Text(name);
    if (v.empty() || !absl::SimpleAtoi(v, &x)) return std::nullopt;
    return x;
  }
  std::optional<double> Real(const char* name) const {
    double x = 0;
    const std::string v = Text(name);
    if (v.empty() || !absl::SimpleAtod(v, &x) || !std::isfinite(x)) return std::nullopt;
    return x;
  }
  // 1/true/yes/on and 0/false/no/off (any case, surrounding blanks ignored); anything else leaves it unset.
  std::optional<bool> Flag(const char* name) const {
    const std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(Text(name)));
    if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
    if (v == "0" || v == "false" || v == "no" || v == "off") return false;
    return std::nullopt;
  }
  // A duration in ms: (0, 24 h]; anything else leaves it unset.
  std::optional<int64_t> Millis(const char* name) const {
    const std::optional<int64_t> v = Int(name);
    if (!v || *v <= 0 || *v > kMaxMillis) return std::nullopt;
    return v;
  }
  static constexpr int64_t kMaxMillis = int64_t{24} * 3600 * 1000;
};

}  // namespace

ClientEnvironment ParseClientEnvironment(const std::function<const char*(const char*)>& lookup) {
  const Reader r{lookup};
  ClientEnvironment e;
  e.lookup_path = r.Text("ENGRAM_LOOKUP_PATH");
  e.lookup_path_table = r.Text("ENGRAM_LOOKUP_PATH_TABLE");
  e.host_gather_min_items = r.Int("ENGRAM_HOST_GATHER_MIN_ITEMS");
  e.lookup_sort_min_items = r.Int("ENGRAM_LOOKUP_SORT_MIN_ITEMS");
  e.lookup_sort_variant = r.Int("ENGRAM_LOOKUP_SORT_VARIANT");
  e.lookup_sort_blocks = r.Int("ENGRAM_LOOKUP_SORT_BLOCKS");
  e.engine_calibrate = r.Flag("ENGRAM_ENGINE_CALIBRATE");
  e.host_gather_threads = r.Int("ENGRAM_HOST_GATHER_THREADS");
  e.host_gather_cpus = r.Text("ENGRAM_HOST_GATHER_CPUS");
  e.host_gather_dedup = r.Flag("ENGRAM_HOST_GATHER_DEDUP");
  e.host_gather_uva_share = r.Real("ENGRAM_HOST_GATHER_UVA_SHARE");
  e.host_gather_prefetch = r.Int("ENGRAM_HOST_GATHER_PREFETCH");
  e.host_gather_nt = r.Int("ENGRAM_HOST_GATHER_NT");
  e.host_gather_fused = r.Int("ENGRAM_HOST_GATHER_FUSED");
  e.host_gather_issuer = r.Int("ENGRAM_HOST_GATHER_ISSUER");
  e.host_gather_spin_us = r.Int("ENGRAM_HOST_GATHER_SPIN_US");
  e.host_gather_dispatch_spin_us = r.Int("ENGRAM_HOST_GATHER_DISPATCH_SPIN_US");
  e.host_gather_pass_spin_us = r.Int("ENGRAM_HOST_GATHER_PASS_SPIN_US");
  e.host_gather_prewake = r.Int("ENGRAM_HOST_GATHER_PREWAKE");
  e.host_gather_issue_min_rows = r.Int("ENGRAM_HOST_GATHER_ISSUE_MIN_ROWS");
  e.host_gather_stream_unpack = r.Int("ENGRAM_HOST_GATHER_STREAM_UNPACK");
  e.dp_form_timeout_ms = r.Millis("ENGRAM_DP_FORM_TIMEOUT_MS");
  e.dp_step_timeout_ms = r.Millis("ENGRAM_DP_STEP_TIMEOUT_MS");
  e.dp_chunk_kib = r.Int("ENGRAM_DP_CHUNK_KIB");
  e.dp_peer_max_slot = r.Int("ENGRAM_DP_PEER_MAX_SLOT");
  e.dp_graph_max_slot = r.Int("ENGRAM_DP_GRAPH_MAX_SLOT");
  e.dp_nccl_blocking = r.Int("ENGRAM_DP_NCCL_BLOCKING");
  e.dp_a2a = r.Text("ENGRAM_DP_A2A");
  e.dp_group = r.Text("ENGRAM_DP_GROUP");
  e.vllm_ple_cpu_offload = r.Flag("VLLM_PLE_CPU_OFFLOAD");
  const std::optional<int64_t> share = r.Int("NCCL_COMM_SPLIT_SHARE_RESOURCES");
  e.nccl_split_shares_resources = share.has_value() && *share != 0;
  return e;
}

namespace {

// Every record parsed so far, kept for the whole process (references handed out stay valid across a reload).
const ClientEnvironment* ParseProcessEnvironment() {
  static auto* mu = new std::mutex();
  static auto* kept = new std::vector<std::unique_ptr<const ClientEnvironment>>();
  auto parsed = std::make_unique<const ClientEnvironment>(
      ParseClientEnvironment([](const char* name) { return std::getenv(name); }));
  std::lock_guard<std::mutex> lock(*mu);
  kept->push_back(std::move(parsed));
  return kept->back().get();
}

std::atomic<const ClientEnvironment*>& Current() {
  static std::atomic<const ClientEnvironment*> current{ParseProcessEnvironment()};
  return current;
}

}  // namespace

const ClientEnvironment& Environment() { return *Current().load(std::memory_order_acquire); }

void ReloadEnvironment() { Current().store(ParseProcessEnvironment(), std::memory_order_release); }

}  // namespace engram::client
