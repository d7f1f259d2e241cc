// The tensor bytes of a synthetic checkpoint and the safetensors shard writer (tools/synthetic_shard.h).
#include "tools/synthetic_shard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tools/synthetic.h"
#include "xxhash.h"

namespace engram::tools {
namespace synthetic_internal {

using nlohmann::json;

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

namespace {

uint8_t Shape(uint8_t b, Kind kind, uint64_t offset) {
  switch (kind) {
    case Kind::kE4M3: return (b & 0x7F) == 0x7F ? static_cast<uint8_t>(b - 1) : b;  // no NaN encodings
    case Kind::kScale: return static_cast<uint8_t>(115 + (b & 0x0F));               // 2^-12 .. 2^3
    case Kind::kBf16:
      // little-endian bf16: odd bytes hold sign + exponent: values of magnitude in [0.5, 2)
      return (offset & 1) ? static_cast<uint8_t>((b & 0x80) | 0x3F) : b;
  }
  return b;
}

}  // namespace

void Fill(uint64_t seed, uint64_t tensor_hash, uint64_t offset, uint64_t n, Kind kind, uint8_t* dst) {
  uint64_t i = 0;
  while (i < n) {
    const uint64_t abs = offset + i;
    const uint64_t word = SplitMix(seed ^ tensor_hash ^ SplitMix(abs >> 3));
    for (uint64_t k = abs & 7; k < 8 && i < n; ++k, ++i) {
      dst[i] = Shape(static_cast<uint8_t>(word >> (8 * k)), kind, offset + i);
    }
  }
}

uint64_t NameHash(const std::string& name) { return XXH3_64bits(name.data(), name.size()); }

absl::Status WriteShard(const std::string& path, std::vector<PlannedTensor>& tensors, uint64_t seed, int threads,
                        uint64_t* file_bytes, uint64_t* written_bytes) {
  json header = json::object();
  uint64_t off = 0;
  for (auto& t : tensors) {
    t.offset = off;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes}}};
    off += t.bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"generator", "engram-mkckpt"}};
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  const uint64_t data_start = 8 + text.size();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xFF);
  head += text;
  if (::pwrite(fd, head.data(), head.size(), 0) != static_cast<ssize_t>(head.size())) {
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
  }
  // Chunks of every tensor, filled and written by a pool of threads.
  constexpr uint64_t kChunk = uint64_t{8} << 20;
  struct Chunk {
    const PlannedTensor* t;
    uint64_t begin, n;
  };
  std::vector<Chunk> chunks;
  for (const auto& t : tensors) {
    const std::vector<std::pair<uint64_t, uint64_t>> whole = {{0, t.bytes}};
    for (const auto& [begin, end] : t.ranges.empty() ? whole : t.ranges) {
      for (uint64_t b = begin; b < end; b += kChunk) chunks.push_back({&t, b, std::min(kChunk, end - b)});
    }
  }
  for (const auto& c : chunks) *written_bytes += c.n;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<int> err{0};
  auto worker = [&] {
    std::vector<uint8_t> buf(kChunk);
    for (size_t i = next++; i < chunks.size() && !failed; i = next++) {
      const Chunk& c = chunks[i];
      Fill(seed, NameHash(c.t->canonical), c.begin, c.n, c.t->kind, buf.data());
      uint64_t done = 0;
      while (done < c.n) {
        ssize_t w =
            ::pwrite(fd, buf.data() + done, c.n - done, static_cast<off_t>(data_start + c.t->offset + c.begin + done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          err = errno;
          failed = true;
          return;
        }
        done += static_cast<uint64_t>(w);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(worker);
  for (auto& th : pool) th.join();
  // A sparse tensor at the end of the file leaves it short of its header's claim: the size makes the holes.
  if (!failed && ::ftruncate(fd, static_cast<off_t>(data_start + off)) != 0) {
    err = errno;
    failed = true;
  }
  if (::close(fd) != 0 || failed) {
    return absl::ResourceExhaustedError(absl::StrCat(path, ": write failed: ", std::strerror(err ? err.load() : EIO)));
  }
  *file_bytes += data_start + off;
  return absl::OkStatus();
}

}  // namespace synthetic_internal

using synthetic_internal::Fill;
using synthetic_internal::Kind;
using synthetic_internal::NameHash;

uint8_t SyntheticByte(uint64_t seed, const std::string& tensor, uint64_t offset, bool is_scale, bool is_bf16) {
  uint8_t b;
  Fill(seed, NameHash(tensor), offset, 1, is_scale ? Kind::kScale : is_bf16 ? Kind::kBf16 : Kind::kE4M3, &b);
  return b;
}

}  // namespace engram::tools
