// The names the docs' C++ snippets use without declaring them (the engine's buffers and stream, a layer, a sink for
// results): each snippet body runs inside a function with `using namespace snippet_names;`. Init() gives them host
// buffers of the test checkpoint's shapes (engram-mkckpt's defaults: 2 layers of 8 columns, rows of 256, hidden 256
// x 4; one request of 5 tokens), so that the snippets run on the CPU backend against a real engramd.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "engram/types.h"

namespace snippet_names {
inline constexpr int32_t kT = 5, kLayers = 2, kCols = 8, kHeadDim = 256, kHidden = 256, kHc = 4, kMaxNgram = 3;
inline void* stream = nullptr;
inline const int32_t* tokens = nullptr;
inline const int64_t* positions = nullptr;
inline const int32_t* query_start_loc = nullptr;
inline const int32_t* lookback = nullptr;
inline const uint8_t* dead = nullptr;
inline int32_t T = 0, R = 0;
inline int32_t* hash_ids = nullptr;
inline int layer = 0;
inline const int32_t* ids = nullptr;
inline int64_t stride = 0;
inline void* out = nullptr;
inline bool packed = false;
inline engram::client::GateInputs args;
inline int used = 0;  // results the snippets handed to use()

// A result a snippet hands on: a pointer must be a real one.
template <class V>
void use(const V& v) {
  if constexpr (std::is_pointer_v<V>) {
    if (v == nullptr) {
      std::fprintf(stderr, "a snippet's result is a null pointer\n");
      std::abort();
    }
  }
  ++used;
}

// A status a snippet's call returned (the driver wraps each `engine->` and `client->` call statement in it): it must
// be OK.
template <class S>
void check(const S& status, const char* call) {
  if (!status.ok()) {
    std::fprintf(stderr, "a snippet's call %s failed: %s\n", call, status.ToString().c_str());
    std::abort();
  }
}

// The driver appends this to every snippet that attaches a table: engramd serves the snippets' checkpoint at both
// of their TP sizes, so each table must be a share of its segment.
template <class T>
void expect_shared(const T& table) {
  if (table.mode() != engram::client::Mode::kShared) {
    std::fprintf(stderr, "a snippet's table is %s, not SHARED:", engram::client::ModeName(table.mode()));
    for (const auto& r : table.reasons()) std::fprintf(stderr, " %s", engram::client::ReasonName(r.code));
    std::fprintf(stderr, "\n");
    std::abort();
  }
}

inline void Init() {
  static std::vector<int32_t> tok(kT), qsl = {0, kT}, back(kMaxNgram - 1, -1), hid(kT * kLayers * kCols, -1);
  static std::vector<int64_t> pos(kT);
  static std::vector<uint8_t> alive(kT, 0);
  static std::vector<uint16_t> rows(size_t{kT} * kCols * kHeadDim), hidden(size_t{kT} * kHc * kHidden),
      kv(size_t{kT} * (kHc + 1) * kHidden), qw(size_t{kHc} * kHidden, 0x3f80), kw(size_t{kHc} * kHidden, 0x3f80),
      gated(size_t{kT} * kHc * kHidden);
  for (int32_t t = 0; t < kT; ++t) {
    tok[t] = 3 + t;
    pos[t] = t;
  }
  tokens = tok.data();
  positions = pos.data();
  query_start_loc = qsl.data();
  lookback = back.data();
  dead = alive.data();
  T = kT;
  R = 1;
  hash_ids = hid.data();
  ids = hid.data();
  stride = int64_t{kLayers} * kCols;
  out = rows.data();
  args.hidden = hidden.data();
  args.kv = kv.data();
  args.q_weight = qw.data();
  args.k_weight = kw.data();
  args.out = gated.data();
  args.num_tokens = kT;
  args.hc_mult = kHc;
  args.dim = kHidden;
}
}  // namespace snippet_names
