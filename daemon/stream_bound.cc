#include "daemon/stream_bound.h"

#include <grpcpp/server_context.h>

#include <cstring>
#include <string>

#include "spdlog/spdlog.h"

namespace engram::daemon {

bool StreamCounts::Admit(uint32_t uid) {
  std::lock_guard<std::mutex> lock(mu_);
  int& n = open_[uid];
  if (n >= max_per_uid_) return false;
  ++n;
  return true;
}

void StreamCounts::Release(uint32_t uid) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(uid);
  if (it != open_.end() && --it->second <= 0) open_.erase(it);
}

int StreamCounts::open_of(uint32_t uid) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(uid);
  return it == open_.end() ? 0 : it->second;
}

namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

bool IsReflection(const char* method) {
  return method != nullptr && std::strstr(method, "/grpc.reflection.") == method;
}

class StreamBound final : public grpc::experimental::Interceptor {
 public:
  StreamBound(ServerRpcInfo* info, StreamCounts* counts) : info_(info), counts_(counts) {}
  ~StreamBound() override {
    if (admitted_) counts_->Release(uid_);
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) Check();
    methods->Proceed();
  }

 private:
  void Check() {
    grpc::ServerContextBase* ctx = info_->server_context();
    const auto peer = counts_->listener()->PeerOf(ctx->peer());
    if (!peer) {
      ctx->TryCancel();
      return;
    }
    const std::string method = info_->method() != nullptr ? info_->method() : "";
    if (IsReflection(info_->method()) && !counts_->reflection()) {
      spdlog::debug("event=refused pid={} uid={} call=reflection reason=REFLECTION_OFF", peer->pid, peer->uid);
      ctx->TryCancel();
      return;
    }
    if (IsReflection(info_->method()) && !counts_->listener()->Operator(*peer)) {
      spdlog::warn("event=refused pid={} uid={} call=reflection reason=NOT_OPERATOR", peer->pid, peer->uid);
      ctx->TryCancel();
      return;
    }
    if (!counts_->Admit(peer->uid)) {
      spdlog::warn("event=refused pid={} uid={} call={} reason=TOO_MANY_STREAMS streams={} limit={}", peer->pid,
                   peer->uid, method, counts_->open_of(peer->uid), counts_->max_per_uid());
      ctx->TryCancel();
      return;
    }
    admitted_ = true;
    uid_ = peer->uid;
  }

  ServerRpcInfo* info_;
  StreamCounts* counts_;
  bool admitted_ = false;
  uint32_t uid_ = 0;
};

}  // namespace

grpc::experimental::Interceptor* StreamBoundFactory::CreateServerInterceptor(ServerRpcInfo* info) {
  if (info->type() == ServerRpcInfo::Type::UNARY) return nullptr;
  const char* method = info->method();
  if (method != nullptr && std::strcmp(method, "/engram.v1.Engram/Session") == 0) return nullptr;  // its own bound
  return new StreamBound(info, counts_);
}

}  // namespace engram::daemon
