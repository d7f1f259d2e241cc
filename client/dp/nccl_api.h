// NcclApi: the NCCL entry points the DP-sharded exchange uses, resolved from libnccl.so.2 with dlopen once per
// process (the library is linked dynamically, never bundled: a process that never runs DP_SHARDED never loads it).
// Get() is thread-safe; the table it returns lives for the whole process.
#pragma once

#include <nccl.h>

#include "absl/status/statusor.h"

namespace engram::client {

struct NcclApi {
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommFinalize)(ncclComm_t);
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;  // NCCL >= 2.18; optional
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  const char* (*GetErrorString)(ncclResult_t);
  int version = 0;
  // Unavailable (naming dlerror) when libnccl.so.2 cannot be loaded.
  static absl::StatusOr<const NcclApi*> Get();
};

}  // namespace engram::client
