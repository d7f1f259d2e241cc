// The C++ API from an installed engram: a client is created, a type's name printed, the version header read.
#include <cstdio>
#include <cstring>

#include "engram/client.h"
#include "engram/engram_c.h"
#include "engram/version.h"

int main() {
  auto client = engram::client::Client::Create({.socket = "/nonexistent/engramd.sock"});
  if (!client.ok()) {
    std::printf("Create: %s\n", client.status().ToString().c_str());
    return 1;
  }
  if (std::strcmp(engram_version(), ENGRAM_VERSION_STRING) != 0) return 2;
  std::printf("cxx ok %s %s\n", engram::client::ModeName(engram::client::Mode::kShared), ENGRAM_VERSION_STRING);
  return 0;
}
