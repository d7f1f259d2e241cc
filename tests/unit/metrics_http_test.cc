// The metrics endpoint in-process (daemon/metrics_http.h): what it answers, and what a slow or hostile client cannot
// take from the others. Bounded by counts and the server's own limits; no timing is asserted.
#include "daemon/metrics_http.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/http_client.h"

namespace engram::daemon {
namespace {

using testing::HttpGet;
using testing::HttpRequest;
using testing::TcpConnection;

std::unique_ptr<MetricsHttpServer> Serve(std::atomic<int>* renders, MetricsHttpLimits limits = {}) {
  auto s = MetricsHttpServer::Start(
      "127.0.0.1:0",
      [renders] {
        ++*renders;
        return std::string("# TYPE x gauge\nx 1\n");
      },
      limits);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

TEST(MetricsAddressTest, ParsesWhatTheDocsSay) {
  auto a = ParseMetricsAddress("127.0.0.1:9464");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 9464);
  EXPECT_EQ(ParseMetricsAddress(":9464")->host, "0.0.0.0");
  EXPECT_EQ(ParseMetricsAddress("localhost:0")->host, "127.0.0.1");
  EXPECT_EQ(ParseMetricsAddress("[::1]:9464")->host, "::1");
  for (const char* bad : {"", "9464", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:9x", "::1:9464",
                          "example.com:9464", "[nope]:1"}) {
    EXPECT_EQ(ParseMetricsAddress(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(MetricsHttpTest, AnAddressInUseIsAnError) {
  std::atomic<int> renders{0};
  auto first = Serve(&renders);
  ASSERT_NE(first, nullptr);
  auto second = MetricsHttpServer::Start(first->address(), [] { return std::string(); });
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("bind"), std::string::npos) << second.status();
}

TEST(MetricsHttpTest, GetAndHeadOfMetricsOnly) {
  std::atomic<int> renders{0};
  auto s = Serve(&renders);
  ASSERT_NE(s, nullptr);
  EXPECT_NE(s->port(), 0);
  EXPECT_EQ(s->address(), "127.0.0.1:" + std::to_string(s->port()));
  auto get = HttpGet(s->port());
  EXPECT_EQ(get.status, 200) << get.head;
  EXPECT_EQ(get.body, "# TYPE x gauge\nx 1\n");
  EXPECT_NE(get.head.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << get.head;
  EXPECT_EQ(HttpGet(s->port(), "/metrics?name[]=x").status, 200) << "a query string is ignored";
  auto head = HttpRequest(s->port(), "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_NE(head.head.find("Content-Length: 19"), std::string::npos) << head.head;
  EXPECT_EQ(HttpGet(s->port(), "/").status, 404);
  EXPECT_EQ(HttpGet(s->port(), "/metricsx").status, 404);
  auto post = HttpRequest(s->port(), "POST", "/metrics", "Content-Length: 0\r\n");
  EXPECT_EQ(post.status, 405);
  EXPECT_NE(post.head.find("Allow: GET, HEAD"), std::string::npos) << post.head;
  EXPECT_EQ(HttpRequest(s->port(), "DELETE", "/metrics").status, 405);
  EXPECT_EQ(renders.load(), 3) << "only the answered GET and HEAD requests render";
}

TEST(MetricsHttpTest, HostileRequestsAreRefusedAndClosed) {
  std::atomic<int> renders{0};
  auto s = Serve(&renders);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(HttpGet(s->port(), "/metrics").status, 200);
  auto huge = HttpRequest(s->port(), "GET", "/metrics", "X-Filler: " + std::string(9000, 'a') + "\r\n");
  EXPECT_EQ(huge.status, 431) << huge.head;
  auto body = HttpRequest(s->port(), "GET", "/metrics", "Content-Length: 5\r\n\r\nhello");
  EXPECT_EQ(body.status, 400) << "a request with a body: " << body.head;
  auto chunked = HttpRequest(s->port(), "GET", "/metrics", "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
  EXPECT_EQ(chunked.status, 400) << "a chunked body: " << chunked.head;
  auto empty_chunked = HttpRequest(s->port(), "GET", "/metrics", "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
  EXPECT_EQ(empty_chunked.status, 400) << "any chunked body: " << empty_chunked.head;
  TcpConnection garbage(s->port());
  ASSERT_TRUE(garbage.Send("\x16\x03\x01 not http at all\r\n\r\n"));
  EXPECT_EQ(garbage.Read().status, 400);
  EXPECT_TRUE(garbage.ClosedByPeer());
  EXPECT_EQ(HttpGet(s->port()).status, 200) << "still serving";
}

TEST(MetricsHttpTest, KeepAliveAnswersRequestAfterRequest) {
  std::atomic<int> renders{0};
  auto s = Serve(&renders);
  ASSERT_NE(s, nullptr);
  TcpConnection c(s->port());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.Send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_EQ(c.Read().status, 200) << i;
  }
  EXPECT_EQ(renders.load(), 3);
}

// A client that sends half a request and then nothing: the others are answered meanwhile, and the server closes it
// once its request timeout passes.
TEST(MetricsHttpTest, ASlowlorisNeitherBlocksOthersNorStays) {
  std::atomic<int> renders{0};
  MetricsHttpLimits limits;
  limits.request_timeout = std::chrono::milliseconds(300);
  auto s = Serve(&renders, limits);
  ASSERT_NE(s, nullptr);
  TcpConnection slow(s->port());
  ASSERT_TRUE(slow.Send("GET /metr"));
  EXPECT_EQ(HttpGet(s->port()).status, 200);
  (void)slow.Send("ics HTTP/1.1\r\n");  // still incomplete: the deadline covers the whole request
  EXPECT_TRUE(slow.ClosedByPeer()) << "closed when its request did not arrive in time";
}

// More connections than the bound: each new one evicts the oldest that is still waiting for its request, so clients
// that hold connections open cannot lock a scraper out.
TEST(MetricsHttpTest, TheConnectionBoundEvictsTheOldestIdleConnection) {
  std::atomic<int> renders{0};
  MetricsHttpLimits limits;
  limits.max_connections = 4;
  auto s = Serve(&renders, limits);
  ASSERT_NE(s, nullptr);
  std::vector<std::unique_ptr<TcpConnection>> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(std::make_unique<TcpConnection>(s->port()));
    ASSERT_TRUE(idle.back()->Send("GET /"));
  }
  // The GET takes a fifth slot: the oldest idle connection goes.
  EXPECT_EQ(HttpGet(s->port()).status, 200);
  EXPECT_TRUE(idle[0]->ClosedByPeer());
  for (int i = 0; i < 32; ++i) {  // a flood of connections that send nothing
    TcpConnection flood(s->port());
    ASSERT_TRUE(flood.ok());
  }
  EXPECT_EQ(HttpGet(s->port()).status, 200);
}

TEST(MetricsHttpTest, StopClosesOpenConnections) {
  std::atomic<int> renders{0};
  auto s = Serve(&renders);
  ASSERT_NE(s, nullptr);
  TcpConnection open(s->port());
  ASSERT_TRUE(open.Send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(open.Read().status, 200);
  s->Stop();
  EXPECT_TRUE(open.ClosedByPeer());
  s.reset();  // a second Stop (the destructor's) is harmless
}

}  // namespace
}  // namespace engram::daemon
