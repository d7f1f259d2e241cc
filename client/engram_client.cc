#include "client/engram_client.h"

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/shard_records.h"
#include "base/status_macros.h"
#include "model/tokenizer.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"

#ifdef ENGRAM_HAVE_CUDA
#include "client/cuda_backend.h"
#endif

namespace engram::client {
namespace {

using Clock = std::chrono::steady_clock;

// The daemon session a table keeps open: it is the lease (shared) or the record of the fallback in
// `engramctl status` (private). Ends when the table goes.
struct SessionHold {
  std::unique_ptr<engram::v1::Engram::Stub> stub;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>> stream;
  std::thread events;
  void Keep() {  // drain daemon events until the session ends
    auto* s = stream.get();
    events = std::thread([s] {
      engram::v1::ServerMessage m;
      while (s->Read(&m)) {
      }
    });
  }
  ~SessionHold() {
    if (ctx) ctx->TryCancel();
    if (events.joinable()) events.join();
  }
};

// State every table shares: what it is, the layout for hashing, where its records are.
class TableBase : public Table {
 public:
  Mode mode() const override { return mode_; }
  Backend backend() const override { return backend_; }
  const uint8_t* device_records(int l) const override {
    return device_records_.empty() ? nullptr : device_records_[static_cast<size_t>(l)];
  }
  double register_seconds() const override { return register_seconds_; }
  const std::vector<Reason>& reasons() const override { return reasons_; }
  const std::vector<LayerInfo>& layers() const override { return layers_; }
  int64_t col_begin() const override { return col_begin_; }
  int64_t col_end() const override { return col_end_; }
  int64_t head_dim() const override { return layout_->config().head_dim; }
  int64_t n_cols() const override { return layout_->n_cols(); }
  const TokenMap& token_map() const override { return *map_; }
  const Layout& layout() const override { return *layout_; }
  const uint8_t* records(int l) const override { return records_[static_cast<size_t>(l)]; }

  absl::Status Hash(const HashBatch& batch, std::span<int32_t> out) const override {
    return HashIdsCpu(*layout_, *map_, batch, out);
  }
  absl::Status Lookup(int l, std::span<const int32_t> ids, std::span<uint16_t> out) const override {
    RETURN_IF_ERROR(CheckLayer(l));
    if (records(l) == nullptr) return absl::FailedPreconditionError("the table lives on the GPU: use DeviceEngine");
    return LookupBf16Cpu(Records(l), ids, out);
  }
  absl::Status Gate(const GateShape& shape, std::span<const uint16_t> hidden, std::span<const uint16_t> kv,
                    std::span<const uint16_t> q_weight, std::span<const uint16_t> k_weight,
                    std::span<const uint8_t> mask, std::span<uint16_t> out) const override {
    return GateCpu(shape, hidden, kv, q_weight, k_weight, mask, out);
  }
  absl::Status LookupPacked(int l, std::span<const int32_t> ids, std::span<uint8_t> out) const override {
    RETURN_IF_ERROR(CheckLayer(l));
    if (records(l) == nullptr) return absl::FailedPreconditionError("the table lives on the GPU: use DeviceEngine");
    return LookupPackedCpu(Records(l), ids, out);
  }

  Mode mode_ = Mode::kPrivatePinned;
  Backend backend_ = Backend::kCpu;
  double register_seconds_ = -1;
  std::vector<const uint8_t*> device_records_;
  std::vector<std::shared_ptr<void>> keep_;  // registrations / device copies, released before the memory itself
  std::unique_ptr<SessionHold> session_;
  std::vector<Reason> reasons_;
  std::vector<LayerInfo> layers_;
  int64_t col_begin_ = 0, col_end_ = 0;
  std::unique_ptr<Layout> layout_;
  std::unique_ptr<TokenMap> map_;
  std::vector<const uint8_t*> records_;

 private:
  absl::Status CheckLayer(int l) const {
    if (l < 0 || l >= static_cast<int>(layers_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", layers_.size(), ")"));
    }
    return absl::OkStatus();
  }
  RecordTable Records(int l) const {
    const auto& li = layers_[static_cast<size_t>(l)];
    return RecordTable{records(l), li.row_begin, li.row_end, head_dim()};
  }
};

// The node's segment, mapped read-only, with the daemon session (the lease) kept open.
class SharedTable final : public TableBase {
 public:
  ~SharedTable() override {
    keep_.clear();  // unregister before the mapping goes
    session_.reset();
    if (pinned_) ::munlock(pin_base_, pin_bytes_);
  }
  std::unique_ptr<SegmentReader> segment_;
  bool pinned_ = false;
  const void* pin_base_ = nullptr;
  size_t pin_bytes_ = 0;
};

// A private copy of this replica's TP shard, built from the checkpoint.
class PrivateTable final : public TableBase {
 public:
  ~PrivateTable() override {
    keep_.clear();
    session_.reset();
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
};

Reason R(const std::string& code, const std::string& hint) { return Reason{code, hint}; }

std::string ReasonList(const std::vector<Reason>& reasons) {
  std::vector<std::string> parts;
  for (const auto& r : reasons) parts.push_back(r.code + ": " + r.hint);
  return absl::StrJoin(parts, "; ");
}

void FillLayers(const Layout& layout, const ShardRange& shard, TableBase* t) {
  t->col_begin_ = shard.col_begin;
  t->col_end_ = shard.col_end;
  for (int64_t l = 0; l < layout.n_layers(); ++l) {
    LayerInfo li;
    li.layer_id = layout.config().layer_ids[l];
    li.row_begin = shard.row_begin[l];
    li.row_end = shard.row_end[l];
    li.multipliers = layout.multipliers(l);
    li.primes = layout.primes(l);
    li.offsets = layout.offsets(l);
    t->layers_.push_back(std::move(li));
  }
}

}  // namespace

std::string ModeName(Mode m) {
  switch (m) {
    case Mode::kShared:
      return "SHARED";
    case Mode::kPrivatePinned:
      return "PRIVATE_PINNED";
    case Mode::kDevice:
      return "DEVICE";
    case Mode::kDpSharded:
      return "DP_SHARDED";
  }
  return "?";
}

std::string BackendName(Backend b) { return b == Backend::kCuda ? "cuda" : "cpu"; }

bool ResolveCpuOffload(const std::optional<bool>& explicit_value) {
  if (explicit_value) return *explicit_value;
  if (const char* env = std::getenv("VLLM_PLE_CPU_OFFLOAD")) {
    const std::string v = absl::AsciiStrToLower(env);
    if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.socket.empty()) return absl::InvalidArgumentError("no daemon socket given");
  return std::unique_ptr<Client>(new Client(options));
}

absl::StatusOr<std::unique_ptr<Table>> Client::Attach(const AttachRequest& req) {
  const bool cpu_offload = ResolveCpuOffload(req.cpu_offload);
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(req.checkpoint));
  if (ckpt->config().kind == ModelKind::kPle) {
    return absl::UnimplementedError(absl::StrCat(ckpt->config().architecture,
                                                 ": PLE tables are never shared (MODEL_NOT_SHAREABLE) and their "
                                                 "lookup is not public; engram cannot serve them"));
  }
  ASSIGN_OR_RETURN(Layout layout, Layout::Build(ckpt->config()));
  ASSIGN_OR_RETURN(ShardRange shard, layout.Shard(req.tp_size, req.tp_rank));
  std::vector<Reason> reasons;
  std::string no_gpu = "this build has no CUDA";
#ifdef ENGRAM_HAVE_CUDA
  const CudaState gpu = options_.use_gpu ? ProbeCuda(&no_gpu) : CudaState::kNoDevice;
  if (!options_.use_gpu) no_gpu = "the GPU backend was turned off (use_gpu = false)";
  if (gpu == CudaState::kNoUva && cpu_offload) {
    // SPEC 6: cpu_offload without UVA support fails fast.
    return absl::FailedPreconditionError(absl::StrCat("cpu_offload needs a GPU that reads host memory through UVA: ",
                                                      no_gpu, "; set cpu_offload false"));
  }
  const bool cuda = gpu == CudaState::kUsable;
#else
  const bool cuda = false;
#endif
  if (!cuda) reasons.push_back(R("NO_CUDA_DEVICE", no_gpu + ": lookups run the CPU reference"));

  // Ask the daemon.
  struct stat st {};
  const bool shm_visible = ::stat(req.shm_dir.c_str(), &st) == 0;
  engram::v1::ClientMessage hello;
  auto* h = hello.mutable_hello();
  h->set_fingerprint(ckpt->Fingerprint());
  h->set_checkpoint(req.checkpoint);
  h->set_tp_size(req.tp_size);
  h->set_tp_rank(req.tp_rank);
  h->set_dp_size(req.dp_size);
  h->set_dp_rank(req.dp_rank);
  h->set_local_dp_size(req.local_dp_size > 0 ? req.local_dp_size : req.dp_size);
  h->set_elastic_ep(req.elastic_ep);
  h->mutable_config()->set_cpu_offload(cpu_offload ? engram::v1::ENABLED : engram::v1::DISABLED);
  h->mutable_config()->set_dp_shared_memory(req.dp_shared_memory == Choice::kTrue    ? engram::v1::ENABLED
                                            : req.dp_shared_memory == Choice::kFalse ? engram::v1::DISABLED
                                                                                     : engram::v1::AUTO);
  h->mutable_config()->set_embedding_across_dp(req.embedding_across_dp);
  h->set_pid(::getpid());
  h->set_shm_visible(shm_visible);
  h->set_shm_dev(st.st_dev);
  h->set_shm_ino(st.st_ino);

  auto shared = std::make_unique<SharedTable>();
  auto session = std::make_unique<SessionHold>();
  bool register_failed = false;
  double prefault_seconds = 0;
  engram::v1::ServerMessage answer;
  bool answered = false;
  if (req.dp_shared_memory != Choice::kFalse) {
    auto channel = grpc::CreateChannel("unix:" + options_.socket, grpc::InsecureChannelCredentials());
    const auto deadline = std::chrono::system_clock::now() + options_.timeout;
    if (channel->WaitForConnected(deadline)) {
      session->stub = engram::v1::Engram::NewStub(channel);
      session->ctx = std::make_unique<grpc::ClientContext>();
      session->stream = session->stub->Session(session->ctx.get());
      // The daemon may hold the answer while it loads; give up (cancel) at the timeout.
      std::atomic<bool> got{false};
      std::thread watchdog([&] {
        while (!got && std::chrono::system_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (!got) session->ctx->TryCancel();
      });
      answered = session->stream->Write(hello) && session->stream->Read(&answer);
      got = true;
      watchdog.join();
      if (!answered) {
        grpc::Status s = session->stream->Finish();
        reasons.push_back(R(s.error_code() == grpc::StatusCode::PERMISSION_DENIED ? "PERMISSION_DENIED"
                                                                                   : "DAEMON_UNAVAILABLE",
                            absl::StrCat("engramd did not answer on ", options_.socket, ": ", s.error_message())));
      }
    } else {
      reasons.push_back(R("DAEMON_UNAVAILABLE", absl::StrCat("no engramd answers on ", options_.socket,
                                                             " (start it: systemctl start engramd)")));
    }
  }
  if (answered && answer.has_grant()) {
    const auto& g = answer.grant();
    auto seg = SegmentReader::Open(g.segment_path());
    if (!seg.ok()) {
      reasons.push_back(R("SHM_NOT_VISIBLE", absl::StrCat("cannot open the granted segment ", g.segment_path(), ": ",
                                                          seg.status().message())));
    } else if ((*seg)->state() != SegmentState::kReady || (*seg)->header().fingerprint != ckpt->Fingerprint() ||
               (*seg)->file_bytes() != g.segment_bytes()) {
      reasons.push_back(R("FINGERPRINT_MISMATCH", "the granted segment's header disagrees with the grant"));
    } else {
      // Build this process's page tables for the mapping before taking the node's ticket, so that the ticketed
      // (serialised) registration only pins pages that are already mapped.
      const auto p0 = Clock::now();
      ::madvise(const_cast<uint8_t*>((*seg)->data()), (*seg)->file_bytes() - (*seg)->header().data_offset,
                MADV_POPULATE_READ);
      prefault_seconds = std::chrono::duration<double>(Clock::now() - p0).count();
      // Registration: take the node's ticket, pin the mapping (what cudaHostRegister does to it), report.
      engram::v1::ClientMessage ticket;
      ticket.mutable_ticket_request();
      engram::v1::ServerMessage reply;
      if (session->stream->Write(ticket) && session->stream->Read(&reply) && reply.has_ticket()) {
        const auto t0 = Clock::now();
        const uint8_t* data = (*seg)->data();
        const size_t bytes = (*seg)->file_bytes() - (*seg)->header().data_offset;
        engram::v1::ClientMessage result;
        auto* r = result.mutable_register_result();
        bool pinned = false;
#ifdef ENGRAM_HAVE_CUDA
        if (cuda) {
          int failed = -1;
          auto reg = HostRegistration::Register(data, bytes, options_.register_chunk_bytes, &failed);
          pinned = reg.ok();
          r->set_backend("cuda");
          if (pinned) {
            shared->backend_ = Backend::kCuda;
            shared->keep_.push_back(std::shared_ptr<HostRegistration>(std::move(*reg)));
          } else {
            r->set_error(std::string(reg.status().message()));
            r->set_failed_chunk(failed);
          }
        }
#endif
        if (!cuda) {
          pinned = ::mlock(data, bytes) == 0;
          r->set_backend("cpu");
          if (pinned) {
            shared->pinned_ = true;
            shared->pin_base_ = data;
            shared->pin_bytes_ = bytes;
          } else {
            r->set_error(absl::StrCat("mlock of ", bytes, " bytes failed: ", std::strerror(errno)));
          }
        }
        r->set_ok(pinned);
        r->set_seconds(std::chrono::duration<double>(Clock::now() - t0).count());
        session->stream->Write(result);
        if (pinned) {
          shared->register_seconds_ = r->seconds();
          shared->mode_ = Mode::kShared;
          shared->reasons_ = reasons;
          shared->layout_ = std::make_unique<Layout>(layout);
          std::vector<int32_t> ids(g.segment().token_map().begin(), g.segment().token_map().end());
          shared->map_ = std::make_unique<TokenMap>(TokenMap::FromIds(std::move(ids)));
          for (const auto& ld : g.segment().layers()) {
            shared->records_.push_back(data + ld.data_offset());
            if (shared->backend_ == Backend::kCuda) shared->device_records_.push_back(data + ld.data_offset());
          }
          FillLayers(layout, shard, shared.get());
          shared->segment_ = std::move(*seg);
          session->Keep();
          shared->session_ = std::move(session);
          spdlog::info("engram: event=attached mode=SHARED backend={} segment={} prefault_seconds={:.3f} "
                       "register_seconds={:.3f}",
                       BackendName(shared->backend_), g.segment_path(), prefault_seconds, shared->register_seconds_);
          return std::unique_ptr<Table>(std::move(shared));
        }
        reasons.push_back(R("REGISTER_FAILED", r->error() + " (raise ulimit -l / LimitMEMLOCK)"));
        register_failed = true;  // the daemon recorded it: keep the session so status shows this replica
      } else {
        reasons.push_back(R("DAEMON_UNAVAILABLE", "the session ended before a registration ticket"));
      }
    }
  } else if (answered && answer.has_fallback()) {
    for (const auto& r : answer.fallback().reasons()) {
      reasons.push_back(R(engram::v1::FallbackReason_Name(r.code()), r.hint()));
    }
  }
  const bool daemon_knows = (answered && answer.has_fallback()) || register_failed;
  if (!daemon_knows) session.reset();  // nothing to keep: the daemon has no record of this fallback

  // Fallback.
  if (req.dp_shared_memory == Choice::kTrue) {
    return absl::FailedPreconditionError(absl::StrCat("dp_shared_memory is true but the table cannot be shared: ",
                                                      ReasonList(reasons)));
  }
  if (req.dp_shared_memory == Choice::kFalse) reasons.push_back(R("DP_SHARED_MEMORY_DISABLED", "dp_shared_memory is false"));
  if (req.embedding_across_dp) {
    reasons.push_back(R("DP_SHARDED_NOT_BUILT", "embedding_across_dp needs the DP collective (all-gather of hash ids, "
                                                "all-to-all of rows), which this build does not have: private table"));
  }
  auto priv = std::make_unique<PrivateTable>();
  priv->mode_ = cpu_offload ? Mode::kPrivatePinned : Mode::kDevice;
  priv->reasons_ = reasons;
  priv->layout_ = std::make_unique<Layout>(layout);
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(ckpt->tokenizer_path()));
  priv->map_ = std::make_unique<TokenMap>(TokenMap::Build(tok));
  RETURN_IF_ERROR(priv->map_->CheckAgainst(ckpt->config()));
  RETURN_IF_ERROR(ckpt->ValidateEngramTensors());
  std::vector<LayerRows> rows;
  uint64_t offset = 0;
  for (int64_t l = 0; l < layout.n_layers(); ++l) {
    rows.push_back({l, shard.row_begin[l], shard.row_end[l], offset});
    offset += static_cast<uint64_t>(shard.row_end[l] - shard.row_begin[l]) * layout.record_bytes();
  }
  priv->bytes_ = std::max<uint64_t>(offset, 1);
  void* p = ::mmap(nullptr, priv->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat("cannot map ", priv->bytes_, " bytes for a private table"));
  priv->base_ = static_cast<uint8_t*>(p);
  ::madvise(p, priv->bytes_, MADV_HUGEPAGE);
  const int threads = req.threads > 0 ? req.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  RETURN_IF_ERROR(ReadShardRecords(*ckpt, rows, priv->base_, threads, nullptr));
  ::mprotect(p, priv->bytes_, PROT_READ);  // a table is read-only once built
  for (const auto& r : rows) priv->records_.push_back(priv->base_ + r.dst_offset);
#ifdef ENGRAM_HAVE_CUDA
  if (cuda) {
    const auto t0 = Clock::now();
    if (cpu_offload) {
      int failed = -1;
      ASSIGN_OR_RETURN(auto reg, HostRegistration::Register(priv->base_, priv->bytes_, options_.register_chunk_bytes,
                                                             &failed));
      priv->keep_.push_back(std::shared_ptr<HostRegistration>(std::move(reg)));
      priv->device_records_ = priv->records_;
    } else {
      ASSIGN_OR_RETURN(auto copy, DeviceCopy::Create(priv->base_, priv->bytes_));
      for (const auto& r : rows) priv->device_records_.push_back(copy->data() + r.dst_offset);
      priv->keep_.push_back(std::shared_ptr<DeviceCopy>(std::move(copy)));
      ::munmap(priv->base_, priv->bytes_);  // the GPU holds the only copy
      priv->base_ = nullptr;
      std::fill(priv->records_.begin(), priv->records_.end(), nullptr);
    }
    priv->backend_ = Backend::kCuda;
    priv->register_seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
  }
#endif
  FillLayers(layout, shard, priv.get());
  if (session) {  // keep the session: `engramctl status` lists this replica with its mode and reasons
    session->Keep();
    priv->session_ = std::move(session);
  }
  std::vector<std::string> codes;
  for (const auto& r : priv->reasons_) codes.push_back(r.code);
  spdlog::warn("engram: event=fallback mode={} backend={} reasons={} detail=\"{}\"", ModeName(priv->mode_),
               BackendName(priv->backend_), absl::StrJoin(codes, ","), ReasonList(priv->reasons_));
  return std::unique_ptr<Table>(std::move(priv));
}

}  // namespace engram::client
