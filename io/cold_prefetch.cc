#include "io/cold_prefetch.h"

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"
#include "model/file_util.h"

namespace engram {

bool ColdPrefetch::WorthStarting(const std::vector<std::vector<PrefetchRange>>& jobs, int samples,
                                 std::string* why_not) {
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
  constexpr uint64_t kProbeBytes = 64 << 10;
  std::vector<uint8_t> probe(kProbeBytes);
  int cold = 0;
  size_t i = 0;
  uint64_t range_start = 0;  // of ranges[i] within the concatenation
  for (int s = 0; s < samples; ++s) {
    const uint64_t at = total / static_cast<uint64_t>(samples) * static_cast<uint64_t>(s);
    while (range_start + ranges[i]->bytes <= at) range_start += ranges[i++]->bytes;
    const PrefetchRange& r = *ranges[i];
    const uint64_t offset = r.offset + (at - range_start);
    const uint64_t n = std::min(kProbeBytes, r.offset + r.bytes - offset);
    auto cached = r.file->ReadIfCached(*r.tensor, offset, probe.data(), n);
    if (!cached.ok()) {  // cannot tell: the workers read on their own
      if (why_not != nullptr) *why_not = std::string(cached.status().message());
      return false;
    }
    if (*cached < n) ++cold;
  }
  return cold >= std::min(2, samples);
}

uint64_t ColdPrefetch::FreeMemoryBytes() { return AvailableMemoryBytes(); }

int64_t ColdPrefetch::WindowJobsFor(uint64_t job_bytes, int workers, uint64_t free_bytes) {
  const uint64_t cap = std::min(kWindowBytes, free_bytes / 4);
  return std::max<int64_t>(2 * std::max(1, workers), static_cast<int64_t>(cap / std::max<uint64_t>(1, job_bytes)));
}

int64_t ColdPrefetch::WindowJobs(uint64_t job_bytes, int workers) {
  return WindowJobsFor(job_bytes, workers, FreeMemoryBytes());
}

ColdPrefetch::ColdPrefetch(std::vector<std::vector<PrefetchRange>> jobs, int readers, int64_t window,
                           BlockObserver observer)
    : pending_(jobs.size(), 0), window_(std::max<int64_t>(1, window)), observer_(std::move(observer)) {
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
  try {
    threads_.reserve(static_cast<size_t>(std::max(1, readers)));
    for (int i = 0; i < std::max(1, readers); ++i) threads_.emplace_back([this] { Reader(); });
  } catch (const std::exception&) {
    // One reader fewer per refused thread (EAGAIN, no memory); the ones started run.
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

std::optional<std::string> ColdPrefetch::gave_up() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) return std::nullopt;
  if (threads_.empty()) return std::string("no reader thread could be started");
  return why_;
}

void ColdPrefetch::GiveUp(const char* why, const char* detail) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) {
    failed_ = true;
    try {
      why_ = absl::StrCat(why, detail);
    } catch (...) {  // no memory for the reason: the flag is what matters
    }
  }
  readers_cv_.notify_all();
  workers_cv_.notify_all();
}

void ColdPrefetch::ReadBlock(const Block& block, std::vector<uint8_t>* scratch) {
  const PrefetchRange& r = block.range;
  scratch->resize(kBlockBytes);
  // What the page cache holds already is only copied; the rest comes from disk.
  auto cached = r.file->ReadIfCached(*r.tensor, r.offset, scratch->data(), r.bytes);
  const uint64_t have = cached.ok() ? *cached : 0;
  if (have < r.bytes) {
    absl::Status st = r.file->ReadRange(*r.tensor, r.offset + have, scratch->data() + have, r.bytes - have);
    if (!st.ok()) return GiveUp("", std::string(st.message()).c_str());
    bytes_read_.fetch_add(r.bytes - have, std::memory_order_relaxed);
    // Did the cache keep it? If not, the workers would read it all again behind us: stop.
    const uint64_t probe = std::min<uint64_t>(4096, r.bytes - have);
    auto kept = r.file->ReadIfCached(*r.tensor, r.offset + r.bytes - probe, scratch->data(), probe);
    if (!kept.ok() || *kept < probe) {
      return GiveUp("the page cache does not keep what the cold-cache readers read: ", r.file->path().c_str());
    }
  }
  bytes_streamed_.fetch_add(r.bytes, std::memory_order_relaxed);
}

void ColdPrefetch::Reader() {
  std::vector<uint8_t> scratch;
  for (;;) {
    const size_t b = next_block_.fetch_add(1, std::memory_order_relaxed);
    if (b >= blocks_.size()) return;
    const Block& block = blocks_[b];
    bool read = false;
    size_t started = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      readers_cv_.wait(lock, [&] {
        return stop_ || failed_ || static_cast<int64_t>(block.job) < static_cast<int64_t>(started_) + window_;
      });
      if (stop_) return;
      read = !failed_;
      started = started_;
    }
    if (read) {
      try {
        if (observer_) observer_(block.job, started);
        ReadBlock(block, &scratch);
      } catch (const std::exception& e) {  // e.g. no memory for the buffer: never std::terminate
        GiveUp("a cold-cache reader failed: ", e.what());
      } catch (...) {
        GiveUp("a cold-cache reader failed");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_[block.job] == 0) workers_cv_.notify_all();
  }
}

}  // namespace engram
