// engramd as a real process for the multi-process tests: start it on a test's own socket (optionally under a prefix
// such as setpriv), read its status through engramctl, wait for its segments to settle or for a log line, make a
// synthetic checkpoint, and ask its gRPC health service. Test-only; not thread-safe.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include <sys/stat.h>

#include "engram/v1/engram.pb.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram::testing {

class Daemon {
 public:
  Daemon(const TempDir& dir, const std::vector<std::string>& extra, const std::string& name = "engramd",
         const std::vector<std::string>& prefix = {})
      : socket_(dir / (name + ".sock")), log_(dir / (name + ".log")) {
    std::vector<std::string> argv = prefix;
    for (const auto& a :
         std::vector<std::string>{BinPath("../daemon/engramd"), "--socket", socket_, "--log-level", "debug"}) {
      argv.push_back(a);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc_ = Process(argv, log_);
  }
  const std::string& socket() const { return socket_; }
  Process& proc() { return proc_; }
  std::string Log() const { return ReadFile(log_); }
  // Status as JSON through engramctl; null when the daemon does not answer.
  nlohmann::json Status() const {
    auto r = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
    if (r.exit_code != 0) return nlohmann::json();
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    return j.is_discarded() ? nlohmann::json() : j;
  }
  // Every segment READY or FAILED.
  bool WaitReady(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) {
    return WaitFor(
        [&] {
          nlohmann::json s = Status();
          if (s.is_null() || s["segments"].empty()) return false;
          for (const auto& seg : s["segments"]) {
            if (seg["state"] != "READY" && seg["state"] != "FAILED") return false;
          }
          return true;
        },
        timeout);
  }
  bool WaitLog(const std::string& needle, std::chrono::milliseconds timeout = std::chrono::milliseconds(30000)) const {
    return WaitFor([&] { return Log().find(needle) != std::string::npos; }, timeout);
  }

 private:
  std::string socket_, log_;
  Process proc_;
};

// The daemon's shm directory for a test: dir/shm (never the real /dev/shm, which a production engramd may own).
inline std::string MakeShm(const TempDir& dir) {
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  return shm;
}

// A synthetic checkpoint of about `mib` MiB of tables in dir/name (engram-mkckpt).
inline std::string MakeCheckpoint(const TempDir& dir, double mib, const std::string& name = "ck", int seed = 1) {
  auto r = RunCmd(BinPath("engram-mkckpt") + " --out " + (dir / name) + " --table-mib " + std::to_string(mib) +
                  " --seed " + std::to_string(seed));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return dir / name;
}

// The hello of a replica that can share `ckpt` served from `shm` (TP 1, rank 0): its fingerprint and its view of the
// shm directory, as a raw session sends it.
inline engram::v1::ClientMessage SharingHello(const std::string& ckpt, const std::string& shm, int dp_size) {
  engram::v1::ClientMessage m;
  auto ck = Checkpoint::Open(ckpt);
  EXPECT_TRUE(ck.ok()) << ck.status();
  struct stat st {};
  EXPECT_EQ(::stat(shm.c_str(), &st), 0) << shm;  // the daemon's directory exists (the hello no longer names it)
  auto* h = m.mutable_hello();
  if (ck.ok()) h->set_fingerprint((*ck)->Fingerprint());
  h->set_tp_size(1);
  h->set_dp_size(dp_size);
  return m;
}

// grpc.health.v1.Health/Check through the generic stub: the response's status byte (1 SERVING, 2 NOT_SERVING), or
// 100 + the gRPC error code (its message on stderr), or 99 when the call did not complete (no daemon), 98/97 for an
// unreadable answer.
inline int HealthCheck(const std::string& socket,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::CompletionQueue cq;
  // HealthCheckRequest{service: ""}, with the empty field written out (the server refuses an empty buffer).
  const char req_bytes[] = {0x0a, 0x00};
  grpc::Slice req_slice(req_bytes, sizeof(req_bytes));
  grpc::ByteBuffer request(&req_slice, 1), response;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) return 99;
  if (!status.ok()) {
    std::cerr << "health: " << status.error_message() << "\n";  // tests read the refusal's message
    return 100 + status.error_code();
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return 98;
  std::string bytes;
  for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 97;
}

}  // namespace engram::testing
