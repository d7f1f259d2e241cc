// bench_soak: the session rate, which the soak test (tests/integration/daemon_test.cc,
// SoakSessionsKillsAndStatusLeakNothing) does not assert. Starts engramd on a small synthetic checkpoint in a private
// temporary directory (its own shm directory and socket), then runs `--clients` threads of attach/detach sessions
// (every fourth takes and returns a registration ticket) for `--seconds`, while one thread polls Status; prints
// sessions/s, failures and the status latency p50 / max. No threshold: numbers for bench/RESULTS.md.
// Usage: bench_soak [--seconds S] [--clients N] [--engramd PATH]
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "tools/synthetic.h"

extern char** environ;

int main(int argc, char** argv) {
  double seconds = 15;
  int clients = 64;
  std::string engramd = std::filesystem::path(argv[0]).parent_path().string() + "/../daemon/engramd";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seconds") seconds = std::atof(argv[i + 1]);
    if (a == "--clients") clients = std::atoi(argv[i + 1]);
    if (a == "--engramd") engramd = argv[i + 1];
  }
  char tmpl[] = "/tmp/engram-bench-soak-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string shm = dir + "/shm", sock = dir + "/engramd.sock";
  ::mkdir(shm.c_str(), 0755);
  engram::tools::SyntheticSpec spec;
  spec.out_dir = dir + "/ck";
  spec.table_mib = 16;
  if (auto r = engram::tools::WriteSyntheticCheckpoint(spec); !r.ok()) {
    std::fprintf(stderr, "checkpoint: %s\n", std::string(r.status().message()).c_str());
    return 1;
  }
  std::vector<std::string> args = {engramd, "--checkpoint", spec.out_dir, "--shm-dir",   shm,   "--socket",
                                   sock,    "--tickets",    "4",          "--log-level", "warn"};
  std::vector<char*> av;
  for (auto& s : args) av.push_back(s.data());
  av.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, av[0], nullptr, nullptr, av.data(), environ) != 0) return 1;
  auto stub = engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + sock, grpc::InsecureChannelCredentials()));
  // Ready: Status answers with every segment READY.
  for (bool ready = false; !ready;) {
    grpc::ClientContext ctx;
    engram::v1::StatusReply r;
    ready = stub->Status(&ctx, engram::v1::StatusRequest(), &r).ok() && r.segments_size() > 0 &&
            std::all_of(r.segments().begin(), r.segments().end(), [](const auto& s) { return s.state() == "READY"; });
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto ck = engram::Checkpoint::Open(spec.out_dir);
  engram::v1::ClientMessage hello;
  hello.mutable_hello()->set_fingerprint((*ck)->Fingerprint());
  hello.mutable_hello()->set_tp_size(1);
  hello.mutable_hello()->set_dp_size(64);
  auto one_session = [&](bool ticket) {
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    engram::v1::ServerMessage m;
    if (!s->Write(hello) || !s->Read(&m) || !m.has_grant()) return false;
    if (ticket) {
      engram::v1::ClientMessage t;
      t.mutable_ticket_request();
      engram::v1::ServerMessage got;
      if (!s->Write(t) || !s->Read(&got)) return false;
      engram::v1::ClientMessage res;
      res.mutable_register_result()->set_ok(true);
      res.mutable_register_result()->set_backend("cpu");
      s->Write(res);
    }
    ctx.TryCancel();
    s->Finish();
    return true;
  };
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::duration<double>(seconds);
  std::atomic<long> sessions{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < clients; ++t) {
    threads.emplace_back([&, t] {
      while (std::chrono::steady_clock::now() < deadline) (one_session(t % 4 == 0) ? sessions : failures)++;
    });
  }
  std::vector<double> status_ms;
  std::thread poller([&] {
    while (std::chrono::steady_clock::now() < deadline) {
      grpc::ClientContext ctx;
      engram::v1::StatusReply r;
      const auto s0 = std::chrono::steady_clock::now();
      if (stub->Status(&ctx, engram::v1::StatusRequest(), &r).ok()) {
        status_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  for (auto& t : threads) t.join();
  poller.join();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::sort(status_ms.begin(), status_ms.end());
  std::printf(
      "soak: %d clients, %.1f s: %ld sessions (%.0f/s), %ld failed; status polls %zu, p50 %.3f ms, max %.3f ms\n",
      clients, elapsed, sessions.load(), static_cast<double>(sessions) / elapsed, failures.load(), status_ms.size(),
      status_ms.empty() ? 0.0 : status_ms[status_ms.size() / 2], status_ms.empty() ? 0.0 : status_ms.back());
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);  // this run's directory only (its shm directory included)
  return failures == 0 ? 0 : 1;
}
