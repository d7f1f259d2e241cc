// Test helper processes only: installs the client's fault hook (client/fault_points.h) from ENGRAM_TEST_FAULT at
// start, so a multi-process test can make one member fail at a named point. The product never links this file.
//   ENGRAM_TEST_FAULT=<name>[:<arg>]   e.g. dp_peer_open, dp_give_up_before_mapping, register_chunk:3
#include <cstdlib>
#include <string>

#include "client/fault_points.h"

namespace {

const bool kInstalled = [] {
  const char* v = std::getenv("ENGRAM_TEST_FAULT");
  if (v == nullptr || *v == '\0') return false;
  std::string spec(v);
  long long arg = -1;
  if (const auto colon = spec.find(':'); colon != std::string::npos) {
    arg = std::atoll(spec.c_str() + colon + 1);
    spec.resize(colon);
  }
  engram::client::SetFaultHook([spec, arg](engram::client::FaultPoint p, int64_t a) {
    return engram::client::FaultPointName(p) == spec && (arg < 0 || a == arg);
  });
  return true;
}();

}  // namespace
