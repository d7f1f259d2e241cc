// The row-order gather's process-wide tuning (kernels/engram_kernels.h, LookupTuning): atomics that start at the
// measured defaults (kernels/lookup_shape.h), set by the engine from its configuration and by benchmarks, read once
// by every launch. Thread-safe (each field is read and written atomically).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>

#include "kernels/engram_kernels.h"
#include "kernels/lookup_shape.h"

namespace engram::kernels {
namespace {

struct TuningState {
  std::atomic<int64_t> sort_min_items{kDefaultSortMinItems};
  std::atomic<int32_t> sort_variant{kDefaultSortVariant};
  std::atomic<int32_t> sort_blocks{kDefaultSortBlocks};
  std::atomic<bool> sort_only{false};
  std::atomic<int32_t> plain_rows{kRows};
  std::atomic<int32_t> plain_block_warps{kWarpsPerBlock};
  std::atomic<int64_t> decode_items{1536};
  std::atomic<int32_t> decode_rows{1};
  std::atomic<int32_t> decode_block_warps{4};
};

bool Pow2UpTo8(int32_t v) { return v == 1 || v == 2 || v == 4 || v == 8; }

TuningState& Tuning() {
  static TuningState state;
  return state;
}

}  // namespace

LookupTuning GetLookupTuning() {
  LookupTuning t;
  t.sort_min_items = Tuning().sort_min_items.load();
  t.sort_variant = Tuning().sort_variant.load();
  t.sort_blocks = Tuning().sort_blocks.load();
  t.sort_only = Tuning().sort_only.load();
  t.plain_rows = Tuning().plain_rows.load();
  t.plain_block_warps = Tuning().plain_block_warps.load();
  t.decode_items = Tuning().decode_items.load();
  t.decode_rows = Tuning().decode_rows.load();
  t.decode_block_warps = Tuning().decode_block_warps.load();
  return t;
}

void SetLookupTuning(const LookupTuning& t) {
  Tuning().sort_min_items.store(t.sort_min_items);
  Tuning().sort_variant.store(std::clamp(t.sort_variant, 0, 3));
  Tuning().sort_blocks.store(std::max(t.sort_blocks, 0));
  Tuning().sort_only.store(t.sort_only);
  if (Pow2UpTo8(t.plain_rows)) Tuning().plain_rows.store(t.plain_rows);
  if (Pow2UpTo8(t.plain_block_warps)) Tuning().plain_block_warps.store(t.plain_block_warps);
  Tuning().decode_items.store(std::max<int64_t>(t.decode_items, 0));
  if (Pow2UpTo8(t.decode_rows)) Tuning().decode_rows.store(t.decode_rows);
  if (Pow2UpTo8(t.decode_block_warps)) Tuning().decode_block_warps.store(t.decode_block_warps);
}

void SetLookupSortShape(std::optional<int32_t> variant, std::optional<int32_t> blocks) {
  if (variant) Tuning().sort_variant.store(std::clamp(*variant, 0, 3));
  if (blocks) Tuning().sort_blocks.store(std::max(*blocks, 0));
}

bool ValidPlainShape(int32_t rows, int32_t block_warps) {
  return (rows == 0 || Pow2UpTo8(rows)) && (block_warps == 0 || Pow2UpTo8(block_warps));
}

}  // namespace engram::kernels
