// Aligned(p, n): whether pointer `p` is a multiple of `n` bytes (n a power of two). The launch wrappers check it
// before choosing a vectorised kernel. Host code; pure.
#pragma once

#include <cstdint>

namespace engram::kernels {

inline bool Aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

}  // namespace engram::kernels
