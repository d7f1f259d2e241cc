// Spinning before sleeping: CpuRelax (the pause hint of a spin-wait loop) and SpinUntil, which spins on a condition
// for a bounded time so that a waiter catches an event that follows at once without the cost of a sleep and a wake.
// The caller sleeps (futex, condition variable) when SpinUntil gives up. Header-only: every library may use it.
#pragma once

#include <chrono>
#include <cstdint>

namespace engram {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins (CpuRelax between checks) until done() is true or `spin_ns` nanoseconds passed; returns done()'s last value.
// spin_ns <= 0: one check, no spin.
template <typename Done>
bool SpinUntil(Done&& done, int64_t spin_ns) {
  if (done()) return true;
  if (spin_ns <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  while (std::chrono::steady_clock::now() < until) {
    CpuRelax();
    if (done()) return true;
  }
  return false;
}

}  // namespace engram
