// The lookup engines' tuning in one place: the measured default of every knob of engram::client::Tuning
// (include/engram/tuning.h), with the measurement it comes from, and how a knob's value is found: the table's
// Tuning (ClientOptions::tuning over the environment's ENGRAM_<KEY>, merged once when Client attaches it), then
// the default here. The kernels' own defaults (kernels::LookupTuning, kernels/lookup_tuning.cc) and the publish
// tuning of engramd (daemon/publisher.h) are another layer's and stay there.
// Pure values and functions; thread-safe.
#pragma once

#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "engram/tuning.h"

namespace engram::client::tuning_default {

// The host gather's UVA share, measured on the H200 (bench/RESULTS.md, 2026-11-30): a quarter of the tokens on the
// UVA row-order kernel, the best share at 196K rows (the size where the engine takes this path; 0.15-0.4 measured
// side by side in four runs: 0.2 and 0.3 won some runs by 1-3% and lost others by as much). The engine's
// calibration replaces it with the best of the shares it times on its own table.
inline constexpr double kHostGatherUvaShare = 0.25;
// The shares the engine's calibration times on its own table. On an H100 host (bench/RESULTS.md, 2026-12-07) 0.40
// was the fastest share measured at 6K-1M rows, fresh ids and repeats alike (196608 rows: 1.95 ms against 2.19 at
// 0.25), so the candidates reach past it.
inline constexpr double kHostGatherCalibrationShares[] = {0.15, 0.25, 0.35, 0.45};
// How a batch reaches the copy engine: bench_kernels' fastest "host gather variant" at 196K rows with the engine's
// UVA share (2 x H200, bench/RESULTS.md 2026-11-30: non-temporal stores, fused plan + gather, the dispatcher
// issuing merged copies of >= 4096 rows, pre-wake, spins of 200 us).
inline constexpr int32_t kHostGatherPrefetchRows = 16;
inline constexpr int32_t kHostGatherStreamStores = 1;
inline constexpr int32_t kHostGatherFused = 1;
inline constexpr int32_t kHostGatherCopyIssuer = 1;
inline constexpr int32_t kHostGatherSpinUs = 200;
inline constexpr int32_t kHostGatherDispatchSpinUs = 200;
inline constexpr int32_t kHostGatherPassSpinUs = 200;
inline constexpr int32_t kHostGatherPrewake = 1;
inline constexpr int32_t kHostGatherIssueMinRows = 4096;

// DP_SHARDED deadlines: forming a group waits for every member's engine (a slow start of one is normal: 5 min);
// a step that has not finished in a minute means a member is gone.
inline constexpr int64_t kDpFormTimeoutMs = 300000;
inline constexpr int64_t kDpStepTimeoutMs = 60000;
// bench_dp on 2 x H200 (bench/RESULTS.md, 2026-11-30 s3): every chunk is one more host-polled NCCL group (~60-75 us
// of host time each: a non-blocking communicator launches every group from a new thread), so few large chunks win:
// 32 MiB (one chunk at 4096 tokens per rank, two at 8192) measured best, 218 / 362 us against 16 MiB's 277 / 400.
inline constexpr int64_t kDpChunkBytes = int64_t{32} << 20;
// bench_dp, 2 x H200 (bench/RESULTS.md, 2026-11-30): peer reads win at every slot measured, 1-16384 tokens per rank
// (6 us at 1 token; 384 us at 16384 against the all-to-all's 669 and the NCCL ceiling's 375): no limit by default.
// Where the GPUs cannot map each other's memory the group agrees on the all-to-all path instead.
inline constexpr int32_t kDpPeerMaxSlot = INT32_MAX;
// The all-to-all's form: the CUDA-graph form for group slots up to this, the pipelined form enqueued call by call
// above. bench_dp on 2 x H200 (RESULTS.md, 2026-11-30 s3, graph run): graph 33-40 us at 1-64 tokens per rank and
// 64 us at 512 (pipelined: 112-144 us), but 245 / 410 us at 4096 / 8192 against the pipelined form's 217 / 366
// (every NCCL kernel in the graph costs more GPU time; more chunks make it worse). 2048: between the measured 512
// (graph wins 2.2x) and 4096 (pipelined wins 1.13x).
inline constexpr int32_t kDpGraphMaxSlot = 2048;

}  // namespace engram::client::tuning_default

namespace engram::client {

// Parses the knobs from `lookup` (a variable's name -> its value or null): ENGRAM_<KEY> for each key of
// Tuning::Keys(). An unset or empty variable, or one whose value Tuning::Set refuses, leaves its knob unset (the
// default applies): the environment is read leniently, a program's Set strictly.
Tuning ParseTuning(const std::function<const char*(const char*)>& lookup);

// The knobs `tuning` sets, as "key=value" joined by commas in Keys() order ("" when none is set): for logs and the
// engine's choice in status.
std::string TuningText(const Tuning& tuning);

// A deadline knob in effect: the value when set and positive, else the default.
inline std::chrono::milliseconds TuningMillis(const std::optional<int64_t>& value, int64_t default_ms) {
  return std::chrono::milliseconds(value.value_or(0) > 0 ? *value : default_ms);
}

}  // namespace engram::client
