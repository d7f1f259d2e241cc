/* engram C API: the same capabilities as engram/client.h for FFI (Python ctypes, Rust, ...).
 *
 *   engram_table* t = NULL;
 *   engram_attach_request req = ENGRAM_ATTACH_REQUEST_INIT;
 *   req.checkpoint = "/models/DeepSeek-V4.1-Flash"; req.dp_size = 4; req.dp_rank = 1;
 *   if (engram_attach("/run/engramd/engramd.sock", 10000, &req, &t, err, sizeof err) != 0) { ...err... }
 *   engram_table_mode(t);  engram_table_reason(t, i);  engram_table_lookup(t, layer, ids, n, out_bf16);
 *   engram_table_free(t);
 *
 * Functions return 0 on success and a non-zero absl/gRPC status code on failure, with a message in `err`.
 * engram_table_hash / engram_table_lookup run on the CPU over host records (one request, simple); the per-step path
 * (batches, prefetch, gate, device pointers and CUDA streams) is an engram_engine (below). A table handle is used
 * by one thread at a time; libengram_c.so (target engram_c) is this API as a shared library, the python/ package's
 * door. */
#ifndef ENGRAM_C_H_
#define ENGRAM_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Versions ----
 * ENGRAM_ABI_VERSION: the version of this C ABI, maintained by hand. It is bumped on every incompatible change of
 * its functions or structs (a function removed or its signature or meaning changed, a struct's layout or an enum's
 * numbers changed); adding a function is compatible and keeps it. A binding checks engram_abi_version() against
 * the number it was written for before it calls anything else.
 * engram_version(): this library's version, ENGRAM_VERSION_STRING of the engram/version.h it was built with
 * ("major.minor.patch"), in static storage. engram_abi_version(): the ENGRAM_ABI_VERSION it was built with. Both may be
 * called first, before anything else, from any thread, and never fail. */
#define ENGRAM_ABI_VERSION 1
const char* engram_version(void);
int engram_abi_version(void);

typedef struct engram_table engram_table;

/* Why a table is not shared: the same numbers as engram.v1.FallbackReason and engram::client::ReasonCode. */
enum engram_reason {
  ENGRAM_REASON_SHM_MISSING = 1,
  ENGRAM_REASON_SHM_TOO_SMALL = 2,
  ENGRAM_REASON_NOT_COLOCATED = 3,
  ENGRAM_REASON_DP_SIZE_ONE = 4,
  ENGRAM_REASON_CPU_OFFLOAD_DISABLED = 5,
  ENGRAM_REASON_ELASTIC_EP = 6,
  ENGRAM_REASON_SHM_NOT_VISIBLE = 7,
  ENGRAM_REASON_REGISTER_FAILED = 8,
  ENGRAM_REASON_FINGERPRINT_MISMATCH = 9,
  ENGRAM_REASON_DAEMON_UNAVAILABLE = 10,
  ENGRAM_REASON_PERMISSION_DENIED = 11,
  ENGRAM_REASON_MODEL_NOT_SHAREABLE = 12,
  ENGRAM_REASON_NO_CUDA_DEVICE = 13,
  ENGRAM_REASON_SEGMENT_NOT_READY = 14,
  ENGRAM_REASON_DP_SHARED_MEMORY_DISABLED = 15,
  ENGRAM_REASON_DP_SHARDED_NOT_BUILT = 16,
  ENGRAM_REASON_MAX = 16
};

typedef struct {
  const char* checkpoint;
  int tp_size, tp_rank, dp_size, dp_rank, local_dp_size;
  int elastic_ep;
  int cpu_offload;      /* -1 unset (VLLM_PLE_CPU_OFFLOAD, then true), 0 false, 1 true */
  int dp_shared_memory; /* -1 auto, 0 false, 1 true */
  int embedding_across_dp;
  const char*
      shm_dir; /* path fallback only (no descriptor passed): the daemon's shm dir as seen here; NULL: the grant's */
  int use_gpu; /* 1 (default): the CUDA backend where a GPU is usable; 0: the CPU backend regardless */
  int private_fallback; /* 1 (default): a table that cannot be shared is built privately; 0: engram_attach fails
                           with FAILED_PRECONDITION naming every reason instead (the caller keeps its own table) */
} engram_attach_request;

#define ENGRAM_ATTACH_REQUEST_INIT \
  { NULL, 1, 0, 1, 0, 0, 0, -1, -1, 0, NULL, 1, 1 }

int engram_attach(const char* socket, int timeout_ms, const engram_attach_request* req, engram_table** out, char* err,
                  size_t err_len);
void engram_table_free(engram_table* t);

/* "SHARED", "PRIVATE_PINNED", "DEVICE", "DP_SHARDED"; "cuda" or "cpu". Valid while the table lives. */
const char* engram_table_mode(const engram_table* t);
const char* engram_table_backend(const engram_table* t);
int engram_table_num_reasons(const engram_table* t);
const char* engram_table_reason(const engram_table* t, int i);      /* e.g. "SHM_NOT_VISIBLE" */
const char* engram_table_reason_hint(const engram_table* t, int i); /* what to do about it */
int engram_table_reason_code(const engram_table* t, int i);         /* an engram_reason; 0 when out of range */
const char* engram_reason_name(int code);                           /* "SHM_NOT_VISIBLE"; "UNKNOWN" otherwise */

int engram_table_num_layers(const engram_table* t);
int engram_table_num_cols(const engram_table* t);
int engram_table_head_dim(const engram_table* t);
int64_t engram_table_raw_vocab(const engram_table* t);

/* One request of `n` raw token ids at positions 0..n-1: out [n, num_layers, num_cols] int32 row ids. */
int engram_table_hash(const engram_table* t, const int32_t* tokens, int64_t n, int32_t* out, char* err, size_t err_len);
/* Rows of layer `layer` for `n` ids: out [n, head_dim] bf16 bits (zero rows outside this shard). */
int engram_table_lookup(const engram_table* t, int layer, const int32_t* ids, int64_t n, uint16_t* out, char* err,
                        size_t err_len);

/* ---- Layout (what the Python package's Table.layout reports) ---- */
int64_t engram_table_layer_id(const engram_table* t, int layer); /* backbone layer id; -1 when out of range */
/* This shard's rows [row_begin, row_end) of layer `layer`'s table, and rows per hash column (the column's prime,
 * `cols` values: columns [0, cols) of num_cols). Return 0, or INVALID_ARGUMENT for a bad layer / null output. */
int engram_table_layer_rows(const engram_table* t, int layer, int64_t* row_begin, int64_t* row_end);
int engram_table_column_rows(const engram_table* t, int layer, int64_t* rows, int cols);
int engram_table_col_range(const engram_table* t, int* col_begin, int* col_end); /* the columns this table owns */
/* The columns an engine's staging fills: the TP shard's. Equal to col_range except on a DP_SHARDED table, which owns
 * only its DP shard of them (a TP rank's wkv product runs over these). */
int engram_table_staging_col_range(const engram_table* t, int* col_begin, int* col_end);
int engram_table_max_ngram(const engram_table* t);
int engram_table_record_bytes(const engram_table* t);
int engram_table_hidden_size(const engram_table* t);
int engram_table_hc_mult(const engram_table* t);
double engram_table_rms_norm_eps(const engram_table* t);
int64_t engram_table_pad_token_id(const engram_table* t);
double engram_table_register_seconds(const engram_table* t); /* -1 when nothing was registered */
/* The host records of layer `layer` (record of row_begin first, record_bytes each, read-only: a SHARED table's
 * are the daemon's segment) in *records; NULL for a DEVICE table, which has none on the host. */
int engram_table_records(const engram_table* t, int layer, const uint8_t** records);

/* ---- Engine: the library's LookupEngine (engram/lookup_engine.h) with a CUDA stream per call ----
 * engram_engine_create sizes the engine for at most `max_tokens` tokens per call. On the CUDA backend every pointer
 * is a device pointer (or registered host memory) and `stream` is a cudaStream_t as an integer (0: the legacy
 * default stream); every call is asynchronous on the stream it is given, so an engine follows the caller's current
 * stream (CUDA-graph capture included). On the CPU backend pointers are host pointers, `stream` is ignored and calls
 * complete before they return. The staging buffers (bf16 [max_tokens, num_cols, head_dim] per layer, written by
 * prefetch) sit at fixed addresses for the engine's life. One thread drives an engine; the table must outlive it.
 * Every misuse (null, more than max_tokens tokens, a layer out of range, bad query_start_loc on the CPU) returns a
 * non-zero code with a message, never a crash. */
typedef struct engram_engine engram_engine;

int engram_engine_create(const engram_table* t, int32_t max_tokens, uintptr_t stream, engram_engine** out, char* err,
                         size_t err_len);
/* The same with flags: ENGRAM_ENGINE_NO_STAGING, an engine that only looks up into its caller's buffers (no staging
 * buffers: saves num_layers x max_tokens x num_cols x head_dim bf16 of GPU memory; prefetch/wait then fail and
 * engram_engine_staging returns NULL; a DP_SHARDED table's engine keeps them). An engine's calls form one sequence:
 * calls on different streams must be ordered by the caller (they share the engine's scratch). */
#define ENGRAM_ENGINE_NO_STAGING 1
int engram_engine_create_flags(const engram_table* t, int32_t max_tokens, uintptr_t stream, int flags,
                               engram_engine** out, char* err, size_t err_len);
void engram_engine_free(engram_engine* e);
const char* engram_engine_backend(const engram_engine* e); /* "cuda" or "cpu" */
int32_t engram_engine_max_tokens(const engram_engine* e);

/* A flattened batch of `num_requests` requests (docs/math.md section 5): tokens [T] int32 raw ids, positions [T] int64
 * (contiguous within a request), query_start_loc [R+1] int32, lookback [R, max_ngram-1] int32 raw ids oldest first, -1
 * unknown (NULL: all unknown), dead [T] uint8 nonzero = DEAD (NULL: none) -> out [T, num_layers, num_cols] int32. */
int engram_engine_hash(engram_engine* e, const int32_t* tokens, const int64_t* positions,
                       const int32_t* query_start_loc, const int32_t* lookback, const uint8_t* dead, int32_t num_tokens,
                       int32_t num_requests, int32_t* out, uintptr_t stream, char* err, size_t err_len);
/* engram_engine_hash with a lookback dead mask: lookback_dead [R, max_ngram-1] uint8, in the columns of `lookback`,
 * nonzero = that lookback id is DEAD (it blocks every n-gram that reaches it, as a dead token does); read only where
 * the lookback id is known (not -1): an unknown id hashes as pad whatever its flag. NULL: no lookback id is dead
 * (the same as engram_engine_hash). A mask without lookback ids is INVALID_ARGUMENT. */
int engram_engine_hash_v2(engram_engine* e, const int32_t* tokens, const int64_t* positions,
                          const int32_t* query_start_loc, const int32_t* lookback, const uint8_t* lookback_dead,
                          const uint8_t* dead, int32_t num_tokens, int32_t num_requests, int32_t* out, uintptr_t stream,
                          char* err, size_t err_len);
/* Rows of layer `layer` for ids[t * ids_stride + c] (c < num_cols): bf16 bits [T, num_cols, head_dim], or with
 * `packed` the raw records [T, num_cols, record_bytes]. Ids outside this shard give zero rows. */
int engram_engine_lookup(engram_engine* e, int layer, const int32_t* ids, int32_t num_tokens, int64_t ids_stride,
                         void* out, int packed, uintptr_t stream, char* err, size_t err_len);
/* Every layer's lookup of hash ids [T, num_layers, num_cols] into the staging buffers: on the CUDA backend on the
 * engine's side stream after the work queued on `stream`; engram_engine_wait(layer) orders `stream` after it. */
/* Rows of layer `layer` written in the caller's layout (an engine's own output buffer): the columns
 * [col_begin, col_begin + num_cols) of ids (read at ids[t * ids_stride + col_begin + j]; num_cols -1: to the last
 * column), token t's rows at out + t * out_token_stride (bf16 values, or bytes with ENGRAM_LOOKUP_PACKED; 0: dense,
 * num_cols rows per token). ENGRAM_LOOKUP_BACKGROUND: a small grid, for a side stream beside the model's kernels.
 * Runs the UVA kernels (row order for large batches), so it is capturable in a CUDA graph. */
#define ENGRAM_LOOKUP_PACKED 1
#define ENGRAM_LOOKUP_BACKGROUND 2
#define ENGRAM_LOOKUP_IDS64 4 /* ids points at int64 ids (ids_stride in int64 elements) */
int engram_engine_lookup_into(engram_engine* e, int layer, const void* ids, int32_t num_tokens, int64_t ids_stride,
                              int32_t col_begin, int32_t num_cols, void* out, int64_t out_token_stride, int flags,
                              uintptr_t stream, char* err, size_t err_len);
/* The path of later prefetches: AUTO (per batch: host gather when not capturing, the ids are host memory and the
 * batch is large enough), UVA (graph capture; DP ranks that must take the same path) or HOST_GATHER. The CPU
 * backend accepts only AUTO. engram_engine_last_lookup_path says what the last prefetch took (AUTO before one). */
#define ENGRAM_LOOKUP_PATH_AUTO 0
#define ENGRAM_LOOKUP_PATH_UVA 1
#define ENGRAM_LOOKUP_PATH_HOST_GATHER 2
int engram_engine_set_lookup_path(engram_engine* e, int path, char* err, size_t err_len);
int engram_engine_last_lookup_path(const engram_engine* e); /* -1 for a null engine */
int engram_engine_prefetch(engram_engine* e, const int32_t* hash_ids, int32_t num_tokens, uintptr_t stream, char* err,
                           size_t err_len);
int engram_engine_wait(engram_engine* e, int layer, uintptr_t stream, char* err, size_t err_len);
void* engram_engine_staging(const engram_engine* e, int layer); /* NULL for a layer out of range */

/* The gate (docs/math.md section 7): out[t, c, :] = hidden[t, c, :] + g * value, bf16 bits; mask [T] nonzero = DEAD
 * (gate 0), may be NULL. */
typedef struct {
  const uint16_t* hidden;   /* [T, hc_mult, dim] */
  const uint16_t* kv;       /* [T, (hc_mult + 1) * dim] */
  const uint16_t* q_weight; /* [hc_mult, dim] */
  const uint16_t* k_weight; /* [hc_mult, dim] */
  const uint8_t* mask;
  uint16_t* out; /* [T, hc_mult, dim]; may not alias the inputs */
  int32_t num_tokens, hc_mult, dim;
  float eps;
} engram_gate_args;
int engram_engine_gate(engram_engine* e, const engram_gate_args* args, uintptr_t stream, char* err, size_t err_len);

/* ---- Daemon status ----
 * engramd's status (what `engramctl status --json` shows: shm, segments, replicas with mode/backend/reasons) as a
 * JSON text in *json (free it with engram_string_free). UNAVAILABLE / DEADLINE_EXCEEDED when no daemon answers. */
int engram_status_json(const char* socket, int timeout_ms, char** json, char* err, size_t err_len);
void engram_string_free(char* s);

/* ---- The library's log ----
 * Lines go to stderr unless a callback is set: then every line at or above the level goes to `fn(level, line,
 * user)` (level 0 debug, 1 info, 2 warning, 3 error; `line` valid during the call only), from any of the
 * library's threads; the callback must not call into the library. fn NULL restores stderr. */
typedef void (*engram_log_fn)(int level, const char* line, void* user);
void engram_set_log_callback(engram_log_fn fn, void* user);
void engram_set_log_level(int level); /* lines below it are dropped (default 1, info); clamped to 0..3 */

#ifdef __cplusplus
}
#endif

#endif /* ENGRAM_C_H_ */
