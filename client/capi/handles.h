// The C ABI's handles (include/engram/engram_c.h) and the helpers every entry point shares: the error return
// (status code, message copied into the caller's buffer), the fork and exception guards, and the bounds on caller
// sizes. Internal to client/capi/; the entry points are in table.cc, engine.cc and daemon.cc.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "engram/client.h"
#include "engram/engram_c.h"
#include "engram/lookup_engine.h"

// The C enum carries the same numbers as the C++ one (and the wire protocol's).
static_assert(ENGRAM_REASON_SHM_MISSING == static_cast<int>(engram::client::ReasonCode::kShmMissing) &&
              ENGRAM_REASON_REGISTER_FAILED == static_cast<int>(engram::client::ReasonCode::kRegisterFailed) &&
              ENGRAM_REASON_SEGMENT_NOT_READY == static_cast<int>(engram::client::ReasonCode::kSegmentNotReady) &&
              ENGRAM_REASON_DP_SHARDED_NOT_BUILT == static_cast<int>(engram::client::ReasonCode::kDpShardedNotBuilt) &&
              ENGRAM_REASON_MAX == engram::client::kMaxReasonCode);

// A table lives until its handle was freed and its last engine is gone (`refs`: the handle plus one per engine), so
// that freeing the handle first (a Python collector breaking a cycle in any order) never frees what an engine
// still uses. `owner`: the process that attached; a forked child may not use or free it.
struct engram_table {
  std::atomic<int> refs{1};
  pid_t owner = ::getpid();
  std::unique_ptr<engram::client::Table> table;
  std::string mode, backend;
  int64_t staging_col_begin = 0, staging_col_end = 0;  // the TP shard's columns (an engine's staging fills them)
};

// The engine behind the C ABI is the library's LookupEngine (every lookup path, DP_SHARDED included); each call
// first points it at the caller's stream.
struct engram_engine {
  engram_table* table = nullptr;  // holds one of its refs
  pid_t owner = ::getpid();
  int32_t max_tokens = 0;
  std::string backend;
  std::unique_ptr<engram::client::LookupEngine> engine;
};

namespace engram::capi {

// Copies st's message into err (NUL-terminated, truncated to err_len) and returns its code.
int Fail(const absl::Status& st, char* err, size_t err_len);
// 0 for OK, else Fail.
int Done(const absl::Status& st, char* err, size_t err_len);
bool LayerOk(const engram_table* t, int l);
absl::Status CheckTokens(int32_t n, int32_t max_tokens);
inline void* AsStream(uintptr_t s) { return reinterpret_cast<void*>(s); }
// A handle is its process's: after fork() the child shares the parent's sessions, DP group and device state, and
// its use of them would take the parent's steps (and its rows) from under it.
absl::Status Owned(pid_t owner, const char* what);
// gRPC's state is its process's too: a forked child of a process that has spoken to engramd cannot (its calls
// would hang), so engram_attach and engram_status_json refuse there instead.
absl::Status GrpcHere();
// Drops one reference of the table (the handle's or an engine's); the last one frees it.
void Release(engram_table* t);
// No C++ exception crosses the C ABI: every status-returning entry point turns one into an error code (an
// allocation that failed is RESOURCE_EXHAUSTED, anything else INTERNAL) with the message in `err`. Call it only
// from a catch block.
int CaughtException(char* err, size_t err_len);

// The host calls engram_table_hash / engram_table_lookup work through a caller's array this many tokens at a time.
inline constexpr int64_t kHostChunkTokens = 4096;
// The most tokens per call an engine may be sized for: far above any engine's batch, and low enough that its
// buffers (max_tokens x layers x columns x head_dim) are an allocation, not an address-space overflow.
inline constexpr int32_t kMaxEngineTokens = 1 << 20;

}  // namespace engram::capi
