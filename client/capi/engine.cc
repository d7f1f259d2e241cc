// The C ABI: engines (LookupEngine behind a handle): hash, lookups, prefetch, gate (include/engram/engram_c.h).
#include "client/capi/handles.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

using namespace engram::capi;  // NOLINT: the entry points' shared helpers

extern "C" {

int engram_engine_create(const engram_table* t, int32_t max_tokens, uintptr_t stream, engram_engine** out, char* err,
                         size_t err_len) {
  return engram_engine_create_flags(t, max_tokens, stream, 0, out, err, err_len);
}

int engram_engine_create_flags(const engram_table* t, int32_t max_tokens, uintptr_t stream, int flags,
                               engram_engine** out, char* err, size_t err_len) {
  try {
    if (t == nullptr || out == nullptr) {
      return Fail(absl::InvalidArgumentError("engram_engine_create: null table or output"), err, err_len);
    }
    if (max_tokens < 1 || max_tokens > kMaxEngineTokens) {
      return Fail(absl::InvalidArgumentError(
                      absl::StrCat("max_tokens must be in [1, ", kMaxEngineTokens, "], got ", max_tokens)),
                  err, err_len);
    }
    if (auto st = Owned(t->owner, "table"); !st.ok()) return Fail(st, err, err_len);
    if ((flags & ~ENGRAM_ENGINE_NO_STAGING) != 0) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("engram_engine_create: unknown flags ", flags)), err,
                  err_len);
    }
    const bool staging =
        (flags & ENGRAM_ENGINE_NO_STAGING) == 0 || t->table->mode() == engram::client::Mode::kDpSharded;
    auto e = std::make_unique<engram_engine>();
    e->max_tokens = max_tokens;
    e->backend = engram::client::BackendName(t->table->backend());
    auto engine = engram::client::LookupEngine::Create(*t->table, max_tokens, AsStream(stream), staging);
    if (!engine.ok()) return Fail(engine.status(), err, err_len);
    e->engine = std::move(*engine);
    auto* table = const_cast<engram_table*>(t);  // the handle's table: the engine holds a ref, never writes it
    table->refs.fetch_add(1);
    e->table = table;
    *out = e.release();
    return 0;
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

void engram_engine_free(engram_engine* e) {
  if (e == nullptr || e->owner != ::getpid()) return;  // a forked child leaves the parent's engine alone
  engram_table* t = e->table;
  delete e;
  Release(t);
}
const char* engram_engine_backend(const engram_engine* e) { return e ? e->backend.c_str() : ""; }
int32_t engram_engine_max_tokens(const engram_engine* e) { return e ? e->max_tokens : 0; }

int engram_engine_hash_v2(engram_engine* e, const int32_t* tokens, const int64_t* positions, const int32_t* qsl,
                          const int32_t* lookback, const uint8_t* lookback_dead, const uint8_t* dead,
                          int32_t num_tokens, int32_t num_requests, int32_t* out, uintptr_t stream, char* err,
                          size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("hash: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    absl::Status st = CheckTokens(num_tokens, e->max_tokens);
    if (st.ok() && (num_requests < 1 || qsl == nullptr ||
                    (num_tokens > 0 && (tokens == nullptr || positions == nullptr || out == nullptr)))) {
      st = absl::InvalidArgumentError("hash: null input or no request");
    }
    if (st.ok() && lookback_dead != nullptr && lookback == nullptr) {
      st = absl::InvalidArgumentError("hash: lookback_dead given without lookback ids");
    }
    if (st.ok()) st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) {
      st = e->engine->Hash(tokens, positions, qsl, lookback, lookback_dead, dead, num_tokens, num_requests, out);
    }
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_engine_hash(engram_engine* e, const int32_t* tokens, const int64_t* positions, const int32_t* qsl,
                       const int32_t* lookback, const uint8_t* dead, int32_t num_tokens, int32_t num_requests,
                       int32_t* out, uintptr_t stream, char* err, size_t err_len) {
  return engram_engine_hash_v2(e, tokens, positions, qsl, lookback, nullptr, dead, num_tokens, num_requests, out,
                               stream, err, err_len);
}

int engram_engine_lookup(engram_engine* e, int layer, const int32_t* ids, int32_t num_tokens, int64_t ids_stride,
                         void* out, int packed, uintptr_t stream, char* err, size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("lookup: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    absl::Status st = CheckTokens(num_tokens, e->max_tokens);
    if (st.ok() && !LayerOk(e->table, layer)) {
      st = absl::InvalidArgumentError(
          absl::StrCat("layer index ", layer, " outside [0, ", e->table->table->layers().size(), ")"));
    }
    const int64_t C = e->table->table->n_cols();
    if (st.ok() && num_tokens > 0 && (ids == nullptr || out == nullptr || ids_stride < C)) {
      st = absl::InvalidArgumentError(absl::StrCat("lookup: null buffer or ids stride ", ids_stride, " < ", C));
    }
    if (!st.ok()) return Fail(st, err, err_len);
    // A DP_SHARDED rank with no tokens still takes part in the step (every lookup is a collective).
    if (num_tokens == 0 && e->table->table->mode() != engram::client::Mode::kDpSharded) return 0;
    st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) st = e->engine->Lookup(layer, ids, num_tokens, ids_stride, out, packed != 0);
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_engine_lookup_into(engram_engine* e, int layer, const void* ids, int32_t num_tokens, int64_t ids_stride,
                              int32_t col_begin, int32_t num_cols, void* out, int64_t out_token_stride, int flags,
                              uintptr_t stream, char* err, size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("lookup_into: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    if ((flags & ~(ENGRAM_LOOKUP_PACKED | ENGRAM_LOOKUP_BACKGROUND | ENGRAM_LOOKUP_IDS64)) != 0) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("lookup_into: unknown flags ", flags)), err, err_len);
    }
    engram::client::LookupWindow w;
    w.col_begin = col_begin;
    w.num_cols = num_cols;
    w.out_token_stride = out_token_stride;
    w.background = (flags & ENGRAM_LOOKUP_BACKGROUND) != 0;
    w.ids_int64 = (flags & ENGRAM_LOOKUP_IDS64) != 0;
    absl::Status st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) {
      st = e->engine->LookupInto(layer, static_cast<const int32_t*>(ids), num_tokens, ids_stride, out,
                                 (flags & ENGRAM_LOOKUP_PACKED) != 0, w);
    }
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_engine_prefetch(engram_engine* e, const int32_t* hash_ids, int32_t num_tokens, uintptr_t stream, char* err,
                           size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("prefetch: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    absl::Status st = CheckTokens(num_tokens, e->max_tokens);
    if (st.ok() && num_tokens > 0 && hash_ids == nullptr) st = absl::InvalidArgumentError("prefetch: null hash ids");
    if (st.ok()) st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) st = e->engine->Prefetch(hash_ids, num_tokens);
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_engine_wait(engram_engine* e, int layer, uintptr_t stream, char* err, size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("wait: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    if (!LayerOk(e->table, layer)) return Fail(absl::InvalidArgumentError("wait: layer out of range"), err, err_len);
    absl::Status st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) st = e->engine->Wait(layer);
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

void* engram_engine_staging(const engram_engine* e, int layer) {
  if (e == nullptr || !LayerOk(e->table, layer) || e->owner != ::getpid()) return nullptr;
  try {
    return e->engine->staging(layer);  // the CPU engine allocates its staging on first use
  } catch (...) {
    return nullptr;
  }
}

int engram_engine_set_lookup_path(engram_engine* e, int path, char* err, size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("set_lookup_path: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    using engram::client::LookupPath;
    if (path != ENGRAM_LOOKUP_PATH_AUTO && path != ENGRAM_LOOKUP_PATH_UVA && path != ENGRAM_LOOKUP_PATH_HOST_GATHER) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("set_lookup_path: unknown path ", path)), err, err_len);
    }
    const LookupPath p = path == ENGRAM_LOOKUP_PATH_UVA           ? LookupPath::kUva
                         : path == ENGRAM_LOOKUP_PATH_HOST_GATHER ? LookupPath::kHostGather
                                                                  : LookupPath::kAuto;
    return Done(e->engine->SetLookupPath(p), err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_engine_last_lookup_path(const engram_engine* e) {
  try {
    if (e == nullptr) return -1;
    switch (e->engine->last_lookup_path()) {
      case engram::client::LookupPath::kUva: return ENGRAM_LOOKUP_PATH_UVA;
      case engram::client::LookupPath::kHostGather: return ENGRAM_LOOKUP_PATH_HOST_GATHER;
      default: return ENGRAM_LOOKUP_PATH_AUTO;
    }
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

int engram_engine_gate(engram_engine* e, const engram_gate_args* g, uintptr_t stream, char* err, size_t err_len) {
  try {
    if (e == nullptr || g == nullptr)
      return Fail(absl::InvalidArgumentError("gate: null engine or args"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    absl::Status st = CheckTokens(g->num_tokens, e->max_tokens);
    if (st.ok() && (g->hc_mult < 1 || g->dim < 1))
      st = absl::InvalidArgumentError("gate: hc_mult and dim must be >= 1");
    if (st.ok() && g->num_tokens > 0 &&
        (g->hidden == nullptr || g->kv == nullptr || g->q_weight == nullptr || g->k_weight == nullptr ||
         g->out == nullptr)) {
      st = absl::InvalidArgumentError("gate: null input");
    }
    if (!st.ok()) return Fail(st, err, err_len);
    if (g->num_tokens == 0) return 0;
    engram::client::GateInputs in{g->hidden, g->kv,         g->q_weight, g->k_weight, g->mask,
                                  g->out,    g->num_tokens, g->hc_mult,  g->dim,      g->eps};
    st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) st = e->engine->Gate(in);
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

}  // extern "C"
