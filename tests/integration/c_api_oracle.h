/* Independent expectations for the C API test (c_api_test.c), implemented in C++ beside it (c_api_oracle.cc):
 * hash ids recomputed from docs/math.md section 5's formula over the layout `engramctl plan --json` printed
 * (multipliers, primes, offsets; the layout is NumPy-golden-tested) and the token map `engramctl tokenmap` wrote
 * (HF-golden-tested), and table rows read by the independent row oracle (tools/row_oracle.h). Shares no code with the
 * client's hash or lookup. Test-only; each call reads its files again. Return 0 on success, -1 with a message on
 * stderr otherwise. */
#ifndef ENGRAM_TESTS_C_API_ORACLE_H_
#define ENGRAM_TESTS_C_API_ORACLE_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Ids of one request of n tokens starting at position 0 (no dead tokens, no lookback), laid out [n, layers, cols]. */
int oracle_hash_ids(const char* checkpoint_dir, const char* plan_json, const char* tokenmap_bin, const int32_t* tokens,
                    int64_t n, int32_t* out, int64_t out_len);
/* The bf16 row of global row `row` of layer index `layer` (position in engram_layer_ids). */
int oracle_row_bf16(const char* checkpoint_dir, int layer, int64_t row, uint16_t* out, int64_t head_dim);
/* The record (head_dim e4m3 bytes, then head_dim/32 ue8m0 scales) of global row `row` of layer index `layer`; a
 * negative row gives a zero record (what a lookup writes for an id outside every table). */
int oracle_record(const char* checkpoint_dir, int layer, int64_t row, uint8_t* out, int64_t record_bytes);

#ifdef __cplusplus
}
#endif

#endif
