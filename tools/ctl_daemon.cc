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
#include <limits>
#include <map>
#include <iostream>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/strings/str_join.h"
#include "client/session/session.h"
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tools/args.h"
#include "tools/row_oracle.h"

namespace engram::tools {
namespace {

using nlohmann::json;
constexpr const char* kDefaultSocket = "/run/engramd/engramd.sock";

int Usage(const std::string& msg) {
  std::cerr << "engramctl: " << msg << "\n";
  return 2;
}

std::unique_ptr<engram::v1::Engram::Stub> Connect(const std::string& socket) {
  return engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

// Why nothing answered on `socket`, from a plain connect(2): no socket, a stale one, or a permission refusal
// (which is not "engramd is not running"). Empty when the connect succeeds.
std::string DiagnoseSocket(const std::string& socket) {
  sockaddr_un addr{};
  if (socket.size() >= sizeof(addr.sun_path)) return socket + ": socket path too long";
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::string("cannot create a socket: ") + std::strerror(errno);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc == 0) return "";
  switch (err) {
    case ENOENT:
      return "engramd is not running (no socket at " + socket + ")";
    case ECONNREFUSED:
      return "engramd is not running (nothing listens on " + socket + ")";
    case EACCES:
    case EPERM:
      return "permission denied on " + socket + ": this user may not use engramd (add it to the daemon's group)";
    default:
      return "cannot connect to " + socket + ": " + std::strerror(err);
  }
}

// Exit code and message for a failed RPC: 3 when nothing answers on the socket, 4 when this user may not use it.
int RpcFailure(const grpc::Status& st, const std::string& socket) {
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE || st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    const std::string why = DiagnoseSocket(socket);
    if (why.rfind("permission denied", 0) == 0) {
      std::cerr << "engramctl: " << why << "\n";
      return 4;
    }
    if (!why.empty()) {
      std::cerr << "engramctl: " << why << "\n";
      return 3;
    }
    // Something listens and answered with an error of its own (e.g. draining): say what it said.
    std::cerr << "engramctl: engramd on " << socket << ": " << st.error_message() << "\n";
    return 1;
  }
  if (st.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    std::cerr << "engramctl: " << st.error_message() << "\n";
    return 4;
  }
  std::cerr << "engramctl: " << st.error_message() << "\n";
  return 1;
}

// The same for a session that could not be opened.
int StatusFailure(const absl::Status& st, const std::string& socket) {
  return RpcFailure(grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message())), socket);
}

std::string Bar(uint64_t used, uint64_t total, int width = 30) {
  const int n = total ? static_cast<int>(static_cast<double>(used) / total * width + 0.5) : 0;
  const size_t filled = static_cast<size_t>(std::clamp(n, 0, width));
  // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on a chain of operator+ here.
  std::string bar = "[";
  bar.append(filled, '#');
  bar.append(static_cast<size_t>(width) - filled, '.');
  bar.push_back(']');
  return bar;
}

std::string GiB(uint64_t b) { return absl::StrFormat("%.2f GiB", static_cast<double>(b) / (1ull << 30)); }

json ReasonsJson(const google::protobuf::RepeatedPtrField<engram::v1::Reason>& reasons, bool with_hints) {
  json out = json::array();
  for (const auto& r : reasons) {
    if (with_hints) {
      out.push_back({{"code", engram::v1::FallbackReason_Name(r.code())}, {"hint", r.hint()}});
    } else {
      out.push_back(engram::v1::FallbackReason_Name(r.code()));
    }
  }
  return out;
}

// DP-sharded groups (embedding_across_dp): members with their dp ranks, slot, bytes per step, broken + who left.
json GroupsJson(const engram::v1::StatusReply& s) {
  json groups = json::array();
  for (const auto& g : s.groups()) {
    json members = json::array();
    for (const auto& m : g.members()) {
      json member = {{"pid", m.pid()}, {"dp_rank", m.dp_rank()}, {"edp_rank", m.edp_rank()},
                     {"max_tokens", m.max_tokens()}, {"bytes_per_step", m.bytes_per_step()}};
      if (m.left()) member["left"] = m.left_reason();  // it left (GroupLeave) or its session ended: why
      members.push_back(member);
    }
    json one = {{"group", g.group()},         {"checkpoint", g.checkpoint()}, {"tp_rank", g.tp_rank()},
                {"tp_size", g.tp_size()},     {"size", g.size()},             {"state", g.state()},
                {"transport", g.transport()}, {"slot", g.slot()},             {"bytes_per_step", g.bytes_per_step()},
                {"members", members},         {"generation", g.generation()}};
    if (g.state() == "BROKEN") {
      one["detail"] = g.detail();
      one["left"] = {{"pid", g.left_pid()}, {"dp_rank", g.left_dp_rank()}};
    }
    groups.push_back(one);
  }
  return groups;
}

void PrintGroups(const engram::v1::StatusReply& s) {
  if (s.groups_size() == 0) return;
  std::cout << absl::StrFormat("\n%-44s %-6s %-9s %-9s %-7s %-12s %s\n", "dp group", "tp", "state", "transport",
                               "slot", "bytes/step", "members (dp rank:pid)");
  for (const auto& g : s.groups()) {
    std::vector<std::string> members;
    for (const auto& m : g.members()) {
      members.push_back(absl::StrFormat("%d:%d%s", m.dp_rank(), m.pid(), m.left() ? "(left)" : ""));
    }
    std::cout << absl::StrFormat("%-44s %-6s %-9s %-9s %-7d %-12s %s (%d of %d)\n", g.group(),
                                 absl::StrFormat("%d/%d", g.tp_rank(), g.tp_size()), g.state(), g.transport(),
                                 g.slot(), absl::StrFormat("%.2f MiB", g.bytes_per_step() / 1048576.0),
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
  if (!st.ok()) return RpcFailure(st, socket);
  json j;
  j["shm"] = {{"path", s.shm().path()},
              {"total_bytes", s.shm().total_bytes()},
              {"free_bytes", s.shm().free_bytes()},
              {"engram_bytes", s.shm().engram_bytes()},
              {"huge_pages", s.shm().huge_pages()}};
  j["segments"] = json::array();
  for (const auto& g : s.segments()) {
    j["segments"].push_back({{"name", g.name()},
                             {"checkpoint", g.checkpoint()},
                             {"tp_rank", g.tp_rank()},
                             {"tp_size", g.tp_size()},
                             {"bytes", g.bytes()},
                             {"state", g.state()},
                             {"origin", g.origin()},
                             {"load_seconds", g.load_seconds()},
                             {"checksum_state", g.checksum_state()},
                             {"progress", g.progress()},
                             {"error", g.error()}});
  }
  j["replicas"] = json::array();
  for (const auto& r : s.replicas()) {
    j["replicas"].push_back({{"pid", r.pid()},
                             {"uid", r.uid()},
                             {"dp_rank", r.dp_rank()},
                             {"dp_size", r.dp_size()},
                             {"local_dp_size", r.local_dp_size()},
                             {"tp_rank", r.tp_rank()},
                             {"tp_size", r.tp_size()},
                             {"segment", r.segment()},
                             {"mode", r.mode()},
                             {"backend", r.backend()},
                             {"reasons", ReasonsJson(r.reasons(), false)},
                             {"hints", ReasonsJson(r.reasons(), true)},
                             {"attach", r.attach()},
                             {"own_pid", r.own_pid()},
                             {"attached_seconds", r.attached_seconds()},
                             {"register_seconds", r.register_seconds()}});
  }
  j["recent_fallbacks"] = s.recent_fallbacks();
  j["draining"] = s.draining();
  j["groups"] = GroupsJson(s);
  j["descriptors"] = {{"socket", s.descriptors().socket()},
                      {"sent", s.descriptors().sent()},
                      {"refused", s.descriptors().refused()}};
  if (a.Has("--json")) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  const auto& shm = s.shm();
  const uint64_t used = shm.total_bytes() - shm.free_bytes();
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
  std::cout << absl::StrFormat("\n%-8s %-6s %-6s %-6s %-15s %-11s %-12s %-10s %s\n", "pid", "uid", "dp", "tp", "mode",
                               "via", "attached", "register", "reasons");
  for (const auto& r : s.replicas()) {
    std::vector<std::string> reasons;
    for (const auto& x : r.reasons()) reasons.push_back(engram::v1::FallbackReason_Name(x.code()));
    // A replica in another PID namespace shows pid 0 to the daemon: its own pid, marked, is more use.
    const std::string pid = r.pid() != 0 ? std::to_string(r.pid()) : absl::StrCat("~", r.own_pid());
    std::cout << absl::StrFormat("%-8s %-6d %-6s %-6s %-15s %-11s %-12s %-10s %s\n", pid, r.uid(),
                                 absl::StrFormat("%d/%d", r.dp_rank(), r.dp_size()),
                                 absl::StrFormat("%d/%d", r.tp_rank(), r.tp_size()), r.mode(), r.attach().empty() ? "-" : r.attach(),
                                 absl::StrFormat("%.0fs", r.attached_seconds()),
                                 r.register_seconds() < 0 ? "-" : absl::StrFormat("%.2fs", r.register_seconds()),
                                 reasons.empty() ? "-" : absl::StrJoin(reasons, ","));
    for (const auto& x : r.reasons()) std::cout << "           " << engram::v1::FallbackReason_Name(x.code()) << ": " << x.hint() << "\n";
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
  if (a.Has("--interval") && (!absl::SimpleAtod(a.Get("--interval"), &interval) || !(interval > 0) || interval > 3600)) {
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
    if (!st.ok()) return RpcFailure(st, socket);
    const auto now = std::chrono::steady_clock::now();
    bool busy = false;
    std::cout << absl::StrFormat("[%s] %d segments, %d replicas\n", absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone()),
                                 s.segments_size(), s.replicas_size());
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
                                   verifying ? "VERIFYING" : g.state(), Bar(static_cast<uint64_t>(g.progress() * 1000), 1000, 20),
                                   g.progress() * 100, rate, eta, g.error().empty() ? "" : "  ! " + g.error());
    }
    std::cout.flush();
    if (!busy && count == 0) return 0;
    std::this_thread::sleep_for(std::chrono::duration<double>(interval));
  }
  return 0;
}

int CmdLoad(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket", "--checkpoint", "--tp", "--timeout"}, {}); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--checkpoint")) return Usage("load needs --checkpoint DIR");
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
  std::cout << "loading " << req.checkpoint() << " (engramctl status shows progress)\n";
  return 0;
}

int CmdUnload(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket", "--checkpoint"}, {}); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--checkpoint")) return Usage("unload needs --checkpoint DIR");
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

int CmdReady(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2, {"--socket"}, {}); !st.ok()) return Usage(std::string(st.message()));
  const std::string socket = a.Get("--socket", kDefaultSocket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  engram::v1::StatusReply s;
  grpc::Status st = Connect(socket)->Status(&ctx, engram::v1::StatusRequest(), &s);
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

int CmdAttach(int argc, char** argv) {
  Args a;
  if (auto st = a.Parse(argc, argv, 2,
                        {"--socket", "--checkpoint", "--tp-size", "--tp-rank", "--dp-size", "--dp-rank",
                         "--local-dp-size", "--cpu-offload", "--dp-shared-memory", "--shm-dir", "--hold", "--verify",
                         "--timeout"},
                        {"--elastic-ep", "--embedding-across-dp", "--ticket", "--no-descriptor"});
      !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--checkpoint")) return Usage("attach needs --checkpoint DIR");
  if (auto st = a.RequireInts({"--tp-size", "--tp-rank", "--dp-size", "--dp-rank", "--local-dp-size", "--verify",
                               "--hold", "--timeout"},
                              0, std::numeric_limits<int32_t>::max());
      !st.ok()) {
    return Usage(std::string(st.message()));
  }
  auto ckpt = Checkpoint::Open(a.Get("--checkpoint"));
  if (!ckpt.ok()) {
    std::cerr << "engramctl: " << ckpt.status().message() << "\n";
    return 1;
  }
  auto geti = [&](const char* name, int64_t d) { return a.GetInt(name, d).value_or(d); };
  auto choice = [](const std::string& v) {
    return v == "true" ? client::Choice::kTrue : v == "false" ? client::Choice::kFalse : client::Choice::kAuto;
  };
  client::Declaration h;
  h.fingerprint = (*ckpt)->Fingerprint();
  h.checkpoint = a.Get("--checkpoint");
  h.tp_size = static_cast<int>(geti("--tp-size", 1));
  h.tp_rank = static_cast<int>(geti("--tp-rank", 0));
  h.dp_size = static_cast<int>(geti("--dp-size", 2));
  h.dp_rank = static_cast<int>(geti("--dp-rank", 0));
  h.local_dp_size = static_cast<int>(geti("--local-dp-size", h.dp_size));
  h.elastic_ep = a.Has("--elastic-ep");
  h.cpu_offload = choice(a.Get("--cpu-offload", "auto"));
  h.dp_shared_memory = choice(a.Get("--dp-shared-memory", "auto"));
  h.embedding_across_dp = a.Has("--embedding-across-dp");

  const std::string socket = a.Get("--socket", kDefaultSocket);
  auto session = client::Session::Open(socket, std::chrono::seconds(geti("--timeout", 60)), h);
  if (!session.ok()) return StatusFailure(session.status(), socket);
  const client::Answer& answer = (*session)->answer();
  json out;
  absl::StatusOr<std::unique_ptr<SegmentReader>> reader = absl::UnavailableError("no grant");
  // Compares random rows of the mapped segment with the checkpoint's; returns (verified, mismatches).
  // The checkpoint side comes from the independent row oracle, not from the reader that filled the segment.
  std::string oracle_error;
  auto oracle = oracle::RowOracle::Open(a.Get("--checkpoint"), &oracle_error);
  auto verify = [&]() -> std::pair<int64_t, int64_t> {
    if (!reader.ok() || (*reader)->state() != SegmentState::kReady || !oracle) return {0, 1};
    int64_t verified = 0, mismatches = 0;
    std::mt19937_64 rng(std::random_device{}());
    const int64_t rb = answer.grant.record_bytes;
    for (const auto& ld : answer.grant.layers) {
      if (ld.row_end <= ld.row_begin ||
          ld.data_offset + static_cast<uint64_t>((ld.row_end - ld.row_begin) * rb) > (*reader)->header().data_bytes) {
        return {verified, mismatches + 1};
      }
      for (int64_t i = 0; i < geti("--verify", 64); ++i) {
        const int64_t row =
            ld.row_begin + static_cast<int64_t>(rng() % static_cast<uint64_t>(ld.row_end - ld.row_begin));
        const uint8_t* mapped = (*reader)->data() + ld.data_offset + static_cast<uint64_t>((row - ld.row_begin) * rb);
        auto rec = oracle->Record(ld.layer_id, row, nullptr);
        if (!rec) {
          ++mismatches;
          continue;
        }
        ++verified;
        // the segment's record must equal the checkpoint's, byte for byte
        mismatches += std::memcmp(mapped, rec->data(), static_cast<size_t>(rb)) != 0;
      }
    }
    return {verified, mismatches};
  };
  if (answer.granted) {
    const auto& g = answer.grant;
    out["decision"] = "shared";
    out["mode"] = "SHARED";
    out["segment"] = g.segment_path;
    out["lease"] = g.lease_id;
    out["reasons"] = json::array();
    // Map it read-only (the descriptor engramd passes; the path, or --shm-dir's file of that name, where it cannot)
    // and compare random rows with the checkpoint's.
    auto fd = a.Has("--no-descriptor") ? absl::StatusOr<int>(absl::UnavailableError("--no-descriptor"))
                                       : (*session)->FetchSegmentDescriptor(std::chrono::seconds(5));
    if (fd.ok()) {
      reader = SegmentReader::OpenDescriptor(*fd, g.segment_path);
      out["attach"] = "descriptor";
    } else {
      reader = SegmentReader::Open(client::GrantedSegmentPath(g, a.Get("--shm-dir", "")));
      out["attach"] = "path";
      out["descriptor_error"] = std::string(fd.status().message());
    }
    if (!reader.ok() || (*reader)->state() != SegmentState::kReady) {
      out["error"] = reader.ok() ? "segment not READY" : std::string(reader.status().message());
    }
    if (!oracle) out["error"] = "row oracle: " + oracle_error;
    auto [verified, mismatches] = verify();
    out["verified"] = verified;
    out["mismatches"] = mismatches;
    if (a.Has("--ticket")) {
      // Take the node's registration ticket and pin the mapping with mlock (what registration does to the pages),
      // then report the result as a replica would.
      const auto t0 = std::chrono::steady_clock::now();
      if ((*session)->AcquireTicket().ok()) {
        out["ticket_wait_seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        client::RegistrationReport rep;
        const auto r0 = std::chrono::steady_clock::now();
        rep.ok = reader.ok() && ::mlock((*reader)->data(), (*reader)->header().data_bytes) == 0;
        rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count();
        if (!rep.ok) rep.error = "mlock failed (ulimit -l?)";
        (void)(*session)->ReportRegistration(rep);
      }
    }
  } else {
    out["decision"] = "fallback";
    out["mode"] = client::ModeName(answer.mode);
    out["reasons"] = json::array();
    out["hints"] = json::array();
    for (const auto& r : answer.reasons) {
      out["reasons"].push_back(client::ReasonName(r.code));
      out["hints"].push_back({{"code", client::ReasonName(r.code)}, {"hint", r.hint}});
    }
  }
  out["pid"] = ::getpid();
  std::cout << out.dump() << std::endl;
  const int64_t hold = geti("--hold", 0);
  if (hold > 0) {
    (*session)->Keep();
    std::this_thread::sleep_for(std::chrono::seconds(hold));
    if (answer.granted) {  // the mapping must still hold the same rows, whatever the daemon did meanwhile
      auto [v, m] = verify();
      std::cout << json{{"reverified", v}, {"remismatches", m}}.dump() << std::endl;
      if (m != 0) out["mismatches"] = m;
    }
  }
  return out.value("mismatches", 0) == 0 ? 0 : 1;
}

}  // namespace engram::tools
