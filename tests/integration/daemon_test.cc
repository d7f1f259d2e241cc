// engramd as a real process, with real replica sessions (`engramctl attach` processes), a real Unix socket and
// real shared memory: publish, share, leases and kill -9, crash debris, adoption after restart without reading
// the tables again, capacity and visibility fallbacks, refusals, and hostile clients. The daemon must stay up.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>
#include <set>
#include <sstream>

#include "engram/v1/engram.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "model/checkpoint.h"
#include "shm/segment.h"
#include "tests/integration/json_lines.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;

class Daemon {
 public:
  Daemon(const TempDir& dir, const std::vector<std::string>& extra, const std::string& name = "engramd")
      : socket_(dir / (name + ".sock")) {
    std::vector<std::string> argv = {BinPath("../daemon/engramd"), "--socket", socket_, "--log-level", "debug"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc_ = Process(argv, dir / (name + ".log"));
  }
  const std::string& socket() const { return socket_; }
  Process& proc() { return proc_; }
  // Status as JSON through engramctl; null when the daemon does not answer.
  json Status() const {
    auto r = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
    return r.exit_code == 0 ? json::parse(r.out) : json();
  }
  bool WaitReady(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) {
    return WaitFor(
        [&] {
          json s = Status();
          if (s.is_null() || s["segments"].empty()) return false;
          for (const auto& seg : s["segments"]) {
            if (seg["state"] != "READY" && seg["state"] != "FAILED") return false;
          }
          return true;
        },
        timeout);
  }

 private:
  std::string socket_;
  Process proc_;
};

std::string MakeCheckpoint(const TempDir& dir, double mib, const std::string& name = "ck", int seed = 1) {
  auto r = RunCmd(BinPath("engram-mkckpt") + " --out " + (dir / name) + " --table-mib " + std::to_string(mib) +
                  " --seed " + std::to_string(seed));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return dir / name;
}

Process Attach(const TempDir& dir, const Daemon& d, const std::string& ckpt, const std::string& shm,
               const std::string& extra, const std::string& log) {
  std::vector<std::string> argv = {BinPath("engramctl"), "attach", "--socket", d.socket(), "--checkpoint", ckpt,
                                   "--shm-dir", shm};
  std::istringstream ss(extra);
  std::string w;
  while (ss >> w) argv.push_back(w);
  return Process(argv, dir / log);
}

json FirstJson(const std::string& out) { return testing::JsonLine(out, false); }
std::set<std::string> Reasons(const json& j) { return testing::ReasonSet(j); }

uint64_t ReadBytesOf(pid_t pid) {  // bytes the process read through read()/pread() so far
  std::ifstream in("/proc/" + std::to_string(pid) + "/io");
  std::string k;
  uint64_t v = 0;
  while (in >> k >> v) {
    if (k == "rchar:") return v;
  }
  return 0;
}

TEST(DaemonTest, PublishesSharesAndHoldsLeases) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 2048);
  Daemon d(dir, {"--checkpoint", ckpt, "--tp", "1,2", "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  json s = d.Status();
  ASSERT_EQ(s["segments"].size(), 3u);
  for (const auto& seg : s["segments"]) {
    EXPECT_EQ(seg["state"], "READY");
    EXPECT_EQ(seg["origin"], "published");
    struct stat st {};
    ASSERT_EQ(::stat((shm + "/" + seg["name"].get<std::string>()).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0640u);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), seg["bytes"].get<uint64_t>());
  }
  // 8 replicas (DP 4 x TP 2) attach at once; each checks 200 random rows per layer against the checkpoint.
  std::vector<Process> replicas;
  for (int i = 0; i < 8; ++i) {
    replicas.push_back(Attach(dir, d, ckpt, shm,
                              "--dp-size 4 --dp-rank " + std::to_string(i / 2) + " --tp-size 2 --tp-rank " +
                                  std::to_string(i % 2) + " --verify 200 --ticket --hold 60",
                              "replica" + std::to_string(i) + ".log"));
  }
  ASSERT_TRUE(WaitFor([&] { return d.Status()["replicas"].size() == 8; }, std::chrono::seconds(30)));
  for (auto& r : replicas) {
    ASSERT_TRUE(WaitFor([&] { return !FirstJson(r.Output()).is_null(); }, std::chrono::seconds(30)));
    json j = FirstJson(r.Output());
    EXPECT_EQ(j["decision"], "shared") << r.Output();
    EXPECT_EQ(j["verified"], 400);
    EXPECT_EQ(j["mismatches"], 0);
  }
  std::set<int> pids_before;
  const json attached = d.Status();
  for (const auto& r : attached["replicas"]) {
    pids_before.insert(r["pid"].get<int>());
    EXPECT_EQ(r["mode"], "SHARED");
    EXPECT_EQ(r["uid"], ::getuid());
    EXPECT_EQ(r["backend"], "cpu");  // pinned with mlock: no GPU here
    EXPECT_GE(r["register_seconds"].get<double>(), 0.0);
  }
  for (auto& r : replicas) {
    EXPECT_TRUE(pids_before.count(r.pid())) << "status pid is the peer's real pid: " << r.pid() << " vs "
                                            << d.Status()["replicas"].dump();
  }
  // kill -9 one replica: its lease goes within a second, the others stay.
  const pid_t victim = replicas[3].pid();
  replicas[3].Signal(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor([&] { return d.Status()["replicas"].size() == 7; }, std::chrono::seconds(5)));
  const double released = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(released, 1.0) << "lease released after " << released << " s";
  const json after = d.Status();
  for (const auto& r : after["replicas"]) EXPECT_NE(r["pid"], victim);
  EXPECT_TRUE(d.proc().Running());
}

TEST(DaemonTest, CrashDuringPublishLeavesNoReadyDebrisAndRestartAdoptsWithoutReadingTables) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 3072);
  {
    Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1"}, "first");
    ASSERT_TRUE(WaitFor([&] {
      json s = d.Status();
      return !s.is_null() && !s["segments"].empty() && s["segments"][0]["state"] == "LOADING" &&
             s["segments"][0]["progress"].get<double>() > 0.05;
    }, std::chrono::seconds(60)));
    d.proc().Signal(SIGKILL);
    d.proc().Wait();
  }
  // What the crash left: one segment file, and it is not READY.
  auto left = ListSegments(shm);
  ASSERT_EQ(left.size(), 1u);
  auto h = ReadSegmentHeader(shm + "/" + left[0]);
  ASSERT_TRUE(h.ok());
  EXPECT_NE(h->state, static_cast<uint32_t>(SegmentState::kReady));
  {
    Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "second");
    ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
    EXPECT_NE(d.proc().Output().find("event=segment_debris"), std::string::npos) << d.proc().Output();
    EXPECT_EQ(d.Status()["segments"][0]["origin"], "published");
    // A replica attaches and holds its mapping while the daemon is killed and restarted.
    Process replica = Attach(dir, d, ckpt, shm, "--verify 100 --hold 8", "holder.log");
    ASSERT_TRUE(WaitFor([&] { return !FirstJson(replica.Output()).is_null(); }, std::chrono::seconds(20)));
    EXPECT_EQ(FirstJson(replica.Output())["decision"], "shared");
    d.proc().Signal(SIGKILL);
    d.proc().Wait();
    Daemon again(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "third");
    ASSERT_TRUE(again.WaitReady(std::chrono::milliseconds(20000))) << again.proc().Output();
    json s = again.Status();
    EXPECT_EQ(s["segments"][0]["origin"], "adopted");
    EXPECT_EQ(s["segments"][0]["state"], "READY");
    // Adoption read the checkpoint's small files and headers only: far less than the 3 GiB of tables.
    const uint64_t read = ReadBytesOf(again.proc().pid());
    EXPECT_LT(read, uint64_t{64} << 20) << "the restarted daemon read " << read << " bytes";
    ASSERT_TRUE(WaitFor([&] { return again.Status()["segments"][0]["checksum_state"] == "ok"; },
                        std::chrono::seconds(60)));
    EXPECT_EQ(replica.Wait(), 0) << replica.Output();
    EXPECT_NE(replica.Output().find("\"remismatches\":0"), std::string::npos) << replica.Output();
  }
}

TEST(DaemonTest, ShmTooSmallAndMissingGiveFallbackReasons) {
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 64);
  const std::string small = dir / "small";
  ::mkdir(small.c_str(), 0755);
  if (::mount("tmpfs", small.c_str(), "tmpfs", 0, "size=16m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root): " << std::strerror(errno);
  }
  {
    Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", small}, "small");
    ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
    EXPECT_EQ(d.Status()["segments"][0]["state"], "FAILED");
    EXPECT_TRUE(ListSegments(small).empty()) << "nothing may be created when the tables do not fit";
    Process r = Attach(dir, d, ckpt, small, "--dp-size 2", "small-replica.log");
    EXPECT_EQ(r.Wait(), 0);
    json j = FirstJson(r.Output());
    EXPECT_EQ(j["decision"], "fallback");
    EXPECT_EQ(j["mode"], "PRIVATE_PINNED");
    EXPECT_TRUE(Reasons(j).count("SHM_TOO_SMALL")) << r.Output();
    EXPECT_NE(j.dump().find("--shm-size"), std::string::npos) << "the hint says what to do";
    EXPECT_TRUE(d.proc().Running());
  }
  ::umount(small.c_str());
  {
    Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", dir / "nope"}, "missing");
    ASSERT_TRUE(WaitFor([&] { return !d.Status().is_null(); }, std::chrono::seconds(20))) << d.proc().Output();
    Process r = Attach(dir, d, ckpt, dir / "nope", "", "missing-replica.log");
    EXPECT_EQ(r.Wait(), 0);
    EXPECT_TRUE(Reasons(FirstJson(r.Output())).count("SHM_MISSING")) << r.Output();
  }
}

TEST(DaemonTest, FallbackReasonsFromTheTopologyAndConfig) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 16);
  const std::string other = MakeCheckpoint(dir, 16, "other", 7);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--tp", "1"});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  struct Case {
    std::string args, ckpt, shm, reason, mode;
  } cases[] = {
      {"--dp-size 1", ckpt, shm, "DP_SIZE_ONE", "PRIVATE_PINNED"},
      {"--dp-size 4 --local-dp-size 2", ckpt, shm, "NOT_COLOCATED", "PRIVATE_PINNED"},
      {"--elastic-ep", ckpt, shm, "ELASTIC_EP", "PRIVATE_PINNED"},
      {"--cpu-offload false", ckpt, shm, "CPU_OFFLOAD_DISABLED", "DEVICE"},
      {"--embedding-across-dp --dp-size 1", ckpt, shm, "DP_SIZE_ONE", "DP_SHARDED"},
      {"", ckpt, "/tmp", "SHM_NOT_VISIBLE", "PRIVATE_PINNED"},
      {"", other, shm, "FINGERPRINT_MISMATCH", "PRIVATE_PINNED"},
      {"--tp-size 2 --tp-rank 1", ckpt, shm, "SEGMENT_NOT_READY", "PRIVATE_PINNED"},
  };
  int i = 0;
  for (const auto& c : cases) {
    Process r = Attach(dir, d, c.ckpt, c.shm, c.args, "case" + std::to_string(i++) + ".log");
    EXPECT_EQ(r.Wait(), 0) << r.Output();
    json j = FirstJson(r.Output());
    EXPECT_EQ(j["decision"], "fallback") << c.args;
    EXPECT_TRUE(Reasons(j).count(c.reason)) << c.args << ": " << r.Output();
    EXPECT_EQ(j["mode"], c.mode) << c.args;
  }
  json s = d.Status();
  EXPECT_GE(s["recent_fallbacks"].size(), 8u);
  // A registration that fails turns the shared replica into a fallback with REGISTER_FAILED.
  Process r = Attach(dir, d, ckpt, shm, "--ticket --register-ok false --hold 3", "regfail.log");
  ASSERT_TRUE(WaitFor([&] {
    const json now = d.Status();
    for (const auto& rep : now["replicas"]) {
      for (const auto& x : rep["reasons"]) {
        if (x == "REGISTER_FAILED") return true;
      }
    }
    return false;
  }, std::chrono::seconds(10))) << r.Output() << d.Status().dump();
  EXPECT_TRUE(d.proc().Running());
}

// Containers, without Docker: a replica in its own mount namespace with a private /dev/shm (a container without
// --ipc=host) falls back with SHM_NOT_VISIBLE; one in its own namespace that still sees the host's /dev/shm shares.
TEST(DaemonTest, PrivateShmNamespaceFallsBackSharedOneShares) {
  if (RunCmd("unshare -m --propagation private true").exit_code != 0) GTEST_SKIP() << "cannot create mount namespaces";
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 16);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", "/dev/shm"});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  const std::string attach = BinPath("engramctl") + " attach --socket " + d.socket() + " --checkpoint " + ckpt +
                             " --shm-dir /dev/shm --dp-size 2";
  auto priv = RunCmd("unshare -m --propagation private sh -c 'mount -t tmpfs -o size=8m tmpfs /dev/shm && " + attach +
                     "'");
  EXPECT_EQ(priv.exit_code, 0) << priv.err;
  json j = FirstJson(priv.out);
  EXPECT_EQ(j["decision"], "fallback") << priv.out;
  EXPECT_EQ(Reasons(j), std::set<std::string>{"SHM_NOT_VISIBLE"});
  auto shared = RunCmd("unshare -m --propagation private sh -c '" + attach + "'");
  EXPECT_EQ(shared.exit_code, 0) << shared.err;
  EXPECT_EQ(FirstJson(shared.out)["decision"], "shared") << shared.out;
  ASSERT_EQ(RunCmd(BinPath("engramctl") + " unload --checkpoint " + ckpt + " --socket " + d.socket()).exit_code, 0);
}

TEST(DaemonTest, WatchShowsProgressAndMetricsFileCounts) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 1536);
  const std::string metrics = dir / "engramd.prom";
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1", "--metrics-file", metrics});
  ASSERT_TRUE(WaitFor([&] { return !d.Status().is_null(); }, std::chrono::seconds(20)));
  Process watch({BinPath("engramctl"), "watch", "--socket", d.socket(), "--interval", "0.2"}, dir / "watch.log");
  EXPECT_EQ(watch.Wait(std::chrono::milliseconds(120000)), 0) << watch.Output();
  const std::string w = watch.Output();
  EXPECT_NE(w.find("LOADING"), std::string::npos) << w;
  EXPECT_NE(w.find("GiB/s"), std::string::npos) << w;
  EXPECT_NE(w.find("eta"), std::string::npos) << w;
  Process r = Attach(dir, d, ckpt, shm, "--dp-size 1", "fallback.log");
  EXPECT_EQ(r.Wait(), 0);
  ASSERT_TRUE(WaitFor([&] {
    const std::string m = testing::ReadFile(metrics);
    return m.find("engram_fallbacks_total{reason=\"DP_SIZE_ONE\"} 1") != std::string::npos;
  }, std::chrono::seconds(10))) << testing::ReadFile(metrics);
  const std::string m = testing::ReadFile(metrics);
  EXPECT_NE(m.find("engram_segments{state=\"READY\"} 1"), std::string::npos) << m;
  EXPECT_NE(m.find("engram_publish_gib_per_second{segment="), std::string::npos) << m;
  EXPECT_NE(m.find("engram_replicas{mode=\"SHARED\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("# TYPE engram_fallbacks_total counter"), std::string::npos) << m;
}

int CountFds(pid_t pid) {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) ++n;
  return n;
}

long RssKib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string k;
  long v = 0;
  while (in >> k) {
    if (k == "VmRSS:") {
      in >> v;
      return v;
    }
  }
  return 0;
}

// Lifecycle under load: 64 sessions attaching and detaching in a loop while status is polled and a replica
// process is killed (-9) every 2 seconds. Afterwards: no leases, fds, mappings or segments leaked, memory flat.
TEST(DaemonTest, SoakSessionsKillsAndStatusLeakNothing) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 16);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--tickets", "4"});
  ASSERT_TRUE(d.WaitReady());
  const pid_t daemon_pid = d.proc().pid();
  auto ck = Checkpoint::Open(ckpt);
  ASSERT_TRUE(ck.ok());
  struct stat sst {};
  ::stat(shm.c_str(), &sst);
  engram::v1::ClientMessage hello;
  hello.mutable_hello()->set_fingerprint((*ck)->Fingerprint());
  hello.mutable_hello()->set_tp_size(1);
  hello.mutable_hello()->set_dp_size(64);
  hello.mutable_hello()->set_shm_visible(true);
  hello.mutable_hello()->set_shm_dev(sst.st_dev);
  hello.mutable_hello()->set_shm_ino(sst.st_ino);
  auto channel = grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials());
  auto stub = engram::v1::Engram::NewStub(channel);
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
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(one_session(true));  // warm up pools and allocator
  ASSERT_TRUE(WaitFor([&] { return d.Status()["replicas"].empty(); }, std::chrono::seconds(5)));
  const int fds0 = CountFds(daemon_pid);
  const long rss0 = RssKib(daemon_pid);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  std::atomic<int> sessions{0}, failures{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 64; ++t) {
    clients.emplace_back([&, t] {
      while (std::chrono::steady_clock::now() < deadline) (one_session(t % 4 == 0) ? sessions : failures)++;
    });
  }
  std::vector<double> status_ms;
  std::thread poller([&] {
    while (std::chrono::steady_clock::now() < deadline) {
      grpc::ClientContext ctx;
      engram::v1::StatusReply r;
      const auto t0 = std::chrono::steady_clock::now();
      if (stub->Status(&ctx, engram::v1::StatusRequest(), &r).ok()) {
        status_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  int kills = 0;
  while (std::chrono::steady_clock::now() + std::chrono::seconds(2) < deadline) {
    Process victim = Attach(dir, d, ckpt, shm, "--dp-size 64 --hold 30", "victim.log");
    std::this_thread::sleep_for(std::chrono::seconds(1));
    victim.Signal(SIGKILL);
    victim.Wait();
    ++kills;
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  for (auto& c : clients) c.join();
  poller.join();
  ASSERT_TRUE(WaitFor([&] { return d.Status()["replicas"].empty(); }, std::chrono::seconds(5)))
      << "leases leaked: " << d.Status()["replicas"].dump();
  ASSERT_TRUE(WaitFor([&] { return CountFds(daemon_pid) <= fds0 + 4; }, std::chrono::seconds(10)))
      << "fds " << fds0 << " -> " << CountFds(daemon_pid);
  const long rss1 = RssKib(daemon_pid);
  std::sort(status_ms.begin(), status_ms.end());
  std::cout << "[ soak ] sessions " << sessions << " failed " << failures << " kills " << kills << " status polls "
            << status_ms.size() << " p50 " << status_ms[status_ms.size() / 2] << " ms max " << status_ms.back()
            << " ms; daemon fds " << fds0 << " -> " << CountFds(daemon_pid) << ", rss " << rss0 << " -> " << rss1
            << " KiB\n";
  EXPECT_GT(sessions, 1000);
  EXPECT_EQ(failures, 0);
  EXPECT_GE(kills, 5);
  EXPECT_LT(rss1 - rss0, 32 * 1024) << "daemon memory grew";
  EXPECT_EQ(ListSegments(shm).size(), 1u);
  json s = d.Status();
  EXPECT_EQ(s["segments"][0]["state"], "READY");
  std::ifstream maps("/proc/" + std::to_string(daemon_pid) + "/maps");
  std::stringstream all;
  all << maps.rdbuf();
  EXPECT_EQ(all.str().find("engram-"), std::string::npos) << "the daemon keeps no segment mapped";
  EXPECT_TRUE(d.proc().Running());
}

// grpc.health.v1.Health/Check through the generic stub: the response's status byte (1 SERVING, 2 NOT_SERVING).
int HealthStatus(const std::string& socket) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
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
  if (!cq.Next(&tag, &ok) || !ok || !status.ok()) {
    std::cerr << "health: " << status.error_code() << " " << status.error_message() << "\n";
    return -1;
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
}

TEST(DaemonTest, HealthIsNotServingWhileLoadingThenServing) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 2048);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1"});
  ASSERT_TRUE(WaitFor([&] { return HealthStatus(d.socket()) != -1; }, std::chrono::seconds(20))) << d.proc().Output();
  EXPECT_EQ(HealthStatus(d.socket()), 2) << "NOT_SERVING while the segment loads";
  ASSERT_TRUE(d.WaitReady());
  EXPECT_TRUE(WaitFor([&] { return HealthStatus(d.socket()) == 1; }, std::chrono::seconds(10)));
}

TEST(DaemonTest, StartupRefusals) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon first(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(first.WaitReady());
  // A second daemon on the same socket.
  Process second({BinPath("../daemon/engramd"), "--checkpoint", ckpt, "--shm-dir", shm, "--socket", first.socket()},
                 dir / "second.log");
  EXPECT_EQ(second.Wait(), 1);
  EXPECT_NE(second.Output().find("another engramd is already serving"), std::string::npos) << second.Output();
  EXPECT_TRUE(first.proc().Running());
  // A truncated checkpoint, and one whose compressed vocabulary disagrees with its tokenizer.
  const std::string bad = MakeCheckpoint(dir, 8, "bad");
  ASSERT_EQ(RunCmd("truncate -s -1000 " + bad + "/model-00002-of-00002.safetensors").exit_code, 0);
  Process p1({BinPath("../daemon/engramd"), "--checkpoint", bad, "--shm-dir", shm, "--socket", dir / "x.sock"},
             dir / "p1.log");
  EXPECT_EQ(p1.Wait(), 1);
  EXPECT_NE(p1.Output().find("truncated"), std::string::npos) << p1.Output();
  const std::string vocab = MakeCheckpoint(dir, 8, "vocab");
  json cfg = json::parse(testing::ReadFile(vocab + "/config.json"));
  const int64_t real = cfg["engram_compressed_vocab_size"];
  cfg["engram_compressed_vocab_size"] = real + 1;
  testing::WriteFile(vocab + "/config.json", cfg.dump());
  Process p2({BinPath("../daemon/engramd"), "--checkpoint", vocab, "--shm-dir", shm, "--socket", dir / "y.sock"},
             dir / "p2.log");
  EXPECT_EQ(p2.Wait(), 1);
  EXPECT_NE(p2.Output().find(std::to_string(real)), std::string::npos) << p2.Output();
  EXPECT_NE(p2.Output().find(std::to_string(real + 1)), std::string::npos) << p2.Output();
  Process p3({BinPath("../daemon/engramd"), "--shm-dir", shm}, dir / "p3.log");
  EXPECT_EQ(p3.Wait(), 2);
}

TEST(DaemonTest, HostileClientsAndForeignUsersDoNotHurtIt) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady());
  auto stub = engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
  {  // first message not a hello
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    engram::v1::ClientMessage m;
    m.mutable_ticket_request();
    s->Write(m);
    s->WritesDone();
    grpc::Status st = s->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("first message"), std::string::npos);
  }
  {  // impossible topology
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    engram::v1::ClientMessage m;
    m.mutable_hello()->set_tp_size(2);
    m.mutable_hello()->set_tp_rank(5);
    m.mutable_hello()->set_dp_size(1);
    s->Write(m);
    s->WritesDone();
    grpc::Status st = s->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("invalid topology"), std::string::npos) << st.error_message();
  }
  {  // a ticket without a grant, after a fallback
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    engram::v1::ClientMessage m;
    m.mutable_hello()->set_tp_size(1);
    m.mutable_hello()->set_dp_size(1);
    s->Write(m);
    engram::v1::ServerMessage answer;
    ASSERT_TRUE(s->Read(&answer));
    EXPECT_TRUE(answer.has_fallback());
    engram::v1::ClientMessage t;
    t.mutable_ticket_request();
    s->Write(t);
    s->WritesDone();
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  {  // an oversized message
    grpc::ClientContext ctx;
    engram::v1::LoadRequest big;
    big.set_checkpoint(std::string(4 << 20, 'x'));
    engram::v1::LoadReply reply;
    EXPECT_EQ(stub->Load(&ctx, big, &reply).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  {  // raw garbage on the socket
    int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, d.socket().c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    std::string junk(100000, '\x17');
    (void)!::write(s, junk.data(), junk.size());
    ::close(s);
  }
  {  // load of a missing checkpoint
    grpc::ClientContext ctx;
    engram::v1::LoadRequest req;
    req.set_checkpoint(dir / "nothing");
    engram::v1::LoadReply reply;
    EXPECT_EQ(stub->Load(&ctx, req, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // A user outside the allowed group: the daemon reads its real uid from the socket and refuses.
  ::chmod(d.socket().c_str(), 0666);
  ::chmod(dir.path().c_str(), 0755);
  auto r = RunCmd("setpriv --reuid=65534 --regid=65534 --clear-groups " + BinPath("engramctl") + " status --socket " +
                  d.socket());
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("uid 65534 may not use engramd"), std::string::npos) << r.err;
  EXPECT_TRUE(d.proc().Running());
  EXPECT_FALSE(d.Status().is_null()) << "still serving everyone else";
  // SIGTERM: a clean stop that leaves the READY segment in place.
  d.proc().Signal(SIGTERM);
  EXPECT_EQ(d.proc().Wait(), 0) << d.proc().Output();
  EXPECT_EQ(ListSegments(shm).size(), 1u);
  EXPECT_EQ(RunCmd(BinPath("engramctl") + " status --socket " + d.socket()).exit_code, 3);
}

TEST(DaemonTest, NotifiesReadinessThroughNotifySocket) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string ckpt = MakeCheckpoint(dir, 256);
  testing::NotifySocket notify(dir / "notify.sock");
  ASSERT_TRUE(notify.bound());
  notify.Export();
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1"});
  testing::NotifySocket::Unexport();
  ASSERT_TRUE(WaitFor([&] { return notify.Drain().find("READY=1") != std::string::npos; }, std::chrono::seconds(60)))
      << notify.Drain();
  const std::string all = notify.Drain();
  EXPECT_NE(all.find("STATUS=serving: 1/1 segments ready"), std::string::npos) << all;
  EXPECT_EQ(d.Status()["segments"][0]["state"], "READY") << "READY=1 only once the segments are";
  d.proc().Signal(SIGTERM);
  EXPECT_EQ(d.proc().Wait(), 0);
  EXPECT_NE(notify.Drain().find("STOPPING=1"), std::string::npos) << notify.Drain();
  // The status command also takes --socket before the subcommand.
  EXPECT_EQ(RunCmd(BinPath("engramctl") + " --socket " + d.socket() + " status").exit_code, 3);
}

TEST(DaemonTest, LoadUnloadAndReload) {
  TempDir dir;
  const std::string shm = dir / "shm";
  ::mkdir(shm.c_str(), 0755);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string b = MakeCheckpoint(dir, 8, "b", 2);
  testing::WriteFile(dir / "engramd.conf", "# test\ncheckpoint = " + a + "\ntp = 1\nshm_dir = " + shm + "\n");
  Daemon d(dir, {"--config", dir / "engramd.conf"});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  EXPECT_EQ(d.Status()["segments"].size(), 1u);
  ASSERT_EQ(RunCmd(BinPath("engramctl") + " load --checkpoint " + b + " --tp 1,2 --socket " + d.socket()).exit_code, 0);
  ASSERT_TRUE(WaitFor([&] { return d.Status()["segments"].size() == 4; }, std::chrono::seconds(10)));
  ASSERT_TRUE(d.WaitReady());
  EXPECT_EQ(ListSegments(shm).size(), 4u);
  ASSERT_EQ(RunCmd(BinPath("engramctl") + " unload --checkpoint " + a + " --socket " + d.socket()).exit_code, 0);
  EXPECT_EQ(ListSegments(shm).size(), 3u);
  // SIGHUP re-reads the file: it names only `a`, so `b` goes and `a` comes back.
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] {
    json s = d.Status();
    return s["segments"].size() == 1 && s["segments"][0]["checkpoint"] == a && s["segments"][0]["state"] == "READY";
  }, std::chrono::seconds(20))) << d.proc().Output();
  EXPECT_EQ(ListSegments(shm).size(), 1u);
  EXPECT_EQ(RunCmd(BinPath("engramctl") + " unload --checkpoint /nope --socket " + d.socket()).exit_code, 1);
}

}  // namespace
}  // namespace engram
