// A minimal HTTP/1.1 client over a loopback TCP socket for the metrics endpoint's tests: raw connections (to send
// partial or hostile requests) and a plain request that reads one response. Every read has a receive timeout as a
// guard against a hang (a failing test, never a threshold the product must meet). Test-only; not thread-safe.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>

namespace engram::testing {

struct HttpResponse {
  int status = 0;  // 0: no complete response (the connection closed or timed out first)
  std::string head, body;
};

class TcpConnection {
 public:
  explicit TcpConnection(int port, int guard_seconds = 20) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{guard_seconds, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~TcpConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  TcpConnection(const TcpConnection&) = delete;
  TcpConnection& operator=(const TcpConnection&) = delete;

  bool ok() const { return fd_ >= 0; }
  bool Send(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // True once the server closed the connection (reads end of stream or a reset); false when the guard expired.
  bool ClosedByPeer() {
    char buf[4096];
    while (true) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }
  // One response: the head up to the blank line, then Content-Length bytes of body (none for a HEAD request).
  HttpResponse Read(bool head_request = false) {
    HttpResponse r;
    size_t end;
    while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
      if (!More()) return r;
    }
    r.head = pending_.substr(0, end + 4);
    pending_.erase(0, end + 4);
    size_t length = 0;
    if (const size_t at = Lower(r.head).find("\r\ncontent-length:"); at != std::string::npos) {
      length = std::strtoul(r.head.c_str() + at + 17, nullptr, 10);
    }
    if (head_request) length = 0;
    while (pending_.size() < length) {
      if (!More()) return r;
    }
    r.body = pending_.substr(0, length);
    pending_.erase(0, length);
    r.status = r.head.size() > 12 ? std::atoi(r.head.c_str() + 9) : 0;
    return r;
  }

 private:
  static std::string Lower(std::string s) {
    for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    return s;
  }
  bool More() {
    char buf[8192];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    pending_.append(buf, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  std::string pending_;
};

// `METHOD path` on a connection of its own, closed after the response.
inline HttpResponse HttpRequest(int port, const std::string& method, const std::string& path,
                                const std::string& extra_headers = "") {
  TcpConnection c(port);
  if (!c.ok() ||
      !c.Send(method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra_headers + "\r\n")) {
    return {};
  }
  return c.Read(method == "HEAD");
}

inline HttpResponse HttpGet(int port, const std::string& path = "/metrics") { return HttpRequest(port, "GET", path); }

}  // namespace engram::testing
