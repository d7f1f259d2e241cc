#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/file_util.h"
#include "model/int128.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"

namespace engram {
namespace {

using nlohmann::json;

// A header larger than this is not a real checkpoint header (HF's own reader caps it at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// More dimensions than any real tensor has (PyTorch itself stops at 64).
constexpr size_t kMaxRank = 64;

absl::Status Bad(const std::string& path, const std::string& tensor, const std::string& what) {
  if (tensor.empty()) return absl::DataLossError(absl::StrCat(path, ": ", what));
  return absl::DataLossError(absl::StrCat(path, ": tensor `", TextExcerpt(tensor), "`: ", what));
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

absl::StatusOr<std::map<std::string, TensorInfo>> ParseHeader(const std::string& path, const std::string& json_text,
                                                              uint64_t data_start, uint64_t file_size,
                                                              std::map<std::string, std::string>* meta) {
  if (data_start > file_size) {
    return Bad(path, "",
               absl::StrCat("data starts at byte ", data_start, ", past the end of the file (", file_size, " bytes)"));
  }
  auto parsed = ParseUntrustedJson(json_text, "header");
  if (!parsed.ok()) return Bad(path, "", std::string(parsed.status().message()));
  const json& header = *parsed;
  if (!header.is_object()) return Bad(path, "", "header is not a JSON object");
  std::map<std::string, TensorInfo> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad(path, "", "`__metadata__` is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Bad(path, "", absl::StrCat("`__metadata__.", TextExcerpt(m.key()), "` is not a string"));
        }
        if (meta) (*meta)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return Bad(path, name, "entry is not an object");
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) return Bad(path, name, "missing or non-string `dtype`");
    auto dtype = ParseDType(dt->get<std::string>());
    if (!dtype) return Bad(path, name, absl::StrCat("unknown dtype ", JsonExcerpt(*dt)));
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) return Bad(path, name, "missing `shape` list");
    if (sh->size() > kMaxRank) {
      return Bad(path, name,
                 absl::StrCat("`shape` has ", sh->size(), " dimensions, more than the ", kMaxRank, " allowed"));
    }
    TensorInfo t;
    t.name = name;
    t.dtype = *dtype;
    // Element count with overflow checks: a lying shape must not wrap around to a plausible byte count.
    uint128 numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) return Bad(path, name, absl::StrCat("shape entry ", JsonExcerpt(d), " is not >= 0"));
      uint64_t dim = d.get<uint64_t>();
      if (dim > (uint64_t{1} << 48)) return Bad(path, name, absl::StrCat("shape entry ", dim, " is absurd"));
      numel *= dim;
      if (numel > (static_cast<uint128>(1) << 62)) return Bad(path, name, "shape is absurdly large");
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return Bad(path, name, "`data_offsets` must be two non-negative integers");
    }
    uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (b > e) return Bad(path, name, absl::StrCat("data_offsets [", b, ", ", e, "] run backwards"));
    const uint128 want = numel * static_cast<uint128>(DTypeSize(*dtype));
    if (want != e - b) {
      return Bad(path, name,
                 absl::StrCat("dtype ", DTypeName(*dtype), " x shape [", absl::StrJoin(t.shape, ", "), "] needs ",
                              static_cast<uint64_t>(want), " bytes but data_offsets span ", e - b));
    }
    if (e > file_size - data_start) {
      return Bad(path, name,
                 absl::StrCat("data ends at byte ", data_start + e, " but the file has only ", file_size,
                              " bytes (truncated?)"));
    }
    t.begin = data_start + b;
    t.end = data_start + e;
    out.emplace(name, std::move(t));
  }
  // Overlap check: sorted by start, each tensor must begin at or after the previous one's end.
  std::vector<const TensorInfo*> sorted;
  for (const auto& [n, t] : out) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i]->begin < sorted[i - 1]->end && sorted[i]->bytes() > 0 && sorted[i - 1]->bytes() > 0) {
      return Bad(path, sorted[i]->name, absl::StrCat("data overlaps tensor `", TextExcerpt(sorted[i - 1]->name), "`"));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::map<std::string, TensorInfo>> ParseSafetensorsHeader(const std::string& path,
                                                                         const std::string& json_text,
                                                                         uint64_t data_start, uint64_t file_size,
                                                                         std::map<std::string, std::string>* meta) {
  // Every field is checked before it is read; the catch is a last line of defence (e.g. std::bad_alloc), so that
  // no exception leaves the parser.
  try {
    return ParseHeader(path, json_text, data_start, file_size, meta);
  } catch (const std::exception& e) {
    return Bad(path, "", absl::StrCat("cannot parse the header: ", TextExcerpt(e.what())));
  }
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path));  // refuses FIFOs and devices without blocking
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Bad(path, "", "cannot stat");
  f->file_size_ = static_cast<uint64_t>(st.st_size);
  if (f->file_size_ < 8) return Bad(path, "", absl::StrCat("only ", f->file_size_, " bytes: no header length"));
  unsigned char len_bytes[8];
  if (::pread(fd, len_bytes, 8, 0) != 8) return Bad(path, "", "cannot read the header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > f->file_size_ - 8) {
    return Bad(
        path, "",
        absl::StrCat("header length ", header_len, " runs past the end of the file (", f->file_size_, " bytes)"));
  }
  if (header_len > kMaxHeaderBytes) {
    return Bad(path, "", absl::StrCat("header length ", header_len, " exceeds the ", kMaxHeaderBytes, " allowed"));
  }
  std::string text(header_len, '\0');
  uint64_t done = 0;
  while (done < header_len) {
    ssize_t n = ::pread(fd, text.data() + done, header_len - done, static_cast<off_t>(8 + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Bad(path, "", "short read of the header");
    done += static_cast<uint64_t>(n);
  }
  f->data_start_ = 8 + header_len;
  ASSIGN_OR_RETURN(f->tensors_, ParseSafetensorsHeader(path, text, f->data_start_, f->file_size_, &f->metadata_));
  return std::shared_ptr<const SafetensorsFile>(std::move(f));
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status SafetensorsFile::ReadFailed(const TensorInfo& tensor, uint64_t at, ssize_t r) const {
  if (r < 0) {
    return absl::DataLossError(
        absl::StrCat(path_, ": tensor `", tensor.name, "`: read error at byte ", at, ": ", std::strerror(errno)));
  }
  return absl::DataLossError(
      absl::StrCat(path_, ": tensor `", tensor.name, "`: file ends at byte ", at, " (truncated since it was opened?)"));
}

absl::Status SafetensorsFile::ReadRange(const TensorInfo& tensor, uint64_t offset, void* dst, uint64_t n) const {
  if (offset > tensor.bytes() || n > tensor.bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor `", tensor.name, "`: read of ", n, " bytes at ", offset,
                                              " is outside its ", tensor.bytes(), " bytes"));
  }
  char* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd_, out + done, n - done, static_cast<off_t>(tensor.begin + offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return ReadFailed(tensor, tensor.begin + offset + done, r);
    done += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SafetensorsFile::ReadIfCached(const TensorInfo& tensor, uint64_t offset, void* dst,
                                                       uint64_t n) const {
  if (offset > tensor.bytes() || n > tensor.bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor `", tensor.name, "`: cached read of ", n, " bytes at ",
                                              offset, " is outside its ", tensor.bytes(), " bytes"));
  }
  char* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    iovec v{out + done, static_cast<size_t>(n - done)};
    const ssize_t r = ::preadv2(fd_, &v, 1, static_cast<off_t>(tensor.begin + offset + done), RWF_NOWAIT);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == EAGAIN) break;  // the next page is not in the page cache
    if (r < 0 && (errno == EOPNOTSUPP || errno == EINVAL)) {
      return absl::UnimplementedError(
          absl::StrCat(path_, ": reads that do not wait (RWF_NOWAIT) are not supported: ", std::strerror(errno)));
    }
    if (r <= 0) return ReadFailed(tensor, tensor.begin + offset + done, r);
    done += static_cast<uint64_t>(r);
  }
  return done;
}

void SafetensorsFile::DropCache(const TensorInfo& tensor, uint64_t offset, uint64_t n) const {
  ::posix_fadvise(fd_, static_cast<off_t>(tensor.begin + offset), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
}

}  // namespace engram
