// RefusingService: the only service of the gRPC server that engramd hands the connections of refused peers to
// (UdsListener: a uid that is neither root, the daemon's own, nor a member of --group). Every method of every
// service (engram.v1.Engram, grpc.health.v1.Health, reflection, anything) answers PERMISSION_DENIED with the same
// message EngramService gives, so a refused uid learns nothing about the daemon, and engramctl still tells a
// permission refusal apart from "not running". Stateless apart from the listener pointer; thread-safe.
#pragma once

#include <grpcpp/generic/async_generic_service.h>

#include "daemon/listener.h"

namespace engram::daemon {

class RefusingService final : public grpc::CallbackGenericService {
 public:
  explicit RefusingService(UdsListener* listener) : listener_(listener) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

 private:
  UdsListener* listener_;
};

}  // namespace engram::daemon
