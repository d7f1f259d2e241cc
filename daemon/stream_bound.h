// StreamBound: a server interceptor that bounds, per uid, the streaming calls engramd serves besides Session (which
// EngramService bounds itself, max_sessions / max_sessions_per_uid): the health service's Watch and, when it is on
// (--reflection), gRPC reflection's ServerReflectionInfo. A sync stream holds one of the server's threads for as long
// as it is open, so idle streams without a bound would take the threads that status and the other engines' sessions
// need. A call over its uid's bound (`max_per_uid`, at least 1), a reflection call while reflection is off (linking
// gRPC's reflection library registers its service on every server, so this is where it is turned off), and one from
// a peer that is not an operator (UdsListener::Operator: reflection describes the daemon's API to operators only) is
// cancelled as soon as its headers arrive and logged (`event=refused ... reason=TOO_MANY_STREAMS`, `NOT_OPERATOR`,
// or at debug level `REFLECTION_OFF`); the client sees CANCELLED. Unary calls pass untouched.
//
// Ownership: the factory belongs to the server (ServerBuilder::experimental().SetInterceptorCreators); each call's
// interceptor holds a pointer to the shared counts, which the factory's owner keeps alive for the server's life.
// Thread-safe: the counts are under one mutex.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "daemon/listener.h"

namespace engram::daemon {

// The per-uid counts of open streams, shared by the calls' interceptors.
class StreamCounts {
 public:
  StreamCounts(UdsListener* listener, int max_per_uid, bool reflection)
      : listener_(listener), max_per_uid_(max_per_uid < 1 ? 1 : max_per_uid), reflection_(reflection) {}
  UdsListener* listener() const { return listener_; }
  bool reflection() const { return reflection_; }  // whether reflection is served at all
  // One more stream of `uid` within the bound (true), or none (false).
  bool Admit(uint32_t uid);
  void Release(uint32_t uid);
  int max_per_uid() const { return max_per_uid_; }
  void set_max_per_uid(int n) { max_per_uid_ = n < 1 ? 1 : n; }  // a reload: new streams are checked against it
  int open_of(uint32_t uid);

 private:
  UdsListener* listener_;
  std::atomic<int> max_per_uid_;
  const bool reflection_;
  std::mutex mu_;
  std::map<uint32_t, int> open_;
};

class StreamBoundFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit StreamBoundFactory(StreamCounts* counts) : counts_(counts) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  StreamCounts* counts_;
};

}  // namespace engram::daemon
