#include "engram/engram_c.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "engram/v1/engram.grpc.pb.h"


// The C enum carries the same numbers as the C++ one (and the wire protocol's).
static_assert(ENGRAM_REASON_SHM_MISSING == static_cast<int>(engram::client::ReasonCode::kShmMissing) &&
              ENGRAM_REASON_REGISTER_FAILED == static_cast<int>(engram::client::ReasonCode::kRegisterFailed) &&
              ENGRAM_REASON_SEGMENT_NOT_READY == static_cast<int>(engram::client::ReasonCode::kSegmentNotReady) &&
              ENGRAM_REASON_DP_SHARDED_NOT_BUILT == static_cast<int>(engram::client::ReasonCode::kDpShardedNotBuilt) &&
              ENGRAM_REASON_MAX == engram::client::kMaxReasonCode);

// A table lives until its handle was freed and its last engine is gone (`refs`: the handle plus one per engine), so
// that freeing the handle first (a Python collector breaking a cycle in any order) never frees what an engine
// still uses. `owner`: the process that attached; a forked child may not use or free it.
struct engram_table {
  std::atomic<int> refs{1};
  pid_t owner = ::getpid();
  std::unique_ptr<engram::client::Table> table;
  std::string mode, backend;
  int64_t staging_col_begin = 0, staging_col_end = 0;  // the TP shard's columns (an engine's staging fills them)
};

namespace {

int Fail(const absl::Status& st, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const std::string m(st.message());
    std::strncpy(err, m.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(st.code());
}

bool LayerOk(const engram_table* t, int l) {
  return t != nullptr && l >= 0 && l < static_cast<int>(t->table->layers().size());
}

absl::Status CheckTokens(int32_t n, int32_t max_tokens) {
  if (n < 0 || n > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(n, " tokens; the engine was sized for ", max_tokens));
  }
  return absl::OkStatus();
}


}  // namespace

// The engine behind the C ABI is the library's LookupEngine (every lookup path, DP_SHARDED included); each call
// first points it at the caller's stream.
struct engram_engine {
  engram_table* table = nullptr;  // holds one of its refs
  pid_t owner = ::getpid();
  int32_t max_tokens = 0;
  std::string backend;
  std::unique_ptr<engram::client::LookupEngine> engine;
};

namespace {

void* AsStream(uintptr_t s) { return reinterpret_cast<void*>(s); }

// A handle is its process's: after fork() the child shares the parent's sessions, DP group and device state, and
// its use of them would take the parent's steps (and its rows) from under it.
absl::Status Owned(pid_t owner, const char* what) {
  if (owner == ::getpid()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this ", what, " belongs to process ", owner, "; process ", ::getpid(),
                   " is a fork of it and may not use it (the parent keeps it): attach again in this process"));
}

// gRPC's state is its process's too: a forked child of a process that has spoken to engramd cannot (its calls
// would hang), so engram_attach and engram_status_json refuse there instead.
std::atomic<pid_t> g_grpc_pid{0};
absl::Status GrpcHere() {
  const pid_t me = ::getpid();
  pid_t first = 0;
  if (g_grpc_pid.compare_exchange_strong(first, me) || first == me) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("process ", first, " spoke to engramd before process ", me,
                   " was forked from it: a forked child cannot (gRPC does not survive fork); start it with exec "
                   "(Python: multiprocessing's 'spawn')"));
}

void Release(engram_table* t) {
  if (t->refs.fetch_sub(1) == 1) delete t;
}

int Done(const absl::Status& st, char* err, size_t err_len) { return st.ok() ? 0 : Fail(st, err, err_len); }

// No C++ exception crosses the C ABI: every status-returning entry point turns one into an error code (an
// allocation that failed is RESOURCE_EXHAUSTED, anything else INTERNAL) with the message in `err`.
// The host calls engram_table_hash / engram_table_lookup work through a caller's array this many tokens at a time.
constexpr int64_t kHostChunkTokens = 4096;

// The most tokens per call an engine may be sized for: far above any engine's batch, and low enough that its
// buffers (max_tokens x layers x columns x head_dim) are an allocation, not an address-space overflow.
constexpr int32_t kMaxEngineTokens = 1 << 20;

int CaughtException(char* err, size_t err_len) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("out of memory"), err, err_len);
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(absl::StrCat("internal error: ", e.what())), err, err_len);
  } catch (...) {
    return Fail(absl::InternalError("internal error: an unknown exception"), err, err_len);
  }
}

}  // namespace

extern "C" {

int engram_attach(const char* socket, int timeout_ms, const engram_attach_request* req, engram_table** out,
                  char* err, size_t err_len) {
  try {
    if (req == nullptr || out == nullptr || req->checkpoint == nullptr) {
      return Fail(absl::InvalidArgumentError("engram_attach: null request, checkpoint or output"), err, err_len);
    }
    engram::client::ClientOptions o;
    if (socket != nullptr) o.socket = socket;
    if (timeout_ms > 0) o.timeout = std::chrono::milliseconds(timeout_ms);
    o.use_gpu = req->use_gpu != 0;
    engram::client::AttachRequest r;
    r.checkpoint = req->checkpoint;
    r.tp_size = req->tp_size;
    r.tp_rank = req->tp_rank;
    r.dp_size = req->dp_size;
    r.dp_rank = req->dp_rank;
    r.local_dp_size = req->local_dp_size;
    r.elastic_ep = req->elastic_ep != 0;
    if (req->cpu_offload >= 0) r.cpu_offload = req->cpu_offload != 0;
    r.dp_shared_memory = req->dp_shared_memory < 0    ? engram::client::Choice::kAuto
                         : req->dp_shared_memory == 0 ? engram::client::Choice::kFalse
                                                      : engram::client::Choice::kTrue;
    r.embedding_across_dp = req->embedding_across_dp != 0;
    if (req->shm_dir != nullptr) r.shm_dir = req->shm_dir;
    r.private_fallback = req->private_fallback != 0;
    if (auto st = GrpcHere(); !st.ok()) return Fail(st, err, err_len);
    auto client = engram::client::Client::Create(o);
    if (!client.ok()) return Fail(client.status(), err, err_len);
    auto table = (*client)->Attach(r);
    if (!table.ok()) return Fail(table.status(), err, err_len);
    auto* t = new engram_table;
    t->table = std::move(*table);
    t->mode = engram::client::ModeName(t->table->mode());
    t->backend = engram::client::BackendName(t->table->backend());
    // A DP_SHARDED table owns a DP shard of the TP shard's columns; its engines' staging holds the whole TP shard's.
    t->staging_col_begin = t->table->col_begin();
    t->staging_col_end = t->table->col_end();
    if (t->table->mode() == engram::client::Mode::kDpSharded) {
      if (auto tp = t->table->layout().Shard(r.tp_size, r.tp_rank); tp.ok()) {
        t->staging_col_begin = tp->col_begin;
        t->staging_col_end = tp->col_end;
      }
    }
    *out = t;
    return 0;
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

void engram_table_free(engram_table* t) {
  if (t == nullptr || t->owner != ::getpid()) return;  // a forked child leaves the parent's table alone
  Release(t);
}

const char* engram_table_mode(const engram_table* t) { return t ? t->mode.c_str() : ""; }
const char* engram_table_backend(const engram_table* t) { return t ? t->backend.c_str() : ""; }
int engram_table_num_reasons(const engram_table* t) { return t ? static_cast<int>(t->table->reasons().size()) : 0; }

const char* engram_table_reason(const engram_table* t, int i) {
  if (t == nullptr || i < 0 || i >= engram_table_num_reasons(t)) return "";
  return engram::client::ReasonName(t->table->reasons()[static_cast<size_t>(i)].code);
}

int engram_table_reason_code(const engram_table* t, int i) {
  try {
    if (t == nullptr || i < 0 || i >= engram_table_num_reasons(t)) return 0;
    return static_cast<int>(t->table->reasons()[static_cast<size_t>(i)].code);
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

const char* engram_reason_name(int code) {
  return engram::client::ReasonName(static_cast<engram::client::ReasonCode>(code));
}

const char* engram_table_reason_hint(const engram_table* t, int i) {
  if (t == nullptr || i < 0 || i >= engram_table_num_reasons(t)) return "";
  return t->table->reasons()[static_cast<size_t>(i)].hint.c_str();
}

int engram_table_num_layers(const engram_table* t) { return t ? static_cast<int>(t->table->layers().size()) : 0; }
int engram_table_num_cols(const engram_table* t) { return t ? static_cast<int>(t->table->n_cols()) : 0; }
int engram_table_head_dim(const engram_table* t) { return t ? static_cast<int>(t->table->head_dim()) : 0; }
int64_t engram_table_raw_vocab(const engram_table* t) { return t ? t->table->token_map().raw_size() : 0; }

int engram_table_hash(const engram_table* t, const int32_t* tokens, int64_t n, int32_t* out, char* err,
                      size_t err_len) {
  try {
    if (t == nullptr || (n > 0 && (tokens == nullptr || out == nullptr)) || n < 0 || n > (int64_t{1} << 30)) {
      return Fail(absl::InvalidArgumentError("engram_table_hash: null table/buffer or bad count"), err, err_len);
    }
    if (auto st = Owned(t->owner, "table"); !st.ok()) return Fail(st, err, err_len);
    if (n == 0) return 0;
    // One request of n tokens hashed in chunks (each chunk's lookback is the tokens before it): what this call
    // allocates does not grow with n.
    const auto& lay = t->table->layout();
    const int64_t N = lay.max_ngram(), LC = lay.n_layers() * lay.n_cols();
    const int64_t chunk = std::min<int64_t>(n, kHostChunkTokens);
    auto engine = engram::client::LookupEngine::CreateOnHost(*t->table, static_cast<int32_t>(chunk));
    if (!engine.ok()) return Fail(engine.status(), err, err_len);
    std::vector<int64_t> pos(static_cast<size_t>(chunk));
    std::vector<int32_t> lookback(static_cast<size_t>(std::max<int64_t>(N - 1, 1)));
    for (int64_t a = 0; a < n; a += chunk) {
      const int64_t len = std::min(chunk, n - a);
      for (int64_t i = 0; i < len; ++i) pos[static_cast<size_t>(i)] = a + i;
      for (int64_t k = 0; k < N - 1; ++k) {  // oldest first: positions a - (N - 1) .. a - 1
        const int64_t p = a - (N - 1) + k;
        lookback[static_cast<size_t>(k)] = p >= 0 ? tokens[p] : -1;
      }
      const int32_t qsl[2] = {0, static_cast<int32_t>(len)};
      absl::Status st = (*engine)->Hash(tokens + a, pos.data(), qsl, N > 1 ? lookback.data() : nullptr, nullptr,
                                        static_cast<int32_t>(len), 1, out + a * LC);
      if (!st.ok()) return Fail(st, err, err_len);
    }
    return 0;
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_table_lookup(const engram_table* t, int layer, const int32_t* ids, int64_t n, uint16_t* out, char* err,
                        size_t err_len) {
  try {
    if (t == nullptr || (n > 0 && (ids == nullptr || out == nullptr)) || n < 0 || n > (int64_t{1} << 30)) {
      return Fail(absl::InvalidArgumentError("engram_table_lookup: null table/buffer or bad count"), err, err_len);
    }
    if (auto st = Owned(t->owner, "table"); !st.ok()) return Fail(st, err, err_len);
    if (layer < 0 || layer >= static_cast<int>(t->table->layers().size())) {
      return Fail(absl::InvalidArgumentError("engram_table_lookup: layer out of range"), err, err_len);
    }
    if (n == 0) return 0;
    // n ids as "tokens" of `cols` ids each, a chunk of tokens at a time; a partial last token is padded with -1
    // (a zero row). What this call allocates does not grow with n.
    const int64_t C = t->table->n_cols(), D = t->table->head_dim();
    const int64_t chunk_ids = std::min<int64_t>((n + C - 1) / C, kHostChunkTokens) * C;
    auto engine = engram::client::LookupEngine::CreateOnHost(*t->table, static_cast<int32_t>(chunk_ids / C));
    if (!engine.ok()) return Fail(engine.status(), err, err_len);
    std::vector<int32_t> padded(static_cast<size_t>(chunk_ids));
    std::vector<uint16_t> rows(static_cast<size_t>(chunk_ids * D));
    for (int64_t a = 0; a < n; a += chunk_ids) {
      const int64_t len = std::min(chunk_ids, n - a), tokens = (len + C - 1) / C;
      std::fill(padded.begin(), padded.end(), -1);
      std::copy(ids + a, ids + a + len, padded.begin());
      absl::Status st = (*engine)->Lookup(layer, padded.data(), static_cast<int32_t>(tokens), C, rows.data(), false);
      if (!st.ok()) return Fail(st, err, err_len);
      std::copy(rows.begin(), rows.begin() + len * D, out + a * D);
    }
    return 0;
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int64_t engram_table_layer_id(const engram_table* t, int layer) {
  return LayerOk(t, layer) ? t->table->layers()[static_cast<size_t>(layer)].layer_id : -1;
}

int engram_table_layer_rows(const engram_table* t, int layer, int64_t* row_begin, int64_t* row_end) {
  try {
    if (!LayerOk(t, layer) || row_begin == nullptr || row_end == nullptr) {
      return static_cast<int>(absl::StatusCode::kInvalidArgument);
    }
    *row_begin = t->table->layers()[static_cast<size_t>(layer)].row_begin;
    *row_end = t->table->layers()[static_cast<size_t>(layer)].row_end;
    return 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

int engram_table_column_rows(const engram_table* t, int layer, int64_t* rows, int cols) {
  try {
    if (!LayerOk(t, layer) || rows == nullptr || cols < 0 || cols > t->table->n_cols()) {
      return static_cast<int>(absl::StatusCode::kInvalidArgument);
    }
    const auto& primes = t->table->layout().primes(layer);
    for (int c = 0; c < cols; ++c) rows[c] = primes[static_cast<size_t>(c)];
    return 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

int engram_table_col_range(const engram_table* t, int* col_begin, int* col_end) {
  try {
    if (t == nullptr || col_begin == nullptr || col_end == nullptr) {
      return static_cast<int>(absl::StatusCode::kInvalidArgument);
    }
    *col_begin = static_cast<int>(t->table->col_begin());
    *col_end = static_cast<int>(t->table->col_end());
    return 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

int engram_table_staging_col_range(const engram_table* t, int* col_begin, int* col_end) {
  try {
    if (t == nullptr || col_begin == nullptr || col_end == nullptr) {
      return static_cast<int>(absl::StatusCode::kInvalidArgument);
    }
    *col_begin = static_cast<int>(t->staging_col_begin);
    *col_end = static_cast<int>(t->staging_col_end);
    return 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

int engram_table_max_ngram(const engram_table* t) { return t ? static_cast<int>(t->table->layout().max_ngram()) : 0; }
int engram_table_record_bytes(const engram_table* t) {
  try {
    return t ? static_cast<int>(t->table->layout().record_bytes()) : 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}
int engram_table_hidden_size(const engram_table* t) {
  try {
    return t ? static_cast<int>(t->table->layout().config().hidden_size) : 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}
int engram_table_hc_mult(const engram_table* t) { return t ? static_cast<int>(t->table->layout().config().hc_mult) : 0; }
double engram_table_rms_norm_eps(const engram_table* t) { return t ? t->table->layout().config().rms_norm_eps : 0; }
int64_t engram_table_pad_token_id(const engram_table* t) { return t ? t->table->layout().config().pad_token_id : -1; }
double engram_table_register_seconds(const engram_table* t) { return t ? t->table->register_seconds() : -1; }

int engram_table_records(const engram_table* t, int layer, const uint8_t** records) {
  try {
    if (!LayerOk(t, layer) || records == nullptr) return static_cast<int>(absl::StatusCode::kInvalidArgument);
    *records = t->table->records(layer);
    return 0;
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

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
      return Fail(absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [1, ", kMaxEngineTokens, "], got ",
                                                          max_tokens)),
                  err, err_len);
    }
    if (auto st = Owned(t->owner, "table"); !st.ok()) return Fail(st, err, err_len);
    if ((flags & ~ENGRAM_ENGINE_NO_STAGING) != 0) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("engram_engine_create: unknown flags ", flags)), err, err_len);
    }
    const bool staging = (flags & ENGRAM_ENGINE_NO_STAGING) == 0 ||
                         t->table->mode() == engram::client::Mode::kDpSharded;
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

int engram_engine_hash(engram_engine* e, const int32_t* tokens, const int64_t* positions, const int32_t* qsl,
                       const int32_t* lookback, const uint8_t* dead, int32_t num_tokens, int32_t num_requests,
                       int32_t* out, uintptr_t stream, char* err, size_t err_len) {
  try {
    if (e == nullptr) return Fail(absl::InvalidArgumentError("hash: null engine"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    absl::Status st = CheckTokens(num_tokens, e->max_tokens);
    if (st.ok() && (num_requests < 1 || qsl == nullptr ||
                    (num_tokens > 0 && (tokens == nullptr || positions == nullptr || out == nullptr)))) {
      st = absl::InvalidArgumentError("hash: null input or no request");
    }
    if (st.ok()) st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) st = e->engine->Hash(tokens, positions, qsl, lookback, dead, num_tokens, num_requests, out);
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
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

int engram_engine_lookup_into(engram_engine* e, int layer, const void* ids, int32_t num_tokens,
                              int64_t ids_stride, int32_t col_begin, int32_t num_cols, void* out,
                              int64_t out_token_stride, int flags, uintptr_t stream, char* err, size_t err_len) {
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
      case engram::client::LookupPath::kUva:
        return ENGRAM_LOOKUP_PATH_UVA;
      case engram::client::LookupPath::kHostGather:
        return ENGRAM_LOOKUP_PATH_HOST_GATHER;
      default:
        return ENGRAM_LOOKUP_PATH_AUTO;
    }
  } catch (...) {
    return static_cast<int>(absl::StatusCode::kInternal);
  }
}

int engram_engine_gate(engram_engine* e, const engram_gate_args* g, uintptr_t stream, char* err, size_t err_len) {
  try {
    if (e == nullptr || g == nullptr) return Fail(absl::InvalidArgumentError("gate: null engine or args"), err, err_len);
    if (auto st = Owned(e->owner, "engine"); !st.ok()) return Fail(st, err, err_len);
    absl::Status st = CheckTokens(g->num_tokens, e->max_tokens);
    if (st.ok() && (g->hc_mult < 1 || g->dim < 1)) st = absl::InvalidArgumentError("gate: hc_mult and dim must be >= 1");
    if (st.ok() && g->num_tokens > 0 &&
        (g->hidden == nullptr || g->kv == nullptr || g->q_weight == nullptr || g->k_weight == nullptr ||
         g->out == nullptr)) {
      st = absl::InvalidArgumentError("gate: null input");
    }
    if (!st.ok()) return Fail(st, err, err_len);
    if (g->num_tokens == 0) return 0;
    engram::client::GateInputs in{g->hidden, g->kv, g->q_weight, g->k_weight, g->mask, g->out,
                                  g->num_tokens, g->hc_mult, g->dim, g->eps};
    st = e->engine->SetStream(AsStream(stream));
    if (st.ok()) st = e->engine->Gate(in);
    return Done(st, err, err_len);
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

int engram_status_json(const char* socket, int timeout_ms, char** json, char* err, size_t err_len) {
  try {
    if (socket == nullptr || json == nullptr) {
      return Fail(absl::InvalidArgumentError("engram_status_json: null socket or output"), err, err_len);
    }
    *json = nullptr;
    if (auto st = GrpcHere(); !st.ok()) return Fail(st, err, err_len);
    auto channel = grpc::CreateChannel(absl::StrCat("unix:", socket), grpc::InsecureChannelCredentials());
    auto stub = engram::v1::Engram::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 5000));
    engram::v1::StatusReply reply;
    grpc::Status rpc = stub->Status(&ctx, engram::v1::StatusRequest(), &reply);
    if (!rpc.ok()) {
      return Fail(absl::Status(static_cast<absl::StatusCode>(rpc.error_code()),
                               absl::StrCat("engramd at ", socket, ": ", rpc.error_message())),
                  err, err_len);
    }
    google::protobuf::util::JsonPrintOptions o;
    o.preserve_proto_field_names = true;
    o.always_print_primitive_fields = true;
    std::string text;
    if (!google::protobuf::util::MessageToJsonString(reply, &text, o).ok()) {
      return Fail(absl::InternalError("status: cannot print the reply as JSON"), err, err_len);
    }
    *json = static_cast<char*>(std::malloc(text.size() + 1));
    if (*json == nullptr) return Fail(absl::ResourceExhaustedError("status: out of memory"), err, err_len);
    std::memcpy(*json, text.c_str(), text.size() + 1);
    return 0;
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

void engram_string_free(char* s) { std::free(s); }

}  // extern "C"
