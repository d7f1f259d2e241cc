#include "io/shard_records.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "base/stream_copy.h"
#include "base/worker_threads.h"
#include "io/cold_prefetch.h"
#include "model/reference.h"
#include "xxhash.h"
#if defined(ENGRAM_XXH_DISPATCH)
// XXH3 through libxxhash's runtime dispatch (AVX2 / AVX-512 where the CPU has them; the same hashes): the publish
// hashes every byte it writes, on the same cores that copy. Set by CMake where the dispatch links.
#include <xxh_x86dispatch.h>
#endif

namespace engram {
namespace {

struct Job {
  size_t entry;       // index into layers
  int64_t first_row;  // relative to row_begin
  int64_t rows;
  size_t chunk;  // checksum chunk within the entry
};

std::vector<Job> MakeJobs(const std::vector<LayerRows>& layers, std::vector<std::vector<uint64_t>>* hashes) {
  std::vector<Job> jobs;
  hashes->assign(layers.size(), {});
  for (size_t e = 0; e < layers.size(); ++e) {
    const int64_t rows = layers[e].row_end - layers[e].row_begin;
    size_t c = 0;
    for (int64_t r = 0; r < rows; r += kChecksumChunkRows, ++c) {
      jobs.push_back({e, r, std::min(kChecksumChunkRows, rows - r), c});
    }
    (*hashes)[e].resize(c);
  }
  return jobs;
}

// Runs fn over every job on `threads` workers; the first error wins and stops the rest. `before_job` (may be empty)
// is called with a job's index by the worker that took it, before fn.
absl::Status RunJobs(const std::vector<Job>& jobs, int threads, const std::function<absl::Status(const Job&)>& fn,
                     const std::function<void(size_t)>& before_job = {}) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Status first_error;
  std::mutex mu;
  auto worker = [&] {
    for (size_t i = next++; i < jobs.size() && !failed; i = next++) {
      if (before_job) before_job(i);
      absl::Status st = fn(jobs[i]);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed.exchange(true)) first_error = st;
        return;
      }
    }
  };
  // A refused thread is one worker fewer, never an exception (in engramd's publish loop an exception would be
  // std::terminate).
  RunWorkers(threads, [&](bool /*own_thread*/) { worker(); });
  return first_error;
}

uint64_t Combine(const std::vector<uint64_t>& hashes) {
  return XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t));
}

}  // namespace

std::unique_ptr<ColdPrefetch> StartColdPrefetch(const Checkpoint& ckpt, const std::vector<LayerRows>& layers,
                                                int threads, int readers, std::string* why_not) {
  if (readers <= 0) return nullptr;
  const int64_t D = ckpt.config().head_dim, S = D / 32;
  std::vector<std::vector<uint64_t>> hashes;
  const std::vector<Job> jobs = MakeJobs(layers, &hashes);
  std::vector<std::vector<PrefetchRange>> ranges;
  uint64_t bytes = 0;
  for (const Job& j : jobs) {
    const LayerRows& l = layers[j.entry];
    if (l.layer < 0 || l.layer >= ckpt.config().n_layers()) return nullptr;  // the fill reports it
    const EngramTensors t = ckpt.engram(l.layer);
    if (!t.embed_weight || !t.embed_scale) return nullptr;
    const auto first = static_cast<uint64_t>(l.row_begin + j.first_row);
    const auto rows = static_cast<uint64_t>(j.rows);
    ranges.push_back({{t.embed_weight.file, t.embed_weight.info, first * D, rows * D},
                      {t.embed_scale.file, t.embed_scale.info, first * S, rows * S}});
    bytes += rows * static_cast<uint64_t>(D + S);
  }
  if (!ColdPrefetch::WorthStarting(ranges, 16, why_not)) return nullptr;
  // Ahead of the workers by up to ColdPrefetch::kWindowBytes: room to read while the destination is still being
  // reserved, bounded so that the page cache is not asked to hold a table.
  const uint64_t per_job = bytes / std::max<size_t>(1, jobs.size());
  return std::make_unique<ColdPrefetch>(std::move(ranges), readers, ColdPrefetch::WindowJobs(per_job, threads));
}

absl::Status ReadShardRecords(const Checkpoint& ckpt, const std::vector<LayerRows>& layers, uint8_t* dst, int threads,
                              std::vector<uint64_t>* checksums, std::atomic<uint64_t>* rows_done,
                              const ShardFillOptions& fill) {
  const int64_t D = ckpt.config().head_dim, S = D / 32, rb = D + S;
  std::vector<EngramTensors> tensors;
  for (const auto& l : layers) {
    if (l.layer < 0 || l.layer >= ckpt.config().n_layers() || l.row_begin < 0 || l.row_end < l.row_begin) {
      return absl::InvalidArgumentError(absl::StrCat("shard rows of layer index ", l.layer, " are not valid"));
    }
    tensors.push_back(ckpt.engram(l.layer));
    if (!tensors.back().embed_weight || !tensors.back().embed_scale) {
      return absl::NotFoundError(absl::StrCat("layer ", tensors.back().layer_id, ": table tensors missing"));
    }
  }
  std::vector<std::vector<uint64_t>> hashes;
  const std::vector<Job> jobs = MakeJobs(layers, &hashes);
  // Sub-chunks small enough to stay in cache: the pread lands in a cache-resident buffer, the repack reads it from
  // there and the checksum reads the fresh records from there too.
  // At most a job's rows (a larger step buys nothing and its buffer could not be allocated: an exception, and in
  // engramd std::terminate, from ENGRAM_PUBLISH_SUB_ROWS=1e12).
  const int64_t kSubRows = fill.sub_rows > 0 ? std::min(fill.sub_rows, kChecksumChunkRows) : 1024;
  // Not in the page cache: readers stream the jobs' ranges in order ahead of the workers (io/cold_prefetch.h),
  // started by the caller (before it reserved dst) or here.
  std::unique_ptr<ColdPrefetch> own_prefetch;
  ColdPrefetch* prefetch = fill.cold_prefetch;
  if (prefetch == nullptr && fill.cold_readers > 0) {
    own_prefetch = StartColdPrefetch(ckpt, layers, threads, fill.cold_readers);
    prefetch = own_prefetch.get();
  }
  std::function<void(size_t)> before_job;
  if (prefetch) before_job = [&](size_t j) { prefetch->WaitForJob(j); };
  absl::Status st = RunJobs(
      jobs, threads,
      [&](const Job& j) -> absl::Status {
        const LayerRows& l = layers[j.entry];
        const EngramTensors& t = tensors[j.entry];
        thread_local std::vector<uint8_t> weight_buf, scale_buf, pack_buf;
        const bool stream = fill.stream_stores;
        weight_buf.resize(static_cast<size_t>(kSubRows * D));
        scale_buf.resize(static_cast<size_t>(kSubRows * S));
        pack_buf.resize(stream ? static_cast<size_t>(kSubRows * rb) : 0);
        XXH3_state_t* hash = XXH3_createState();
        XXH3_64bits_reset(hash);
        uint8_t* out = dst + l.dst_offset + static_cast<uint64_t>(j.first_row * rb);
        const int64_t first_global = l.row_begin + j.first_row;
        absl::Status r;
        uint64_t streamed = 0;
        for (int64_t done = 0; done < j.rows; done += kSubRows) {  // every failure breaks out
          const int64_t n = std::min(kSubRows, j.rows - done);
          const int64_t row = first_global + done;
          const size_t bytes = static_cast<size_t>(n * rb);
          uint8_t* const rec = out + done * rb;
          if (fill.before_write) r = fill.before_write(rec, bytes);
          if (r.ok()) {
            r = t.embed_scale.file->ReadRange(*t.embed_scale.info, static_cast<uint64_t>(row * S), scale_buf.data(),
                                              static_cast<uint64_t>(n * S));
          }
          if (!r.ok()) break;
          // The records of this step are assembled at `packed`: in place, or (streamed) in the cache-resident buffer,
          // hashed there and then written out with non-temporal stores.
          uint8_t* const packed = stream ? pack_buf.data() : rec;
          r = t.embed_weight.file->ReadRange(*t.embed_weight.info, static_cast<uint64_t>(row * D), weight_buf.data(),
                                             static_cast<uint64_t>(n * D));
          if (!r.ok()) break;
          PackRecords(weight_buf.data(), scale_buf.data(), n, D, packed);
          XXH3_64bits_update(hash, packed, bytes);
          if (stream) {
            StreamCopy(rec, packed, static_cast<int64_t>(bytes));
            streamed += bytes;
          }
        }
        if (stream) StreamFence();  // this job's records are in memory before it is counted done
        if (fill.streamed_bytes) fill.streamed_bytes->fetch_add(streamed, std::memory_order_relaxed);
        hashes[j.entry][j.chunk] = XXH3_64bits_digest(hash);
        XXH3_freeState(hash);
        if (!r.ok()) return r;
        if (fill.drop_cache) {
          t.embed_weight.file->DropCache(*t.embed_weight.info, static_cast<uint64_t>(first_global * D),
                                         static_cast<uint64_t>(j.rows * D));
          t.embed_scale.file->DropCache(*t.embed_scale.info, static_cast<uint64_t>(first_global * S),
                                        static_cast<uint64_t>(j.rows * S));
        }
        if (rows_done) rows_done->fetch_add(static_cast<uint64_t>(j.rows), std::memory_order_relaxed);
        return absl::OkStatus();
      },
      before_job);
  if (prefetch && fill.prefetched_bytes) fill.prefetched_bytes->fetch_add(prefetch->bytes_streamed());
  own_prefetch.reset();  // joins the readers
  if (!st.ok()) return st;
  if (checksums) {
    checksums->clear();
    for (const auto& h : hashes) checksums->push_back(Combine(h));
  }
  return absl::OkStatus();
}

std::function<void()> ShardCacheDropper(const Checkpoint& ckpt, const std::vector<LayerRows>& layers) {
  struct Range {
    TensorRef tensor;
    uint64_t offset, bytes;
  };
  std::vector<Range> ranges;
  const int64_t D = ckpt.config().head_dim, S = D / 32;
  for (const auto& l : layers) {
    if (l.layer < 0 || l.layer >= ckpt.config().n_layers() || l.row_end <= l.row_begin) continue;
    const EngramTensors t = ckpt.engram(l.layer);
    if (!t.embed_weight || !t.embed_scale) continue;
    const auto rows = static_cast<uint64_t>(l.row_end - l.row_begin);
    ranges.push_back({t.embed_weight, static_cast<uint64_t>(l.row_begin * D), rows * static_cast<uint64_t>(D)});
    ranges.push_back({t.embed_scale, static_cast<uint64_t>(l.row_begin * S), rows * static_cast<uint64_t>(S)});
  }
  return [ranges = std::move(ranges)] {
    for (const Range& r : ranges) r.tensor.file->DropCache(*r.tensor.info, r.offset, r.bytes);
  };
}

absl::Status ReadRecordRow(const Checkpoint& ckpt, int64_t layer, int64_t row, uint8_t* record) {
  ShardFillOptions one_row;
  one_row.cold_readers = 0;  // 264 bytes: no readers, no probes
  return ReadShardRecords(ckpt, {LayerRows{layer, row, row + 1, 0}}, record, /*threads=*/1, nullptr, nullptr, one_row);
}

std::vector<uint64_t> ChecksumRecords(const std::vector<LayerRows>& layers, int64_t record_bytes, const uint8_t* base,
                                      int threads, std::atomic<uint64_t>* rows_done) {
  std::vector<std::vector<uint64_t>> hashes;
  const std::vector<Job> jobs = MakeJobs(layers, &hashes);
  (void)RunJobs(jobs, threads, [&](const Job& j) {
    const LayerRows& l = layers[j.entry];
    hashes[j.entry][j.chunk] = XXH3_64bits(base + l.dst_offset + static_cast<uint64_t>(j.first_row * record_bytes),
                                           static_cast<size_t>(j.rows * record_bytes));
    if (rows_done) rows_done->fetch_add(static_cast<uint64_t>(j.rows), std::memory_order_relaxed);
    return absl::OkStatus();
  });
  std::vector<uint64_t> out;
  for (const auto& h : hashes) out.push_back(Combine(h));
  return out;
}

}  // namespace engram
