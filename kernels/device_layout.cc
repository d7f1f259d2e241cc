#include "kernels/device_layout.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace engram::kernels {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevice:
      return absl::InvalidArgumentError(msg);  // the caller's mistake, as the CPU engine reports it
    case cudaErrorMemoryAllocation:
    case cudaErrorLaunchOutOfResources: return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable: return absl::UnavailableError(msg);
    case cudaErrorNotSupported: return absl::UnimplementedError(msg);
    default: return absl::InternalError(msg);  // a fault of ours or the device's (illegal address, launch failure, ...)
  }
}

absl::StatusOr<std::unique_ptr<DeviceLayout>> DeviceLayout::Upload(const Layout& layout, const TokenMap& map) {
  const int64_t L = layout.n_layers(), N = layout.max_ngram(), C = layout.n_cols();
  const int64_t pad = layout.config().pad_token_id;
  if (pad < 0 || pad >= map.raw_size()) return absl::InvalidArgumentError("pad token id is outside the token map");
  // Host image of the device block: int64 tables first (8-byte aligned), then the int32 token map.
  std::vector<int64_t> i64;
  for (int64_t l = 0; l < L; ++l) i64.insert(i64.end(), layout.multipliers(l).begin(), layout.multipliers(l).end());
  for (int64_t l = 0; l < L; ++l) i64.insert(i64.end(), layout.primes(l).begin(), layout.primes(l).end());
  for (int64_t l = 0; l < L; ++l) i64.insert(i64.end(), layout.offsets(l).begin(), layout.offsets(l).end());
  for (int64_t l = 0; l < L; ++l) {
    for (uint64_t m : layout.mod_magics(l)) i64.push_back(static_cast<int64_t>(m));
  }
  const size_t table_bytes = i64.size() * 8, map_bytes = map.ids().size() * 4;
  std::unique_ptr<DeviceLayout> d(new DeviceLayout());
  if (auto st = CudaStatus(cudaMalloc(&d->block_, table_bytes + map_bytes), "cudaMalloc(layout)"); !st.ok()) {
    return st;
  }
  auto* base = static_cast<uint8_t*>(d->block_);
  if (auto st = CudaStatus(cudaMemcpy(base, i64.data(), table_bytes, cudaMemcpyHostToDevice), "upload layout");
      !st.ok()) {
    return st;
  }
  if (auto st = CudaStatus(cudaMemcpy(base + table_bytes, map.ids().data(), map_bytes, cudaMemcpyHostToDevice),
                           "upload token map");
      !st.ok()) {
    return st;
  }
  auto* t = reinterpret_cast<int64_t*>(base);
  LayoutView& v = d->view_;
  v.n_layers = static_cast<int32_t>(L);
  v.max_ngram = static_cast<int32_t>(N);
  v.n_heads = static_cast<int32_t>(layout.config().n_heads);
  v.multipliers = t;
  v.primes = t + L * N;
  v.offsets = t + L * N + L * C;
  v.magics = reinterpret_cast<const uint64_t*>(t + L * N + 2 * L * C);
  v.token_map = reinterpret_cast<const int32_t*>(base + table_bytes);
  v.vocab = static_cast<int32_t>(map.raw_size());
  v.pad_compressed = map[pad];
  return d;
}

DeviceLayout::~DeviceLayout() {
  if (block_ != nullptr) cudaFree(block_);
}

}  // namespace engram::kernels
