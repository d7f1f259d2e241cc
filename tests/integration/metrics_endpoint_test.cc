// A real engramd with --metrics-address on a port the kernel picks, scraped over HTTP: the families are there, the
// textfile says the same, the values move with what replicas do (an attach that registers, a fallback), and clients
// that hold the HTTP port open do not stop the daemon's gRPC side (engramctl status) nor other scrapes.
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engram/version.h"
#include "gtest/gtest.h"
#include "tests/http_client.h"
#include "tests/integration/daemon_harness.h"

namespace engram {
namespace {

using testing::Daemon;
using testing::HttpGet;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::Process;
using testing::TcpConnection;
using testing::TempDir;

// The port the daemon logged (`event=metrics_listening address=127.0.0.1:PORT`); 0 when it did not.
int MetricsPort(const Daemon& d) {
  const std::string marker = "event=metrics_listening address=127.0.0.1:";
  if (!d.WaitLog(marker)) return 0;
  const std::string log = d.Log();
  size_t at = log.find(marker) + marker.size();
  int port = 0;
  for (; at < log.size() && log[at] >= '0' && log[at] <= '9'; ++at) port = port * 10 + (log[at] - '0');
  return port;
}

// Sample lines: "name{labels}" -> value.
std::map<std::string, std::string> Samples(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    out[line.substr(0, sp)] = line.substr(sp + 1);
  }
  return out;
}

std::string Scrape(int port) { return HttpGet(port).body; }

std::string Value(int port, const std::string& sample) {
  auto s = Samples(Scrape(port));
  auto it = s.find(sample);
  return it == s.end() ? "" : it->second;
}

int RunAttach(const TempDir& dir, const Daemon& d, const std::string& ckpt, const std::string& shm,
              const std::vector<std::string>& extra, const std::string& log) {
  std::vector<std::string> argv = {
      testing::BinPath("engramctl"), "attach", "--socket", d.socket(), "--checkpoint", ckpt, "--shm-dir", shm};
  argv.insert(argv.end(), extra.begin(), extra.end());
  Process p(argv, dir / log);
  return p.Wait(std::chrono::milliseconds(60000));
}

TEST(MetricsEndpointTest, ScrapesTheFamiliesAndTheyMove) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  const std::string file = dir / "engramd.prom";
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1", "--metrics-address", "127.0.0.1:0",
                 "--metrics-file", file});
  const int port = MetricsPort(d);
  ASSERT_NE(port, 0) << d.Log();
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  auto s = Samples(Scrape(port));
  EXPECT_EQ(s["engram_build_info{version=\"" ENGRAM_VERSION_STRING "\"}"], "1");
  EXPECT_EQ(s["engram_segments{state=\"READY\"}"], "1");
  const std::string segment = d.Status()["segments"][0]["name"];
  EXPECT_EQ(s["engram_publish_bytes{segment=\"" + segment + "\",kind=\"done\"}"],
            s["engram_publish_bytes{segment=\"" + segment + "\",kind=\"total\"}"]);
  EXPECT_NE(s["engram_publish_bytes{segment=\"" + segment + "\",kind=\"total\"}"], "0");
  EXPECT_EQ(s["engram_register_seconds_count"], "0");
  EXPECT_EQ(s["engram_attach_seconds_count"], "0");
  EXPECT_EQ(s["engram_fallbacks_total{reason=\"ELASTIC_EP\"}"], "0");

  // One rendering for both: the textfile has the same samples as the scrape.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto f = Samples(testing::ReadFile(file)), h = Samples(Scrape(port));
        std::set<std::string> fk, hk;
        for (const auto& [k, v] : f) fk.insert(k);
        for (const auto& [k, v] : h) hk.insert(k);
        return !fk.empty() && fk == hk;
      },
      std::chrono::seconds(20)))
      << testing::ReadFile(file) << "\n---\n"
      << Scrape(port);

  // A replica that attaches and reports its registration (mlock stands in for CUDA's; a failed one is reported too).
  EXPECT_EQ(RunAttach(dir, d, ckpt, shm, {"--ticket"}, "attach.log"), 0) << testing::ReadFile(dir / "attach.log");
  EXPECT_TRUE(
      testing::WaitFor([&] { return Value(port, "engram_register_seconds_count") == "1"; }, std::chrono::seconds(20)))
      << Scrape(port);
  EXPECT_EQ(Value(port, "engram_attach_seconds_count"), "1");
  EXPECT_EQ(Value(port, "engram_attach_seconds_bucket{le=\"+Inf\"}"), "1");
  // A fallback, counted by its reason.
  EXPECT_EQ(RunAttach(dir, d, ckpt, shm, {"--elastic-ep"}, "fallback.log"), 0)
      << testing::ReadFile(dir / "fallback.log");
  EXPECT_TRUE(testing::WaitFor([&] { return Value(port, "engram_fallbacks_total{reason=\"ELASTIC_EP\"}") == "1"; },
                               std::chrono::seconds(20)))
      << Scrape(port);
  EXPECT_EQ(Value(port, "engram_sessions_total"), "2");
}

// Many clients that open the HTTP port and send half a request: engramctl status keeps answering over the socket,
// and a scraper still gets its answer (each new connection evicts the oldest waiting one).
TEST(MetricsEndpointTest, SlowHttpClientsDoNotStopStatusOrScrapes) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1", "--metrics-address", "127.0.0.1:0"});
  const int port = MetricsPort(d);
  ASSERT_NE(port, 0) << d.Log();
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  std::vector<std::unique_ptr<TcpConnection>> slow;
  for (int i = 0; i < 64; ++i) {
    slow.push_back(std::make_unique<TcpConnection>(port));
    ASSERT_TRUE(slow.back()->ok());
    (void)slow.back()->Send("GET /metrics HTTP/1.1\r\nX-Slow: ");
  }
  for (int round = 0; round < 3; ++round) {
    auto r = testing::RunCmd(testing::BinPath("engramctl") + " status --json --socket " + d.socket());
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("\"segments\""), std::string::npos) << r.out;
    for (auto& c : slow) (void)c->Send("a");  // a byte each, never the end of the request
    EXPECT_EQ(HttpGet(port).status, 200) << "round " << round;
  }
  d.proc().Signal(SIGTERM);
  EXPECT_EQ(d.proc().Wait(), 0) << "stops with the slow connections still open\n" << d.Log();
}

TEST(MetricsEndpointTest, AnUnusableAddressIsAStartupError) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  Daemon bad(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--metrics-address", "127.0.0.1:99999"}, "bad");
  EXPECT_EQ(bad.proc().Wait(), 2) << bad.Log();
  EXPECT_NE(bad.Log().find("metrics address"), std::string::npos) << bad.Log();
}

}  // namespace
}  // namespace engram
