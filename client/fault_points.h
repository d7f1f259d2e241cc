// Fault points: the client library's one seam for fault injection. The product never reads a variable or an
// option field to fail on purpose; a test (or a test helper process, tests/support/fault_from_env.cc) installs a
// hook, and the library asks it at a few named moments whether to fail there as if the system had failed.
//
//   kRegisterChunk                 CUDA host registration of chunk `arg` fails (as if the driver refused it)
//   kDpRank0DiesAfterRegion        the host DP transport's rank 0 SIGKILLs itself right after naming its region
//   kDpGiveUpBeforeMapping         a host DP member other than rank 0 gives up before opening the region
//   kDpPeerOpen                    a GPU DP member cannot map the other members' memory (peer path refused)
//   kPrivateTableMemory            the memory free for a private table (`arg`: the bytes it needs) reads as half
//                                  of what it needs (as in a small cgroup)
//   kCpuStaging                    the CPU engine's staging buffer of layer `arg` cannot be allocated (as if the
//                                  process ran out of memory)
//
// With no hook installed every query is false and costs one relaxed atomic load. SetFaultHook is meant for the
// start of a process or test, before the library runs; Fault() is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

namespace engram::client {

enum class FaultPoint {
  kRegisterChunk,
  kDpRank0DiesAfterRegion,
  kDpGiveUpBeforeMapping,
  kDpPeerOpen,
  kPrivateTableMemory,
  kCpuStaging
};

// "register_chunk", "dp_rank0_dies_after_region", "dp_give_up_before_mapping", "dp_peer_open",
// "private_table_memory", "cpu_staging".
std::string_view FaultPointName(FaultPoint p);

using FaultHook = std::function<bool(FaultPoint point, int64_t arg)>;

// Installs `hook` (an empty function removes it).
void SetFaultHook(FaultHook hook);

// Whether the installed hook wants `point` (with `arg`) to fail; false without a hook.
bool Fault(FaultPoint point, int64_t arg = 0);

}  // namespace engram::client
