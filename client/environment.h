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
#include <vector>

#include "engram/tuning.h"

namespace engram::client {

struct ClientEnvironment {
  // The lookup engines' knobs (engram/tuning.h): ENGRAM_<KEY> for each key of Tuning::Keys(), parsed by
  // ParseTuning (client/tuning.h). A program's ClientOptions::tuning wins over these for the tables it attaches.
  Tuning tuning;
  // ENGRAM_DP_GROUP: the deployment's name in its DP group's key ([A-Za-z0-9._-], at most 128 bytes), so two
  // deployments of one checkpoint on a node form separate groups; every replica of a deployment gives the same one.
  std::string dp_group;
  // Variables of the engines and libraries we work with, read for their meaning to us.
  std::optional<bool> vllm_ple_cpu_offload;  // VLLM_PLE_CPU_OFFLOAD (vLLM's: 0/false/no/off = false)
  bool nccl_split_shares_resources = false;  // NCCL_COMM_SPLIT_SHARE_RESOURCES != 0 (NCCL's)
  // Variables that are set but no longer read (ENGRAM_HOST_GATHER_DEDUP, ENGRAM_HOST_GATHER_STREAM_UNPACK: removed
  // having lost where measured); Client::Create warns about each, so that a setting is not dropped silently.
  std::vector<std::string> removed;
};

// The process's environment, parsed on the first call.
const ClientEnvironment& Environment();

// Parses the process's environment again, for a process that changed it on purpose before attaching (a test, a
// host configuring the library in-process). A table merges the environment's knobs into its Tuning when it is
// attached: tables attached earlier, and the engines made from them, keep what they took.
void ReloadEnvironment();

// Parses from `lookup` (name -> value or null) instead of the process environment: for tests.
ClientEnvironment ParseClientEnvironment(const std::function<const char*(const char*)>& lookup);

}  // namespace engram::client
