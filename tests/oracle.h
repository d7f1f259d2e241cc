// Float64 oracles shared by the CPU-reference tests and the GPU tests: the gate of docs/math.md section 7 computed in
// double. Test-only; pure functions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "model/fp8.h"

namespace engram::testing {

// n bf16 values drawn from N(0, scale^2).
inline std::vector<uint16_t> RandomBf16(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = FloatToBf16(dist(rng));
  return v;
}

// Returns the largest violation of |got - want| <= 1e-2 * max(|want|, 1e-2) over the whole output (<= 0 passes),
// or +inf when an output is NaN. want = h + g * value with g from the float64 gate.
inline double GateViolation(int64_t T, int64_t HC, int64_t D, double eps, const std::vector<uint16_t>& hidden,
                            const std::vector<uint16_t>& kv, const std::vector<uint16_t>& q,
                            const std::vector<uint16_t>& k, const std::vector<uint8_t>& mask,
                            const std::vector<uint16_t>& out) {
  double worst = -1;
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* value = kv.data() + (t * (HC + 1) + HC) * D;
    const bool dead = !mask.empty() && mask[static_cast<size_t>(t)];
    for (int64_t c = 0; c < HC; ++c) {
      const uint16_t* h = hidden.data() + (t * HC + c) * D;
      const uint16_t* key = kv.data() + (t * (HC + 1) + c) * D;
      double dot = 0, hh = 0, kk = 0;
      for (int64_t j = 0; j < D; ++j) {
        const double hj = Bf16ToFloat(h[j]), kj = Bf16ToFloat(key[j]);
        dot +=
            hj * Bf16ToFloat(q[static_cast<size_t>(c * D + j)]) * Bf16ToFloat(k[static_cast<size_t>(c * D + j)]) * kj;
        hh += hj * hj;
        kk += kj * kj;
      }
      dot = dot / std::sqrt(hh / D + eps) / std::sqrt(kk / D + eps) / std::sqrt(static_cast<double>(D));
      const double x = (dot > 0 ? 1 : dot < 0 ? -1 : 0) * std::sqrt(std::max(std::fabs(dot), 1e-6));
      const double g = dead ? 0.0 : 1.0 / (1.0 + std::exp(-x));
      for (int64_t j = 0; j < D; ++j) {
        const double want = Bf16ToFloat(h[j]) + g * Bf16ToFloat(value[j]);
        const double got = Bf16ToFloat(out[static_cast<size_t>((t * HC + c) * D + j)]);
        if (std::isnan(got)) return INFINITY;
        worst = std::max(worst, std::fabs(got - want) - 1e-2 * std::max(std::fabs(want), 1e-2));
      }
    }
  }
  return worst;
}

}  // namespace engram::testing
