// The C ABI: the library's version and the C ABI's (include/engram/engram_c.h). Constants: nothing to fail, no state.
#include "engram/version.h"
#include "engram/engram_c.h"

extern "C" {

const char* engram_version(void) { return ENGRAM_VERSION_STRING; }

int engram_abi_version(void) { return ENGRAM_ABI_VERSION; }

}  // extern "C"
