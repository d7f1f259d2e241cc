// engramctl attach: a replica session opened by hand, its grant checked against the checkpoint (tools/ctl_daemon.h).
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
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tools/args.h"
#include "tools/row_oracle.h"

#include "tools/ctl_common.h"

namespace engram::tools {

using namespace ctl;  // NOLINT: the subcommands' shared helpers

int CmdAttach(int argc, char** argv) {
  Args a;
  if (auto st =
          a.Parse(argc, argv, 2,
                  {"--socket", "--checkpoint", "--tp-size", "--tp-rank", "--dp-size", "--dp-rank", "--local-dp-size",
                   "--cpu-offload", "--dp-shared-memory", "--shm-dir", "--hold", "--verify", "--timeout"},
                  {"--elastic-ep", "--embedding-across-dp", "--ticket", "--no-descriptor"});
      !st.ok()) {
    return Usage(std::string(st.message()));
  }
  if (!a.Has("--checkpoint")) return Usage("attach needs --checkpoint DIR");
  if (auto st = a.RequireInts(
          {"--tp-size", "--tp-rank", "--dp-size", "--dp-rank", "--local-dp-size", "--verify", "--hold", "--timeout"}, 0,
          std::numeric_limits<int32_t>::max());
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
