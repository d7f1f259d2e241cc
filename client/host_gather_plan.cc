#include "client/host_gather_plan.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

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

GatherPool::GatherPool(int threads, std::vector<int> cpus) {
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
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

// Workers and the caller spin briefly before sleeping: a batch runs several short parallel passes back to back, and
// a futex wake-up of every worker per pass costs more than the pass.
constexpr auto kSpin = std::chrono::microseconds(200);

void GatherPool::Run(const std::function<void(int)>& fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    job_ = &fn;
    running_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_cv_.notify_all();
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (running_.load(std::memory_order_acquire) != 0 && std::chrono::steady_clock::now() < until) {
  }
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return running_.load(std::memory_order_acquire) == 0; });
  job_ = nullptr;
}

void GatherPool::Loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
    }
    const std::function<void(int)>* job = nullptr;
    {
      std::unique_lock<std::mutex> l(mu_);
      start_cv_.wait(l, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
      if (stop_) return;
      seen = generation_.load(std::memory_order_relaxed);
      job = job_;
    }
    (*job)(worker);
    if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> l(mu_);
      done_cv_.notify_one();
    }
  }
}

namespace {

inline uint64_t Mix(uint64_t x) {  // murmur3's finaliser: spreads consecutive rows over the table
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

inline int64_t IdAt(const int32_t* ids, int64_t item, int32_t cols, int64_t stride) {
  if (stride == cols) return ids[item];
  return ids[(item / cols) * stride + item % cols];
}

}  // namespace

RowDeduper::RowDeduper(int64_t max_items) : max_items_(std::max<int64_t>(max_items, 1)) {
  capacity_ = 16;
  while (capacity_ < 2 * max_items_) capacity_ <<= 1;
  keys_.reset(new std::atomic<uint32_t>[static_cast<size_t>(capacity_)]);
  for (int64_t s = 0; s < capacity_; ++s) keys_[static_cast<size_t>(s)].store(0, std::memory_order_relaxed);
  compact_.resize(static_cast<size_t>(capacity_));
}

absl::Status RowDeduper::Plan(const int32_t* ids, int32_t num_tokens, int32_t num_cols, int64_t ids_stride,
                              int64_t row_begin, int64_t row_end, bool dedup, GatherPool& pool, int32_t* index,
                              GatherPlan* plan) {
  const int64_t items = static_cast<int64_t>(num_tokens) * num_cols;
  if (num_tokens < 0 || num_cols < 1 || ids_stride < num_cols || row_end < row_begin) {
    return absl::InvalidArgumentError("gather plan: bad shape");
  }
  if (items > max_items_) {
    return absl::InvalidArgumentError(absl::StrCat(items, " items; the de-duplicator was sized for ", max_items_));
  }
  if (row_end - row_begin >= static_cast<int64_t>(GatherPlan::kNoRow)) {
    return absl::InvalidArgumentError("gather plan: more than 2^32 - 1 rows in a layer");
  }
  if (items > 0 && (ids == nullptr || index == nullptr)) return absl::InvalidArgumentError("gather plan: null ids");
  if (plan->rows.size() < static_cast<size_t>(items)) plan->rows.resize(static_cast<size_t>(items));
  uint32_t* rows = plan->rows.data();
  const int P = pool.threads();
  if (!dedup) {
    pool.Run([&](int w) {
      const Range r = SplitRange(items, P, w);
      for (int64_t i = r.begin; i < r.end; ++i) {
        const int64_t id = IdAt(ids, i, num_cols, ids_stride);
        const bool owned = id >= row_begin && id < row_end;
        rows[i] = owned ? static_cast<uint32_t>(id - row_begin) : GatherPlan::kNoRow;
        index[i] = owned ? static_cast<int32_t>(i) : -1;
      }
    });
    plan->n_rows = items;
    return absl::OkStatus();
  }
  // The table in use: a power of two >= 2 * items (small batches scan a small table).
  int64_t cap = 16;
  while (cap < 2 * items) cap <<= 1;
  const uint64_t mask = static_cast<uint64_t>(cap) - 1;
  const uint64_t range = static_cast<uint64_t>(std::max<int64_t>(row_end - row_begin, 1));
  std::atomic<uint32_t>* keys = keys_.get();
  // 1. Every owned item claims or finds its row's slot (open addressing, linear probing, lock-free); index[i] holds
  //    the slot for now. Ordered placement (slot proportional to the row) makes the slot order the row order, so
  //    the gather walks the table in address order (page-walk locality, as the GPU's row-order gather); should the
  //    ids crowd into a narrow band of rows (long probe runs), the batch is placed again by a hash.
  std::atomic<bool> crowded{false};
  auto claim = [&](bool ordered) {
    pool.Run([&](int w) {
      const Range r = SplitRange(items, P, w);
      for (int64_t i = r.begin; i < r.end && !crowded.load(std::memory_order_relaxed); ++i) {
        const int64_t id = IdAt(ids, i, num_cols, ids_stride);
        if (id < row_begin || id >= row_end) {
          index[i] = -1;
          continue;
        }
        const uint32_t key = static_cast<uint32_t>(id - row_begin) + 1;
        uint64_t s = ordered ? (static_cast<uint64_t>(key - 1) * static_cast<uint64_t>(cap)) / range : Mix(key) & mask;
        for (int probes = 0;; ++probes) {
          uint32_t k = keys[s].load(std::memory_order_relaxed);
          if (k == 0 && keys[s].compare_exchange_strong(k, key, std::memory_order_relaxed)) break;
          if (k == key) break;
          if (ordered && probes > 256) {
            crowded.store(true, std::memory_order_relaxed);
            break;
          }
          s = (s + 1) & mask;
        }
        index[i] = static_cast<int32_t>(s);
      }
    });
  };
  claim(true);
  if (crowded.load()) {
    pool.Run([&](int w) {
      const Range r = SplitRange(cap, P, w);
      for (int64_t s = r.begin; s < r.end; ++s) keys[s].store(0, std::memory_order_relaxed);
    });
    crowded.store(false);
    claim(false);
  }
  // 2. Occupied slots per part of the table, then each part numbers its rows and empties its slots.
  counts_.assign(static_cast<size_t>(P) + 1, 0);
  pool.Run([&](int w) {
    const Range r = SplitRange(cap, P, w);
    int64_t n = 0;
    for (int64_t s = r.begin; s < r.end; ++s) n += keys[s].load(std::memory_order_relaxed) != 0;
    counts_[static_cast<size_t>(w) + 1] = n;
  });
  for (int w = 0; w < P; ++w) counts_[static_cast<size_t>(w) + 1] += counts_[static_cast<size_t>(w)];
  pool.Run([&](int w) {
    const Range r = SplitRange(cap, P, w);
    int64_t next = counts_[static_cast<size_t>(w)];
    for (int64_t s = r.begin; s < r.end; ++s) {
      const uint32_t k = keys[s].load(std::memory_order_relaxed);
      if (k == 0) continue;
      compact_[static_cast<size_t>(s)] = static_cast<uint32_t>(next);
      rows[next++] = k - 1;
      keys[s].store(0, std::memory_order_relaxed);
    }
  });
  // 3. Slots become positions in `rows`.
  pool.Run([&](int w) {
    const Range r = SplitRange(items, P, w);
    for (int64_t i = r.begin; i < r.end; ++i) {
      if (index[i] >= 0) index[i] = static_cast<int32_t>(compact_[static_cast<size_t>(index[i])]);
    }
  });
  plan->n_rows = counts_[static_cast<size_t>(P)];
  return absl::OkStatus();
}

void GatherRecords(const uint8_t* records, int64_t rb, const uint32_t* rows, int64_t begin, int64_t end,
                   uint8_t* dst) {
  constexpr int64_t kAhead = 16;
  for (int64_t k = begin; k < std::min(end, begin + kAhead); ++k) {
    if (rows[k] != GatherPlan::kNoRow) __builtin_prefetch(records + static_cast<int64_t>(rows[k]) * rb);
  }
  for (int64_t k = begin; k < end; ++k) {
    if (k + kAhead < end && rows[k + kAhead] != GatherPlan::kNoRow) {
      const uint8_t* p = records + static_cast<int64_t>(rows[k + kAhead]) * rb;
      for (int64_t off = 0; off < rb; off += 64) __builtin_prefetch(p + off);
      __builtin_prefetch(p + rb - 1);
    }
    if (rows[k] == GatherPlan::kNoRow) continue;
    std::memcpy(dst + k * rb, records + static_cast<int64_t>(rows[k]) * rb, static_cast<size_t>(rb));
  }
}

}  // namespace engram::client
