// Helpers shared by engram's tests: temporary directories, file I/O, test-data paths, running the project's
// binaries as real processes, and a process whose threads cannot start. Test-only; not thread-safe.
#pragma once

#include <fcntl.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace engram::testing {

// Test data and binaries; the environment (ENGRAM_TEST_DATA_DIR, ENGRAM_BIN_DIR) overrides the build-time paths,
// so a bundle copied to another machine finds them.
inline std::string DataPath(const std::string& rel) {
  const char* env = std::getenv("ENGRAM_TEST_DATA_DIR");
  return std::string(env ? env : ENGRAM_TEST_DATA_DIR) + "/" + rel;
}
inline std::string BinPath(const std::string& name) {
  const char* env = std::getenv("ENGRAM_BIN_DIR");
  return std::string(env ? env : ENGRAM_BIN_DIR) + "/" + name;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "engram-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Writes every file directly in `dir` to disk and asks the kernel to drop its pages from the page cache (clean,
// unmapped pages go; whether they did is the caller's check, e.g. SafetensorsFile::ReadIfCached).
inline void DropPageCache(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs a shell command line, capturing stdout and stderr separately.
inline CommandResult RunCmd(const std::string& cmd) {
  TempDir tmp;
  const std::string err_path = tmp / "stderr";
  CommandResult r;
  FILE* p = ::popen((cmd + " 2>" + err_path).c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.err = ReadFile(err_path);
  return r;
}

// While alive, no new thread of this process can start: the default stack is set larger than any address space, so
// pthread_create fails (what RLIMIT_NPROC or an exhausted address space do to std::thread). refused(): a probe
// thread was refused, i.e. the setting took. The default thread attributes are restored on destruction.
class RefusedThreads {
 public:
  RefusedThreads() {
    saved_ok_ = ::pthread_getattr_default_np(&saved_) == 0;
    ::pthread_attr_init(&huge_);
    if (saved_ok_ && ::pthread_attr_setstacksize(&huge_, size_t{1} << 62) == 0 &&
        ::pthread_setattr_default_np(&huge_) == 0) {
      pthread_t t;
      refused_ = ::pthread_create(
                     &t, nullptr, [](void*) -> void* { return nullptr; }, nullptr) != 0;
      if (!refused_) ::pthread_join(t, nullptr);
    }
  }
  ~RefusedThreads() {
    if (saved_ok_) {
      ::pthread_setattr_default_np(&saved_);
      ::pthread_attr_destroy(&saved_);
    }
    ::pthread_attr_destroy(&huge_);
  }
  RefusedThreads(const RefusedThreads&) = delete;
  RefusedThreads& operator=(const RefusedThreads&) = delete;
  bool refused() const { return refused_; }

 private:
  pthread_attr_t saved_{}, huge_{};
  bool saved_ok_ = false, refused_ = false;
};

}  // namespace engram::testing
