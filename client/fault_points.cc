#include "client/fault_points.h"

#include <atomic>
#include <memory>
#include <mutex>

namespace engram::client {
namespace {

std::atomic<bool> g_installed{false};

std::mutex& HookMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

std::shared_ptr<const FaultHook>& Hook() {
  static auto* hook = new std::shared_ptr<const FaultHook>();
  return *hook;
}

}  // namespace

std::string_view FaultPointName(FaultPoint p) {
  switch (p) {
    case FaultPoint::kRegisterChunk: return "register_chunk";
    case FaultPoint::kDpRank0DiesAfterRegion: return "dp_rank0_dies_after_region";
    case FaultPoint::kDpGiveUpBeforeMapping: return "dp_give_up_before_mapping";
    case FaultPoint::kDpPeerOpen: return "dp_peer_open";
    case FaultPoint::kPrivateTableMemory: return "private_table_memory";
    case FaultPoint::kCpuStaging: return "cpu_staging";
  }
  return "unknown";
}

void SetFaultHook(FaultHook hook) {
  auto next = hook ? std::make_shared<const FaultHook>(std::move(hook)) : nullptr;
  std::lock_guard<std::mutex> lock(HookMutex());
  g_installed.store(next != nullptr, std::memory_order_release);
  Hook() = std::move(next);
}

bool Fault(FaultPoint point, int64_t arg) {
  if (!g_installed.load(std::memory_order_acquire)) return false;
  std::shared_ptr<const FaultHook> hook;
  {
    std::lock_guard<std::mutex> lock(HookMutex());
    hook = Hook();
  }
  return hook != nullptr && (*hook)(point, arg);
}

}  // namespace engram::client
