#include "client/engine/host_gather_plan.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/spin.h"
#include "base/stream_copy.h"

namespace engram::client {

int DefaultGatherThreads(int cores) { return std::clamp(cores / 2, 1, 16); }

int64_t PlanChunkRows(int64_t rows, int threads, int64_t min_rows, int64_t max_rows) {
  if (rows <= 0) return 0;
  min_rows = std::max<int64_t>(min_rows, 1);
  max_rows = std::max(max_rows, min_rows);
  // Four chunks per thread: while a thread gathers its next chunk, the copy engine drains the previous ones.
  const int64_t want = std::max<int64_t>(threads, 1) * 4;
  return std::clamp((rows + want - 1) / want, min_rows, max_rows);
}

Range SplitRange(int64_t n, int parts, int part) {
  parts = std::max(parts, 1);
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = part * base + std::min<int64_t>(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

GatherPool::GatherPool(int threads, std::vector<int> cpus, int spin_us, int caller_spin_us)
    : spin_ns_(std::max<int64_t>(spin_us, 0) * 1000),
      caller_spin_ns_(caller_spin_us < 0 ? spin_ns_ : int64_t{caller_spin_us} * 1000) {
  threads = std::max(threads, 1);
  for (int w = 0; w < threads; ++w) {
    workers_.emplace_back([this, w] { Loop(w); });
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[static_cast<size_t>(w) % cpus.size()], &set);
      (void)pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    }
  }
}

GatherPool::~GatherPool() {
  stop_.store(true, std::memory_order_release);
  signal_.fetch_add(1, std::memory_order_release);
  signal_.notify_all();
  for (auto& t : workers_) t.join();
}

// Sleeping and waking go straight through the futex words (std::atomic wait/notify): one system call wakes every
// worker, and no worker then queues for a mutex behind the others.
void GatherPool::Run(const std::function<void(int)>& fn, const std::function<void()>& caller) {
  job_ = &fn;
  running_.store(static_cast<int32_t>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  signal_.fetch_add(1, std::memory_order_release);
  signal_.notify_all();
  if (caller) caller();
  SpinUntil([&] { return running_.load(std::memory_order_acquire) == 0; }, caller_spin_ns_);
  for (int32_t r = running_.load(std::memory_order_acquire); r != 0; r = running_.load(std::memory_order_acquire)) {
    running_.wait(r, std::memory_order_acquire);
  }
  job_ = nullptr;
}

void GatherPool::Wake() {
  signal_.fetch_add(1, std::memory_order_release);
  signal_.notify_all();
}

void GatherPool::Loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    // A job is new when generation_ moved; signal_ is read first so that a Run after the check still wakes us.
    const uint32_t sig = signal_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    if (generation_.load(std::memory_order_acquire) == seen) {
      SpinUntil(
          [&] { return generation_.load(std::memory_order_acquire) != seen || stop_.load(std::memory_order_relaxed); },
          spin_ns_);
      if (generation_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_acquire)) {
        signal_.wait(sig, std::memory_order_acquire);
      }
      continue;
    }
    // Run cannot start the next job before this worker finished this one, so job_ is this generation's.
    seen = generation_.load(std::memory_order_acquire);
    (*job_)(worker);
    if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) running_.notify_all();
  }
}

namespace {

// Calls fn(i, id) for items i in [begin, end) in order, id = ids[t * stride + c] for i = t * cols + c (one division
// per range, not per item).
template <typename Fn>
inline void ForEachId(const int32_t* ids, int64_t begin, int64_t end, int32_t cols, int64_t stride, Fn&& fn) {
  if (begin >= end) return;
  if (stride == cols) {
    for (int64_t i = begin; i < end; ++i) fn(i, static_cast<int64_t>(ids[i]));
    return;
  }
  int64_t t = begin / cols, c = begin % cols;
  const int32_t* row = ids + t * stride;
  for (int64_t i = begin; i < end; ++i) {
    fn(i, static_cast<int64_t>(row[c]));
    if (++c == cols) {
      c = 0;
      row += stride;
    }
  }
}

}  // namespace

absl::Status PlanIdentity(const int32_t* ids, int32_t num_tokens, int32_t num_cols, int64_t ids_stride,
                          int64_t row_begin, int64_t row_end, GatherPool& pool, int32_t* index, GatherPlan* plan) {
  const int64_t items = static_cast<int64_t>(num_tokens) * num_cols;
  if (num_tokens < 0 || num_cols < 1 || ids_stride < num_cols || row_end < row_begin) {
    return absl::InvalidArgumentError("gather plan: bad shape");
  }
  if (row_end - row_begin >= static_cast<int64_t>(GatherPlan::kNoRow)) {
    return absl::InvalidArgumentError("gather plan: more than 2^32 - 1 rows in a layer");
  }
  if (items > 0 && (ids == nullptr || index == nullptr)) return absl::InvalidArgumentError("gather plan: null ids");
  if (plan->rows.size() < static_cast<size_t>(items)) plan->rows.resize(static_cast<size_t>(items));
  uint32_t* rows = plan->rows.data();
  const int P = pool.threads();
  pool.Run([&](int w) {
    const Range r = SplitRange(items, P, w);
    PlanIdentityRange(ids, num_cols, ids_stride, row_begin, row_end, r.begin, r.end, rows, index);
  });
  plan->n_rows = items;
  return absl::OkStatus();
}

void PlanIdentityRange(const int32_t* ids, int32_t cols, int64_t stride, int64_t row_begin, int64_t row_end,
                       int64_t begin, int64_t end, uint32_t* rows, int32_t* index) {
  ForEachId(ids, begin, end, cols, stride, [&](int64_t i, int64_t id) {
    const bool owned = id >= row_begin && id < row_end;
    rows[i] = owned ? static_cast<uint32_t>(id - row_begin) : GatherPlan::kNoRow;
    index[i] = owned ? static_cast<int32_t>(i) : -1;
  });
}

namespace {

// Every cache line of [p, p + n) prefetched once.
inline void PrefetchLines(const uint8_t* p, int64_t n) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(p + n - 1);
  for (uintptr_t a = first; a <= last; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a));
}

}  // namespace

void GatherRecords(const uint8_t* records, int64_t rb, const uint32_t* rows, int64_t begin, int64_t end, uint8_t* dst,
                   const GatherCopy& how) {
  const int64_t ahead = std::max(how.prefetch_rows, 0);
  if (ahead > 0) {
    for (int64_t k = begin; k < std::min(end, begin + ahead); ++k) {
      if (rows[k] != GatherPlan::kNoRow) PrefetchLines(records + static_cast<int64_t>(rows[k]) * rb, rb);
    }
  }
  for (int64_t k = begin; k < end; ++k) {
    if (ahead > 0 && k + ahead < end && rows[k + ahead] != GatherPlan::kNoRow) {
      PrefetchLines(records + static_cast<int64_t>(rows[k + ahead]) * rb, rb);
    }
    if (rows[k] == GatherPlan::kNoRow) continue;
    const uint8_t* src = records + static_cast<int64_t>(rows[k]) * rb;
    if (how.stream_stores)
      StreamCopy(dst + k * rb, src, rb);
    else
      std::memcpy(dst + k * rb, src, static_cast<size_t>(rb));
  }
  if (how.stream_stores) StreamFence();
}

}  // namespace engram::client
