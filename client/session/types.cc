#include "engram/types.h"

namespace engram::client {

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kShared: return "SHARED";
    case Mode::kPrivatePinned: return "PRIVATE_PINNED";
    case Mode::kDevice: return "DEVICE";
    case Mode::kDpSharded: return "DP_SHARDED";
  }
  return "UNKNOWN";
}

const char* BackendName(Backend b) { return b == Backend::kCuda ? "cuda" : "cpu"; }

const char* AttachMethodName(AttachMethod m) {
  return m == AttachMethod::kDescriptor ? "descriptor" : m == AttachMethod::kPath ? "path" : "";
}

const char* ReasonName(ReasonCode code) {
  static constexpr const char* kNames[] = {
      "REASON_UNSPECIFIED",  "SHM_MISSING",          "SHM_TOO_SMALL",      "NOT_COLOCATED",
      "DP_SIZE_ONE",         "CPU_OFFLOAD_DISABLED", "ELASTIC_EP",         "SHM_NOT_VISIBLE",
      "REGISTER_FAILED",     "FINGERPRINT_MISMATCH", "DAEMON_UNAVAILABLE", "PERMISSION_DENIED",
      "MODEL_NOT_SHAREABLE", "NO_CUDA_DEVICE",       "SEGMENT_NOT_READY",  "DP_SHARED_MEMORY_DISABLED",
      "DP_SHARDED_NOT_BUILT"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kMaxReasonCode + 1);
  const int i = static_cast<int>(code);
  return i >= 1 && i <= kMaxReasonCode ? kNames[i] : "UNKNOWN";
}

}  // namespace engram::client
