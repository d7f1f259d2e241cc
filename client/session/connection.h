// The wire side of a Session (client/session/session.h): one gRPC stream to engramd on its Unix socket, the hello
// that opens it (the replica's declaration, pid and library version), and the checks of the socket path before gRPC
// sees it. The client's enums carry the wire numbers (checked in connection.cc).
//
// Internal to client/session/. Ownership: a Connection owns its stub, context and stream; the caller owns the
// Connection. Thread-safety: Connect is reentrant; a Connection's stream takes one reader and one writer at a time,
// and its ctx.TryCancel() may be called from any thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/session/session.h"
#include "engram/v1/engram.grpc.pb.h"

namespace engram::client {

// One gRPC stream to engramd.
struct Connection {
  std::unique_ptr<v1::Engram::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ClientMessage, v1::ServerMessage>> stream;
};

// A gRPC status as an absl::Status with the same code, its message prefixed with `what`.
absl::Status FromGrpc(const grpc::Status& s, const std::string& what);

// gRPC's target for the daemon's socket path. The path is taken literally: one gRPC would read differently (it
// percent-decodes and splits on ',' '?' '#') or the kernel could not hold (too long) is refused here, with a clear
// error, before gRPC sees it.
absl::StatusOr<std::string> GrpcTarget(const std::string& socket);

// Connects, says hello and waits for the answer within `timeout` (the call is cancelled at the deadline).
absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string& socket, std::chrono::milliseconds timeout,
                                                    const Declaration& d, v1::ServerMessage* answer);

// Whether the daemon that answered a hello takes EngineChoice messages (an older one ends a session that sends one).
bool TakesEngineChoice(const v1::ServerMessage& answer);

}  // namespace engram::client
