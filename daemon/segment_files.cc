#include "daemon/segment_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/utf8.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

bool Unsettled(ServingState s) { return s == ServingState::kPending || s == ServingState::kLoading; }

absl::StatusOr<bool> OursOrClear(const std::string& path, Env* env) {
  struct stat st {};
  if (env->Lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return false;
    return absl::InternalError(absl::StrCat("lstat ", path, ": ", std::strerror(errno)));
  }
  if (S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0) return true;
  const char* kind = S_ISLNK(st.st_mode) ? "symlink" : S_ISREG(st.st_mode) ? "file" : "special";
  if (env->Unlink(path.c_str()) == 0 || errno == ENOENT) {
    spdlog::warn("event=segment_foreign path={} owner={} mode={:04o} kind={}: not this daemon's, removed",
                 engram::LogValue(path), st.st_uid, st.st_mode & 07777, kind);
    return false;
  }
  const int err = errno;
  spdlog::error("event=segment_foreign path={} owner={} mode={:04o} kind={} detail={}: cannot be removed",
                engram::LogValue(path), st.st_uid, st.st_mode & 07777, kind, engram::LogQuoted(std::strerror(err)));
  return absl::FailedPreconditionError(absl::StrFormat(
      "a file owned by uid %d occupies %s (mode %04o) and cannot be removed (%s): it is not this daemon's (uid %d)",
      st.st_uid, path, st.st_mode & 07777, std::strerror(err), ::geteuid()));
}

FileIdentity FileIdentityOf(const std::string& path, Env* env) {
  struct stat st {};
  if (env->Lstat(path.c_str(), &st) != 0) return {};
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

std::string SizeProblem(const std::string& path, uint64_t bytes, Env* env, FileIdentity expected) {
  struct stat st {};
  if (env->Lstat(path.c_str(), &st) != 0)
    return absl::StrCat("the segment file ", path, " is gone: ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return absl::StrCat("the segment file ", path, " is no longer a regular file");
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return absl::StrFormat("the segment file %s is %d bytes, %d expected: truncated or replaced", path, st.st_size,
                           bytes);
  }
  if (expected.ino != 0 &&
      (static_cast<uint64_t>(st.st_dev) != expected.dev || static_cast<uint64_t>(st.st_ino) != expected.ino)) {
    return absl::StrFormat("the segment file %s was replaced (inode %d, %d when it was made ready)", path, st.st_ino,
                           expected.ino);
  }
  return "";
}

std::string Bounded(const std::string& s, size_t max) { return s.size() <= max ? s : Utf8Prefix(s, max) + "..."; }

std::shared_ptr<const engram::v1::SegmentDescriptor> ReadDescriptor(const std::string& path, Env* env) {
  auto reader = SegmentReader::Open(path, env);
  if (!reader.ok()) return nullptr;
  auto d = std::make_shared<engram::v1::SegmentDescriptor>();
  if (!d->ParseFromString((*reader)->descriptor_bytes())) return nullptr;
  return d;
}

}  // namespace engram::daemon
