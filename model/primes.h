// Primality for the Engram prime buckets (docs/math.md, section 4): a deterministic Miller-Rabin test, exact for every
// 64-bit integer (bases 2..37 suffice below 3.3e24), and the search for the next prime not already taken.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

namespace engram {

bool IsPrime(uint64_t n);

// Smallest prime strictly greater than `n`.
uint64_t NextPrime(uint64_t n);

}  // namespace engram
