#include "engram/lookup_engine.h"

#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/dp/dp_engine.h"
#include "client/fault_points.h"
#include "model/reference.h"

#ifdef ENGRAM_HAVE_CUDA
#include "client/engine/device_engine.h"
#endif

namespace engram::client {
namespace {

// The CPU backend: the reference functions (model/reference.h) over the table's host records. Staging buffers are
// allocated on the first Prefetch (an engine used only for Hash/Lookup holds no staging memory).
class CpuEngine final : public LookupEngine {
 public:
  CpuEngine(const Table& t, int32_t max_tokens) : t_(t), max_tokens_(max_tokens) {}
  Backend backend() const override { return Backend::kCpu; }

  using LookupEngine::Hash;
  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl, const int32_t* lookback,
                    const uint8_t* lookback_dead, const uint8_t* dead, int32_t T, int32_t R, int32_t* out) override {
    RETURN_IF_ERROR(CheckTokens(T));
    if (R < 1 || qsl == nullptr || (T > 0 && (tokens == nullptr || positions == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("hash: null input or no request");
    }
    const size_t nl = t_.layout().max_ngram() > 1 ? static_cast<size_t>(t_.layout().max_ngram() - 1) : 0;
    HashBatch b{{tokens, static_cast<size_t>(T)},
                {positions, static_cast<size_t>(T)},
                {qsl, static_cast<size_t>(R) + 1},
                lookback ? std::span<const int32_t>(lookback, static_cast<size_t>(R) * nl) : std::span<const int32_t>(),
                dead ? std::span<const uint8_t>(dead, static_cast<size_t>(T)) : std::span<const uint8_t>(),
                lookback_dead ? std::span<const uint8_t>(lookback_dead, static_cast<size_t>(R) * nl)
                              : std::span<const uint8_t>()};
    return HashIdsCpu(t_.layout(), t_.token_map(), b,
                      {out, static_cast<size_t>(T) * t_.layers().size() * static_cast<size_t>(t_.n_cols())});
  }

  absl::Status Lookup(int l, const int32_t* ids, int32_t T, int64_t stride, void* out, bool packed) override {
    RETURN_IF_ERROR(CheckTokens(T));
    if (l < 0 || l >= static_cast<int>(t_.layers().size())) {
      return absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", t_.layers().size(), ")"));
    }
    if (ids == nullptr || out == nullptr || stride < t_.n_cols()) {
      return absl::InvalidArgumentError("lookup: null or bad stride");
    }
    return LookupInto(l, ids, T, stride, out, packed, LookupWindow{});
  }

  absl::Status LookupInto(int l, const int32_t* ids, int32_t T, int64_t stride, void* out, bool packed,
                          const LookupWindow& window) override {
    ASSIGN_OR_RETURN(const LookupWindow w, CheckWindow(t_, l, ids, T, max_tokens_, stride, out, packed, window));
    if (T == 0) return absl::OkStatus();
    if (t_.records(l) == nullptr) {
      return absl::FailedPreconditionError("the table has no host records (a DEVICE table lives on the GPU only)");
    }
    const auto& li = t_.layers()[static_cast<size_t>(l)];
    const RecordTable records{t_.records(l), li.row_begin, li.row_end, t_.head_dim()};
    const int64_t D = t_.head_dim(), rb = D + D / 32, C = w.num_cols;
    const int64_t row = packed ? rb : D;  // output units (bytes or bf16 values) per row
    const int64_t token_stride = w.out_token_stride > 0 ? w.out_token_stride : C * row;
    std::vector<int32_t> narrowed(w.ids_int64 ? static_cast<size_t>(C) : 0);
    const auto* ids64 = reinterpret_cast<const int64_t*>(ids);
    for (int64_t i = 0; i < T; ++i) {  // one token's window at a time: no buffer sized by the caller's count
      std::span<const int32_t> token_ids(ids + i * stride + w.col_begin, static_cast<size_t>(C));
      if (w.ids_int64) {
        for (int64_t c = 0; c < C; ++c) {
          const int64_t id = ids64[i * stride + w.col_begin + c];
          narrowed[static_cast<size_t>(c)] = id >= 0 && id <= INT32_MAX ? static_cast<int32_t>(id) : -1;
        }
        token_ids = narrowed;
      }
      if (packed) {
        uint8_t* dst = static_cast<uint8_t*>(out) + i * token_stride;
        RETURN_IF_ERROR(LookupPackedCpu(records, token_ids, {dst, static_cast<size_t>(C * rb)}));
      } else {
        uint16_t* dst = static_cast<uint16_t*>(out) + i * token_stride;
        RETURN_IF_ERROR(LookupBf16Cpu(records, token_ids, {dst, static_cast<size_t>(C * D)}));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Gate(const GateInputs& g) override {
    if (g.hidden == nullptr || g.kv == nullptr || g.q_weight == nullptr || g.k_weight == nullptr || g.out == nullptr) {
      return absl::InvalidArgumentError("gate: null input");
    }
    const size_t T = static_cast<size_t>(g.num_tokens), HC = static_cast<size_t>(g.hc_mult),
                 D = static_cast<size_t>(g.dim);
    return GateCpu({g.num_tokens, g.hc_mult, g.dim, g.eps}, {g.hidden, T * HC * D}, {g.kv, T * (HC + 1) * D},
                   {g.q_weight, HC * D}, {g.k_weight, HC * D},
                   g.mask ? std::span<const uint8_t>(g.mask, T) : std::span<const uint8_t>(), {g.out, T * HC * D});
  }

  absl::Status Prefetch(const int32_t* hash_ids, int32_t T) override {
    const int L = static_cast<int>(t_.layers().size());
    if (hash_ids == nullptr && T > 0) return absl::InvalidArgumentError("prefetch: null hash ids");
    RETURN_IF_ERROR(AllocateStaging());
    for (int l = 0; l < L; ++l) {
      RETURN_IF_ERROR(Lookup(l, hash_ids + static_cast<int64_t>(l) * t_.n_cols(), T, L * t_.n_cols(),
                             staging_[static_cast<size_t>(l)].data(), false));
    }
    return absl::OkStatus();
  }
  absl::Status Wait(int l) override {
    if (l < 0 || l >= static_cast<int>(staging_.size())) return absl::InvalidArgumentError("wait: layer out of range");
    return absl::OkStatus();
  }
  uint16_t* staging(int l) const override {
    if (!const_cast<CpuEngine*>(this)->AllocateStaging().ok()) return nullptr;
    return l < 0 || l >= static_cast<int>(staging_.size())
               ? nullptr
               : const_cast<uint16_t*>(staging_[static_cast<size_t>(l)].data());
  }

 private:
  // Every layer's buffer or none: a failure part way leaves the engine as it was (the next call tries again).
  absl::Status AllocateStaging() {
    if (!staging_.empty()) return absl::OkStatus();
    const size_t per_layer = static_cast<size_t>(max_tokens_) * t_.n_cols() * t_.head_dim();
    std::vector<std::vector<uint16_t>> made(t_.layers().size());
    try {
      for (size_t l = 0; l < made.size(); ++l) {
        if (Fault(FaultPoint::kCpuStaging, static_cast<int64_t>(l))) throw std::bad_alloc();
        made[l].resize(per_layer);
      }
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("prefetch: the staging buffers (", made.size(), " layers of ", per_layer * sizeof(uint16_t),
                       " bytes, for max_tokens ", max_tokens_, ") could not be allocated; the engine is unchanged"));
    }
    staging_ = std::move(made);
    return absl::OkStatus();
  }
  absl::Status CheckTokens(int32_t T) const {
    if (T < 0 || T > max_tokens_) {
      return absl::InvalidArgumentError(absl::StrCat(T, " tokens; the engine was sized for ", max_tokens_));
    }
    return absl::OkStatus();
  }
  const Table& t_;
  int32_t max_tokens_;
  std::vector<std::vector<uint16_t>> staging_;
};

}  // namespace

absl::StatusOr<LookupWindow> LookupEngine::CheckWindow(const Table& table, int l, const int32_t* ids,
                                                       int32_t num_tokens, int32_t max_tokens, int64_t ids_stride,
                                                       const void* out, bool packed, const LookupWindow& window) const {
  if (num_tokens < 0 || num_tokens > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens; the engine was sized for ", max_tokens));
  }
  const int layers = static_cast<int>(table.layers().size());
  if (l < 0 || l >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", layers, ")"));
  }
  const int64_t C = table.n_cols();
  LookupWindow w = window;
  if (w.num_cols < 0) w.num_cols = static_cast<int32_t>(C - w.col_begin);
  if (w.col_begin < 0 || w.num_cols < 1 || w.col_begin + static_cast<int64_t>(w.num_cols) > C) {
    return absl::InvalidArgumentError(absl::StrCat("lookup window: columns [", window.col_begin, ", ",
                                                   window.col_begin + static_cast<int64_t>(window.num_cols),
                                                   ") outside the table's [0, ", C, ")"));
  }
  if (ids_stride < w.col_begin + static_cast<int64_t>(w.num_cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lookup: ids stride ", ids_stride, " < the window's end ", w.col_begin + w.num_cols));
  }
  const int64_t D = table.head_dim(), row = packed ? D + D / 32 : D;
  if (w.out_token_stride < 0 || (w.out_token_stride > 0 && w.out_token_stride < w.num_cols * row)) {
    return absl::InvalidArgumentError(absl::StrCat("lookup: output token stride ", w.out_token_stride,
                                                   " is less than one token's ", w.num_cols * row,
                                                   packed ? " bytes" : " bf16 values"));
  }
  if (num_tokens > 0 && (ids == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError("lookup: null ids or output");
  }
  return w;
}

absl::Status LookupEngine::LookupInto(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                                      bool packed, const LookupWindow& window) {
  // The dense full window is the plain lookup (the engines of a DP_SHARDED table, whose exchange writes whole
  // tokens, take only that); other engines override this. Every argument is checked here first: a refusal must
  // not reach the group's collective (where a failure aborts the step for every member).
  const Table* t = table_for_checks();
  if (t == nullptr) return absl::InternalError("lookup_into: this engine does not say which table it serves");
  ASSIGN_OR_RETURN(const LookupWindow w,
                   CheckWindow(*t, l, ids, num_tokens, max_tokens_for_checks(), ids_stride, out, packed, window));
  const int64_t C = t->n_cols(), D = t->head_dim(), row = packed ? D + D / 32 : D;
  const bool dense = w.col_begin == 0 && w.num_cols == C && (w.out_token_stride == 0 || w.out_token_stride == C * row);
  if (!dense || w.ids_int64) {
    return absl::UnimplementedError(
        "this engine (a DP_SHARDED table's) writes whole tokens from int32 ids: a lookup window, an output stride "
        "or int64 ids are not supported");
  }
  return Lookup(l, ids, num_tokens, ids_stride, out, packed);
}

absl::StatusOr<std::unique_ptr<LookupEngine>> LookupEngine::Create(const Table& table, int32_t max_tokens,
                                                                   void* stream) {
  return Create(table, max_tokens, stream, true);
}

absl::StatusOr<std::unique_ptr<LookupEngine>> LookupEngine::Create(const Table& table, int32_t max_tokens, void* stream,
                                                                   bool staging) {
  if (max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  if (table.mode() == Mode::kDpSharded) return CreateDpEngine(table, max_tokens, stream);  // joins the DP group
  if (table.backend() == Backend::kCuda) {
#ifdef ENGRAM_HAVE_CUDA
    ASSIGN_OR_RETURN(auto e, DeviceEngine::Create(table, max_tokens, static_cast<cudaStream_t>(stream), staging));
    table.NoteEngineChoice(e->choice());
    return std::unique_ptr<LookupEngine>(std::move(e));
#else
    return absl::InternalError("a CUDA table in a build without CUDA");
#endif
  }
  ASSIGN_OR_RETURN(auto e, CreateOnHost(table, max_tokens));
  table.NoteEngineChoice(e->choice());
  return e;
}

absl::StatusOr<std::unique_ptr<LookupEngine>> LookupEngine::CreateOnHost(const Table& table, int32_t max_tokens) {
  if (max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  return std::unique_ptr<LookupEngine>(new CpuEngine(table, max_tokens));
}

}  // namespace engram::client
