// engramctl status, watch and ready: what the daemon holds and who uses it (tools/ctl_daemon.h).
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
#include "client/session/session.h"
#include "client/session/status_json.h"
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "shm/segment.h"
#include "tools/args.h"
#include "tools/row_oracle.h"

#include "proto/printable.h"
#include "tools/ctl_common.h"

namespace engram::tools {

using namespace ctl;  // NOLINT: the subcommands' shared helpers

namespace {

void PrintGroups(const engram::v1::StatusReply& s) {
  if (s.groups_size() == 0) return;
  std::cout << absl::StrFormat("\n%-44s %-6s %-9s %-9s %-7s %-12s %s\n", "dp group", "tp", "state", "transport", "slot",
                               "bytes/step", "members (dp rank:pid)");
  for (const auto& g : s.groups()) {
    std::vector<std::string> members;
    for (const auto& m : g.members()) {
      members.push_back(absl::StrFormat("%d:%d%s", m.dp_rank(), m.pid(),
                                        m.stalled() ? "(stalled)"
                                        : m.left()  ? "(left)"
                                                    : ""));
    }
    std::cout << absl::StrFormat("%-44s %-6s %-9s %-9s %-7d %-12s %s (%d of %d)\n", g.group(),
                                 absl::StrFormat("%d/%d", g.tp_rank(), g.tp_size()), g.state(), g.transport(), g.slot(),
                                 absl::StrFormat("%.2f MiB", g.bytes_per_step() / 1048576.0),
                                 absl::StrJoin(members, " "), g.members_size(), g.size());
    if (g.state() == "BROKEN") std::cout << "           ! " << g.detail() << "\n";
  }
}

}  // namespace

int CmdStatus(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket"}, {"--json"}); !st.ok()) return Usage(std::string(st.message()));
  const std::string socket = a.Get("--socket", kDefaultSocket);
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  engram::v1::StatusReply s;
  grpc::Status st = stub->Status(&ctx, engram::v1::StatusRequest(), &s);
  if (st.ok()) MakePrintable(&s);  // every string it shows came from a file or a client
  if (!st.ok()) return RpcFailure(st, socket);
  if (a.Has("--json")) {
    std::cout << client::StatusJson(s) << "\n";  // the one status document (docs/status.md), as engram.status()
    return 0;
  }
  const auto& shm = s.shm();
  const uint64_t used = shm.total_bytes() - shm.free_bytes();
  std::cout << absl::StrFormat("engramd %s on %s\n", s.daemon_version().empty() ? "-" : s.daemon_version(), socket);
  std::cout << absl::StrFormat("shm %s (huge pages: %s)\n  %s %s used of %s, engram %s, free %s\n\n", shm.path(),
                               shm.huge_pages(), Bar(used, shm.total_bytes()), GiB(used), GiB(shm.total_bytes()),
                               GiB(shm.engram_bytes()), GiB(shm.free_bytes()));
  std::cout << absl::StrFormat("%-40s %-6s %-10s %-9s %-10s %-8s %s\n", "segment", "tp", "size", "state", "origin",
                               "load s", "checksum");
  for (const auto& g : s.segments()) {
    std::string state = g.state();
    if (g.state() == "LOADING") state += absl::StrFormat(" %.0f%%", g.progress() * 100);
    std::cout << absl::StrFormat("%-40s %-6s %-10s %-9s %-10s %-8.2f %s%s\n", g.name(),
                                 absl::StrFormat("%d/%d", g.tp_rank(), g.tp_size()), GiB(g.bytes()), state,
                                 g.origin().empty() ? "-" : g.origin(), g.load_seconds(), g.checksum_state(),
                                 g.error().empty() ? "" : "  ! " + g.error());
  }
  // engramd's own first registration of each segment (daemon/prewarm.h): one line when it is off everywhere.
  bool any_prewarm = false;
  for (const auto& g : s.segments()) {
    const auto& p = g.prewarm();
    if (p.state() == "off" || p.state().empty()) continue;
    any_prewarm = true;
    std::cout << absl::StrFormat("  prewarm %s: %s", g.name(), p.state());
    if (p.state() == "done")
      std::cout << absl::StrFormat(", registered in %.2fs (%.2fs in all)", p.register_seconds(), p.seconds());
    if (p.at_unix_ms() > 0) {
      std::cout << ", at "
                << absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(p.at_unix_ms()), absl::LocalTimeZone());
    }
    if (p.state() != "done" && !p.detail().empty()) std::cout << ": " << p.detail();
    std::cout << "\n";
  }
  if (!any_prewarm && s.segments_size() > 0) {
    std::cout << "  registration prewarm off: " << s.segments(0).prewarm().detail() << "\n";
  }
  std::cout << absl::StrFormat("\n%-8s %-6s %-6s %-6s %-15s %-11s %-12s %-10s %-10s %s\n", "pid", "uid", "dp", "tp",
                               "mode", "via", "attached", "register", "client", "reasons");
  for (const auto& r : s.replicas()) {
    std::vector<std::string> reasons;
    for (const auto& x : r.reasons()) reasons.push_back(engram::v1::FallbackReason_Name(x.code()));
    // A replica in another PID namespace shows pid 0 to the daemon: its own pid, marked, is more use.
    const std::string pid = r.pid() != 0 ? std::to_string(r.pid()) : absl::StrCat("~", r.own_pid());
    std::cout << absl::StrFormat("%-8s %-6d %-6s %-6s %-15s %-11s %-12s %-10s %-10s %s\n", pid, r.uid(),
                                 absl::StrFormat("%d/%d", r.dp_rank(), r.dp_size()),
                                 absl::StrFormat("%d/%d", r.tp_rank(), r.tp_size()), r.mode(),
                                 r.attach().empty() ? "-" : r.attach(), absl::StrFormat("%.0fs", r.attached_seconds()),
                                 r.register_seconds() < 0 ? "-" : absl::StrFormat("%.2fs", r.register_seconds()),
                                 r.client_version().empty() ? "-" : r.client_version(),  // "-": an older client
                                 reasons.empty() ? "-" : absl::StrJoin(reasons, ","));
    for (const auto& x : r.reasons())
      std::cout << "           " << engram::v1::FallbackReason_Name(x.code()) << ": " << x.hint() << "\n";
    if (!r.engine().empty()) std::cout << "           engine: " << r.engine() << "\n";
  }
  PrintGroups(s);
  if (s.recent_fallbacks_size() > 0) {
    std::cout << "\nrecent fallbacks:\n";
    for (const auto& f : s.recent_fallbacks()) std::cout << "  " << f << "\n";
  }
  if (!s.descriptors().socket().empty()) {
    std::cout << absl::StrFormat("\ndescriptors: %s, %d passed, %d refused\n", s.descriptors().socket(),
                                 s.descriptors().sent(), s.descriptors().refused());
  } else {
    std::cout << "\ndescriptors: not passed by this engramd (replicas attach by path)\n";
  }
  if (s.draining()) std::cout << "\nengramd is draining\n";
  return 0;
}

int CmdWatch(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket", "--interval", "--count"}, {}); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  const std::string socket = a.Get("--socket", kDefaultSocket);
  if (auto st = a.RequireInts({"--count"}, 0, std::numeric_limits<int32_t>::max()); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  double interval = 1;
  if (a.Has("--interval") &&
      (!absl::SimpleAtod(a.Get("--interval"), &interval) || !(interval > 0) || interval > 3600)) {
    return Usage("--interval wants seconds in (0, 3600], got " + a.Get("--interval"));
  }
  interval = std::max(0.1, interval);
  const int64_t count = a.GetInt("--count", 0).value_or(0);
  auto stub = Connect(socket);
  std::map<std::string, std::pair<double, std::chrono::steady_clock::time_point>> last;  // progress seen
  for (int64_t tick = 0; count == 0 || tick < count; ++tick) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    engram::v1::StatusReply s;
    grpc::Status st = stub->Status(&ctx, engram::v1::StatusRequest(), &s);
    if (st.ok()) MakePrintable(&s);  // every string it shows came from a file or a client
    if (!st.ok()) return RpcFailure(st, socket);
    const auto now = std::chrono::steady_clock::now();
    bool busy = false;
    std::cout << absl::StrFormat("[%s] %d segments, %d replicas\n",
                                 absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone()), s.segments_size(),
                                 s.replicas_size());
    for (const auto& g : s.segments()) {
      const bool loading = g.state() == "LOADING" || g.state() == "PENDING";
      const bool verifying = g.checksum_state() == "verifying";
      busy = busy || loading || verifying;
      std::string rate = "-", eta = "-";
      auto it = last.find(g.name());
      if (it != last.end() && (loading || verifying)) {
        const double dt = std::chrono::duration<double>(now - it->second.second).count();
        const double gibs = (g.progress() - it->second.first) * g.bytes() / 1073741824.0 / std::max(dt, 1e-3);
        if (gibs > 0) {
          rate = absl::StrFormat("%.2f GiB/s", gibs);
          eta = absl::StrFormat("%.0f s", (1 - g.progress()) * g.bytes() / 1073741824.0 / gibs);
        }
      }
      last[g.name()] = {g.progress(), now};
      std::cout << absl::StrFormat("  %-40s %-9s %s %5.1f%%  %-12s eta %s%s\n", g.name(),
                                   verifying ? "VERIFYING" : g.state(),
                                   Bar(static_cast<uint64_t>(g.progress() * 1000), 1000, 20), g.progress() * 100, rate,
                                   eta, g.error().empty() ? "" : "  ! " + g.error());
    }
    std::cout.flush();
    if (!busy && count == 0) return 0;
    std::this_thread::sleep_for(std::chrono::duration<double>(interval));
  }
  return 0;
}

int CmdReady(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket"}, {}); !st.ok()) return Usage(std::string(st.message()));
  const std::string socket = a.Get("--socket", kDefaultSocket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  engram::v1::StatusReply s;
  grpc::Status st = Connect(socket)->Status(&ctx, engram::v1::StatusRequest(), &s);
  if (st.ok()) MakePrintable(&s);  // every string it shows came from a file or a client
  if (!st.ok()) return RpcFailure(st, socket);
  std::vector<std::string> waiting;
  for (const auto& g : s.segments()) {
    if (g.state() != "READY") waiting.push_back(g.name() + " " + g.state());
  }
  if (s.draining()) waiting.push_back("engramd is draining");
  if (s.segments().empty()) waiting.push_back("no segments configured yet");
  if (!waiting.empty()) {
    std::cout << "not ready: " << absl::StrJoin(waiting, ", ") << "\n";
    return 1;
  }
  std::cout << "ready: " << s.segments_size() << " segments READY\n";
  return 0;
}

}  // namespace engram::tools
