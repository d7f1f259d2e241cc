// DeviceLayout: owns the device copies of a model's layout tables (multipliers, primes, offsets, fast-modulo
// magics) and token map, and hands out the LayoutView the hash kernel reads. Upload once per process and model;
// the view stays valid while the DeviceLayout lives. Not thread-safe for mutation; the view may be used from any
// thread or stream.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/engram_kernels.h"
#include "model/layout.h"
#include "model/token_map.h"

namespace engram::kernels {

class DeviceLayout {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceLayout>> Upload(const Layout& layout, const TokenMap& token_map);
  ~DeviceLayout();
  DeviceLayout(const DeviceLayout&) = delete;
  DeviceLayout& operator=(const DeviceLayout&) = delete;

  const LayoutView& view() const { return view_; }

 private:
  DeviceLayout() = default;
  void* block_ = nullptr;  // one device allocation holding every table
  LayoutView view_;
};

// Status for a CUDA runtime error, naming what was being done. The code says whose fault it is, as on the CPU
// engine: a bad argument (cudaErrorInvalidValue, ...) is INVALID_ARGUMENT, out of memory RESOURCE_EXHAUSTED, no
// usable device UNAVAILABLE, anything else (an illegal address, a failed launch) INTERNAL.
absl::Status CudaStatus(cudaError_t err, const char* what);

}  // namespace engram::kernels
