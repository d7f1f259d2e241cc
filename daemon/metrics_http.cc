#include "daemon/metrics_http.h"

#include <arpa/inet.h>

// Asio's fenced blocks (std::atomic_thread_fence around each handler) are what ThreadSanitizer cannot model (GCC's
// -Wtsan refuses them); the one io_context here runs on one thread and its queue is under a mutex, which TSan sees.
// Asio is used in this file only, so the setting is the same wherever it is included.
#define BOOST_ASIO_DISABLE_FENCED_BLOCK

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <list>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engram/version.h"

namespace engram::daemon {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

bool IsMetricsTarget(beast::string_view target) {
  const size_t q = target.find('?');
  return (q == beast::string_view::npos ? target : target.substr(0, q)) == "/metrics";
}

std::string FormatEndpoint(const tcp::endpoint& e) {
  const std::string host = e.address().to_string();
  return e.address().is_v6() ? absl::StrCat("[", host, "]:", e.port()) : absl::StrCat(host, ":", e.port());
}

}  // namespace

absl::StatusOr<MetricsEndpoint> ParseMetricsAddress(const std::string& address) {
  const auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "': ", why,
                                                   " (want HOST:PORT, [IPV6]:PORT or :PORT, HOST numeric)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  int p = -1;
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos || !absl::SimpleAtoi(port, &p) ||
      p > 65535) {
    return bad("the port is not a number from 0 to 65535");
  }
  unsigned char buf[16];
  if (host.empty()) {
    host = "0.0.0.0";
  } else if (host == "localhost") {
    host = "127.0.0.1";
  } else if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    if (::inet_pton(AF_INET6, host.c_str(), buf) != 1) return bad("not a numeric IPv6 address");
  } else if (::inet_pton(AF_INET, host.c_str(), buf) != 1) {
    return bad(host.find(':') != std::string::npos ? "an IPv6 host needs brackets" : "not a numeric IPv4 address");
  }
  return MetricsEndpoint{host, p};
}

struct MetricsHttpServer::Impl {
  class Session;

  Impl(Render r, MetricsHttpLimits l) : render(std::move(r)), limits(l) {}

  // Declared before the io_context: sessions still owned by its handlers deregister while it is destroyed.
  std::list<Session*> sessions;  // oldest first
  Render render;
  MetricsHttpLimits limits;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  net::steady_timer retry{io};
  tcp::endpoint bound;
  std::thread thread;

  void Accept();
  void Admit(tcp::socket socket);
};

// One connection: read a request (header limit, no body, one deadline for all of it), answer, repeat while kept
// alive. Owned by the handlers of its pending operation (shared_from_this); lives on the server's thread only.
class MetricsHttpServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* server, tcp::socket socket) : server_(server), stream_(std::move(socket)) {
    server_->sessions.push_back(this);
    self_in_list_ = std::prev(server_->sessions.end());
  }
  ~Session() { server_->sessions.erase(self_in_list_); }

  void Read() {
    waiting_for_request_ = true;
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(server_->limits.max_request_bytes));
    parser_->body_limit(0);
    stream_.expires_after(server_->limits.request_timeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }
  bool waiting_for_request() const { return waiting_for_request_; }
  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

 private:
  void OnRead(beast::error_code ec) {
    waiting_for_request_ = false;
    if (ec == http::error::end_of_stream || ec == net::error::operation_aborted || ec == beast::error::timeout) {
      return Close();
    }
    if (ec) {
      // A malformed, oversized or body-carrying request: say so once and close.
      const bool too_large = ec == http::error::header_limit || ec == http::error::buffer_overflow;
      return Answer(too_large ? http::status::request_header_fields_too_large : http::status::bad_request, 11, false,
                    false, absl::StrCat(ec.message(), "\n"));
    }
    const auto& req = parser_->get();
    if (parser_->chunked() || parser_->content_length().value_or(0) > 0) {
      // A body of any framing (an empty chunked one too): GET and HEAD take none.
      return Answer(http::status::bad_request, req.version(), false, false, "a request takes no body\n");
    }
    const bool keep = req.keep_alive();
    if (req.method() != http::verb::get && req.method() != http::verb::head) {
      return Answer(http::status::method_not_allowed, req.version(), keep, false, "only GET and HEAD\n");
    }
    if (!IsMetricsTarget(req.target())) {
      return Answer(http::status::not_found, req.version(), keep, false, "engramd serves /metrics only\n");
    }
    Answer(http::status::ok, req.version(), keep, req.method() == http::verb::head, server_->render());
  }

  void Answer(http::status status, unsigned version, bool keep_alive, bool head, std::string body) {
    response_ = {};
    response_.result(status);
    response_.version(version);
    response_.set(http::field::server, "engramd/" ENGRAM_VERSION_STRING);
    response_.set(http::field::content_type, status == http::status::ok ? kContentType : "text/plain; charset=utf-8");
    if (status == http::status::method_not_allowed) response_.set(http::field::allow, "GET, HEAD");
    response_.keep_alive(keep_alive);
    response_.content_length(body.size());
    if (!head) response_.body() = std::move(body);
    stream_.expires_after(server_->limits.request_timeout);
    http::async_write(stream_, response_, [self = shared_from_this(), keep_alive](beast::error_code ec, size_t) {
      if (ec || !keep_alive) return self->Close();
      self->Read();
    });
  }

  Impl* server_;
  std::list<Session*>::iterator self_in_list_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  http::response<http::string_body> response_;
  bool waiting_for_request_ = false;
};

void MetricsHttpServer::Impl::Accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted) return;  // stopping
    if (!ec) {
      Admit(std::move(socket));
      return Accept();
    }
    // An accept error (EMFILE, a reset connection) costs that connection only; pause a little so that one that
    // persists does not spin the thread.
    retry.expires_after(std::chrono::milliseconds(100));
    retry.async_wait([this](beast::error_code wait_ec) {
      if (!wait_ec) Accept();
    });
  });
}

void MetricsHttpServer::Impl::Admit(tcp::socket socket) {
  if (sessions.size() >= static_cast<size_t>(limits.max_connections)) {
    Session* idle = nullptr;
    for (Session* s : sessions) {
      if (s->waiting_for_request()) {
        idle = s;
        break;
      }
    }
    if (idle == nullptr) {  // every connection is being answered: this one waits for nothing, it is closed
      beast::error_code ignored;
      socket.close(ignored);
      return;
    }
    idle->Close();  // its pending read ends (operation_aborted) and it goes
  }
  std::make_shared<Session>(this, std::move(socket))->Read();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& address, Render render,
                                                                            MetricsHttpLimits limits) {
  auto endpoint = ParseMetricsAddress(address);
  if (!endpoint.ok()) return endpoint.status();
  auto impl = std::make_unique<Impl>(std::move(render), limits);
  beast::error_code ec;
  const tcp::endpoint at(net::ip::make_address(endpoint->host, ec), static_cast<unsigned short>(endpoint->port));
  const auto fail = [&](const char* step) {
    return absl::UnavailableError(absl::StrCat("metrics address ", address, ": ", step, ": ", ec.message()));
  };
  if (ec) return fail("address");
  if (impl->acceptor.open(at.protocol(), ec); ec) return fail("socket");
  if (impl->acceptor.set_option(net::socket_base::reuse_address(true), ec); ec) return fail("SO_REUSEADDR");
  if (impl->acceptor.bind(at, ec); ec) return fail("bind");
  if (impl->acceptor.listen(64, ec); ec) return fail("listen");
  impl->bound = impl->acceptor.local_endpoint(ec);
  if (ec) return fail("getsockname");
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl)));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  if (!impl_->thread.joinable()) return;
  // On the server's thread: stop accepting and close every connection; their handlers run once more (aborted), the
  // sessions go, and run() returns for lack of work.
  Impl* impl = impl_.get();
  net::post(impl->io, [impl] {
    beast::error_code ignored;
    impl->acceptor.close(ignored);
    impl->retry.cancel();
    for (Impl::Session* s : impl->sessions) s->Close();
  });
  impl_->thread.join();
}

int MetricsHttpServer::port() const { return impl_->bound.port(); }

std::string MetricsHttpServer::address() const { return FormatEndpoint(impl_->bound); }

}  // namespace engram::daemon
