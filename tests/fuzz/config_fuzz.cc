// Fuzz target: ParseEngramConfig (model/config.h) and, for accepted configs small enough to lay out quickly,
// Layout::Build and every TP shard split (model/layout.h).
#include <string>

#include "model/config.h"
#include "model/layout.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto cfg = engram::ParseEngramConfig(text);
  if (!cfg.ok() || cfg->kind != engram::ModelKind::kEngram) return 0;
  if (cfg->n_layers() * cfg->n_cols() > 4096) return 0;  // a valid but large layout: slow, not interesting
  auto layout = engram::Layout::Build(*cfg);
  if (!layout.ok()) return 0;
  for (int64_t tp = 1; tp <= 8; ++tp) {
    for (int64_t r = 0; r < tp; ++r) (void)layout->Shard(tp, r);
  }
  return 0;
}
