#include "client/lookup_engine.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "client/dp_engine.h"
#include "model/reference.h"
#include "base/status_macros.h"

#ifdef ENGRAM_HAVE_CUDA
#include "client/device_engine.h"
#endif

namespace engram::client {
namespace {

// The CPU backend: the reference functions (model/reference.h) over the table's host records. Staging buffers are
// allocated on the first Prefetch (an engine used only for Hash/Lookup holds no staging memory).
class CpuEngine final : public LookupEngine {
 public:
  CpuEngine(const Table& t, int32_t max_tokens) : t_(t), max_tokens_(max_tokens) {}
  Backend backend() const override { return Backend::kCpu; }

  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl, const int32_t* lookback,
                    const uint8_t* dead, int32_t T, int32_t R, int32_t* out) override {
    RETURN_IF_ERROR(CheckTokens(T));
    if (R < 1 || qsl == nullptr || (T > 0 && (tokens == nullptr || positions == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("hash: null input or no request");
    }
    const size_t nl = t_.layout().max_ngram() > 1 ? static_cast<size_t>(t_.layout().max_ngram() - 1) : 0;
    HashBatch b{{tokens, static_cast<size_t>(T)},
                {positions, static_cast<size_t>(T)},
                {qsl, static_cast<size_t>(R) + 1},
                lookback ? std::span<const int32_t>(lookback, static_cast<size_t>(R) * nl) : std::span<const int32_t>(),
                dead ? std::span<const uint8_t>(dead, static_cast<size_t>(T)) : std::span<const uint8_t>()};
    return HashIdsCpu(t_.layout(), t_.token_map(), b,
                      {out, static_cast<size_t>(T) * t_.layers().size() * static_cast<size_t>(t_.n_cols())});
  }

  absl::Status Lookup(int l, const int32_t* ids, int32_t T, int64_t stride, void* out, bool packed) override {
    RETURN_IF_ERROR(CheckTokens(T));
    if (l < 0 || l >= static_cast<int>(t_.layers().size())) {
      return absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", t_.layers().size(), ")"));
    }
    const int64_t C = t_.n_cols();
    if (ids == nullptr || out == nullptr || stride < C) return absl::InvalidArgumentError("lookup: null or bad stride");
    if (t_.records(l) == nullptr) {
      return absl::FailedPreconditionError("the table has no host records (a DEVICE table lives on the GPU only)");
    }
    const auto& li = t_.layers()[static_cast<size_t>(l)];
    const RecordTable records{t_.records(l), li.row_begin, li.row_end, t_.head_dim()};
    std::vector<int32_t> flat(static_cast<size_t>(T * C));
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t c = 0; c < C; ++c) flat[static_cast<size_t>(i * C + c)] = ids[i * stride + c];
    }
    const size_t n = flat.size();
    if (packed) {
      const size_t rb = static_cast<size_t>(t_.head_dim() + t_.head_dim() / 32);
      return LookupPackedCpu(records, flat, {static_cast<uint8_t*>(out), n * rb});
    }
    return LookupBf16Cpu(records, flat, {static_cast<uint16_t*>(out), n * static_cast<size_t>(t_.head_dim())});
  }

  absl::Status Gate(const GateInputs& g) override {
    if (g.hidden == nullptr || g.kv == nullptr || g.q_weight == nullptr || g.k_weight == nullptr || g.out == nullptr) {
      return absl::InvalidArgumentError("gate: null input");
    }
    const size_t T = static_cast<size_t>(g.num_tokens), HC = static_cast<size_t>(g.hc_mult), D = static_cast<size_t>(g.dim);
    return GateCpu({g.num_tokens, g.hc_mult, g.dim, g.eps}, {g.hidden, T * HC * D}, {g.kv, T * (HC + 1) * D},
                   {g.q_weight, HC * D}, {g.k_weight, HC * D},
                   g.mask ? std::span<const uint8_t>(g.mask, T) : std::span<const uint8_t>(), {g.out, T * HC * D});
  }

  absl::Status Prefetch(const int32_t* hash_ids, int32_t T) override {
    const int L = static_cast<int>(t_.layers().size());
    if (hash_ids == nullptr && T > 0) return absl::InvalidArgumentError("prefetch: null hash ids");
    AllocateStaging();
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
    const_cast<CpuEngine*>(this)->AllocateStaging();
    return l < 0 || l >= static_cast<int>(staging_.size()) ? nullptr
                                                           : const_cast<uint16_t*>(staging_[static_cast<size_t>(l)].data());
  }

 private:
  void AllocateStaging() {
    if (!staging_.empty()) return;
    staging_.resize(t_.layers().size());
    for (auto& s : staging_) s.resize(static_cast<size_t>(max_tokens_) * t_.n_cols() * t_.head_dim());
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

absl::StatusOr<std::unique_ptr<LookupEngine>> LookupEngine::Create(const Table& table, int32_t max_tokens,
                                                                   void* stream) {
  if (max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  if (table.mode() == Mode::kDpSharded) return CreateDpEngine(table, max_tokens, stream);  // joins the DP group
  if (table.backend() == Backend::kCuda) {
#ifdef ENGRAM_HAVE_CUDA
    ASSIGN_OR_RETURN(auto e, DeviceEngine::Create(table, max_tokens, static_cast<cudaStream_t>(stream)));
    return std::unique_ptr<LookupEngine>(std::move(e));
#else
    return absl::InternalError("a CUDA table in a build without CUDA");
#endif
  }
  return CreateOnHost(table, max_tokens);
}

absl::StatusOr<std::unique_ptr<LookupEngine>> LookupEngine::CreateOnHost(const Table& table, int32_t max_tokens) {
  if (max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  return std::unique_ptr<LookupEngine>(new CpuEngine(table, max_tokens));
}

}  // namespace engram::client
