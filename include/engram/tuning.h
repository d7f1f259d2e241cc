// engram::client::Tuning: the lookup engines' knobs, each an override of a measured default. Unset (an empty
// optional or string) means the default: the environment's value where the operator set one (ENGRAM_<KEY>, e.g.
// ENGRAM_HOST_GATHER_THREADS), else the built-in default or the engine's calibration. A program sets them on
// ClientOptions::tuning; a value set there wins over the environment for the tables that Client attaches. The merge
// is knob by knob: a knob the program leaves unset still takes the environment's value (so an environment
// host_gather_min_items still applies beside a program's lookup_path_table), and a program cannot unset a knob the
// environment sets. The C ABI and the Python package set no Tuning: there the environment is the only source.
// docs/configuration.md lists every knob, its default and what it changes.
//
// A Tuning is a plain value: copy it freely; it is not synchronized (one writer at a time).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace engram::client {

struct Tuning {
  // The lookup path: "auto" | "uva" | "host" (also "host_gather"); and its per-size table, a file of
  // "ITEMS host|uva" lines. Either one fixes the choice the engine would otherwise calibrate.
  std::string lookup_path;
  std::string lookup_path_table;
  std::optional<int64_t> host_gather_min_items;  // host gather from this many items per layer, UVA below
  // The UVA row-order gather. Setting sort_min_items skips its per-table calibration; variant and blocks are
  // process-wide (the kernels' state): the last engine created with them set decides.
  std::optional<int64_t> lookup_sort_min_items;
  std::optional<int64_t> lookup_sort_variant;  // 0..3
  std::optional<int64_t> lookup_sort_blocks;   // 0 = a grid sized to the GPU
  // false: the engine keeps the built-in decode shape and host-gather plan instead of timing them on its table.
  std::optional<bool> engine_calibrate;
  // The host-gather engine: its threads, their CPUs (a list such as "8-15,24"), the UVA share of a split batch
  // (0..1), and the gather loop's own knobs.
  std::optional<int64_t> host_gather_threads;
  std::string host_gather_cpus;
  std::optional<double> host_gather_uva_share;
  std::optional<int64_t> host_gather_prefetch;  // rows prefetched ahead
  // The 0/1 knobs (nt, fused, issuer, prewake, dp_nccl_blocking) take Set's flag words: 1/true/yes/on, 0/false/no/off.
  std::optional<int64_t> host_gather_nt;                // 1: non-temporal stores into the staging buffer
  std::optional<int64_t> host_gather_fused;             // 1: each worker plans and gathers its own items
  std::optional<int64_t> host_gather_issuer;            // 1: a dispatcher issues merged copies while workers run
  std::optional<int64_t> host_gather_spin_us;           // workers' spin before sleeping
  std::optional<int64_t> host_gather_dispatch_spin_us;  // the dispatcher's spin
  std::optional<int64_t> host_gather_pass_spin_us;      // a pass's wait for stragglers
  std::optional<int64_t> host_gather_prewake;           // 1: workers are woken as the ids' copy is issued
  std::optional<int64_t> host_gather_issue_min_rows;    // the smallest merged copy the dispatcher issues
  // DP_SHARDED: the group's forming and step deadlines (1 ms .. 24 h; each member's own), the exchange's chunk, the
  // largest group slot read through peer pointers and captured in a CUDA graph, a blocking communicator for the
  // steps, and the all-to-all's form ("auto" | "sequential" | "pipelined" | "graph"). For all but the deadlines,
  // rank 0's values decide for the group.
  std::optional<int64_t> dp_form_timeout_ms;
  std::optional<int64_t> dp_step_timeout_ms;
  std::optional<int64_t> dp_chunk_kib;
  std::optional<int64_t> dp_peer_max_slot;
  std::optional<int64_t> dp_graph_max_slot;
  std::optional<int64_t> dp_nccl_blocking;
  std::string dp_a2a;

  // Sets one knob by its key: the environment variable's name without ENGRAM_, in lower case
  // ("host_gather_threads"). InvalidArgument names the key for an unknown key or a value that does not parse or is
  // out of the knob's range; the record is unchanged then.
  absl::Status Set(std::string_view key, std::string_view value);

  // Checks every knob that is set, also those assigned directly rather than through Set, as Set would, and writes
  // the word knobs (lookup_path, dp_a2a) in lower case and every text knob trimmed. InvalidArgument names the first
  // bad key; the record is unchanged then. Client::Create runs it on ClientOptions::tuning.
  absl::Status Normalize();

  // This record's knobs, with each one it leaves unset taken from `base`.
  Tuning Over(const Tuning& base) const;

  // Every key Set takes, in the order of the fields above.
  static const std::vector<std::string>& Keys();
};

}  // namespace engram::client
