/* The C API from C: attach with no daemon (a private table from the checkpoint), read mode and reasons, hash one
 * request, look rows up, and hit every refusal. Prints "N passed, N failed". Usage: c_api_test CHECKPOINT_DIR */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/engram_c.h"

static int passed = 0, failed = 0;
#define CHECK(cond)                                                  \
  do {                                                               \
    if (cond) {                                                      \
      ++passed;                                                      \
    } else {                                                         \
      ++failed;                                                      \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2) return 2;
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
  int32_t tokens[5] = {1, 2, 3, 4, 5};
  int32_t* ids = calloc((size_t)(5 * L * C), sizeof(int32_t));
  CHECK(engram_table_hash(t, tokens, 5, ids, err, sizeof err) == 0);
  uint16_t* rows = calloc((size_t)(5 * D), sizeof(uint16_t));
  CHECK(engram_table_lookup(t, 0, ids, 5, rows, err, sizeof err) == 0);
  int nonzero = 0;
  for (int i = 0; i < 5 * D; ++i) nonzero += rows[i] != 0;
  CHECK(nonzero > 0);
  /* Refusals: a bad layer, a token outside the vocabulary, null buffers, an explicit dp_shared_memory true. */
  CHECK(engram_table_lookup(t, L, ids, 5, rows, err, sizeof err) != 0 && strstr(err, "layer index") != NULL);
  int32_t bad = (int32_t)engram_table_raw_vocab(t);
  CHECK(engram_table_hash(t, &bad, 1, ids, err, sizeof err) != 0 && strstr(err, "outside") != NULL);
  CHECK(engram_table_lookup(t, 0, NULL, 5, rows, err, sizeof err) != 0);
  engram_table* t2 = NULL;
  req.dp_shared_memory = 1;
  CHECK(engram_attach("/nonexistent/engramd.sock", 200, &req, &t2, err, sizeof err) != 0);
  CHECK(t2 == NULL && strstr(err, "DAEMON_UNAVAILABLE") != NULL);
  CHECK(engram_attach(NULL, 0, NULL, &t2, err, sizeof err) != 0);
  free(ids);
  free(rows);
  engram_table_free(t);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
