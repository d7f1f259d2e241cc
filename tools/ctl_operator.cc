// engramctl load, unload and drain: the operator calls (tools/ctl_daemon.h).
#include "tools/ctl_daemon.h"

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/utf8.h"
#include "client/session/session.h"
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "model/normalize.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tools/args.h"
#include "tools/row_oracle.h"

#include "tools/ctl_common.h"

namespace engram::tools {

using namespace ctl;  // NOLINT: the subcommands' shared helpers

namespace {
// The daemon's paths travel as protobuf strings, which are UTF-8 by definition.
constexpr const char* kNotUtf8 = "--checkpoint is not valid UTF-8: engramd takes checkpoint paths in UTF-8";
}  // namespace

int CmdLoad(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket", "--checkpoint", "--tp", "--timeout"}, {}); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--checkpoint")) return Usage("load needs --checkpoint DIR");
  if (!IsValidUtf8(a.Get("--checkpoint"))) return Usage(kNotUtf8);
  if (auto st = a.RequireInts({"--timeout"}, 1, 24 * 3600); !st.ok()) return Usage(std::string(st.message()));
  engram::v1::LoadRequest req;
  req.set_checkpoint(a.Get("--checkpoint"));
  if (a.Has("--tp")) {
    auto tps = ParseIntList("--tp", a.Get("--tp"));
    if (!tps.ok()) return Usage(std::string(tps.status().message()));
    for (int64_t t : *tps) {
      if (t < 1 || t > 1024) return Usage("--tp sizes must be in [1, 1024], got " + a.Get("--tp"));
      req.add_tp_sizes(static_cast<int32_t>(t));
    }
  }
  const std::string socket = a.Get("--socket", kDefaultSocket);
  grpc::ClientContext ctx;
  // Opening a checkpoint reads its headers and builds the token map; publishing runs in the background.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(a.GetInt("--timeout", 300).value_or(300)));
  engram::v1::LoadReply reply;
  grpc::Status st = Connect(socket)->Load(&ctx, req, &reply);
  if (!st.ok()) return RpcFailure(st, socket);
  std::cout << "loading " << Printable(req.checkpoint()) << " (engramctl status shows progress)\n";
  return 0;
}

int CmdUnload(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket", "--checkpoint"}, {}); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--checkpoint")) return Usage("unload needs --checkpoint DIR");
  if (!IsValidUtf8(a.Get("--checkpoint"))) return Usage(kNotUtf8);
  engram::v1::UnloadRequest req;
  req.set_checkpoint(a.Get("--checkpoint"));
  const std::string socket = a.Get("--socket", kDefaultSocket);
  grpc::ClientContext ctx;
  engram::v1::UnloadReply reply;
  grpc::Status st = Connect(socket)->Unload(&ctx, req, &reply);
  if (!st.ok()) return RpcFailure(st, socket);
  return 0;
}

int CmdDrain(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket"}, {}); !st.ok()) return Usage(std::string(st.message()));
  const std::string socket = a.Get("--socket", kDefaultSocket);
  grpc::ClientContext ctx;
  engram::v1::DrainReply reply;
  grpc::Status st = Connect(socket)->Drain(&ctx, engram::v1::DrainRequest(), &reply);
  if (!st.ok()) return RpcFailure(st, socket);
  return 0;
}

}  // namespace engram::tools
