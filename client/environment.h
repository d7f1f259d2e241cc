// ClientEnvironment: every environment variable the client library reads, read once per process (the first call
// of Environment()) and parsed into typed fields. This is the only file of client/ and kernels/ that calls getenv;
// everything else takes its configuration from ClientOptions, the engine's options, or these fields. The
// variables are operator and benchmark overrides of measured defaults; docs/configuration.md lists each one.
// An unset or empty variable leaves its field empty (the code's default applies); a malformed or non-finite
// number, a flag other than 1/true/yes/on or 0/false/no/off, and a duration outside 1 ms .. 24 h are ignored the
// same way. Thread-safe (the parse happens once, under a function-local static).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace engram::client {

struct ClientEnvironment {
  // The lookup path (ENGRAM_LOOKUP_PATH: auto | uva | host | host_gather) and its per-size choice.
  std::string lookup_path;                       // ENGRAM_LOOKUP_PATH
  std::string lookup_path_table;                 // ENGRAM_LOOKUP_PATH_TABLE: a file of "ITEMS host|uva" lines
  std::optional<int64_t> host_gather_min_items;  // ENGRAM_HOST_GATHER_MIN_ITEMS: host gather from N items
  // The UVA row-order gather (kernels::LookupTuning). Setting sort_min_items also skips the per-table calibration.
  std::optional<int64_t> lookup_sort_min_items;  // ENGRAM_LOOKUP_SORT_MIN_ITEMS
  std::optional<int64_t> lookup_sort_variant;    // ENGRAM_LOOKUP_SORT_VARIANT (0..3)
  std::optional<int64_t> lookup_sort_blocks;     // ENGRAM_LOOKUP_SORT_BLOCKS
  // ENGRAM_ENGINE_CALIBRATE=0: an engine keeps the built-in decode shape and host-gather plan instead of timing
  // them on its table at creation (client/engine/calibration.h).
  std::optional<bool> engine_calibrate;
  // The host-gather engine.
  std::optional<int64_t> host_gather_threads;           // ENGRAM_HOST_GATHER_THREADS
  std::string host_gather_cpus;                         // ENGRAM_HOST_GATHER_CPUS: a CPU list ("8-15,24")
  std::optional<bool> host_gather_dedup;                // ENGRAM_HOST_GATHER_DEDUP (0 | 1)
  std::optional<double> host_gather_uva_share;          // ENGRAM_HOST_GATHER_UVA_SHARE (0..1)
  std::optional<int64_t> host_gather_prefetch;          // ENGRAM_HOST_GATHER_PREFETCH (rows ahead)
  std::optional<int64_t> host_gather_nt;                // ENGRAM_HOST_GATHER_NT (non-temporal stores)
  std::optional<int64_t> host_gather_fused;             // ENGRAM_HOST_GATHER_FUSED
  std::optional<int64_t> host_gather_issuer;            // ENGRAM_HOST_GATHER_ISSUER
  std::optional<int64_t> host_gather_spin_us;           // ENGRAM_HOST_GATHER_SPIN_US
  std::optional<int64_t> host_gather_dispatch_spin_us;  // ENGRAM_HOST_GATHER_DISPATCH_SPIN_US
  std::optional<int64_t> host_gather_pass_spin_us;      // ENGRAM_HOST_GATHER_PASS_SPIN_US
  std::optional<int64_t> host_gather_prewake;           // ENGRAM_HOST_GATHER_PREWAKE
  std::optional<int64_t> host_gather_issue_min_rows;    // ENGRAM_HOST_GATHER_ISSUE_MIN_ROWS
  std::optional<int64_t> host_gather_stream_unpack;     // ENGRAM_HOST_GATHER_STREAM_UNPACK
  // DP_SHARDED.
  std::optional<int64_t> dp_form_timeout_ms;  // ENGRAM_DP_FORM_TIMEOUT_MS (1 ms .. 24 h)
  std::optional<int64_t> dp_step_timeout_ms;  // ENGRAM_DP_STEP_TIMEOUT_MS (1 ms .. 24 h)
  std::optional<int64_t> dp_chunk_kib;        // ENGRAM_DP_CHUNK_KIB
  std::optional<int64_t> dp_peer_max_slot;    // ENGRAM_DP_PEER_MAX_SLOT
  std::optional<int64_t> dp_graph_max_slot;   // ENGRAM_DP_GRAPH_MAX_SLOT
  std::optional<int64_t> dp_nccl_blocking;    // ENGRAM_DP_NCCL_BLOCKING
  std::string dp_a2a;                         // ENGRAM_DP_A2A: auto | sequential | pipelined | graph
  // ENGRAM_DP_GROUP: the deployment's name in its DP group's key ([A-Za-z0-9._-], at most 128 bytes), so two
  // deployments of one checkpoint on a node form separate groups; every replica of a deployment gives the same one.
  std::string dp_group;
  // Variables of the engines and libraries we work with, read for their meaning to us.
  std::optional<bool> vllm_ple_cpu_offload;  // VLLM_PLE_CPU_OFFLOAD (vLLM's: 0/false/no/off = false)
  bool nccl_split_shares_resources = false;  // NCCL_COMM_SPLIT_SHARE_RESOURCES != 0 (NCCL's)
};

// The process's environment, parsed on the first call.
const ClientEnvironment& Environment();

// Parses the process's environment again, for a process that changed it on purpose before creating engines (a
// test, a host configuring the library in-process). Engines created earlier keep what they read.
void ReloadEnvironment();

// Parses from `lookup` (name -> value or null) instead of the process environment: for tests.
ClientEnvironment ParseClientEnvironment(const std::function<const char*(const char*)>& lookup);

}  // namespace engram::client
