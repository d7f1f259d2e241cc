// A bit-exact C++ rendering of the part of NumPy's random module the Engram hash multipliers need:
// SeedSequence (entropy pool mixing, generate_state), the PCG64 bit generator (128-bit LCG, XSL-RR output) and
// Generator.integers(low, high, dtype=int64) (Lemire's bounded draw, NumPy's variant, use_masked=False).
//
//   NumpyDefaultRng rng(seed);                        // numpy.random.default_rng(seed), seed >= 0
//   int64_t v = rng.Integers(0, high);                // numpy rng.integers(0, high, dtype=np.int64), one draw
//
// Golden values come from NumPy itself (tests/data/golden_multipliers.py, tests/data/goldens/multipliers-*.json).
// Plain value types; not thread-safe (each thread owns its generator).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/int128.h"

namespace engram {

// numpy.random.SeedSequence(entropy) with no spawn key and the default pool size (4 words).
class SeedSequence {
 public:
  explicit SeedSequence(uint64_t entropy);
  // generate_state(n_words, dtype=uint32)
  std::vector<uint32_t> GenerateState32(size_t n_words) const;
  // generate_state(n_words, dtype=uint64): pairs of 32-bit words, little-endian.
  std::vector<uint64_t> GenerateState64(size_t n_words) const;

 private:
  std::array<uint32_t, 4> pool_{};
};

// numpy.random.PCG64 seeded from a SeedSequence.
class Pcg64 {
 public:
  explicit Pcg64(const SeedSequence& seq);
  uint64_t NextUint64();
  uint32_t NextUint32();  // NumPy buffers the high half of a 64-bit draw

 private:
  uint128 state_ = 0;
  uint128 inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

// numpy.random.default_rng(seed) restricted to integers(low, high, dtype=int64), endpoint=False.
class NumpyDefaultRng {
 public:
  explicit NumpyDefaultRng(uint64_t seed) : bitgen_(SeedSequence(seed)) {}
  // Requires low < high.
  int64_t Integers(int64_t low, int64_t high);

 private:
  Pcg64 bitgen_;
};

}  // namespace engram
