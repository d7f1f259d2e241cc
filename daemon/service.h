// EngramService: the gRPC service of engramd (proto/engram/v1/engram.proto) over Coordinator. Session is one
// long-lived bidirectional stream per replica: hello -> grant or fallback; ticket requests and registration
// results; then once the replica settled, its outcome (at most one, never while it holds a ticket); daemon events.
// The stream is the lease: when it ends for any reason the replica is detached. Every
// malformed or out-of-order message ends that one session with a precise status; nothing a client sends can take
// the daemon down. Every string a client sends is bounded (kMaxClientStringBytes: hello.checkpoint, the checkpoint
// of Load/Unload, a registration's error; a backend name kMaxBackendBytes; hello.client_version kMaxClientVersionBytes
// of printable ASCII): longer or otherwise is INVALID_ARGUMENT, and what is echoed back into hints and status is cut
// further (kMaxEchoBytes, daemon/fallback.h). Thread-safe (gRPC's sync
// server runs each call on its own thread).
#pragma once

#include <map>
#include <mutex>

#include "daemon/coordinator.h"
#include "daemon/listener.h"
#include "engram/v1/engram.grpc.pb.h"

namespace engram::daemon {

inline constexpr size_t kMaxClientStringBytes = 4096;
inline constexpr size_t kMaxEngineChoiceBytes = 2048;  // EngineChoice.text
inline constexpr size_t kMaxBackendBytes = 64;
inline constexpr size_t kMaxClientVersionBytes = 64;

class EngramService final : public engram::v1::Engram::Service {
 public:
  EngramService(Coordinator* state, UdsListener* listener, int max_sessions = 2048, int max_sessions_per_uid = 512)
      : state_(state), listener_(listener), max_sessions_(max_sessions), max_sessions_per_uid_(max_sessions_per_uid) {}

  grpc::Status Session(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<engram::v1::ServerMessage, engram::v1::ClientMessage>* stream) override;
  grpc::Status Status(grpc::ServerContext* ctx, const engram::v1::StatusRequest* req,
                      engram::v1::StatusReply* reply) override;
  grpc::Status Load(grpc::ServerContext* ctx, const engram::v1::LoadRequest* req,
                    engram::v1::LoadReply* reply) override;
  grpc::Status Unload(grpc::ServerContext* ctx, const engram::v1::UnloadRequest* req,
                      engram::v1::UnloadReply* reply) override;
  grpc::Status Drain(grpc::ServerContext* ctx, const engram::v1::DrainRequest* req,
                     engram::v1::DrainReply* reply) override;
  // New session bounds (a reload): the next session is admitted against them; open sessions are never cut.
  void SetSessionBounds(int max_sessions, int max_sessions_per_uid);

 private:
  // Authorize, and the peer is an operator (UdsListener::Operator); `call` names the refused call.
  grpc::Status AuthorizeOperator(grpc::ServerContext* ctx, const char* call, PeerCred* peer);
  // The caller's credentials, or PERMISSION_DENIED.
  grpc::Status Authorize(grpc::ServerContext* ctx, PeerCred* peer);
  // Admits one more session of `uid` within the bounds, or RESOURCE_EXHAUSTED; EndSession gives it back.
  grpc::Status AdmitSession(const PeerCred& peer);
  void EndSession(uint32_t uid);
  Coordinator* state_;
  UdsListener* listener_;
  std::mutex sessions_mu_;  // guards the five below
  int max_sessions_, max_sessions_per_uid_;
  std::map<uint32_t, int> sessions_by_uid_;
  int sessions_ = 0;
  uint64_t sessions_refused_ = 0;
};

grpc::Status ToGrpc(const absl::Status& st);

}  // namespace engram::daemon
