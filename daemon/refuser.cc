#include "daemon/refuser.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace engram::daemon {
namespace {

class Refusal final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Refusal(const std::string& message) { Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, message)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerGenericBidiReactor* RefusingService::CreateReactor(grpc::GenericCallbackServerContext* ctx) {
  auto peer = listener_->PeerOf(ctx->peer());
  return new Refusal(
      peer ? absl::StrCat("uid ", peer->uid, " may not use engramd: add it to the daemon's group (--group)")
           : std::string("cannot identify the peer (SO_PEERCRED)"));
}

}  // namespace engram::daemon
