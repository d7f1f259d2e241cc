#include "engram/client.h"

#include <cstdlib>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "client/dp/plan.h"
#include "client/environment.h"
#include "client/fault_points.h"
#include "client/log.h"
#include "client/session/session.h"
#include "client/table/tables.h"
#include "model/checkpoint.h"
#include "shm/descriptor_protocol.h"

#ifdef ENGRAM_HAVE_CUDA
#include "client/table/cuda_backend.h"
#endif

namespace engram::client {
namespace {

// What a private table needs beyond its rows before it is built: the process's own working memory (token map,
// reader buffers, the engine), so that a table that just fits does not push the process into an OOM kill.
constexpr uint64_t kPrivateTableHeadroomBytes = 256ull << 20;

std::string ReasonList(const std::vector<Reason>& reasons) {
  std::vector<std::string> parts;
  for (const auto& r : reasons) parts.push_back(absl::StrCat(ReasonName(r.code), ": ", r.hint));
  return absl::StrJoin(parts, "; ");
}

std::string ReasonCodes(const std::vector<Reason>& reasons) {
  std::vector<std::string> codes;
  for (const auto& r : reasons) codes.push_back(ReasonName(r.code));
  return absl::StrJoin(codes, ",");
}

// Whether this process can use a GPU: false with the reason when not; an error when cpu_offload needs UVA that the
// GPU lacks (docs/math.md section 9: fail fast).
absl::StatusOr<bool> ProbeGpu(const ClientOptions& options, bool cpu_offload, std::string* no_gpu) {
  *no_gpu = "this build has no CUDA";
#ifdef ENGRAM_HAVE_CUDA
  if (!options.use_gpu) {
    *no_gpu = "the GPU backend was turned off (use_gpu = false)";
    return false;
  }
  const CudaState gpu = ProbeCuda(no_gpu);
  if (gpu == CudaState::kNoUva && cpu_offload) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cpu_offload needs a GPU that reads host memory through UVA: ", *no_gpu, "; set cpu_offload false"));
  }
  return gpu == CudaState::kUsable;
#else
  (void)options;
  (void)cpu_offload;
  return false;
#endif
}

Declaration Declare(const AttachRequest& req, uint64_t fingerprint, bool cpu_offload) {
  Declaration d;
  d.fingerprint = fingerprint;
  d.checkpoint = req.checkpoint;
  d.tp_size = req.tp_size;
  d.tp_rank = req.tp_rank;
  d.dp_size = req.dp_size;
  d.dp_rank = req.dp_rank;
  d.local_dp_size = req.local_dp_size;
  d.elastic_ep = req.elastic_ep;
  d.cpu_offload = cpu_offload ? Choice::kTrue : Choice::kFalse;
  d.dp_shared_memory = req.dp_shared_memory;
  d.embedding_across_dp = req.embedding_across_dp;
  return d;
}

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

absl::StatusOr<std::unique_ptr<Session>> TimedSessionOpen(const ClientOptions& options, const Declaration& d,
                                                          double* seconds) {
  const auto t0 = Clock::now();
  auto s = Session::Open(options.socket, options.timeout, d);
  *seconds = SecondsSince(t0);
  return s;
}

// A shared table from the daemon's grant: map and check, take the node's ticket, pin, report. Null (with the reason
// added) when this replica must fall back; the session stays usable for reporting that.
std::unique_ptr<TableImpl> ShareGranted(Session& session, const ClientOptions& options, const std::string& shm_dir,
                                        Env* env, uint64_t fingerprint, const Layout& layout, const ShardRange& shard,
                                        bool cuda, AttachTimes* times, std::vector<Reason>* reasons) {
  const Grant& g = session.answer().grant;
  const auto t0 = Clock::now();
  // The descriptor first (any namespace that reaches the socket), the path where it cannot be passed.
  absl::StatusOr<std::unique_ptr<TableImpl>> table = absl::UnavailableError("not attached");
  std::string no_descriptor;
  if (!options.descriptor_passing) {
    no_descriptor = "descriptor passing is off in this client";
  } else if (auto fd = session.FetchSegmentDescriptor(std::chrono::milliseconds(5000)); fd.ok()) {
    table = OpenSharedTable(g, *fd, "", fingerprint, layout, shard, env);
  } else {
    no_descriptor = std::string(fd.status().message());
  }
  if (!no_descriptor.empty()) {
    const std::string path = GrantedSegmentPath(g, shm_dir);
    table = OpenSharedTable(g, -1, path, fingerprint, layout, shard, env);
    if (!table.ok() && SegmentGone(no_descriptor)) {
      // Retired or unloaded between the grant and the fetch: not this replica's view of the directory.
      reasons->push_back({ReasonCode::kSegmentNotReady,
                          absl::StrCat("the granted segment went away before it was mapped (", no_descriptor,
                                       "): the daemon retired or unloaded it; the next start shares again")});
      return nullptr;
    }
    if (!table.ok() && (table.status().code() == absl::StatusCode::kNotFound ||
                        table.status().code() == absl::StatusCode::kPermissionDenied)) {
      reasons->push_back({ReasonCode::kShmNotVisible,
                          absl::StrCat("no descriptor (", no_descriptor, ") and no path (", table.status().message(),
                                       "): mount the daemon's socket directory (its .fds socket must be reachable "
                                       "next to the gRPC socket), or give this replica the daemon's shm directory")});
      return nullptr;
    }
    if (table.ok())
      Log().warn("engram: event=attach_by_path path={} detail={}", engram::LogValue(path),
                 engram::LogQuoted(no_descriptor));
  }
  if (!table.ok()) {
    reasons->push_back({ReasonCode::kFingerprintMismatch, std::string(table.status().message())});
    return nullptr;
  }
  session.NoteMappedFile((*table)->segment_->device(), (*table)->segment_->inode());
  times->populate = (*table)->times_.populate;  // timed where the mapping is made
  times->map = SecondsSince(t0) - times->populate;
  const auto ticket0 = Clock::now();
  if (auto st = session.AcquireTicket(options.timeout); !st.ok()) {
    reasons->push_back({ReasonCode::kDaemonUnavailable, absl::StrCat("no registration ticket: ", st.message())});
    return nullptr;
  }
  times->ticket = SecondsSince(ticket0);
  RegistrationReport rep = PinTable(**table, cuda, options.register_chunk_bytes);
  times->pin = rep.seconds;
  (void)session.ReportRegistration(rep);
  if (!rep.ok) {
    reasons->push_back({ReasonCode::kRegisterFailed, rep.error + " (raise ulimit -l / LimitMEMLOCK)"});
    return nullptr;
  }
  return std::move(*table);
}

}  // namespace

bool ResolveCpuOffload(const std::optional<bool>& explicit_value) {
  if (explicit_value) return *explicit_value;
  return Environment().vllm_ple_cpu_offload.value_or(true);
}

const Tuning& Table::tuning() const { return Environment().tuning; }

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (options.socket.empty()) return absl::InvalidArgumentError("no daemon socket given");
  ClientOptions checked = options;
  RETURN_IF_ERROR(checked.tuning.Normalize());  // a knob assigned directly is checked as Set checks it
  for (const std::string& name : Environment().removed) {
    Log().warn(
        "engram: event=removed_variable name={} detail=\"the library no longer reads it (CHANGELOG.md): "
        "ignored\"",
        name);
  }
  return std::unique_ptr<Client>(new Client(checked));
}

absl::StatusOr<std::unique_ptr<Table>> Client::Attach(const AttachRequest& req) {
  Env* env = options_.env != nullptr ? options_.env : Env::Default();
  const bool cpu_offload = ResolveCpuOffload(req.cpu_offload);
  const auto t0 = Clock::now();
  AttachTimes times;
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(req.checkpoint));
  times.checkpoint = SecondsSince(t0);
  if (ckpt->config().kind == ModelKind::kPle) {
    return absl::UnimplementedError(absl::StrCat(ckpt->config().architecture,
                                                 ": PLE tables are never shared (MODEL_NOT_SHAREABLE) and their "
                                                 "lookup is not public; engram cannot serve them"));
  }
  ASSIGN_OR_RETURN(Layout layout, Layout::Build(ckpt->config()));
  ASSIGN_OR_RETURN(ShardRange shard, layout.Shard(req.tp_size, req.tp_rank));
  std::string no_gpu;
  const auto gpu0 = Clock::now();
  ASSIGN_OR_RETURN(const bool cuda, ProbeGpu(options_, cpu_offload, &no_gpu));
  times.gpu = SecondsSince(gpu0);
  std::vector<Reason> reasons;
  if (!cuda) reasons.push_back({ReasonCode::kNoCudaDevice, no_gpu + ": lookups run the CPU reference"});

  // Ask the daemon (unless sharing is off), then share what it granted or take the mode it decided.
  std::unique_ptr<Session> session;
  std::string segment;  // the granted segment's path, for the log
  Mode mode = cpu_offload ? Mode::kPrivatePinned : Mode::kDevice;
  std::unique_ptr<TableImpl> table;
  // embedding_across_dp asks the daemon even with dp_shared_memory false: it brokers the DP group (and names
  // DP_SHARED_MEMORY_DISABLED itself).
  if (req.dp_shared_memory == Choice::kFalse && !req.embedding_across_dp) {
    reasons.push_back(
        {ReasonCode::kDpSharedMemoryDisabled, "dp_shared_memory is false: this replica holds its own table"});
  } else if (auto s = TimedSessionOpen(options_, Declare(req, ckpt->Fingerprint(), cpu_offload), &times.session);
             !s.ok()) {
    const bool refused = s.status().code() == absl::StatusCode::kPermissionDenied;
    reasons.push_back(
        {refused ? ReasonCode::kPermissionDenied : ReasonCode::kDaemonUnavailable, std::string(s.status().message())});
  } else {
    session = std::move(*s);
    if (session->answer().granted) {
      segment = session->answer().grant.segment_path;
      table = ShareGranted(*session, options_, req.shm_dir, env, ckpt->Fingerprint(), layout, shard, cuda, &times,
                           &reasons);
    } else {
      mode = session->answer().mode;
      reasons.insert(reasons.end(), session->answer().reasons.begin(), session->answer().reasons.end());
    }
  }
  if (table == nullptr && req.dp_shared_memory == Choice::kTrue) {
    return absl::FailedPreconditionError(
        absl::StrCat("dp_shared_memory is true but the table cannot be shared: ", ReasonList(reasons)));
  }
  if (table == nullptr && !req.private_fallback) {
    // The session (when one opened) ends here: the daemon's status keeps this fallback in its recent history.
    if (session != nullptr) {
      (void)session->ReportOutcome(mode, reasons, cuda ? Backend::kCuda : Backend::kCpu, AttachMethod::kNone);
    }
    return absl::FailedPreconditionError(
        absl::StrCat("not shared (", ModeName(mode), ", no private table built here): ", ReasonList(reasons)));
  }
  if (table == nullptr) {
    const int threads =
        req.threads > 0 ? req.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    // DP_SHARDED: only this rank's shard of the group's columns (client/dp/plan.h), in host memory or, with
    // cpu_offload false, on the GPU; the LookupEngine exchanges the rest every step (client/dp/dp_engine.h).
    bool dp_sharded = mode == Mode::kDpSharded;
    ShardRange own = shard;
    if (dp_sharded) {
      auto plan = PlanDpSharded(layout, req.tp_size, req.tp_rank, req.dp_size, req.dp_rank, req.local_dp_size);
      if (plan.ok()) {
        own = plan->owned;
      } else {  // e.g. more shards than the TP position has columns: a table of its own, and why
        dp_sharded = false;
        mode = cpu_offload ? Mode::kPrivatePinned : Mode::kDevice;
        reasons.push_back({ReasonCode::kDpShardedNotBuilt,
                           absl::StrCat("embedding_across_dp cannot split this table over the node-local DP group (",
                                        plan.status().message(), "): this replica holds its own table")});
      }
    }
    // The private copy takes its whole size in host memory (a DEVICE table is staged there too): refused with the
    // numbers when the node, or this process's cgroup, has not that much to give, instead of an OOM kill midway.
    uint64_t need = kPrivateTableHeadroomBytes;
    for (int64_t l = 0; l < layout.n_layers(); ++l) {
      need += static_cast<uint64_t>(own.row_end[l] - own.row_begin[l]) * layout.record_bytes();
    }
    uint64_t available = env->AvailableMemoryBytes();
    if (Fault(FaultPoint::kPrivateTableMemory, static_cast<int64_t>(need))) available = need / 2;
    if (need > available) {
      const std::string why = absl::StrCat(
          "a private table of this shard needs ", need, " bytes (", need - kPrivateTableHeadroomBytes, " of rows + ",
          kPrivateTableHeadroomBytes, " headroom) but ", available,
          " are available (MemAvailable, or the cgroup's memory.max less memory.current): no private table built; "
          "share the daemon's segment or give this replica more memory");
      Log().error("engram: event=private_table_refused need_bytes={} available_bytes={} reasons={}", need, available,
                  ReasonCodes(reasons));
      if (session != nullptr) {
        (void)session->ReportOutcome(mode, reasons, cuda ? Backend::kCuda : Backend::kCpu, AttachMethod::kNone);
      }
      return absl::ResourceExhaustedError(absl::StrCat(why, "; not shared because: ", ReasonList(reasons)));
    }
    const auto build0 = Clock::now();
    ASSIGN_OR_RETURN(table, BuildPrivateTable(*ckpt, layout, own, dp_sharded ? cpu_offload : mode != Mode::kDevice,
                                              cuda, threads, options_.register_chunk_bytes, env));
    times.build = SecondsSince(build0);
    if (dp_sharded) table->mode_ = Mode::kDpSharded;
  }
  table->reasons_ = std::move(reasons);
  table->tuning_ = options_.tuning.Over(Environment().tuning);
  times.total = SecondsSince(t0);
  table->times_ = times;
  if (session != nullptr) {  // status lists this replica with exactly what it runs; the session is its lease
    (void)session->ReportOutcome(table->mode(), table->reasons(), table->backend(), table->attach_method());
    session->Keep();
    table->session_ = std::move(session);
  }
  if (table->mode() == Mode::kShared) {
    Log().info(
        "engram: event=attached mode=SHARED backend={} attach={} segment={} seconds={:.3f} populate_seconds={:.3f} "
        "ticket_seconds={:.3f} register_seconds={:.3f}",
        BackendName(table->backend()), AttachMethodName(table->attach_method()), segment, times.total, times.populate,
        times.ticket, table->register_seconds());
  } else {
    Log().warn("engram: event=fallback mode={} backend={} reasons={} detail={}", ModeName(table->mode()),
               BackendName(table->backend()), ReasonCodes(table->reasons()),
               engram::LogQuoted(ReasonList(table->reasons())));
  }
  return std::unique_ptr<Table>(std::move(table));
}

}  // namespace engram::client
