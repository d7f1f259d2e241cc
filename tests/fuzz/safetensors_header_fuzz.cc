// Fuzz target: ParseSafetensorsHeader (model/safetensors.h). The input is the JSON header; the data region that
// follows it is given a size derived from the input's length, so offsets past the end are exercised too.
#include <map>
#include <string>

#include "model/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string header(reinterpret_cast<const char*>(data), size);
  const uint64_t data_start = 8 + header.size();
  std::map<std::string, std::string> meta;
  for (uint64_t data_bytes : {uint64_t{0}, uint64_t{64}, uint64_t{1} << 40}) {
    auto parsed =
        engram::ParseSafetensorsHeader("fuzz.safetensors", header, data_start, data_start + data_bytes, &meta);
    if (parsed.ok()) {
      for (const auto& [name, t] : *parsed) {
        // Invariants of an accepted header: every tensor lies inside the data region, sized by dtype x shape.
        if (t.begin < data_start || t.end < t.begin || t.end > data_start + data_bytes) __builtin_trap();
        if (static_cast<uint64_t>(t.numel()) * engram::DTypeSize(t.dtype) != t.bytes()) __builtin_trap();
      }
    }
  }
  return 0;
}
