// Tensor element types as safetensors names them, with their sizes. Pure data; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace engram {

enum class DType {
  kBool,
  kU8,
  kI8,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kI64,
  kU64,
  kF64
};

std::optional<DType> ParseDType(std::string_view name);  // "F8_E4M3", "BF16", ...
std::string DTypeName(DType d);
int64_t DTypeSize(DType d);

}  // namespace engram
