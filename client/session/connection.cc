// The wire side of a Session (client/session/connection.h): the hello, the socket's gRPC target, the connect, and
// the one-shot Status call (FetchStatusJson).
#include "client/session/connection.h"

#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "client/session/status_json.h"
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

}  // namespace

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

absl::StatusOr<std::string> GrpcTarget(const std::string& socket) {
  RETURN_IF_ERROR(net::CheckSocketPath(socket));
  if (socket.find_first_of(std::string("%,?#\0", 5)) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("the socket path '", Printable(socket),
                                                   "' contains one of % , ? # or a NUL: give the path without them"));
  }
  return absl::StrCat("unix:", socket);
}

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

bool TakesEngineChoice(const v1::ServerMessage& answer) {
  return answer.has_grant() ? answer.grant().takes_engine_choice()
                            : answer.has_fallback() && answer.fallback().takes_engine_choice();
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
