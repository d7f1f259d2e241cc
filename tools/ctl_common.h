// What engramctl's daemon subcommands share (tools/ctl_status.cc, ctl_operator.cc, ctl_attach.cc): the usage
// error, the gRPC stub on the daemon's socket, the exit codes and messages of a failed call (3: nothing answers,
// 4: this uid may not use the socket), and the small formatters of status. Stateless; thread-compatible.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "engram/v1/engram.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace engram::tools::ctl {

using nlohmann::json;
inline constexpr const char* kDefaultSocket = "/run/engramd/engramd.sock";

// Prints `msg` and the usage to stderr; returns 2.
int Usage(const std::string& msg);
std::unique_ptr<engram::v1::Engram::Stub> Connect(const std::string& socket);
// Why nothing answered on `socket`, from a plain connect(2): no socket, a stale one, a path that is not a socket at
// all (named for what it is: a FIFO, a file, a directory, a device), or a permission refusal (which is not "engramd
// is not running"). Empty when the connect succeeds.
std::string DiagnoseSocket(const std::string& socket);
// Exit code and message for a failed RPC: 3 when nothing answers on the socket, 4 when this user may not use it.
int RpcFailure(const grpc::Status& st, const std::string& socket);
// The same for a session that could not be opened.
int StatusFailure(const absl::Status& st, const std::string& socket);
std::string Bar(uint64_t used, uint64_t total, int width = 30);
std::string GiB(uint64_t b);

}  // namespace engram::tools::ctl
