// Session (client/session/session.h): opening the session (hello -> grant or fallback), the granted segment's
// descriptor, the registration ticket, the reports (registration, outcome, engine choice) and Keep.
#include "client/session/session.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "client/session/descriptor_client.h"
#include "client/session/session_impl.h"
#include "engram/v1/engram.grpc.pb.h"

namespace engram::client {

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->closing = true;
    impl_->conn->ctx.TryCancel();
  }
  impl_->cv.notify_all();
  if (impl_->events.joinable()) impl_->events.join();
}

absl::StatusOr<std::unique_ptr<Session>> Session::Open(const std::string& socket, std::chrono::milliseconds timeout,
                                                       const Declaration& d) {
  auto impl = std::make_unique<Impl>();
  impl->socket = socket;
  impl->declaration = d;
  v1::ServerMessage answer;
  ASSIGN_OR_RETURN(impl->conn, Connect(socket, timeout, d, &answer));
  std::unique_ptr<Session> s(new Session(std::move(impl)));
  Answer& a = s->answer_;
  s->impl_->takes_engine_choice = TakesEngineChoice(answer);
  if (answer.has_grant()) {
    const auto& g = answer.grant();
    a.granted = true;
    a.grant.segment_path = g.segment_path();
    a.grant.segment_bytes = g.segment_bytes();
    a.grant.fingerprint = g.segment().fingerprint();
    a.grant.head_dim = g.segment().head_dim();
    a.grant.record_bytes = g.segment().record_bytes();
    for (const auto& l : g.segment().layers()) {
      a.grant.layers.push_back({l.layer_id(), l.row_begin(), l.row_end(), l.data_offset()});
    }
    a.grant.token_map.assign(g.segment().token_map().begin(), g.segment().token_map().end());
    a.grant.lease_id = g.lease_id();
    a.grant.epoch = g.epoch();
    a.grant.fd_socket = g.fd_socket();
    a.grant.fd_token = g.fd_token();
    a.grant.segment_dev = g.segment_dev();
    a.grant.segment_ino = g.segment_ino();
    s->impl_->granted = true;
    s->impl_->segment_dev = g.segment_dev();
    s->impl_->segment_ino = g.segment_ino();
  } else {
    a.mode = static_cast<Mode>(answer.fallback().mode());
    for (const auto& r : answer.fallback().reasons()) {
      a.reasons.push_back({static_cast<ReasonCode>(r.code()), r.hint()});
    }
  }
  return s;
}

std::string GrantedSegmentPath(const Grant& g, const std::string& shm_dir) {
  if (shm_dir.empty()) return g.segment_path;
  const auto slash = g.segment_path.rfind('/');
  return absl::StrCat(shm_dir, "/", slash == std::string::npos ? g.segment_path : g.segment_path.substr(slash + 1));
}

void Session::NoteMappedFile(uint64_t dev, uint64_t ino) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->segment_dev = dev;
  impl_->segment_ino = ino;
}

absl::StatusOr<int> Session::FetchSegmentDescriptor(std::chrono::milliseconds timeout) const {
  const Grant& g = answer_.grant;
  if (!answer_.granted || g.fd_socket.empty() || g.fd_token.empty()) {
    return absl::UnavailableError("the grant offers no descriptor (an engramd without descriptor passing)");
  }
  ASSIGN_OR_RETURN(std::string path, ChannelPath(impl_->socket, g.fd_socket));
  // A busy channel (this uid's share of its slots taken) is tried again within the timeout; anything else is final.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto backoff = std::chrono::milliseconds(20);
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto fd =
        client::FetchSegmentDescriptor(path, g.lease_id, g.fd_token, std::max(left, std::chrono::milliseconds(1)));
    const bool transient = fd.status().code() == absl::StatusCode::kResourceExhausted;
    if (fd.ok() || !transient || std::chrono::steady_clock::now() + backoff >= deadline) return fd;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

absl::Status Session::AcquireTicket(std::chrono::milliseconds wait) {
  v1::ClientMessage req;
  const auto wait_ms = std::clamp<int64_t>(wait.count(), 0, UINT32_MAX);
  req.mutable_ticket_request()->set_wait_ms(static_cast<uint32_t>(wait_ms));
  if (auto st = impl_->Write(req); !st.ok()) return impl_->Ended("ticket request");
  // The daemon answers by the deadline; one that does not is cut off a second after it.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog;
  if (wait_ms > 0) {
    watchdog = std::thread([&, deadline = std::chrono::steady_clock::now() + wait + std::chrono::seconds(1)] {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_until(lock, deadline, [&] { return done; })) impl_->conn->ctx.TryCancel();
    });
  }
  auto finish = [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_all();
    if (watchdog.joinable()) watchdog.join();
  };
  v1::ServerMessage reply;
  while (impl_->conn->stream->Read(&reply)) {
    if (reply.has_ticket()) {
      finish();
      return absl::OkStatus();
    }
    if (reply.has_ticket_refused()) {
      finish();
      return absl::DeadlineExceededError(Printable(reply.ticket_refused().detail()));
    }
    // Events may arrive while the ticket queue moves; they need no answer.
  }
  finish();
  return impl_->Ended("waiting for the registration ticket");
}

absl::Status Session::ReportRegistration(const RegistrationReport& r) {
  v1::ClientMessage m;
  auto* res = m.mutable_register_result();
  res->set_ok(r.ok);
  res->set_seconds(r.seconds);
  res->set_error(r.error);
  res->set_failed_chunk(r.failed_chunk);
  res->set_backend(BackendName(r.backend));
  return impl_->Write(m);
}

absl::Status Session::ReportOutcome(Mode mode, const std::vector<Reason>& reasons, Backend backend,
                                    AttachMethod attach) {
  v1::ClientMessage m;
  auto* o = m.mutable_outcome();
  o->set_mode(static_cast<v1::Mode>(mode));
  for (const auto& r : reasons) {
    auto* w = o->add_reasons();
    w->set_code(static_cast<v1::FallbackReason>(r.code));
    w->set_hint(r.hint);
  }
  o->set_backend(BackendName(backend));
  o->set_attach(static_cast<v1::AttachMethod>(attach));
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->outcome = m;
  return impl_->Write(m);
}

absl::Status Session::ReportEngineChoice(const std::string& text) {
  v1::ClientMessage m;
  m.mutable_engine_choice()->set_text(Utf8Prefix(text, 2048));  // the daemon's bound
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->outcome) return absl::FailedPreconditionError("an engine choice is reported after the outcome");
  impl_->engine_choice = m;
  if (!impl_->takes_engine_choice) return absl::OkStatus();  // an older engramd: it would end the session
  return impl_->Write(m);
}

void Session::Keep() {
  if (impl_->events.joinable()) return;
  impl_->events = std::thread([impl = impl_.get()] { impl->Run(); });
}

const Declaration& Session::declaration() const { return impl_->declaration; }

}  // namespace engram::client
