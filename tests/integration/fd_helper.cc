// fd_helper: one replica-side actor of the descriptor-passing tests (tests/integration/descriptor_test.cc), run as a
// separate process so that a test can give it another uid (setpriv), other namespaces (unshare) or SIGKILL. It
// speaks to engramd through the client's own session and descriptor channel (client/session/session.h, fd_channel.h)
// and prints one JSON line per result, flushed at once. Modes:
//   fetch SOCKET CHECKPOINT       session (DP 2, TP 1) -> descriptor -> what this process can and cannot do with it
//   grant SOCKET CHECKPOINT       session; prints lease, token and channel path, then holds the session until killed
//   steal CHANNEL LEASE TOKEN     asks the channel for someone else's descriptor
//   cycle SOCKET CHECKPOINT N     N x (session, descriptor, map, check the header, unmap, close)
//   hold SOCKET CHECKPOINT        session and descriptor, prints {"fetched": ...}, then holds both until killed
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "client/session/descriptor_client.h"
#include "client/session/session.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"

namespace {

using nlohmann::json;
using namespace std::chrono_literals;

void Print(const json& j) { std::cout << j.dump() << std::endl; }

absl::StatusOr<std::unique_ptr<engram::client::Session>> OpenSession(const std::string& socket,
                                                                     const std::string& checkpoint) {
  auto ck = engram::Checkpoint::Open(checkpoint);
  if (!ck.ok()) return ck.status();
  engram::client::Declaration d;
  d.fingerprint = (*ck)->Fingerprint();
  d.checkpoint = checkpoint;
  d.dp_size = 2;
  d.cpu_offload = engram::client::Choice::kTrue;
  return engram::client::Session::Open(socket, 20s, d);
}

int Fetch(const std::string& socket, const std::string& checkpoint) {
  auto s = OpenSession(socket, checkpoint);
  if (!s.ok()) {
    Print({{"granted", false}, {"error", std::string(s.status().message())}});
    return 0;
  }
  const auto& g = (*s)->answer().grant;
  json out = {{"granted", (*s)->answer().granted}};
  auto fd = (*s)->FetchSegmentDescriptor(5s);
  out["fetched"] = fd.ok();
  if (!fd.ok()) {
    out["error"] = std::string(fd.status().message());
    Print(out);
    return 0;
  }
  const int flags = ::fcntl(*fd, F_GETFL);
  out["read_only"] = (flags & O_ACCMODE) == O_RDONLY;
  const off_t size = ::lseek(*fd, 0, SEEK_END);
  void* w = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  out["mmap_write_errno"] = w == MAP_FAILED ? errno : 0;
  if (w != MAP_FAILED) ::munmap(w, static_cast<size_t>(size));
  void* r = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, *fd, 0);
  if (r != MAP_FAILED) {
    out["magic_ok"] = std::memcmp(r, engram::kSegmentMagic, 8) == 0;
    out["mprotect_errno"] = ::mprotect(r, 4096, PROT_READ | PROT_WRITE) == 0 ? 0 : errno;
    ::munmap(r, static_cast<size_t>(size));
  }
  const std::string proc = "/proc/self/fd/" + std::to_string(*fd);
  int rw = ::open(proc.c_str(), O_RDWR | O_CLOEXEC);
  out["reopen_rw_errno"] = rw < 0 ? errno : 0;
  if (rw >= 0) ::close(rw);
  int byname = ::open(g.segment_path.c_str(), O_RDONLY | O_CLOEXEC);
  out["open_path_errno"] = byname < 0 ? errno : 0;
  if (byname >= 0) ::close(byname);
  ::close(*fd);
  // The token works once.
  auto again = (*s)->FetchSegmentDescriptor(5s);
  out["second_fetch"] = again.ok();
  if (again.ok()) ::close(*again);
  Print(out);
  return 0;
}

int Grant(const std::string& socket, const std::string& checkpoint, const std::string& trigger = "") {
  auto s = OpenSession(socket, checkpoint);
  if (!s.ok() || !(*s)->answer().granted) {
    Print({{"granted", false}});
    return 1;
  }
  const auto& g = (*s)->answer().grant;
  auto channel = engram::client::ChannelPath(socket, g.fd_socket);
  Print({{"granted", true}, {"lease", g.lease_id}, {"token", g.fd_token}, {"channel", channel.ok() ? *channel : ""}});
  if (!trigger.empty()) {  // fetch the descriptor once the file `trigger` exists (after the test changed the node)
    while (::access(trigger.c_str(), F_OK) != 0) std::this_thread::sleep_for(20ms);
    auto fd = (*s)->FetchSegmentDescriptor(5000ms);
    json out = {{"fetched", fd.ok()}};
    if (fd.ok()) ::close(*fd);
    if (!fd.ok()) out["error"] = std::string(fd.status().message());
    Print(out);
  }
  while (true) std::this_thread::sleep_for(1s);
}

int Steal(const std::string& channel, const std::string& lease, const std::string& token) {
  auto fd = engram::client::FetchSegmentDescriptor(channel, lease, token, 5s);
  json out = {{"fetched", fd.ok()}};
  if (fd.ok()) ::close(*fd);
  if (!fd.ok()) out["error"] = std::string(fd.status().message());
  Print(out);
  return 0;
}

int Cycle(const std::string& socket, const std::string& checkpoint, int n) {
  int failures = 0;
  std::string last_error;
  for (int i = 0; i < n; ++i) {
    auto s = OpenSession(socket, checkpoint);
    if (!s.ok()) {
      ++failures;
      last_error = std::string(s.status().message());
      continue;
    }
    auto fd = (*s)->FetchSegmentDescriptor(5s);
    if (!fd.ok()) {
      ++failures;
      last_error = std::string(fd.status().message());
      continue;
    }
    auto reader = engram::SegmentReader::OpenDescriptor(*fd, "cycle");
    if (!reader.ok() || (*reader)->state() != engram::SegmentState::kReady) {
      ++failures;
      last_error = reader.ok() ? "not READY" : std::string(reader.status().message());
    }
  }
  Print({{"cycles", n}, {"failures", failures}, {"last_error", last_error}});
  return 0;
}

int Hold(const std::string& socket, const std::string& checkpoint) {
  auto s = OpenSession(socket, checkpoint);
  if (!s.ok()) {
    Print({{"fetched", false}});
    return 1;
  }
  auto fd = (*s)->FetchSegmentDescriptor(5s);
  Print({{"fetched", fd.ok()}});
  while (true) std::this_thread::sleep_for(1s);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "fetch" && argc == 4) return Fetch(argv[2], argv[3]);
  if (mode == "grant" && argc == 4) return Grant(argv[2], argv[3]);
  if (mode == "grant" && argc == 5) return Grant(argv[2], argv[3], argv[4]);
  if (mode == "steal" && argc == 5) return Steal(argv[2], argv[3], argv[4]);
  if (mode == "cycle" && argc == 5) return Cycle(argv[2], argv[3], std::atoi(argv[4]));
  if (mode == "hold" && argc == 4) return Hold(argv[2], argv[3]);
  std::cerr << "usage: fd_helper fetch|grant|hold SOCKET CHECKPOINT | steal CHANNEL LEASE TOKEN | "
               "cycle SOCKET CHECKPOINT N\n";
  return 2;
}
