/* The C ABI from an installed engram: versions, and a status call with no daemon that fails with a message. */
#include <stdio.h>
#include <string.h>

#include "engram/engram_c.h"
#include "engram/version.h"

int main(void) {
  char err[512] = "";
  char* json = NULL;
  if (engram_abi_version() != ENGRAM_ABI_VERSION) return 1;
  if (strcmp(engram_version(), ENGRAM_VERSION_STRING) != 0) return 2;
  if (engram_status_json("/nonexistent/engramd.sock", 200, &json, err, sizeof err) == 0) return 3;
  printf("c ok %s (no daemon: %s)\n", engram_version(), err);
  return 0;
}
