// Number formats of the Engram tables (docs/math.md, sections 1 and 6), usable from host and device code:
//   e4m3  OCP FP8 E4M3 (__nv_fp8_e4m3): 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no inf.
//   ue8m0 an unsigned power-of-two scale, decoded exactly as the float whose bits are `byte << 23`
//         (byte 0 -> +0.0, 127 -> 1.0, 255 -> +inf).
//   bf16  the upper half of a float; FloatToBf16 rounds to nearest even (as __float2bfloat16_rn); any NaN becomes
//         the canonical 0x7FFF, so CPU and GPU agree bit for bit even on NaN (0 x inf from a 255 scale).
// Header-only pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#include "base/hd.h"

namespace engram {

ENGRAM_HD float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

ENGRAM_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

// Exact: every e4m3 value is a float.
ENGRAM_HD float E4M3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t exp = (v >> 3) & 0xF;
  const uint32_t man = v & 0x7;
  if (exp == 0xF && man == 0x7) return BitsToFloat(sign | 0x7FC00000u);  // NaN
  if (exp == 0) {
    // Subnormal: man/8 * 2^-6 = man * 2^-9.
    const float mag = static_cast<float>(man) * BitsToFloat(0x3B000000u);  // 2^-9
    return sign ? -mag : mag;
  }
  return BitsToFloat(sign | ((exp + 120) << 23) | (man << 20));
}

ENGRAM_HD float Ue8m0ToFloat(uint8_t v) { return BitsToFloat(static_cast<uint32_t>(v) << 23); }

ENGRAM_HD uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatToBits(f);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return 0x7FFFu;  // every NaN becomes the canonical NaN, as the GPU's cvt.rn.bf16.f32 does
  }
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

ENGRAM_HD float Bf16ToFloat(uint16_t v) { return BitsToFloat(static_cast<uint32_t>(v) << 16); }

// Dequantised element j of a record (256 e4m3 + head_dim/32 ue8m0 bytes), rounded to bf16.
ENGRAM_HD uint16_t DequantBf16(uint8_t e4m3, uint8_t ue8m0) {
  return FloatToBf16(E4M3ToFloat(e4m3) * Ue8m0ToFloat(ue8m0));
}

}  // namespace engram
