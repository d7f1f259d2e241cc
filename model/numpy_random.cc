#include "model/numpy_random.h"

namespace engram {
namespace {

// Constants of NumPy's SeedSequence (numpy/random/bit_generator.pyx).
constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr int kXShift = 16;

uint32_t HashMix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t Mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

// PCG's default 128-bit multiplier.
constexpr uint128 kPcgMult = (static_cast<uint128>(2549297995355413924ULL) << 64) | 4865540595714422341ULL;

}  // namespace

SeedSequence::SeedSequence(uint64_t entropy) {
  // _coerce_to_uint32_array: little-endian 32-bit words, [0] for zero.
  std::vector<uint32_t> words;
  if (entropy == 0) words.push_back(0);
  while (entropy != 0) {
    words.push_back(static_cast<uint32_t>(entropy & 0xffffffffu));
    entropy >>= 32;
  }
  uint32_t hash_const = kInitA;
  const size_t n = pool_.size();
  for (size_t i = 0; i < n; ++i) pool_[i] = HashMix(i < words.size() ? words[i] : 0, hash_const);
  for (size_t src = 0; src < n; ++src) {
    for (size_t dst = 0; dst < n; ++dst) {
      if (src != dst) pool_[dst] = Mix(pool_[dst], HashMix(pool_[src], hash_const));
    }
  }
  for (size_t src = n; src < words.size(); ++src) {
    for (size_t dst = 0; dst < n; ++dst) pool_[dst] = Mix(pool_[dst], HashMix(words[src], hash_const));
  }
}

std::vector<uint32_t> SeedSequence::GenerateState32(size_t n_words) const {
  std::vector<uint32_t> out(n_words);
  uint32_t hash_const = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool_[i % pool_.size()];
    v ^= hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    v ^= v >> kXShift;
    out[i] = v;
  }
  return out;
}

std::vector<uint64_t> SeedSequence::GenerateState64(size_t n_words) const {
  std::vector<uint32_t> w = GenerateState32(n_words * 2);
  std::vector<uint64_t> out(n_words);
  for (size_t i = 0; i < n_words; ++i) out[i] = uint64_t{w[2 * i]} | (uint64_t{w[2 * i + 1]} << 32);
  return out;
}

Pcg64::Pcg64(const SeedSequence& seq) {
  std::vector<uint64_t> v = seq.GenerateState64(4);
  // pcg64_set_seed: seed = (v[0] << 64) | v[1], inc = (v[2] << 64) | v[3]; then pcg_setseq_128_srandom_r.
  uint128 init_state = (static_cast<uint128>(v[0]) << 64) | v[1];
  uint128 init_seq = (static_cast<uint128>(v[2]) << 64) | v[3];
  state_ = 0;
  inc_ = (init_seq << 1) | 1;
  state_ = state_ * kPcgMult + inc_;
  state_ += init_state;
  state_ = state_ * kPcgMult + inc_;
}

uint64_t Pcg64::NextUint64() {
  state_ = state_ * kPcgMult + inc_;
  uint64_t hi = static_cast<uint64_t>(state_ >> 64);
  uint64_t lo = static_cast<uint64_t>(state_);
  unsigned rot = static_cast<unsigned>(state_ >> 122);
  uint64_t x = hi ^ lo;
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t Pcg64::NextUint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  uint64_t next = NextUint64();
  has_uint32_ = true;
  uinteger_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xffffffffu);
}

int64_t NumpyDefaultRng::Integers(int64_t low, int64_t high) {
  // _rand_int64: rng = (high - 1) - low, off = low; random_bounded_uint64_fill with use_masked = false.
  const uint64_t rng = static_cast<uint64_t>(high - 1) - static_cast<uint64_t>(low);
  const uint64_t off = static_cast<uint64_t>(low);
  uint64_t draw;
  if (rng == 0) {
    draw = 0;
  } else if (rng <= 0xffffffffULL) {
    if (rng == 0xffffffffULL) {
      draw = bitgen_.NextUint32();
    } else {
      // buffered_bounded_lemire_uint32
      const uint32_t rng_excl = static_cast<uint32_t>(rng) + 1;
      uint64_t m = uint64_t{bitgen_.NextUint32()} * rng_excl;
      uint32_t leftover = static_cast<uint32_t>(m);
      if (leftover < rng_excl) {
        const uint32_t threshold = static_cast<uint32_t>((0xffffffffu - static_cast<uint32_t>(rng)) % rng_excl);
        while (leftover < threshold) {
          m = uint64_t{bitgen_.NextUint32()} * rng_excl;
          leftover = static_cast<uint32_t>(m);
        }
      }
      draw = m >> 32;
    }
  } else if (rng == 0xffffffffffffffffULL) {
    draw = bitgen_.NextUint64();
  } else {
    // bounded_lemire_uint64
    const uint64_t rng_excl = rng + 1;
    uint128 m = static_cast<uint128>(bitgen_.NextUint64()) * rng_excl;
    uint64_t leftover = static_cast<uint64_t>(m);
    if (leftover < rng_excl) {
      const uint64_t threshold = (0xffffffffffffffffULL - rng) % rng_excl;
      while (leftover < threshold) {
        m = static_cast<uint128>(bitgen_.NextUint64()) * rng_excl;
        leftover = static_cast<uint64_t>(m);
      }
    }
    draw = static_cast<uint64_t>(m >> 64);
  }
  return static_cast<int64_t>(off + draw);
}

}  // namespace engram
