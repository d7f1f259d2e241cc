#include "daemon/metrics_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "shm/env.h"

namespace engram::daemon {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

std::atomic<uint64_t> g_next_tmp{0};

// Whether a directory may hold the metrics file or lead to it: root's or the daemon's, and sticky if others may
// write it (then no one else can replace what is in it).
absl::Status CheckTrusted(const struct stat& st, const std::string& dir) {
  const bool owner_ok = st.st_uid == 0 || st.st_uid == ::geteuid();
  const bool others_write = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (owner_ok && (!others_write || (st.st_mode & S_ISVTX) != 0)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "the metrics file's directory %s (owner uid %d, mode %04o) is not safe to write in: it and every directory "
      "above it must be root's or uid %d's, and sticky if others may write it",
      dir, st.st_uid, st.st_mode & 07777, ::geteuid()));
}

// Opens `dir` one component at a time, each directory checked (CheckTrusted) before the next is looked up in it, so
// that no one who may not write a directory on the way can plant a link that moves the file elsewhere. A symlink on
// the way is followed only when it is root's or the daemon's, and its target is walked the same way, component by
// component (at most 40 links).
absl::StatusOr<int> OpenTrustedDir(Env& env, const std::string& dir) {
  std::deque<std::string> todo;  // the components still to walk
  auto push_front_path = [&todo](const std::string& p) {
    std::vector<std::string> parts = absl::StrSplit(p, '/', absl::SkipEmpty());
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) todo.push_front(*it);
  };
  push_front_path(dir);
  int dfd = env.Open(dir[0] == '/' ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  if (dfd < 0) return Errno(absl::StrCat("open the metrics file's directory ", dir));
  std::string walked = dir[0] == '/' ? "" : ".";
  int links = 0;
  auto fail = [&dfd, &env](absl::Status st) {
    env.Close(dfd);
    return st;
  };
  while (true) {
    struct stat ds {};
    if (env.Fstat(dfd, &ds) != 0) return fail(Errno(absl::StrCat("fstat ", walked.empty() ? "/" : walked)));
    if (absl::Status st = CheckTrusted(ds, walked.empty() ? "/" : walked); !st.ok()) return fail(st);
    while (!todo.empty() && todo.front() == ".") todo.pop_front();
    if (todo.empty()) return dfd;
    const std::string name = todo.front();
    todo.pop_front();
    struct stat ls {};
    if (env.Fstatat(dfd, name.c_str(), &ls, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(ls.st_mode)) {
      const std::string at = absl::StrCat(walked, "/", name);
      if (ls.st_uid != 0 && ls.st_uid != ::geteuid()) {
        return fail(absl::FailedPreconditionError(
            absl::StrFormat("the metrics file's path %s is a symlink of uid %d: only root's or uid %d's are followed",
                            at, ls.st_uid, ::geteuid())));
      }
      if (++links > 40) return fail(absl::FailedPreconditionError(absl::StrCat("too many symlinks at ", at)));
      std::string to;
      if (env.Readlinkat(dfd, name.c_str(), &to) != 0) return fail(Errno(absl::StrCat("readlink ", at)));
      if (to.empty()) return fail(absl::FailedPreconditionError(absl::StrCat("an empty symlink at ", at)));
      push_front_path(to);
      if (to[0] == '/') {  // absolute: start again from the root, checking it
        const int root = env.Open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
        if (root < 0) return fail(Errno("open /"));
        env.Close(dfd);
        dfd = root;
        walked.clear();
      }
      continue;
    }
    const int next = env.Openat(dfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (next < 0) {
      const int err = errno;
      env.Close(dfd);
      errno = err;
      return Errno(absl::StrCat("open the metrics file's directory ", walked, "/", name));
    }
    env.Close(dfd);
    dfd = next;
    walked = absl::StrCat(walked, "/", name);
  }
}

}  // namespace

absl::Status WriteMetricsFile(const std::string& path, const std::string& text, Env* env_or_null) {
  Env& env = env_or_null != nullptr ? *env_or_null : *Env::Default();
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  if (base.empty()) return absl::InvalidArgumentError(absl::StrCat("metrics file ", path, " names no file"));
  absl::StatusOr<int> opened = OpenTrustedDir(env, dir);
  if (!opened.ok()) return opened.status();
  const int dfd = *opened;
  struct Closer {
    Env& env;
    int fd;
    ~Closer() { env.Close(fd); }
  } close_dir{env, dfd};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = absl::StrCat(base, ".tmp.", ::getpid(), ".", g_next_tmp.fetch_add(1));
    fd = env.Openat(dfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) return Errno(absl::StrCat("create ", dir, "/", tmp));
  }
  if (fd < 0) return Errno(absl::StrCat("create a temporary file beside ", path));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = env.Write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status st = Errno(absl::StrCat("write ", dir, "/", tmp));
      env.Close(fd);
      env.Unlinkat(dfd, tmp.c_str(), 0);
      return st;
    }
    done += static_cast<size_t>(n);
  }
  env.Fchmod(fd, 0644);  // readable by the collector whatever the umask
  if (env.Close(fd) != 0) {
    const absl::Status st = Errno(absl::StrCat("close ", dir, "/", tmp));
    env.Unlinkat(dfd, tmp.c_str(), 0);
    return st;
  }
  if (env.Renameat(dfd, tmp.c_str(), dfd, base.c_str()) != 0) {
    const absl::Status st = Errno(absl::StrCat("rename ", dir, "/", tmp, " to ", path));
    env.Unlinkat(dfd, tmp.c_str(), 0);
    return st;
  }
  return absl::OkStatus();
}

}  // namespace engram::daemon
