#include "client/device_engine.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace engram::client {

absl::StatusOr<std::unique_ptr<DeviceEngine>> DeviceEngine::Create(const Table& table, int32_t max_tokens,
                                                                   cudaStream_t stream) {
  if (table.backend() != Backend::kCuda) {
    return absl::FailedPreconditionError("the table has the CPU backend (no usable GPU): use LookupEngine::Create, which gives the CPU engine");
  }
  if (max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  std::unique_ptr<DeviceEngine> e(new DeviceEngine());
  e->table_ = &table;
  e->stream_ = stream;
  e->max_tokens_ = max_tokens;
  ASSIGN_OR_RETURN(e->layout_, kernels::DeviceLayout::Upload(table.layout(), table.token_map()));
  std::vector<kernels::LayerTable> tables;
  for (size_t l = 0; l < table.layers().size(); ++l) {
    tables.push_back({table.device_records(static_cast<int>(l)), table.layers()[l].row_begin, table.layers()[l].row_end});
  }
  RETURN_IF_ERROR(e->prefetcher_.Init(tables, max_tokens, static_cast<int32_t>(table.n_cols()),
                                      static_cast<int32_t>(table.head_dim())));
  e->sort_bytes_ = kernels::LookupSortScratchBytes(static_cast<int64_t>(max_tokens) * table.n_cols());
  RETURN_IF_ERROR(kernels::CudaStatus(cudaMalloc(&e->sort_scratch_, e->sort_bytes_), "sort scratch"));
  return e;
}

DeviceEngine::~DeviceEngine() {
  if (sort_scratch_ != nullptr) cudaFree(sort_scratch_);
}

absl::Status DeviceEngine::Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl,
                                const int32_t* lookback, const uint8_t* dead, int32_t num_tokens,
                                int32_t num_requests, int32_t* out) {
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens; the engine was sized for ", max_tokens_));
  }
  kernels::HashArgs a{tokens, positions, qsl, lookback, dead, num_tokens, num_requests, out, nullptr};
  return kernels::CudaStatus(kernels::LaunchHash(layout_->view(), a, stream_), "hash kernel");
}

absl::Status DeviceEngine::Lookup(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                                  bool packed) {
  if (l < 0 || l >= static_cast<int>(table_->layers().size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer index ", l, " out of range"));
  }
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens; the engine was sized for ", max_tokens_));
  }
  kernels::LookupArgs a;
  a.records = table_->device_records(l);
  a.row_begin = table_->layers()[static_cast<size_t>(l)].row_begin;
  a.row_end = table_->layers()[static_cast<size_t>(l)].row_end;
  a.head_dim = static_cast<int32_t>(table_->head_dim());
  a.ids = ids;
  a.num_tokens = num_tokens;
  a.num_cols = static_cast<int32_t>(table_->n_cols());
  a.ids_stride = ids_stride;
  a.out = out;
  a.packed = packed;
  a.sort_scratch = sort_scratch_;
  a.sort_scratch_bytes = sort_bytes_;
  return kernels::CudaStatus(kernels::LaunchLookup(a, stream_), "lookup kernel");
}

absl::Status DeviceEngine::Gate(const GateInputs& g) {
  kernels::GateArgs a{g.hidden, g.kv, g.q_weight, g.k_weight, g.mask, g.out, g.num_tokens, g.hc_mult, g.dim, g.eps};
  return kernels::CudaStatus(kernels::LaunchGate(a, stream_), "gate kernel");
}

absl::Status DeviceEngine::Prefetch(const int32_t* hash_ids, int32_t num_tokens) {
  return prefetcher_.Prefetch(hash_ids, num_tokens, stream_);
}

absl::Status DeviceEngine::Wait(int l) { return prefetcher_.Wait(l, stream_); }

}  // namespace engram::client
