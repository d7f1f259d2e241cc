// The C ABI: attaching, a table's facts, and the host hash / lookup (include/engram/engram_c.h).
#include "client/capi/handles.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/layout.h"
#include "model/token_map.h"

using namespace engram::capi;  // NOLINT: the entry points' shared helpers

namespace {

// Writes a column range [begin, end) into the caller's two outputs (both required).
int ColRange(int64_t begin, int64_t end, int* col_begin, int* col_end) {
  if (col_begin == nullptr || col_end == nullptr) return static_cast<int>(absl::StatusCode::kInvalidArgument);
  *col_begin = static_cast<int>(begin);
  *col_end = static_cast<int>(end);
  return 0;
}

}  // namespace

extern "C" {

int engram_attach(const char* socket, int timeout_ms, const engram_attach_request* req, engram_table** out, char* err,
                  size_t err_len) {
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
  if (t == nullptr) return static_cast<int>(absl::StatusCode::kInvalidArgument);
  return ColRange(t->table->col_begin(), t->table->col_end(), col_begin, col_end);
}

int engram_table_staging_col_range(const engram_table* t, int* col_begin, int* col_end) {
  if (t == nullptr) return static_cast<int>(absl::StatusCode::kInvalidArgument);
  return ColRange(t->staging_col_begin, t->staging_col_end, col_begin, col_end);
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
int engram_table_hc_mult(const engram_table* t) {
  return t ? static_cast<int>(t->table->layout().config().hc_mult) : 0;
}
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

}  // extern "C"
