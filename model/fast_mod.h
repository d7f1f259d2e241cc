// Exact `x % p` for 0 <= x < 2^64 and 2 <= p < 2^32 without a division, usable from host and device code.
// With M = floor(2^64 / p), q = mulhi(x, M) is floor(x / p) or one less (M undershoots 2^64/p by less than one, so
// x*M/2^64 undershoots x/p by less than x/2^64 < 1), hence r = x - q*p lies in [0, 2p) and one conditional subtract
// finishes. The hash columns' divisors are primes, fixed per layout, so M is computed once (FastModMagic).
// Header-only pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "base/hd.h"
#include "model/int128.h"

namespace engram {

// floor((2^64 - 1) / p): equals floor(2^64 / p) unless p is a power of two, where it is one less; the bound on q
// above holds either way (M <= 2^64 / p, undershooting by at most 1).
inline uint64_t FastModMagic(uint64_t p) { return ~uint64_t{0} / p; }

ENGRAM_HD uint64_t FastMod(uint64_t x, uint64_t p, uint64_t magic) {
#if defined(__CUDA_ARCH__)
  const uint64_t q = __umul64hi(x, magic);
#else
  const uint64_t q = static_cast<uint64_t>((static_cast<uint128>(x) * magic) >> 64);
#endif
  uint64_t r = x - q * p;
  return r >= p ? r - p : r;
}

}  // namespace engram
