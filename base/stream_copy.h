// Copies with non-temporal (streaming) stores: StreamCopy writes [d, d + n) from [s, s + n) without reading the
// destination's cache lines first (no read-for-ownership) and without keeping them in the cache, for destinations
// that this thread will not read again soon (pinned staging a DMA reads, a shared segment being published).
// StreamFence orders the streaming stores before later stores: call it before another thread or a device is told
// the data is there. Any alignment and length are accepted (unaligned heads and tails use plain stores); on targets
// other than x86-64 both are a plain memcpy and nothing. Header-only: every library may use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace engram {

inline void StreamCopy(uint8_t* d, const uint8_t* s, int64_t n) {
#if defined(__x86_64__)
  if ((reinterpret_cast<uintptr_t>(d) & 7) != 0) {  // 8-byte streaming stores need 8-byte alignment
    const int64_t head = std::min<int64_t>(n, 8 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) & 7));
    std::memcpy(d, s, static_cast<size_t>(head));
    d += head, s += head, n -= head;
  }
  if ((reinterpret_cast<uintptr_t>(d) & 15) != 0 && n >= 8) {
    long long v;
    std::memcpy(&v, s, 8);
    _mm_stream_si64(reinterpret_cast<long long*>(d), v);
    d += 8, s += 8, n -= 8;
  }
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  for (; n >= 16; d += 16, s += 16, n -= 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  if (n >= 8) {
    long long v;
    std::memcpy(&v, s, 8);
    _mm_stream_si64(reinterpret_cast<long long*>(d), v);
    d += 8, s += 8, n -= 8;
  }
  if (n > 0) std::memcpy(d, s, static_cast<size_t>(n));
#else
  std::memcpy(d, s, static_cast<size_t>(n));
#endif
}

inline void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace engram
