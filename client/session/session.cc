// Session (client/session/session.h). One concern kept whole: the hello, the grant, the event stream and the lease
// re-establishment are one conversation with engramd over one stream.
#include "client/session/session.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "client/log.h"
#include "client/session/descriptor_client.h"
#include "client/session/status_json.h"
#include "engram/v1/engram.grpc.pb.h"
#include "engram/version.h"
#include "net/unix_socket.h"

namespace engram::client {
namespace {

namespace v1 = engram::v1;

// The client's enums carry the wire numbers.
static_assert(static_cast<int>(Mode::kShared) == v1::SHARED &&
              static_cast<int>(Mode::kPrivatePinned) == v1::PRIVATE_PINNED &&
              static_cast<int>(Mode::kDevice) == v1::DEVICE && static_cast<int>(Mode::kDpSharded) == v1::DP_SHARDED);
static_assert(static_cast<int>(ReasonCode::kShmMissing) == v1::SHM_MISSING &&
              static_cast<int>(ReasonCode::kRegisterFailed) == v1::REGISTER_FAILED &&
              static_cast<int>(ReasonCode::kSegmentNotReady) == v1::SEGMENT_NOT_READY &&
              static_cast<int>(ReasonCode::kDpShardedNotBuilt) == v1::DP_SHARDED_NOT_BUILT &&
              kMaxReasonCode == v1::FallbackReason_MAX);
static_assert(static_cast<int>(AttachMethod::kDescriptor) == v1::ATTACH_DESCRIPTOR &&
              static_cast<int>(AttachMethod::kPath) == v1::ATTACH_PATH);

v1::Choice WireChoice(Choice c) {
  return c == Choice::kTrue ? v1::ENABLED : c == Choice::kFalse ? v1::DISABLED : v1::AUTO;
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace

// One gRPC stream to engramd.
struct Connection {
  std::unique_ptr<v1::Engram::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ClientMessage, v1::ServerMessage>> stream;
};

namespace {

v1::ClientMessage Hello(const Declaration& d) {
  v1::ClientMessage hello;
  auto* h = hello.mutable_hello();
  h->set_fingerprint(d.fingerprint);
  h->set_checkpoint(d.checkpoint);
  h->set_tp_size(d.tp_size);
  h->set_tp_rank(d.tp_rank);
  h->set_dp_size(d.dp_size);
  h->set_dp_rank(d.dp_rank);
  h->set_local_dp_size(d.local_dp_size > 0 ? d.local_dp_size : d.dp_size);
  h->set_elastic_ep(d.elastic_ep);
  h->mutable_config()->set_cpu_offload(WireChoice(d.cpu_offload));
  h->mutable_config()->set_dp_shared_memory(WireChoice(d.dp_shared_memory));
  h->mutable_config()->set_embedding_across_dp(d.embedding_across_dp);
  h->set_pid(static_cast<int32_t>(::getpid()));
  h->set_client_version(ENGRAM_VERSION_STRING);  // status shows it per replica
  return hello;
}

// gRPC's target for the daemon's socket path. The path is taken literally: one gRPC would read differently (it
// percent-decodes and splits on ',' '?' '#') or the kernel could not hold (too long) is refused here, with a clear
// error, before gRPC sees it.
absl::StatusOr<std::string> GrpcTarget(const std::string& socket) {
  RETURN_IF_ERROR(net::CheckSocketPath(socket));
  if (socket.find_first_of(std::string("%,?#\0", 5)) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("the socket path '", Printable(socket),
                                                   "' contains one of % , ? # or a NUL: give the path without them"));
  }
  return absl::StrCat("unix:", socket);
}

// Connects, says hello and waits for the answer within `timeout` (the call is cancelled at the deadline).
absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string& socket, std::chrono::milliseconds timeout,
                                                    const Declaration& d, v1::ServerMessage* answer) {
  ASSIGN_OR_RETURN(const std::string target, GrpcTarget(socket));
  auto c = std::make_unique<Connection>();
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  const auto deadline = std::chrono::system_clock::now() + timeout;
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(
        absl::StrCat("no engramd answers on ", socket, " (start it: systemctl start engramd)"));
  }
  c->stub = v1::Engram::NewStub(channel);
  c->stream = c->stub->Session(&c->ctx);
  // The daemon may hold its answer while the segment loads.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_until(lock, deadline, [&] { return done; })) c->ctx.TryCancel();
  });
  const bool answered = c->stream->Write(Hello(d)) && c->stream->Read(answer);
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  if (!answered) {
    return FromGrpc(c->stream->Finish(), absl::StrCat("engramd did not answer on ", socket));
  }
  if (!answer->has_grant() && !answer->has_fallback()) {
    return absl::InternalError("engramd answered the hello with neither a grant nor a fallback");
  }
  return c;
}

}  // namespace

// Whether the daemon that answered a hello takes EngineChoice messages (an older one ends a session that sends one).
static bool TakesEngineChoice(const v1::ServerMessage& answer) {
  return answer.has_grant() ? answer.grant().takes_engine_choice()
                            : answer.has_fallback() && answer.fallback().takes_engine_choice();
}

struct Session::Impl {
  std::string socket;
  Declaration declaration;
  bool granted = false;                       // this session's mapping came from a grant
  bool takes_engine_choice = false;           // the daemon of the current connection takes EngineChoice
  uint64_t segment_dev = 0, segment_ino = 0;  // that file's identity when it was granted

  std::mutex mu;  // guards conn, closing, outcome
  std::condition_variable cv;
  std::unique_ptr<Connection> conn;
  bool closing = false;
  std::optional<v1::ClientMessage> outcome;         // replayed after a reconnect
  std::optional<v1::ClientMessage> engine_choice;   // the same (after the outcome)
  std::function<void(const GroupEvent&)> on_group;  // the DP group this session joined (JoinGroup)
  uint64_t join_id = 0;                             // that membership's id (0: none)
  uint64_t next_join_id = 1;
  std::thread events;

  // DP group updates (JoinGroup), from the events thread.
  void DeliverGroupUpdate(const v1::GroupUpdate& u) {
    GroupEvent e;
    e.formed = u.state() == v1::GroupUpdate::FORMED;
    e.broken = u.state() == v1::GroupUpdate::BROKEN;
    e.group = u.group();
    e.detail = u.detail();
    e.rendezvous = u.rendezvous();
    e.slot = u.slot();
    e.left_pid = u.left_pid();
    e.left_dp_rank = u.left_dp_rank();
    e.generation = u.generation();
    for (const auto& m : u.members()) e.members.push_back({m.pid(), m.dp_rank(), m.edp_rank(), m.max_tokens()});
    std::function<void(const GroupEvent&)> cb;
    {
      std::lock_guard<std::mutex> lock(mu);
      // A late update of a membership this session left is not the current one's (0: an engramd that does not
      // echo join ids, which has no GroupLeave either: its updates are the one membership's).
      if (u.join_id() == join_id || u.join_id() == 0) cb = on_group;
    }
    if (cb) cb(e);
  }
  void DeliverGroupLeft(const v1::GroupLeft& l) {
    if (l.code() == 0) {
      Log().info("engram: event=dp_group_left group={} generation={}", l.group(), l.generation());
    } else {
      Log().warn("engram: event=dp_group_leave_refused code={} detail={}", l.code(), engram::LogQuoted(l.error()));
    }
  }
  // The session ended: a group this session joined cannot go on (its membership was this lease); the reconnect
  // that follows does not rejoin it.
  void LoseGroup() {
    std::function<void(const GroupEvent&)> cb;
    {
      std::lock_guard<std::mutex> lock(mu);
      cb = std::move(on_group);
      on_group = nullptr;
      join_id = 0;
    }
    if (!cb) return;
    GroupEvent e;
    e.broken = true;
    e.detail = absl::StrCat("this replica's session with engramd on ", socket,
                            " ended (lease lost, or the daemon refused the group join): the DP group cannot go on");
    cb(e);
  }

  absl::Status Write(const v1::ClientMessage& m) {
    if (conn->stream->Write(m)) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("the session with engramd on ", socket, " ended"));
  }
  // The stream's final status, for a failed read or write.
  absl::Status Ended(const std::string& what) { return FromGrpc(conn->stream->Finish(), what); }

  // The events loop: drains daemon events; when the session breaks (engramd died or restarted), logs it and
  // reconnects with backoff, replays the outcome so that status lists this replica again, and keeps the mapping
  // it has (still valid: the pages stay mapped whatever happened to the daemon).
  void Run() {
    while (true) {
      Connection* c;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (closing) return;
        c = conn.get();
      }
      v1::ServerMessage m;
      while (c->stream->Read(&m)) {
        if (m.has_event() && m.event().kind() == v1::Event::DRAINING) {
          Log().warn("engram: event=daemon_draining detail={}", engram::LogQuoted(m.event().detail()));
        }
        if (m.has_group_update()) DeliverGroupUpdate(m.group_update());
        if (m.has_group_left()) DeliverGroupLeft(m.group_left());
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        if (closing) return;
      }
      LoseGroup();
      Log().warn(
          "engram: event=lease_lost socket={} detail=\"engramd ended the session; the mapping stays valid, "
          "reconnecting\"",
          socket);
      auto backoff = std::chrono::milliseconds(100);
      while (true) {
        {
          std::unique_lock<std::mutex> lock(mu);
          if (cv.wait_for(lock, backoff, [&] { return closing; })) return;
        }
        backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
        v1::ServerMessage answer;
        auto next = Connect(socket, std::chrono::milliseconds(2000), declaration, &answer);
        if (!next.ok()) continue;
        // The same file (device and inode as the daemon reports them, the same in every mount namespace; not
        // just the name: a republished segment has the old name), or not.
        const bool same = answer.has_grant() && granted && segment_ino != 0 &&
                          answer.grant().segment_dev() == segment_dev && answer.grant().segment_ino() == segment_ino;
        std::lock_guard<std::mutex> lock(mu);
        if (closing) {
          (*next)->ctx.TryCancel();
          return;
        }
        if (outcome && outcome->outcome().mode() == v1::SHARED && !same) {
          // This replica keeps reading its mapping of a file the daemon no longer serves: a copy of its own now.
          auto* o = outcome->mutable_outcome();
          o->set_mode(v1::PRIVATE_PINNED);
          o->set_attach(v1::ATTACH_NONE);
          auto* r = o->add_reasons();
          r->set_code(v1::SEGMENT_NOT_READY);
          r->set_hint(
              "engramd restarted and no longer serves the segment this replica mapped; the replica keeps "
              "reading its own mapping of the old file (no longer shared): restart it to share again");
        }
        if (outcome && !(*next)->stream->Write(*outcome)) continue;
        takes_engine_choice = TakesEngineChoice(answer);
        if (engine_choice && takes_engine_choice && !(*next)->stream->Write(*engine_choice)) continue;
        std::unique_ptr<Connection> old = std::move(conn);
        conn = std::move(*next);
        (void)old->stream->Finish();  // it ended (Read returned false): collect its status, then let it go
        Log().info("engram: event=lease_restored socket={} same_segment={}", socket, same);
        break;
      }
    }
  }
};

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

}  // namespace engram::client

namespace engram::client {

const Declaration& Session::declaration() const { return impl_->declaration; }

absl::StatusOr<uint64_t> Session::JoinGroup(const GroupJoinRequest& join,
                                            std::function<void(const GroupEvent&)> on_update) {
  v1::ClientMessage m;
  auto* j = m.mutable_group_join();
  j->set_name(join.name);
  j->set_transport(join.transport);
  j->set_rendezvous(join.rendezvous);
  j->set_max_tokens(join.max_tokens);
  j->set_bytes_per_step(join.bytes_per_step);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->on_group) {
    return absl::FailedPreconditionError(
        "this session is in a DP group already: close its engine (which leaves the "
        "group) before making another");
  }
  const uint64_t id = impl_->next_join_id++;
  j->set_join_id(id);
  impl_->on_group = std::move(on_update);
  impl_->join_id = id;
  if (auto st = impl_->Write(m); !st.ok()) {
    impl_->on_group = nullptr;
    impl_->join_id = 0;
    return st;
  }
  return id;
}

absl::Status Session::LeaveGroup(uint64_t join_id, const std::string& group, uint64_t generation,
                                 const std::string& reason, const std::vector<int32_t>& stalled_edp_ranks) {
  v1::ClientMessage m;
  auto* l = m.mutable_group_leave();
  for (int32_t r : stalled_edp_ranks) l->add_stalled_edp_ranks(r);
  l->set_group(group);
  l->set_generation(generation);
  l->set_reason(Utf8Prefix(reason, 512));  // the daemon's bound
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (join_id == 0 || impl_->join_id != join_id) return absl::OkStatus();  // lost with the lease, or left already
  impl_->on_group = nullptr;
  impl_->join_id = 0;
  return impl_->Write(m);
}

absl::StatusOr<std::string> FetchStatusJson(const std::string& socket, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(const std::string target, GrpcTarget(socket));
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = v1::Engram::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::StatusReply reply;
  const grpc::Status rpc = stub->Status(&ctx, v1::StatusRequest(), &reply);
  if (!rpc.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(rpc.error_code()),
                        absl::StrCat("engramd at ", socket, ": ", rpc.error_message()));
  }
  return StatusJson(reply);
}

}  // namespace engram::client
