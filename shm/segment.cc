#include "shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/worker_threads.h"
#include "shm/env.h"
#include "xxhash.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace engram {
namespace {

uint64_t NowMs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

absl::Status Errno(const std::string& what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case ENOMEM: return absl::ResourceExhaustedError(msg);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case ENOENT: return absl::NotFoundError(msg);
    case EEXIST: return absl::AlreadyExistsError(msg);
    default: return absl::InternalError(msg);
  }
}

}  // namespace

std::string SegmentStateName(SegmentState s) {
  switch (s) {
    case SegmentState::kCreating: return "CREATING";
    case SegmentState::kLoading: return "LOADING";
    case SegmentState::kReady: return "READY";
    case SegmentState::kRetired: return "RETIRED";
  }
  return "UNKNOWN";
}

std::string SegmentName(uint64_t fingerprint, int64_t tp_size, int64_t tp_rank) {
  return absl::StrFormat("engram-%016x-tp%dof%d", fingerprint, tp_rank, tp_size);
}

bool ParseSegmentName(const std::string& name, uint64_t* fingerprint, int64_t* tp_size, int64_t* tp_rank) {
  unsigned long long fp = 0;
  long long r = 0, n = 0;
  int consumed = 0;
  if (name.rfind("engram-", 0) != 0) return false;
  if (std::sscanf(name.c_str(), "engram-%16llx-tp%lldof%lld%n", &fp, &r, &n, &consumed) != 3) return false;
  if (static_cast<size_t>(consumed) != name.size() || n < 1 || r < 0 || r >= n) return false;
  if (SegmentName(fp, n, r) != name) return false;
  *fingerprint = fp;
  *tp_size = n;
  *tp_rank = r;
  return true;
}

uint64_t SegmentDataOffset(uint64_t desc_bytes) {
  return (kHeaderBytes + desc_bytes + kDataAlign - 1) / kDataAlign * kDataAlign;
}

uint64_t SegmentFileBytes(uint64_t desc_bytes, uint64_t data_bytes) {
  return (SegmentDataOffset(desc_bytes) + data_bytes + kDataAlign - 1) / kDataAlign * kDataAlign;
}

absl::Status PopulateForWrite(uint8_t* p, uint64_t n, Env* env) {
  if (n == 0) return absl::OkStatus();
  // Whole system pages: madvise refuses a start off one (EINVAL), and a 64 KiB-page kernel's pages are not 4 KiB.
  const uintptr_t pg = static_cast<uintptr_t>(std::max<size_t>(env->PageBytes(), 4096));
  const uintptr_t b = reinterpret_cast<uintptr_t>(p) & ~(pg - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + n + pg - 1) & ~(pg - 1);
  int r;
  do {
    r = env->Madvise(reinterpret_cast<void*>(b), e - b, MADV_POPULATE_WRITE);
  } while (r != 0 && (errno == EINTR || errno == EAGAIN));
  if (r == 0) return absl::OkStatus();
  const int err = errno;
  if (err == EFAULT || err == ENOMEM || err == ENOSPC) {
    return absl::ResourceExhaustedError(absl::StrCat("populating ", e - b,
                                                     " bytes of the segment: ", std::strerror(err),
                                                     " (no room left in the shm mount or the hugetlb pool)"));
  }
  return Errno(absl::StrCat("populating ", e - b, " bytes of the segment"), err);
}

absl::StatusOr<std::unique_ptr<SegmentWriter>> SegmentWriter::Create(const std::string& dir, uint64_t fingerprint,
                                                                     int64_t tp_size, int64_t tp_rank,
                                                                     const std::string& descriptor, uint64_t data_bytes,
                                                                     uint64_t instance_id, uint64_t epoch, Env* env,
                                                                     SegmentReserve reserve) {
  std::unique_ptr<SegmentWriter> w(new SegmentWriter());
  w->env_ = env;
  w->path_ = dir + "/" + SegmentName(fingerprint, tp_size, tp_rank);
  const uint64_t total = SegmentFileBytes(descriptor.size(), data_bytes);
  int fd =
      RetryEintr([&] { return env->Open(w->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600); });
  if (fd < 0) return Errno(absl::StrCat("create ", w->path_), errno);
  env->Fchmod(fd, 0600);  // whatever the umask
  auto fail = [&](absl::Status st) {
    env->Close(fd);
    env->Unlink(w->path_.c_str());
    return st;
  };
  // The mount's page: hugetlbfs and a huge=always tmpfs report their huge page as the file's block size; a tmpfs
  // otherwise reports the system's page (4 KiB, or 64 KiB on a 64 KiB-page aarch64 kernel: not huge). A
  // huge=within_size tmpfs reports it only for a file large enough: the file is sized first (best effort: hugetlbfs
  // refuses a size that is not whole huge pages, and reports its page whatever the size).
  (void)env->Ftruncate(fd, static_cast<off_t>(total));
  struct stat st {};
  if (env->Fstat(fd, &st) == 0 && st.st_blksize > 4096) w->page_ = static_cast<uint64_t>(st.st_blksize);
  w->huge_ = w->page_ > std::max<uint64_t>(env->PageBytes(), 4096);
  if (total % w->page_ != 0) {
    return fail(absl::FailedPreconditionError(
        absl::StrCat(w->path_, ": the mount's page size (", w->page_, " bytes) does not divide the segment's ", total,
                     " bytes (hugetlbfs with pages above 2 MiB is not supported: mount it with pagesize=2M)")));
  }
  const uint64_t data_offset = SegmentDataOffset(descriptor.size());
  auto reserve_range = [&](uint64_t off, uint64_t len) {
    int err;
    do {
      err = env->PosixFallocate(fd, static_cast<off_t>(off), static_cast<off_t>(len));
    } while (err == EINTR);
    return err;
  };
  if (reserve == SegmentReserve::kAuto) reserve = w->huge_ ? SegmentReserve::kWriters : SegmentReserve::kWhole;
  // kWriters: the header pages and the last page (which sets the size); the data's pages are populated by the filler.
  const bool writers = reserve == SegmentReserve::kWriters && total > data_offset + w->page_;
  int err = writers ? reserve_range(0, data_offset) : reserve_range(0, total);
  if (err == 0 && writers) err = reserve_range(total - w->page_, w->page_);
  if (err != 0) return fail(Errno(absl::StrCat("reserve ", total, " bytes for ", w->path_), err));
  void* p = env->Mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  err = errno;
  if (p == MAP_FAILED) return fail(Errno(absl::StrCat("map ", w->path_), err));
  w->base_ = static_cast<uint8_t*>(p);
  w->size_ = total;
  env->Madvise(p, total, MADV_HUGEPAGE);  // honoured where the mount gives huge pages; harmless elsewhere
  if (writers) {
    // The header's page is reserved: this only asks whether the kernel has MADV_POPULATE_WRITE.
    if (env->Madvise(p, std::max<size_t>(env->PageBytes(), 4096), MADV_POPULATE_WRITE) == 0) {
      w->populate_ = true;
    } else if ((err = reserve_range(0, total)) != 0) {
      env->Munmap(p, total);
      w->base_ = nullptr;
      return fail(Errno(absl::StrCat("reserve ", total, " bytes for ", w->path_), err));
    }
  }
  env->Close(fd);
  SegmentHeader* h = w->header();
  std::memset(static_cast<void*>(h), 0, kHeaderBytes);
  std::memcpy(h->magic, kSegmentMagic, 8);
  h->version = kSegmentVersion;
  std::atomic_ref<uint32_t>(h->state).store(static_cast<uint32_t>(SegmentState::kCreating), std::memory_order_release);
  h->instance_id = instance_id;
  h->epoch = epoch;
  h->fingerprint = fingerprint;
  h->tp_size = static_cast<uint32_t>(tp_size);
  h->tp_rank = static_cast<uint32_t>(tp_rank);
  h->desc_offset = kHeaderBytes;
  h->desc_bytes = descriptor.size();
  h->desc_checksum = XXH3_64bits(descriptor.data(), descriptor.size());
  h->data_offset = data_offset;
  h->data_bytes = data_bytes;
  h->total_bytes = total;
  h->created_unix_ms = NowMs();
  std::memcpy(w->base_ + kHeaderBytes, descriptor.data(), descriptor.size());
  return w;
}

void SegmentWriter::SetLoading() {
  std::atomic_ref<uint32_t>(header()->state)
      .store(static_cast<uint32_t>(SegmentState::kLoading), std::memory_order_release);
}

absl::Status SegmentWriter::Finish(double load_seconds) {
  header()->load_seconds = load_seconds;
  header()->ready_unix_ms = NowMs();
  ::msync(base_, size_, MS_SYNC);
  std::atomic_ref<uint32_t>(header()->state)
      .store(static_cast<uint32_t>(SegmentState::kReady), std::memory_order_release);
  finished_ = true;
  return absl::OkStatus();
}

double SegmentWriter::ReleaseDataMapping(int threads) {
  const auto t0 = std::chrono::steady_clock::now();
  (void)MadviseInSlices(env_, data(), size_ - header()->data_offset, MADV_DONTNEED, threads);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

SegmentWriter::~SegmentWriter() {
  if (base_ != nullptr) env_->Munmap(base_, size_);
  if (!finished_ && !path_.empty()) env_->Unlink(path_.c_str());
}

namespace {

// The header of the file open on `fd`; with `owner`, also that the file is the daemon's: owned by that uid and
// writable by nobody else (a file planted in a world-writable shm directory is refused, not adopted).
absl::StatusOr<SegmentHeader> HeaderOfOpenFile(const std::string& path, int fd, const uid_t* owner, Env* env) {
  struct stat st {};
  if (env->Fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::DataLossError(absl::StrCat(path, ": not a regular file"));
  }
  if (owner != nullptr && (st.st_uid != *owner || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0)) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: owned by uid %d with mode %04o; a segment must be owned by this daemon (uid %d) and writable by no one "
        "else: not adopted",
        path, st.st_uid, st.st_mode & 07777, *owner));
  }
  SegmentHeader h;
  ssize_t n = RetryEintr([&] { return env->Pread(fd, static_cast<void*>(&h), sizeof(h), 0); });
  if (n != static_cast<ssize_t>(sizeof(h))) return absl::DataLossError(absl::StrCat(path, ": shorter than a header"));
  if (std::memcmp(h.magic, kSegmentMagic, 8) != 0) return absl::DataLossError(absl::StrCat(path, ": not a segment"));
  if (h.version != kSegmentVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": segment format ", h.version, ", this build reads ", kSegmentVersion));
  }
  // The descriptor lies between the header and the records, which start on a 2 MiB page and end at most one 2 MiB
  // page before the end of the file (the padding). Every bound is checked without a sum that could wrap: a lying
  // desc_bytes near 2^64 must not pass as small and send the checksum past the mapping.
  if (h.total_bytes != static_cast<uint64_t>(st.st_size) || h.desc_offset != kHeaderBytes ||
      h.data_offset > h.total_bytes || h.data_offset < h.desc_offset || h.data_offset % kDataAlign != 0 ||
      h.desc_bytes > h.data_offset - h.desc_offset || h.data_bytes > h.total_bytes - h.data_offset ||
      h.total_bytes - h.data_offset - h.data_bytes >= kDataAlign) {
    return absl::DataLossError(absl::StrCat(path, ": header sizes disagree with the file (", st.st_size, " bytes)"));
  }
  return h;
}

absl::StatusOr<SegmentHeader> ReadHeader(const std::string& path, const uid_t* owner, Env* env) {
  int fd = RetryEintr([&] { return env->Open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0); });
  if (fd < 0) return Errno(absl::StrCat("open ", path), errno);
  auto h = HeaderOfOpenFile(path, fd, owner, env);
  env->Close(fd);
  return h;
}

}  // namespace

absl::StatusOr<SegmentHeader> ReadSegmentHeader(const std::string& path, Env* env) {
  return ReadHeader(path, nullptr, env);
}

absl::StatusOr<SegmentHeader> ReadOwnedSegmentHeader(const std::string& path, uid_t owner, Env* env) {
  return ReadHeader(path, &owner, env);
}

absl::Status SetSegmentState(const std::string& path, SegmentState state, Env* env) {
  int fd = RetryEintr([&] { return env->Open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0); });
  if (fd < 0) return Errno(absl::StrCat("open ", path), errno);
  struct stat st {};
  if (env->Fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    env->Close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  const uint32_t v = static_cast<uint32_t>(state);
  ssize_t n = RetryEintr([&] { return env->Pwrite(fd, &v, 4, offsetof(SegmentHeader, state)); });
  int err = errno;
  if (n != 4 && err == EINVAL && st.st_blksize > 4096) {
    // hugetlbfs has no write(2): through a mapping of the first (huge) page instead.
    const size_t len = static_cast<size_t>(st.st_blksize);
    void* p = env->Mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = errno;
    if (p != MAP_FAILED) {
      std::atomic_ref<uint32_t>(reinterpret_cast<SegmentHeader*>(p)->state).store(v, std::memory_order_release);
      env->Munmap(p, len);
      n = 4;
    }
  }
  env->Close(fd);
  return n == 4 ? absl::OkStatus() : Errno(absl::StrCat("write state of ", path), err);
}

absl::StatusOr<std::unique_ptr<SegmentReader>> SegmentReader::Open(const std::string& path, Env* env) {
  int fd = RetryEintr([&] { return env->Open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0); });
  if (fd < 0) return Errno(absl::StrCat("open ", path), errno);
  return OpenDescriptor(fd, path, env);
}

absl::StatusOr<std::unique_ptr<SegmentReader>> SegmentReader::OpenDescriptor(int fd, const std::string& name,
                                                                             Env* env) {
  auto h = HeaderOfOpenFile(name, fd, nullptr, env);
  if (!h.ok()) {
    env->Close(fd);
    return h.status();
  }
  struct stat st {};
  if (env->Fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != h->total_bytes) {
    env->Close(fd);
    return absl::DataLossError(absl::StrCat(name, ": changed size while it was opened"));
  }
  void* p = env->Mmap(nullptr, h->total_bytes, PROT_READ, MAP_SHARED, fd, 0);
  int err = errno;
  env->Close(fd);
  if (p == MAP_FAILED) return Errno(absl::StrCat("map ", name), err);
  std::unique_ptr<SegmentReader> r(new SegmentReader());
  r->env_ = env;
  r->base_ = static_cast<const uint8_t*>(p);
  r->size_ = h->total_bytes;
  r->dev_ = st.st_dev;
  r->ino_ = st.st_ino;
  const SegmentHeader& mh = r->header();
  // The mapping's header is the one every later access uses: it must be the header just validated (the file could
  // have been rewritten between the read and the map), or a lying size would reach past the mapping.
  if (mh.desc_offset != h->desc_offset || mh.desc_bytes != h->desc_bytes || mh.data_offset != h->data_offset ||
      mh.data_bytes != h->data_bytes || mh.total_bytes != h->total_bytes) {
    return absl::DataLossError(absl::StrCat(name, ": header changed while it was opened"));
  }
  if (XXH3_64bits(r->base_ + mh.desc_offset, mh.desc_bytes) != mh.desc_checksum) {
    return absl::DataLossError(absl::StrCat(name, ": descriptor checksum mismatch"));
  }
  return r;
}

std::string SegmentReader::descriptor_bytes() const {
  return std::string(reinterpret_cast<const char*>(base_ + header().desc_offset), header().desc_bytes);
}

SegmentReader::~SegmentReader() {
  if (base_ != nullptr) env_->Munmap(const_cast<uint8_t*>(base_), size_);
}

std::vector<std::string> ListSegments(const std::string& dir, Env* env) {
  std::vector<std::string> names, out;
  if (env->ListDirectory(dir.c_str(), &names) != 0) return out;
  for (const std::string& name : names) {
    uint64_t fp;
    int64_t n, r;
    if (ParseSegmentName(name, &fp, &n, &r)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace engram
