// MetricsHttpServer: engramd's --metrics-address, an HTTP/1.1 endpoint that answers `GET /metrics` (and HEAD) with the
// text a render callback returns (daemon/metrics_text.h), for Prometheus to scrape. Built on Boost.Beast; one thread
// of its own runs every connection asynchronously, so nothing an HTTP client does reaches the gRPC service or the
// registries beyond one render per request.
//
// What a client can and cannot do (MetricsHttpLimits):
//   - at most `max_connections` connections at once; one more evicts the oldest connection that is still waiting for
//     its request (a slowloris holds no slot for long), or is closed at once when every connection is being answered;
//   - a request (its whole header, however slowly it arrives) within `request_timeout`, and at most
//     `max_request_bytes` of header (431 and the connection closed otherwise); a body is refused (400);
//   - the response written within `request_timeout` (a client that does not read is dropped);
//   - GET and HEAD of /metrics (a query string is ignored); any other path 404, any other method 405.
// Keep-alive is honoured; an idle kept-alive connection is closed after `request_timeout`.
//
// The render callback runs on the server's thread, one request at a time; it must be thread-safe with respect to the
// rest of the program (Coordinator::MetricsText is). Start() binds and listens on the caller's thread (errors come
// back from it) and then serves on its own; Stop() (or the destructor) closes every connection and joins the thread.
// The object's methods are not meant to be called concurrently with each other.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace engram::daemon {

// A listening address: numeric IPv4 or IPv6 host (or "localhost") and a port.
struct MetricsEndpoint {
  std::string host;  // numeric
  int port = 0;      // 0: the kernel picks one (the server's port() says which)
};

// "HOST:PORT", "[IPV6]:PORT" or ":PORT" (every IPv4 interface, 0.0.0.0). HOST is numeric, or "localhost"
// (127.0.0.1): no name is resolved. PORT 0-65535. InvalidArgument naming the problem otherwise.
absl::StatusOr<MetricsEndpoint> ParseMetricsAddress(const std::string& address);

struct MetricsHttpLimits {
  int max_connections = 16;
  std::chrono::milliseconds request_timeout{10000};
  size_t max_request_bytes = 8192;
};

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;

  // Listens on `address` (ParseMetricsAddress) and serves until stopped. Errors: InvalidArgument for the address,
  // Unavailable naming the address and the OS error when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address, Render render,
                                                                  MetricsHttpLimits limits = {});
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  void Stop();
  int port() const;
  // The bound address as "HOST:PORT" ("[HOST]:PORT" for IPv6), with the port the kernel chose for port 0.
  std::string address() const;

 private:
  struct Impl;
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace engram::daemon
