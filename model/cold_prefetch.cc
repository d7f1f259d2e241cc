#include "model/cold_prefetch.h"

#include <algorithm>
#include <system_error>

namespace engram {

bool ColdPrefetch::WorthStarting(const std::vector<std::vector<PrefetchRange>>& jobs, int samples) {
  std::vector<const PrefetchRange*> ranges;
  uint64_t total = 0;
  for (const auto& job : jobs) {
    for (const auto& r : job) {
      if (r.bytes == 0) continue;
      ranges.push_back(&r);
      total += r.bytes;
    }
  }
  if (total == 0 || samples <= 0) return false;
  constexpr uint64_t kProbeBytes = 256 << 10;
  size_t i = 0;
  uint64_t range_start = 0;  // of ranges[i] within the concatenation
  for (int s = 0; s < samples; ++s) {
    const uint64_t at = total / static_cast<uint64_t>(samples) * static_cast<uint64_t>(s);
    while (range_start + ranges[i]->bytes <= at) range_start += ranges[i++]->bytes;
    const PrefetchRange& r = *ranges[i];
    const uint64_t offset = r.offset + (at - range_start);
    const uint64_t n = std::min(kProbeBytes, r.offset + r.bytes - offset);
    auto resident = r.file->ResidentBytes(*r.tensor, offset, n);
    if (!resident.ok() || *resident < n) return true;
  }
  return false;
}

ColdPrefetch::ColdPrefetch(std::vector<std::vector<PrefetchRange>> jobs, int readers, int64_t window)
    : pending_(jobs.size(), 0), window_(std::max<int64_t>(1, window)) {
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (const auto& r : jobs[j]) {
      for (uint64_t done = 0; done < r.bytes; done += kBlockBytes) {
        PrefetchRange piece = r;
        piece.offset = r.offset + done;
        piece.bytes = std::min(kBlockBytes, r.bytes - done);
        blocks_.push_back({j, std::move(piece)});
        ++pending_[j];
      }
    }
  }
  for (int i = 0; i < std::max(1, readers); ++i) {
    try {
      threads_.emplace_back([this] { Reader(); });
    } catch (const std::system_error&) {
      break;  // one reader fewer
    }
  }
  if (threads_.empty()) failed_ = true;  // no reader: the workers read for themselves
}

ColdPrefetch::~ColdPrefetch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  readers_cv_.notify_all();
  workers_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ColdPrefetch::WaitForJob(size_t j) {
  if (j >= pending_.size()) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (j + 1 > started_) {
    started_ = j + 1;
    readers_cv_.notify_all();
  }
  workers_cv_.wait(lock, [&] { return failed_ || stop_ || pending_[j] == 0; });
}

void ColdPrefetch::Reader() {
  std::vector<uint8_t> scratch;
  for (;;) {
    const size_t b = next_block_.fetch_add(1, std::memory_order_relaxed);
    if (b >= blocks_.size()) return;
    const Block& block = blocks_[b];
    bool read = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      readers_cv_.wait(lock, [&] {
        return stop_ || failed_ || static_cast<int64_t>(block.job) < static_cast<int64_t>(started_) + window_;
      });
      if (stop_) return;
      read = !failed_;
    }
    if (read) {
      const PrefetchRange& r = block.range;
      auto resident = r.file->ResidentBytes(*r.tensor, r.offset, r.bytes);
      if (!resident.ok() || *resident < r.bytes) {
        scratch.resize(kBlockBytes);
        if (r.file->ReadRange(*r.tensor, r.offset, scratch.data(), r.bytes).ok()) {
          bytes_read_.fetch_add(r.bytes, std::memory_order_relaxed);
        } else {
          std::lock_guard<std::mutex> lock(mu_);
          failed_ = true;  // the worker's own read reports it
          readers_cv_.notify_all();
          workers_cv_.notify_all();
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_[block.job] == 0) workers_cv_.notify_all();
  }
}

}  // namespace engram
