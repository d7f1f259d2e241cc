#include "tools/ctl_common.h"

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/utf8.h"
#include "client/session/session.h"
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tools/args.h"
#include "tools/row_oracle.h"

namespace engram::tools::ctl {

int Usage(const std::string& msg) {
  std::cerr << "engramctl: " << Printable(msg) << "\n";
  return 2;
}

std::unique_ptr<engram::v1::Engram::Stub> Connect(const std::string& socket) {
  return engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

namespace {

// What `socket` is when it exists and is not a socket ("" otherwise: a socket, or nothing stat can see).
std::string NotASocket(const std::string& socket) {
  struct stat st {};
  if (::stat(socket.c_str(), &st) != 0 || S_ISSOCK(st.st_mode)) return "";
  const char* kind = S_ISFIFO(st.st_mode)  ? "a FIFO"
                     : S_ISDIR(st.st_mode) ? "a directory"
                     : S_ISREG(st.st_mode) ? "a regular file"
                     : S_ISCHR(st.st_mode) ? "a character device"
                     : S_ISBLK(st.st_mode) ? "a block device"
                                           : "something other than a socket";
  return socket + " is " + kind + ", not engramd's socket (--socket names the socket engramd listens on)";
}

}  // namespace

std::string DiagnoseSocket(const std::string& socket) {
  sockaddr_un addr{};
  if (socket.size() >= sizeof(addr.sun_path)) return socket + ": socket path too long";
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::string("cannot create a socket: ") + std::strerror(errno);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc == 0) return "";
  // A path that is not a socket at all (a FIFO, a file, a directory) is refused as a stale socket is, or, when this
  // user may not write it, as a permission refusal: name what it is instead.
  if (err == ECONNREFUSED || err == EACCES || err == EPERM) {
    if (std::string what = NotASocket(socket); !what.empty()) return what;
  }
  switch (err) {
    case ENOENT: return "engramd is not running (no socket at " + socket + ")";
    case ECONNREFUSED: return "engramd is not running (nothing listens on " + socket + ")";
    case EACCES:
    case EPERM:
      return "permission denied on " + socket + ": this user may not use engramd (add it to the daemon's group)";
    default: return "cannot connect to " + socket + ": " + std::strerror(err);
  }
}

int RpcFailure(const grpc::Status& st, const std::string& socket) {
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE || st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    const std::string why = DiagnoseSocket(socket);
    if (why.rfind("permission denied", 0) == 0) {
      std::cerr << "engramctl: " << why << "\n";
      return 4;
    }
    if (!why.empty()) {
      std::cerr << "engramctl: " << why << "\n";
      return 3;
    }
    // Something listens and answered with an error of its own (e.g. draining): say what it said.
    std::cerr << "engramctl: engramd on " << socket << ": " << Printable(st.error_message()) << "\n";
    return 1;
  }
  if (st.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    std::cerr << "engramctl: " << Printable(st.error_message()) << "\n";
    return 4;
  }
  std::cerr << "engramctl: " << Printable(st.error_message()) << "\n";
  return 1;
}

int StatusFailure(const absl::Status& st, const std::string& socket) {
  return RpcFailure(grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message())), socket);
}

std::string Bar(uint64_t used, uint64_t total, int width) {
  const int n = total ? static_cast<int>(static_cast<double>(used) / total * width + 0.5) : 0;
  const size_t filled = static_cast<size_t>(std::clamp(n, 0, width));
  // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on a chain of operator+ here.
  std::string bar = "[";
  bar.append(filled, '#');
  bar.append(static_cast<size_t>(width) - filled, '.');
  bar.push_back(']');
  return bar;
}

std::string GiB(uint64_t b) { return absl::StrFormat("%.2f GiB", static_cast<double>(b) / (1ull << 30)); }

}  // namespace engram::tools::ctl
