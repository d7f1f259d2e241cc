// The client's vocabulary, shared by the library, its C ABI (engram_c.h) and engramctl: where a
// table lives (Mode), what runs the lookups (Backend), a tri-state config value (Choice) and why a table is not
// shared (ReasonCode + hint). The numbers of Mode and ReasonCode are the wire protocol's (engram.v1.Mode,
// engram.v1.FallbackReason; static_asserts in client/session/connection.cc and a test hold them equal) and the C API's,
// so every layer names the same thing the same way. Plain values; the name functions return static strings.
#pragma once

#include <string>

namespace engram::client {

enum class Mode { kShared = 1, kPrivatePinned = 2, kDevice = 3, kDpSharded = 4 };
enum class Backend { kCuda, kCpu };
enum class Choice { kAuto, kTrue, kFalse };
// How a SHARED table reached its segment (engram.v1.AttachMethod's numbers): the descriptor engramd passed, or the
// segment's path (where the descriptor could not be passed and this process may open the file); kNone otherwise.
enum class AttachMethod { kNone = 0, kDescriptor = 1, kPath = 2 };

enum class ReasonCode {
  kShmMissing = 1,
  kShmTooSmall = 2,
  kNotColocated = 3,
  kDpSizeOne = 4,
  kCpuOffloadDisabled = 5,
  kElasticEp = 6,
  kShmNotVisible = 7,
  kRegisterFailed = 8,
  kFingerprintMismatch = 9,
  kDaemonUnavailable = 10,
  kPermissionDenied = 11,
  kModelNotShareable = 12,
  kNoCudaDevice = 13,
  kSegmentNotReady = 14,
  kDpSharedMemoryDisabled = 15,
  kDpShardedNotBuilt = 16,
};
inline constexpr int kMaxReasonCode = 16;

// "SHARED", "PRIVATE_PINNED", ...; "cuda", "cpu"; "SHM_NOT_VISIBLE", ... (static strings; "UNKNOWN" otherwise).
const char* ModeName(Mode m);
const char* BackendName(Backend b);
const char* ReasonName(ReasonCode code);
const char* AttachMethodName(AttachMethod m);  // "descriptor", "path", "" (kNone)

struct Reason {
  ReasonCode code;
  std::string hint;  // what to do about it
};

}  // namespace engram::client
