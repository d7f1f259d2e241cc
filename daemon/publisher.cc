#include "daemon/publisher.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/reference.h"
#include "shm/segment.h"
#include "xxhash.h"

namespace engram::daemon {
namespace {

struct Job {
  int64_t layer;      // index into the descriptor's layers
  int64_t first_row;  // relative to the layer's row_begin
  int64_t rows;
  int64_t chunk;      // checksum chunk index within the layer
};

std::vector<Job> MakeJobs(const engram::v1::SegmentDescriptor& d) {
  std::vector<Job> jobs;
  for (int l = 0; l < d.layers_size(); ++l) {
    const int64_t rows = d.layers(l).row_end() - d.layers(l).row_begin();
    for (int64_t r = 0, c = 0; r < rows; r += kChecksumChunkRows, ++c) {
      jobs.push_back({l, r, std::min(kChecksumChunkRows, rows - r), c});
    }
  }
  return jobs;
}

uint64_t CombineChunkHashes(const std::vector<uint64_t>& hashes) {
  return XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t));
}

// Runs `fn(job)` over every job on `threads` workers; the first error wins and stops the rest.
absl::Status RunJobs(const std::vector<Job>& jobs, int threads, const std::function<absl::Status(const Job&)>& fn) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Status first_error;
  std::mutex mu;
  auto worker = [&] {
    for (size_t i = next++; i < jobs.size() && !failed; i = next++) {
      absl::Status st = fn(jobs[i]);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed.exchange(true)) first_error = st;
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < std::max(1, threads); ++t) pool.emplace_back(worker);
  for (auto& th : pool) th.join();
  return first_error;
}

}  // namespace

engram::v1::SegmentDescriptor MakeDescriptor(const Checkpoint& ckpt, const Layout& layout, const TokenMap& map,
                                             const ShardRange& shard, uint64_t fingerprint) {
  const EngramConfig& c = layout.config();
  engram::v1::SegmentDescriptor d;
  d.set_fingerprint(fingerprint);
  d.set_checkpoint(ckpt.dir());
  d.set_architecture(c.architecture);
  d.set_tp_size(static_cast<int32_t>(shard.tp_size));
  d.set_tp_rank(static_cast<int32_t>(shard.tp_rank));
  d.set_col_begin(static_cast<int32_t>(shard.col_begin));
  d.set_col_end(static_cast<int32_t>(shard.col_end));
  d.set_head_dim(static_cast<int32_t>(c.head_dim));
  d.set_record_bytes(static_cast<int32_t>(c.record_bytes()));
  d.set_max_ngram(static_cast<int32_t>(c.max_ngram_size));
  d.set_n_heads(static_cast<int32_t>(c.n_heads));
  d.set_pad_token_id(c.pad_token_id);
  d.set_compressed_vocab(c.compressed_vocab_size);
  uint64_t offset = 0;  // relative to the data region; the reader adds header().data_offset
  for (int64_t l = 0; l < layout.n_layers(); ++l) {
    auto* ld = d.add_layers();
    ld->set_layer_id(c.layer_ids[l]);
    ld->set_row_begin(shard.row_begin[l]);
    ld->set_row_end(shard.row_end[l]);
    ld->set_data_offset(offset);
    const uint64_t bytes = static_cast<uint64_t>(shard.row_end[l] - shard.row_begin[l]) * c.record_bytes();
    ld->set_bytes(bytes);
    offset += bytes;
    for (int64_t v : layout.multipliers(l)) ld->add_multipliers(v);
    for (int64_t v : layout.primes(l)) ld->add_primes(v);
    for (int64_t v : layout.offsets(l)) ld->add_offsets(v);
  }
  for (int32_t v : map.ids()) d.add_token_map(v);
  return d;
}

absl::StatusOr<PublishResult> Publish(const Checkpoint& ckpt, const Layout& layout, const TokenMap& map,
                                      int64_t tp_size, int64_t tp_rank, const std::string& shm_dir,
                                      uint64_t instance_id, uint64_t epoch, int threads,
                                      std::atomic<uint64_t>* rows_done) {
  const auto t0 = std::chrono::steady_clock::now();
  auto shard = layout.Shard(tp_size, tp_rank);
  if (!shard.ok()) return shard.status();
  const uint64_t fingerprint = ckpt.Fingerprint();
  engram::v1::SegmentDescriptor desc = MakeDescriptor(ckpt, layout, map, *shard, fingerprint);
  const int64_t D = layout.config().head_dim, S = D / 32, rb = layout.record_bytes();
  uint64_t data_bytes = 0;
  for (const auto& l : desc.layers()) data_bytes += l.bytes();
  // Checksums are not known yet: reserve the descriptor's final size by filling them with a non-zero placeholder
  // (fixed64 fields serialise to the same size whatever their value).
  for (auto& l : *desc.mutable_layers()) l.set_checksum(~uint64_t{0});
  auto writer = SegmentWriter::Create(shm_dir, fingerprint, tp_size, tp_rank, desc.SerializeAsString(), data_bytes,
                                      instance_id, epoch);
  if (!writer.ok()) return writer.status();
  (*writer)->SetLoading();
  uint8_t* data = (*writer)->data();

  std::vector<EngramTensors> tensors;
  for (int64_t l = 0; l < layout.n_layers(); ++l) tensors.push_back(ckpt.engram(l));
  std::vector<std::vector<uint64_t>> chunk_hashes(static_cast<size_t>(desc.layers_size()));
  const std::vector<Job> jobs = MakeJobs(desc);
  for (const auto& j : jobs) {
    auto& v = chunk_hashes[static_cast<size_t>(j.layer)];
    v.resize(std::max<size_t>(v.size(), static_cast<size_t>(j.chunk + 1)));
  }
  // Each job (one checksum chunk of 64K rows) streams through sub-chunks small enough to stay in cache: the pread
  // lands in a cache-resident buffer, the repack reads it from there and the checksum reads the fresh records from
  // there too, so memory sees about one read of the checkpoint and one write of the segment.
  constexpr int64_t kSubRows = 1024;
  absl::Status st = RunJobs(jobs, threads, [&](const Job& j) -> absl::Status {
    const auto& ld = desc.layers(static_cast<int>(j.layer));
    const EngramTensors& t = tensors[static_cast<size_t>(j.layer)];
    if (!t.embed_weight || !t.embed_scale) {
      return absl::NotFoundError(absl::StrCat("layer ", ld.layer_id(), ": table tensors missing"));
    }
    thread_local std::vector<uint8_t> weight_buf, scale_buf;
    weight_buf.resize(static_cast<size_t>(kSubRows * D));
    scale_buf.resize(static_cast<size_t>(kSubRows * S));
    XXH3_state_t* hash = XXH3_createState();
    XXH3_64bits_reset(hash);
    uint8_t* dst = data + ld.data_offset() + static_cast<uint64_t>(j.first_row * rb);
    const int64_t first_global = ld.row_begin() + j.first_row;
    absl::Status r;
    for (int64_t done = 0; done < j.rows && r.ok(); done += kSubRows) {
      const int64_t n = std::min(kSubRows, j.rows - done);
      const int64_t row = first_global + done;
      r = t.embed_weight.file->ReadRange(*t.embed_weight.info, static_cast<uint64_t>(row * D), weight_buf.data(),
                                         static_cast<uint64_t>(n * D));
      if (r.ok()) {
        r = t.embed_scale.file->ReadRange(*t.embed_scale.info, static_cast<uint64_t>(row * S), scale_buf.data(),
                                          static_cast<uint64_t>(n * S));
      }
      if (!r.ok()) break;
      PackRecords(weight_buf.data(), scale_buf.data(), n, D, dst + done * rb);
      XXH3_64bits_update(hash, dst + done * rb, static_cast<size_t>(n * rb));
    }
    chunk_hashes[static_cast<size_t>(j.layer)][static_cast<size_t>(j.chunk)] = XXH3_64bits_digest(hash);
    XXH3_freeState(hash);
    if (!r.ok()) return r;
    t.embed_weight.file->DropCache(*t.embed_weight.info, static_cast<uint64_t>(first_global * D),
                                   static_cast<uint64_t>(j.rows * D));
    t.embed_scale.file->DropCache(*t.embed_scale.info, static_cast<uint64_t>(first_global * S),
                                  static_cast<uint64_t>(j.rows * S));
    if (rows_done) rows_done->fetch_add(static_cast<uint64_t>(j.rows), std::memory_order_relaxed);
    return absl::OkStatus();
  });
  if (!st.ok()) return st;  // the writer's destructor removes the partial segment
  for (int l = 0; l < desc.layers_size(); ++l) {
    desc.mutable_layers(l)->set_checksum(CombineChunkHashes(chunk_hashes[static_cast<size_t>(l)]));
  }
  const std::string final_desc = desc.SerializeAsString();
  // Rewrite the descriptor in place (same size) and its checksum, then READY.
  auto reopened = ReadSegmentHeader((*writer)->path());
  if (!reopened.ok()) return reopened.status();
  if (final_desc.size() != reopened->desc_bytes) return absl::InternalError("descriptor size changed");
  uint8_t* base = data - reopened->data_offset;
  std::memcpy(base + reopened->desc_offset, final_desc.data(), final_desc.size());
  reinterpret_cast<SegmentHeader*>(base)->desc_checksum = XXH3_64bits(final_desc.data(), final_desc.size());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (auto f = (*writer)->Finish(seconds); !f.ok()) return f;
  return PublishResult{(*writer)->path(), reopened->total_bytes, seconds};
}

absl::Status VerifyChecksums(const std::string& segment_path, int threads, std::atomic<uint64_t>* rows_done) {
  auto reader = SegmentReader::Open(segment_path);
  if (!reader.ok()) return reader.status();
  engram::v1::SegmentDescriptor desc;
  if (!desc.ParseFromString((*reader)->descriptor_bytes())) {
    return absl::DataLossError(absl::StrCat(segment_path, ": descriptor does not parse"));
  }
  const int64_t rb = desc.record_bytes();
  std::vector<std::vector<uint64_t>> chunk_hashes(static_cast<size_t>(desc.layers_size()));
  const std::vector<Job> jobs = MakeJobs(desc);
  for (const auto& j : jobs) {
    auto& v = chunk_hashes[static_cast<size_t>(j.layer)];
    v.resize(std::max<size_t>(v.size(), static_cast<size_t>(j.chunk + 1)));
  }
  const uint8_t* data = (*reader)->data();
  absl::Status st = RunJobs(jobs, threads, [&](const Job& j) {
    const auto& ld = desc.layers(static_cast<int>(j.layer));
    chunk_hashes[static_cast<size_t>(j.layer)][static_cast<size_t>(j.chunk)] =
        XXH3_64bits(data + ld.data_offset() + static_cast<uint64_t>(j.first_row * rb), static_cast<size_t>(j.rows * rb));
    if (rows_done) rows_done->fetch_add(static_cast<uint64_t>(j.rows), std::memory_order_relaxed);
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  for (int l = 0; l < desc.layers_size(); ++l) {
    if (CombineChunkHashes(chunk_hashes[static_cast<size_t>(l)]) != desc.layers(l).checksum()) {
      return absl::DataLossError(absl::StrCat(segment_path, ": layer ", desc.layers(l).layer_id(),
                                              " checksum mismatch (the segment was modified)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace engram::daemon
