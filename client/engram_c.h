/* engram C API: the same capabilities as client/engram_client.h for FFI (Python ctypes, Rust, ...).
 *
 *   engram_table* t = NULL;
 *   engram_attach_request req = ENGRAM_ATTACH_REQUEST_INIT;
 *   req.checkpoint = "/models/DeepSeek-V4.1-Flash"; req.dp_size = 4; req.dp_rank = 1;
 *   if (engram_attach("/run/engramd/engramd.sock", 10000, &req, &t, err, sizeof err) != 0) { ...err... }
 *   engram_table_mode(t);  engram_table_reason(t, i);  engram_table_lookup(t, layer, ids, n, out_bf16);
 *   engram_table_free(t);
 *
 * Functions return 0 on success and a non-zero absl/gRPC status code on failure, with a message in `err`.
 * Host-memory calls (hash, lookup) run on the CPU; the GPU path is the C++ DeviceEngine. A table handle is used
 * by one thread at a time. */
#ifndef ENGRAM_C_H_
#define ENGRAM_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

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
  int cpu_offload;       /* -1 unset (VLLM_PLE_CPU_OFFLOAD, then true), 0 false, 1 true */
  int dp_shared_memory;  /* -1 auto, 0 false, 1 true */
  int embedding_across_dp;
  const char* shm_dir;   /* NULL: /dev/shm */
} engram_attach_request;

#define ENGRAM_ATTACH_REQUEST_INIT {NULL, 1, 0, 1, 0, 0, 0, -1, -1, 0, NULL}

int engram_attach(const char* socket, int timeout_ms, const engram_attach_request* req, engram_table** out,
                  char* err, size_t err_len);
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

#ifdef __cplusplus
}
#endif

#endif /* ENGRAM_C_H_ */
