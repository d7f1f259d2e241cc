#include "daemon/service.h"

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/utf8.h"
#include "proto/printable.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

grpc::Status ToGrpc(const absl::Status& st) {
  // absl and gRPC share the canonical code numbers. Messages quote paths and checkpoint text: printable only.
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), Printable(std::string(st.message())));
}

namespace {

// OK, or INVALID_ARGUMENT naming the field when `value` is longer than `max` bytes.
grpc::Status Bounded(const char* field, const std::string& value, size_t max = kMaxClientStringBytes) {
  if (value.size() <= max) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat(field, " is ", value.size(), " bytes, at most ", max, " are accepted"));
}

// OK, or INVALID_ARGUMENT when the hello's client_version (shown as it is in status) is longer than
// kMaxClientVersionBytes or holds a byte that is not printable ASCII.
grpc::Status CheckClientVersion(const std::string& v) {
  if (auto st = Bounded("hello.client_version", v, kMaxClientVersionBytes); !st.ok()) return st;
  for (const unsigned char c : v) {
    if (c < 0x20 || c > 0x7e) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrFormat("hello.client_version holds byte 0x%02x: printable ASCII only", c));
    }
  }
  return grpc::Status::OK;
}

// What the group registry notifies this session through: writes to the session's stream until the session closes
// it, then drops them. The registry sends updates outside its lock, possibly just after the session ended, so the
// callback it holds must stay callable while the stream it wrote to is gone (daemon/group_registry.h).
class GroupSink {
 public:
  explicit GroupSink(std::function<void(const engram::v1::ServerMessage&)> write) : write_(std::move(write)) {}
  void Write(const engram::v1::ServerMessage& m) {
    std::lock_guard<std::mutex> lock(mu_);
    if (write_) write_(m);
  }
  // Waits for a write in progress; later ones are dropped.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    write_ = nullptr;
  }

 private:
  std::mutex mu_;
  std::function<void(const engram::v1::ServerMessage&)> write_;
};

}  // namespace

grpc::Status EngramService::AuthorizeOperator(grpc::ServerContext* ctx, const char* call, PeerCred* peer) {
  if (auto st = Authorize(ctx, peer); !st.ok()) return st;
  if (listener_->Operator(*peer)) return grpc::Status::OK;
  spdlog::warn("event=refused pid={} uid={} call={} reason=NOT_OPERATOR", peer->pid, peer->uid, call);
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("uid ", peer->uid, " may attach but not ", call,
                                   ": operator calls take root, the daemon's uid or a member of --admin-group"));
}

grpc::Status EngramService::Authorize(grpc::ServerContext* ctx, PeerCred* peer) {
  auto p = listener_->PeerOf(ctx->peer());
  if (!p) return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "cannot identify the peer (SO_PEERCRED)");
  if (!listener_->Allowed(*p)) {
    spdlog::warn("event=refused pid={} uid={} reason=PERMISSION_DENIED", p->pid, p->uid);
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("uid ", p->uid, " may not use engramd: add it to the daemon's group (--group)"));
  }
  *peer = *p;
  return grpc::Status::OK;
}

grpc::Status EngramService::AdmitSession(const PeerCred& peer) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  int& mine = sessions_by_uid_[peer.uid];
  if (sessions_ >= max_sessions_ || mine >= max_sessions_per_uid_) {
    ++sessions_refused_;
    const bool per_uid = mine >= max_sessions_per_uid_;
    if (mine == 0) sessions_by_uid_.erase(peer.uid);
    spdlog::warn("event=refused pid={} uid={} reason=TOO_MANY_SESSIONS sessions={} limit={}", peer.pid, peer.uid,
                 per_uid ? mine : sessions_, per_uid ? max_sessions_per_uid_ : max_sessions_);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        per_uid ? absl::StrCat("uid ", peer.uid, " holds ", max_sessions_per_uid_,
                                               " sessions, the most one uid may (max_sessions_per_uid)")
                                : absl::StrCat("engramd holds ", max_sessions_,
                                               " sessions, the most it takes "
                                               "(max_sessions)"));
  }
  ++mine;
  ++sessions_;
  return grpc::Status::OK;
}

void EngramService::SetSessionBounds(int max_sessions, int max_sessions_per_uid) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  max_sessions_ = max_sessions;
  max_sessions_per_uid_ = max_sessions_per_uid;
}

void EngramService::EndSession(uint32_t uid) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  auto it = sessions_by_uid_.find(uid);
  if (it != sessions_by_uid_.end() && --it->second <= 0) sessions_by_uid_.erase(it);
  --sessions_;
}

grpc::Status EngramService::Session(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<engram::v1::ServerMessage, engram::v1::ClientMessage>* stream) {
  PeerCred peer;
  if (auto st = Authorize(ctx, &peer); !st.ok()) return st;
  if (auto st = AdmitSession(peer); !st.ok()) return st;
  struct Admitted {
    EngramService* s;
    uint32_t uid;
    ~Admitted() { s->EndSession(uid); }
  } admitted{this, peer.uid};
  engram::v1::ClientMessage first;
  if (!stream->Read(&first)) return grpc::Status(grpc::StatusCode::CANCELLED, "session closed before hello");
  if (first.msg_case() != engram::v1::ClientMessage::kHello) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first message of a session must be a hello");
  }
  for (const grpc::Status& st :
       {Bounded("hello.checkpoint", first.hello().checkpoint()), CheckClientVersion(first.hello().client_version())}) {
    if (st.ok()) continue;
    spdlog::warn("event=refused pid={} uid={} reason=INVALID_ARGUMENT detail={}", peer.pid, peer.uid,
                 engram::LogQuoted(st.error_message()));
    return st;
  }
  std::mutex write_mu;
  auto write = [&](const engram::v1::ServerMessage& m) {
    std::lock_guard<std::mutex> lock(write_mu);
    stream->Write(m);
  };
  auto group_sink = std::make_shared<GroupSink>(write);
  std::string lease;
  auto answer = state_->Attach(
      first.hello(), peer, [ctx] { return ctx->IsCancelled(); }, write, &lease);
  if (!answer.ok()) return ToGrpc(answer.status());
  write(*answer);
  grpc::Status result = grpc::Status::OK;
  engram::v1::ClientMessage msg;
  bool ticket_held = false;
  bool outcome_sent = false;
  engram::v1::Mode outcome_mode = engram::v1::MODE_UNSPECIFIED;
  while (stream->Read(&msg)) {
    switch (msg.msg_case()) {
      case engram::v1::ClientMessage::kTicketRequest: {
        if (!answer->has_grant()) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "ticket requested without a grant");
          break;
        }
        if (outcome_sent) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "ticket requested after the outcome");
          break;
        }
        if (ticket_held) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "ticket requested twice");
          break;
        }
        const uint32_t wait_ms = msg.ticket_request().wait_ms();
        const auto deadline = wait_ms == 0 ? std::chrono::steady_clock::time_point::max()
                                           : std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
        const TicketWait got = state_->AwaitTicket(
            lease, [ctx] { return ctx->IsCancelled(); }, deadline);
        if (got == TicketWait::kTimedOut) {
          spdlog::warn("event=ticket_timeout pid={} uid={} lease={} wait_ms={}", peer.pid, peer.uid, lease, wait_ms);
          engram::v1::ServerMessage refused;
          refused.mutable_ticket_refused()->set_detail(
              absl::StrCat("no registration ticket was free within the replica's ", wait_ms, " ms"));
          write(refused);
          continue;
        }
        if (got != TicketWait::kGranted) break;
        ticket_held = true;
        engram::v1::ServerMessage t;
        t.mutable_ticket();
        write(t);
        continue;
      }
      case engram::v1::ClientMessage::kRegisterResult:
        if (auto st = Bounded("register_result.error", msg.register_result().error()); !st.ok()) {
          result = st;
          break;
        }
        if (auto st = Bounded("register_result.backend", msg.register_result().backend(), kMaxBackendBytes); !st.ok()) {
          result = st;
          break;
        }
        if (!ticket_held) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "registration reported without a ticket");
          break;
        }
        state_->ReportRegistration(lease, msg.register_result());
        ticket_held = false;
        continue;
      case engram::v1::ClientMessage::kOutcome: {
        // Once, after the replica settled: after its grant (and its registration, if it took a ticket) or after
        // the fallback it built.
        if (ticket_held) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                "outcome sent while holding a registration ticket: send the register_result first");
          break;
        }
        if (outcome_sent) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "outcome sent twice in one session");
          break;
        }
        if (auto st = state_->RecordOutcome(lease, msg.outcome()); !st.ok()) {
          result = ToGrpc(st);
          break;
        }
        outcome_sent = true;
        outcome_mode = msg.outcome().mode();
        continue;
      }
      case engram::v1::ClientMessage::kEngineChoice:
        // After the outcome: status shows what the replica's engine chose (the latest one's).
        if (!outcome_sent) {
          result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "engine choice sent before the outcome");
          break;
        }
        if (auto st = Bounded("engine_choice.text", msg.engine_choice().text(), kMaxEngineChoiceBytes); !st.ok()) {
          result = st;
          break;
        }
        state_->RecordEngineChoice(lease, msg.engine_choice().text());
        continue;
      case engram::v1::ClientMessage::kGroupJoin:
        // DP_SHARDED replicas only, once they settled in that mode (daemon/group_registry.h checks the rest).
        if (!outcome_sent || outcome_mode != engram::v1::DP_SHARDED) {
          result =
              grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "group join before an outcome of mode DP_SHARDED");
          break;
        }
        if (auto st = state_->JoinGroup(lease, first.hello(), peer, msg.group_join(),
                                        [group_sink](const engram::v1::ServerMessage& m) { group_sink->Write(m); });
            !st.ok()) {
          spdlog::warn("event=group_join_refused pid={} uid={} detail={}", peer.pid, peer.uid,
                       engram::LogQuoted(std::string(st.message())));
          if (st.code() != absl::StatusCode::kAlreadyExists) {  // a malformed or out-of-order join ends the session
            result = ToGrpc(st);
            break;
          }
          // Its place is taken (its edp rank, or the whole group formed already): answered on the session, which goes
          // on with its lease (the member learns why, not only that its session ended; it may join again with the right
          // rank).
          engram::v1::ServerMessage reply;
          auto* u = reply.mutable_group_update();
          u->set_state(engram::v1::GroupUpdate::BROKEN);
          u->set_detail(absl::StrCat("group join refused: ", st.message()));
          u->set_join_id(msg.group_join().join_id());
          write(reply);
        }
        continue;
      case engram::v1::ClientMessage::kGroupLeave: {
        // The session's member leaves its group; a refused leave is answered and changes nothing (the session, and
        // the group it may be in, go on).
        engram::v1::ServerMessage reply;
        auto* left = reply.mutable_group_left();
        if (auto st = Bounded("group_leave.group", msg.group_leave().group()); !st.ok()) {
          left->set_code(static_cast<int32_t>(st.error_code()));
          left->set_error(st.error_message());
        } else if (auto res = state_->groups().LeaveGroup(lease, msg.group_leave()); res.ok()) {
          *left = *res;
        } else {
          spdlog::warn("event=group_leave_refused pid={} uid={} detail={}", peer.pid, peer.uid,
                       engram::LogQuoted(std::string(res.status().message())));
          left->set_code(static_cast<int32_t>(res.status().code()));
          left->set_error(std::string(res.status().message()));
        }
        write(reply);
        continue;
      }
      case engram::v1::ClientMessage::kHello:
        result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "hello sent twice in one session");
        break;
      default: result = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty or unknown client message"); break;
    }
    break;  // only reached on a protocol error
  }
  state_->Detach(lease);
  group_sink->Close();  // the stream goes with this frame; updates still in flight to it are dropped
  return result;
}

grpc::Status EngramService::Status(grpc::ServerContext* ctx, const engram::v1::StatusRequest*,
                                   engram::v1::StatusReply* reply) {
  PeerCred peer;
  if (auto st = Authorize(ctx, &peer); !st.ok()) return st;
  *reply = state_->Status();
  std::lock_guard<std::mutex> lock(sessions_mu_);
  if (sessions_refused_ > 0) {
    reply->add_recent_fallbacks(absl::StrFormat(
        "sessions_refused count=%d: sessions over max_sessions (%d) or max_sessions_per_uid (%d); %d open now",
        sessions_refused_, max_sessions_, max_sessions_per_uid_, sessions_));
  }
  MakePrintable(reply);  // paths, errors and hints quote checkpoint files and clients
  return grpc::Status::OK;
}

grpc::Status EngramService::Load(grpc::ServerContext* ctx, const engram::v1::LoadRequest* req, engram::v1::LoadReply*) {
  PeerCred peer;
  if (auto st = AuthorizeOperator(ctx, "load", &peer); !st.ok()) return st;
  if (auto st = Bounded("checkpoint", req->checkpoint()); !st.ok()) return st;
  if (req->tp_sizes_size() > 64) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "at most 64 TP sizes are accepted");
  }
  for (int32_t tp : req->tp_sizes()) {
    if (tp < 1 || tp > 1024) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("TP size ", tp, " is not in [1, 1024]"));
    }
  }
  std::vector<int64_t> tps(req->tp_sizes().begin(), req->tp_sizes().end());
  return ToGrpc(state_->Load(req->checkpoint(), tps));
}

grpc::Status EngramService::Unload(grpc::ServerContext* ctx, const engram::v1::UnloadRequest* req,
                                   engram::v1::UnloadReply*) {
  PeerCred peer;
  if (auto st = AuthorizeOperator(ctx, "unload", &peer); !st.ok()) return st;
  if (auto st = Bounded("checkpoint", req->checkpoint()); !st.ok()) return st;
  return ToGrpc(state_->Unload(req->checkpoint()));
}

grpc::Status EngramService::Drain(grpc::ServerContext* ctx, const engram::v1::DrainRequest*, engram::v1::DrainReply*) {
  PeerCred peer;
  if (auto st = AuthorizeOperator(ctx, "drain", &peer); !st.ok()) return st;
  state_->Drain();
  return grpc::Status::OK;
}

}  // namespace engram::daemon
