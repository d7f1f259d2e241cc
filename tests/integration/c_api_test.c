/* The C API from C: attach with no daemon (a private table from the checkpoint), read mode and reasons, hash one
 * request and compare every id with an independent recomputation of docs/math.md section 5, look layer 0's rows up and
 * compare each with the independent row oracle (c_api_oracle.h), hash a chunk whose lookback holds dead ids as the
 * whole request hashed in one piece (engram_engine_hash_v2), and hit every refusal; first, the versions against
 * engram/version.h. Prints "N passed, N failed".
 * Usage: c_api_test CHECKPOINT_DIR PLAN_JSON TOKENMAP_BIN (from `engramctl plan --json` and `engramctl tokenmap`) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engram/engram_c.h"
#include "engram/version.h"
#include "tests/integration/c_api_oracle.h"

static int passed = 0, failed = 0;
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (cond) {                                                                \
      ++passed;                                                                \
    } else {                                                                   \
      ++failed;                                                                \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  /* The versions, called first (before anything else): the library's are this build's (engram/version.h). */
  CHECK(engram_abi_version() == ENGRAM_ABI_VERSION);
  CHECK(ENGRAM_ABI_VERSION >= 1);
  CHECK(engram_version() != NULL && strcmp(engram_version(), ENGRAM_VERSION_STRING) == 0);
  CHECK(engram_version() == engram_version()); /* static storage: the same string every call */
  char err[512] = {0};
  engram_table* t = NULL;
  engram_attach_request req = ENGRAM_ATTACH_REQUEST_INIT;
  req.checkpoint = argv[1];
  req.dp_size = 4;
  CHECK(engram_attach("/nonexistent/engramd.sock", 200, &req, &t, err, sizeof err) == 0);
  CHECK(t != NULL);
  if (t == NULL) {
    fprintf(stderr, "attach: %s\n", err);
    printf("%d passed, %d failed\n", passed, failed);
    return 1;
  }
  CHECK(strcmp(engram_table_mode(t), "PRIVATE_PINNED") == 0);
  int saw_unavailable = 0;
  for (int i = 0; i < engram_table_num_reasons(t); ++i) {
    if (strcmp(engram_table_reason(t, i), "DAEMON_UNAVAILABLE") == 0) saw_unavailable = 1;
    CHECK(strlen(engram_table_reason_hint(t, i)) > 0);
  }
  CHECK(saw_unavailable);
  const int L = engram_table_num_layers(t), C = engram_table_num_cols(t), D = engram_table_head_dim(t);
  CHECK(L > 0 && C > 0 && D > 0);
  {
    /* A private table of the whole TP shard owns every column its staging fills: both ranges are [0, C). */
    int cb = -1, ce = -1, sb = -1, se = -1;
    CHECK(engram_table_col_range(t, &cb, &ce) == 0 && engram_table_staging_col_range(t, &sb, &se) == 0);
    CHECK(cb == 0 && ce == C && sb == 0 && se == C);
    CHECK(engram_table_staging_col_range(t, NULL, &se) != 0);
  }
  enum { T = 7 };
  int32_t tokens[T] = {1, 2, 3, 4, 5, 300, 2};
  int32_t* ids = calloc((size_t)(T * L * C), sizeof(int32_t));
  int32_t* want_ids = calloc((size_t)(T * L * C), sizeof(int32_t));
  for (int i = 0; i < T * L * C; ++i) ids[i] = -7;
  CHECK(engram_table_hash(t, tokens, T, ids, err, sizeof err) == 0);
  CHECK(oracle_hash_ids(argv[1], argv[2], argv[3], tokens, T, want_ids, (int64_t)T * L * C) == 0);
  int id_mismatches = 0;
  for (int i = 0; i < T * L * C; ++i) id_mismatches += ids[i] != want_ids[i];
  CHECK(id_mismatches == 0);
  /* Layer 0's ids ([T, C] from the [T, L, C] output), looked up; every row equals the oracle's bf16 row. */
  int32_t* layer0 = calloc((size_t)(T * C), sizeof(int32_t));
  for (int i = 0; i < T; ++i) {
    for (int c = 0; c < C; ++c) layer0[i * C + c] = ids[(i * L + 0) * C + c];
  }
  uint16_t* rows = malloc((size_t)(T * C * D) * sizeof(uint16_t));
  uint16_t* want = malloc((size_t)D * sizeof(uint16_t));
  for (int i = 0; i < T * C * D; ++i) rows[i] = 0xFFFF; /* poison: never a lookup's value */
  CHECK(engram_table_lookup(t, 0, layer0, T * C, rows, err, sizeof err) == 0);
  int row_mismatches = 0, rows_checked = 0;
  for (int k = 0; k < T * C; ++k) {
    if (oracle_row_bf16(argv[1], 0, layer0[k], want, D) != 0) {
      ++row_mismatches;
      continue;
    }
    ++rows_checked;
    row_mismatches += memcmp(rows + (size_t)k * D, want, (size_t)D * sizeof(uint16_t)) != 0;
  }
  CHECK(rows_checked == T * C);
  CHECK(row_mismatches == 0);
  /* Refusals: a bad layer, a token outside the vocabulary, null buffers, an explicit dp_shared_memory true. */
  CHECK(engram_table_lookup(t, L, layer0, T * C, rows, err, sizeof err) != 0 && strstr(err, "layer") != NULL);
  int32_t bad = (int32_t)engram_table_raw_vocab(t);
  CHECK(engram_table_hash(t, &bad, 1, ids, err, sizeof err) != 0 && strstr(err, "outside") != NULL);
  CHECK(engram_table_lookup(t, 0, NULL, T * C, rows, err, sizeof err) != 0);
  /* The engine's lookup into a caller's layout: columns [1, 1 + W) of layer 0, packed, at a token stride with a
   * 24-byte gap after each token's rows; every record equals the oracle's bytes (weights then scales) and the gaps
   * keep their poison. */
  {
    engram_engine* e = NULL;
    CHECK(engram_engine_create(t, T, 0, &e, err, sizeof err) == 0 && e != NULL);
    const int RB = engram_table_record_bytes(t), W = C > 2 ? 2 : 1, gap = 24;
    const int64_t stride = (int64_t)W * RB + gap;
    uint8_t* packed = malloc((size_t)(T * stride));
    uint8_t* want_rec = malloc((size_t)RB);
    memset(packed, 0xA5, (size_t)(T * stride));
    CHECK(engram_engine_lookup_into(e, 0, layer0, T, C, 1, W, packed, stride, ENGRAM_LOOKUP_PACKED, 0, err,
                                    sizeof err) == 0);
    int rec_mismatches = 0, gap_damage = 0;
    for (int i = 0; i < T; ++i) {
      for (int j = 0; j < W; ++j) {
        if (oracle_record(argv[1], 0, layer0[i * C + 1 + j], want_rec, RB) != 0) {
          ++rec_mismatches;
          continue;
        }
        rec_mismatches += memcmp(packed + i * stride + (int64_t)j * RB, want_rec, (size_t)RB) != 0;
      }
      for (int b = 0; b < gap; ++b) gap_damage += packed[i * stride + (int64_t)W * RB + b] != 0xA5;
    }
    CHECK(rec_mismatches == 0);
    CHECK(gap_damage == 0);
    /* Hostile arguments: refused with a message, and nothing written. */
    memset(packed, 0xA5, (size_t)(T * stride));
    CHECK(engram_engine_lookup_into(e, 0, layer0, T, C, C - 1, 2, packed, stride, ENGRAM_LOOKUP_PACKED, 0, err,
                                    sizeof err) != 0 &&
          strstr(err, "window") != NULL);
    CHECK(engram_engine_lookup_into(e, 0, layer0, T, C, 0, W, packed, 8, ENGRAM_LOOKUP_PACKED, 0, err, sizeof err) !=
              0 &&
          strstr(err, "stride") != NULL);
    CHECK(engram_engine_lookup_into(e, 0, layer0, T, C, 0, W, packed, stride, 64, 0, err, sizeof err) != 0 &&
          strstr(err, "flags") != NULL);
    CHECK(engram_engine_lookup_into(e, 0, layer0, T + 1, C, 0, W, packed, stride, ENGRAM_LOOKUP_PACKED, 0, err,
                                    sizeof err) != 0);
    CHECK(engram_engine_lookup_into(e, L, layer0, T, C, 0, W, packed, stride, ENGRAM_LOOKUP_PACKED, 0, err,
                                    sizeof err) != 0 &&
          strstr(err, "layer") != NULL);
    CHECK(engram_engine_lookup_into(e, 0, NULL, T, C, 0, W, packed, stride, ENGRAM_LOOKUP_PACKED, 0, err, sizeof err) !=
          0);
    CHECK(engram_engine_lookup_into(NULL, 0, layer0, T, C, 0, W, packed, stride, 0, 0, err, sizeof err) != 0);
    int untouched = 1;
    for (int64_t b = 0; b < T * stride; ++b) untouched &= packed[b] == 0xA5;
    CHECK(untouched);
    /* The CPU engine has one lookup path. */
    CHECK(engram_engine_last_lookup_path(e) == ENGRAM_LOOKUP_PATH_AUTO);
    CHECK(engram_engine_set_lookup_path(e, ENGRAM_LOOKUP_PATH_AUTO, err, sizeof err) == 0);
    CHECK(engram_engine_set_lookup_path(e, ENGRAM_LOOKUP_PATH_UVA, err, sizeof err) != 0);
    CHECK(engram_engine_set_lookup_path(e, 9, err, sizeof err) != 0 && strstr(err, "unknown") != NULL);
    CHECK(engram_engine_last_lookup_path(NULL) == -1);
    /* The records read in place: layer 0's first record is the oracle's row 0. */
    const uint8_t* records = NULL;
    CHECK(engram_table_records(t, 0, &records) == 0 && records != NULL);
    CHECK(oracle_record(argv[1], 0, 0, want_rec, RB) == 0 && memcmp(records, want_rec, (size_t)RB) == 0);
    CHECK(engram_table_records(t, L, &records) != 0 && engram_table_records(t, 0, NULL) != 0);
    free(packed);
    free(want_rec);
    engram_engine_free(e);
  }
  /* The lookback dead mask (engram_engine_hash_v2): a chunk whose lookback holds the last N-1 tokens before it,
   * flagged as the whole request's dead mask flags them, hashes as the same positions of the whole request hashed in
   * one piece. Two requests of one batch, each with its own dead lookback position (the newest, the oldest). A flag on
   * an unknown (-1) lookback id is not read. A mask without lookback ids is refused, writing nothing. */
  {
    engram_engine* e = NULL;
    enum { FT = 16, P = 12, CT = FT - P };
    CHECK(engram_engine_create(t, 2 * FT, 0, &e, err, sizeof err) == 0 && e != NULL);
    const int N = engram_table_max_ngram(t), NL = N - 1;
    if (e != NULL && strcmp(engram_engine_backend(e), "cpu") == 0 && N >= 2 && NL <= P) {
      int32_t full_tok[FT], chunk_tok[2 * CT], qsl_full[2] = {0, FT}, qsl_chunk[3] = {0, CT, 2 * CT};
      int64_t full_pos[FT], chunk_pos[2 * CT];
      uint8_t full_dead[2][FT], chunk_dead[2 * CT];
      int32_t* lb = malloc(sizeof(int32_t) * (size_t)(2 * NL));
      int32_t* unknown = malloc(sizeof(int32_t) * (size_t)(2 * NL));
      uint8_t* lb_dead = malloc((size_t)(2 * NL));
      uint8_t* all_dead = malloc((size_t)(2 * NL));
      const size_t per = (size_t)(L * C);
      int32_t* full_ids = malloc(sizeof(int32_t) * FT * per * 2);
      int32_t* got = malloc(sizeof(int32_t) * 2 * CT * per);
      int32_t* plain = malloc(sizeof(int32_t) * 2 * CT * per);
      for (int i = 0; i < FT; ++i) {
        full_tok[i] = 3 + (i * 37) % 200;
        full_pos[i] = i;
        full_dead[0][i] = full_dead[1][i] = 0;
      }
      full_dead[0][P - 1] = 1;  /* request 0: the newest lookback position is dead */
      full_dead[1][P - NL] = 1; /* request 1: the oldest */
      for (int r = 0; r < 2; ++r) {
        for (int i = 0; i < CT; ++i) {
          chunk_tok[r * CT + i] = full_tok[P + i];
          chunk_pos[r * CT + i] = P + i;
          chunk_dead[r * CT + i] = 0;
        }
        for (int k = 0; k < NL; ++k) { /* oldest first: positions P - NL .. P - 1 */
          lb[r * NL + k] = full_tok[P - NL + k];
          lb_dead[r * NL + k] = full_dead[r][P - NL + k];
          unknown[r * NL + k] = -1;
          all_dead[r * NL + k] = 1;
        }
        CHECK(engram_engine_hash(e, full_tok, full_pos, qsl_full, NULL, full_dead[r], FT, 1,
                                 full_ids + (size_t)r * FT * per, 0, err, sizeof err) == 0);
      }
      for (size_t i = 0; i < 2 * CT * per; ++i) got[i] = -7;
      CHECK(engram_engine_hash_v2(e, chunk_tok, chunk_pos, qsl_chunk, lb, lb_dead, chunk_dead, 2 * CT, 2, got, 0, err,
                                  sizeof err) == 0);
      int chunk_mismatches = 0;
      for (int r = 0; r < 2; ++r) {
        chunk_mismatches +=
            memcmp(got + (size_t)r * CT * per, full_ids + ((size_t)r * FT + P) * per, sizeof(int32_t) * CT * per) != 0;
      }
      CHECK(chunk_mismatches == 0);
      /* The same chunk without the mask differs (the dead lookback id takes part again). */
      CHECK(engram_engine_hash_v2(e, chunk_tok, chunk_pos, qsl_chunk, lb, NULL, chunk_dead, 2 * CT, 2, plain, 0, err,
                                  sizeof err) == 0);
      CHECK(memcmp(plain, got, sizeof(int32_t) * 2 * CT * per) != 0);
      /* Flags on unknown ids: unknown ids hash as pad and block nothing, as without the mask. */
      CHECK(engram_engine_hash_v2(e, chunk_tok, chunk_pos, qsl_chunk, unknown, all_dead, chunk_dead, 2 * CT, 2, got, 0,
                                  err, sizeof err) == 0);
      CHECK(engram_engine_hash(e, chunk_tok, chunk_pos, qsl_chunk, unknown, chunk_dead, 2 * CT, 2, plain, 0, err,
                               sizeof err) == 0);
      CHECK(memcmp(plain, got, sizeof(int32_t) * 2 * CT * per) == 0);
      /* Refusals: a mask without lookback ids, a null engine; nothing written. */
      for (size_t i = 0; i < 2 * CT * per; ++i) got[i] = -7;
      CHECK(engram_engine_hash_v2(e, chunk_tok, chunk_pos, qsl_chunk, NULL, lb_dead, chunk_dead, 2 * CT, 2, got, 0, err,
                                  sizeof err) == 3 &&
            strstr(err, "lookback_dead") != NULL);
      CHECK(engram_engine_hash_v2(NULL, chunk_tok, chunk_pos, qsl_chunk, lb, lb_dead, chunk_dead, 2 * CT, 2, got, 0,
                                  err, sizeof err) == 3);
      CHECK(engram_engine_hash_v2(e, chunk_tok, NULL, qsl_chunk, lb, lb_dead, chunk_dead, 2 * CT, 2, got, 0, err,
                                  sizeof err) == 3);
      CHECK(engram_engine_hash_v2(e, chunk_tok, chunk_pos, qsl_chunk, lb, lb_dead, chunk_dead, 2 * FT + 1, 2, got, 0,
                                  err, sizeof err) != 0);
      int written = 0;
      for (size_t i = 0; i < 2 * CT * per; ++i) written += got[i] != -7;
      CHECK(written == 0);
      free(lb);
      free(unknown);
      free(lb_dead);
      free(all_dead);
      free(full_ids);
      free(got);
      free(plain);
    }
    engram_engine_free(e);
  }
  engram_table* t2 = NULL;
  req.dp_shared_memory = 1;
  CHECK(engram_attach("/nonexistent/engramd.sock", 200, &req, &t2, err, sizeof err) != 0);
  CHECK(t2 == NULL && strstr(err, "DAEMON_UNAVAILABLE") != NULL);
  CHECK(engram_attach(NULL, 0, NULL, &t2, err, sizeof err) != 0);
  free(ids);
  free(want_ids);
  free(layer0);
  free(rows);
  free(want);
  engram_table_free(t);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
