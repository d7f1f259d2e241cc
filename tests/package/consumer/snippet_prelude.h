// The names the docs' C++ snippets use without declaring them (the engine's buffers and stream, a layer, a sink for
// results): each snippet body runs inside a function with `using namespace snippet_names;`.
#pragma once

#include <cstdint>

#include "engram/lookup_engine.h"

namespace snippet_names {
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
template <class V>
void use(const V&) {}
}  // namespace snippet_names
