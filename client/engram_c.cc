#include "client/engram_c.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client/engram_client.h"
#include "client/lookup_engine.h"

// The C enum carries the same numbers as the C++ one (and the wire protocol's).
static_assert(ENGRAM_REASON_SHM_MISSING == static_cast<int>(engram::client::ReasonCode::kShmMissing) &&
              ENGRAM_REASON_REGISTER_FAILED == static_cast<int>(engram::client::ReasonCode::kRegisterFailed) &&
              ENGRAM_REASON_SEGMENT_NOT_READY == static_cast<int>(engram::client::ReasonCode::kSegmentNotReady) &&
              ENGRAM_REASON_DP_SHARDED_NOT_BUILT == static_cast<int>(engram::client::ReasonCode::kDpShardedNotBuilt) &&
              ENGRAM_REASON_MAX == engram::client::kMaxReasonCode);

struct engram_table {
  std::unique_ptr<engram::client::Table> table;
  std::string mode, backend;
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

}  // namespace

extern "C" {

int engram_attach(const char* socket, int timeout_ms, const engram_attach_request* req, engram_table** out,
                  char* err, size_t err_len) {
  if (req == nullptr || out == nullptr || req->checkpoint == nullptr) {
    return Fail(absl::InvalidArgumentError("engram_attach: null request, checkpoint or output"), err, err_len);
  }
  engram::client::ClientOptions o;
  if (socket != nullptr) o.socket = socket;
  if (timeout_ms > 0) o.timeout = std::chrono::milliseconds(timeout_ms);
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
  auto client = engram::client::Client::Connect(o);
  if (!client.ok()) return Fail(client.status(), err, err_len);
  auto table = (*client)->Attach(r);
  if (!table.ok()) return Fail(table.status(), err, err_len);
  auto* t = new engram_table;
  t->table = std::move(*table);
  t->mode = engram::client::ModeName(t->table->mode());
  t->backend = engram::client::BackendName(t->table->backend());
  *out = t;
  return 0;
}

void engram_table_free(engram_table* t) { delete t; }

const char* engram_table_mode(const engram_table* t) { return t ? t->mode.c_str() : ""; }
const char* engram_table_backend(const engram_table* t) { return t ? t->backend.c_str() : ""; }
int engram_table_num_reasons(const engram_table* t) { return t ? static_cast<int>(t->table->reasons().size()) : 0; }

const char* engram_table_reason(const engram_table* t, int i) {
  if (t == nullptr || i < 0 || i >= engram_table_num_reasons(t)) return "";
  return engram::client::ReasonName(t->table->reasons()[static_cast<size_t>(i)].code);
}

int engram_table_reason_code(const engram_table* t, int i) {
  if (t == nullptr || i < 0 || i >= engram_table_num_reasons(t)) return 0;
  return static_cast<int>(t->table->reasons()[static_cast<size_t>(i)].code);
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
  if (t == nullptr || (n > 0 && (tokens == nullptr || out == nullptr)) || n < 0 || n > (int64_t{1} << 30)) {
    return Fail(absl::InvalidArgumentError("engram_table_hash: null table/buffer or bad count"), err, err_len);
  }
  if (n == 0) return 0;
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = i;
  const std::vector<int32_t> qsl = {0, static_cast<int32_t>(n)};
  auto engine = engram::client::LookupEngine::CreateOnHost(*t->table, static_cast<int32_t>(n));
  if (!engine.ok()) return Fail(engine.status(), err, err_len);
  absl::Status st = (*engine)->Hash(tokens, pos.data(), qsl.data(), nullptr, nullptr, static_cast<int32_t>(n), 1, out);
  return st.ok() ? 0 : Fail(st, err, err_len);
}

int engram_table_lookup(const engram_table* t, int layer, const int32_t* ids, int64_t n, uint16_t* out, char* err,
                        size_t err_len) {
  if (t == nullptr || (n > 0 && (ids == nullptr || out == nullptr)) || n < 0 || n > (int64_t{1} << 30)) {
    return Fail(absl::InvalidArgumentError("engram_table_lookup: null table/buffer or bad count"), err, err_len);
  }
  // n ids as ceil(n / cols) "tokens" of `cols` ids each; a partial last token is padded with -1 (a zero row).
  const int64_t C = t->table->n_cols(), D = t->table->head_dim();
  if (layer < 0 || layer >= static_cast<int>(t->table->layers().size())) {
    return Fail(absl::InvalidArgumentError("engram_table_lookup: layer out of range"), err, err_len);
  }
  if (n == 0) return 0;
  const int64_t tokens = (n + C - 1) / C;
  std::vector<int32_t> padded(static_cast<size_t>(tokens * C), -1);
  std::copy(ids, ids + n, padded.begin());
  std::vector<uint16_t> rows(static_cast<size_t>(tokens * C * D));
  auto engine = engram::client::LookupEngine::CreateOnHost(*t->table, static_cast<int32_t>(tokens));
  if (!engine.ok()) return Fail(engine.status(), err, err_len);
  absl::Status st = (*engine)->Lookup(layer, padded.data(), static_cast<int32_t>(tokens), C, rows.data(), false);
  if (!st.ok()) return Fail(st, err, err_len);
  std::copy(rows.begin(), rows.begin() + n * D, out);
  return 0;
}

}  // extern "C"
