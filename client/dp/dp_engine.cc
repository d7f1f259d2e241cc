#include "client/dp/dp_engine.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "client/dp/group.h"
#include "client/dp/host_transport.h"
#include "client/dp/plan.h"
#include "client/fault_points.h"
#include "client/log.h"
#ifdef ENGRAM_HAVE_CUDA
#include "client/dp/dp_device_engine.h"
#endif
#include "client/table/tables.h"
#include "model/reference.h"

namespace engram::client {
namespace {

// Where one step's ids come from: id(t, li, c) = base[t * token_stride + li * layer_stride + c].
struct StepIds {
  const int32_t* base = nullptr;
  int64_t token_stride = 0, layer_stride = 0;
};

class DpHostEngine final : public LookupEngine {
 public:
  DpHostEngine(const Table& t, int32_t max_tokens, DpShardedPlan plan, std::unique_ptr<DpGroup> group,
               std::unique_ptr<DpHostRegion> region)
      : t_(t),
        max_tokens_(max_tokens),
        plan_(std::move(plan)),
        group_(std::move(group)),
        region_(std::move(region)),
        host_(*LookupEngine::CreateOnHost(t, max_tokens)) {
    const int64_t L = static_cast<int64_t>(t_.layers().size()), C = t_.n_cols(), D = t_.head_dim();
    const int64_t part = PartOf(plan_);
    slot_ = group_->formed().slot;
    staging_.resize(static_cast<size_t>(L));
    for (auto& s : staging_) s.assign(static_cast<size_t>(max_tokens_) * C * D, 0);
    flat_.resize(static_cast<size_t>(slot_) * part);
    iota_.resize(static_cast<size_t>(max_tokens_) * part);
    std::iota(iota_.begin(), iota_.end(), 0);
    rows_.resize(static_cast<size_t>(max_tokens_) * part * D);
  }

  // A member that goes away (its engine closed) tells the others at once: their next step fails naming it
  // instead of waiting for the step timeout (the region's abort flag), and engramd breaks the group (the group's
  // destructor leaves it), so status says who left and this session may make another engine.
  ~DpHostEngine() override {
    if (failed_.ok()) region_->Abort(absl::StrCat("dp rank ", t_rank(), " closed its engine"));
  }

  static int64_t PartOf(const DpShardedPlan& p) {
    int64_t part = 1;
    for (const auto& m : p.members) part = std::max(part, m.col_end - m.col_begin);
    return part;
  }

  Backend backend() const override { return Backend::kCpu; }

  using LookupEngine::Hash;
  absl::Status Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl, const int32_t* lookback,
                    const uint8_t* lookback_dead, const uint8_t* dead, int32_t T, int32_t R, int32_t* out) override {
    return host_->Hash(tokens, positions, qsl, lookback, lookback_dead, dead, T, R, out);
  }
  absl::Status Gate(const GateInputs& g) override { return host_->Gate(g); }
  const Table* table_for_checks() const override { return &t_; }
  int32_t max_tokens_for_checks() const override { return max_tokens_; }

  absl::Status Lookup(int l, const int32_t* ids, int32_t T, int64_t stride, void* out, bool packed) override {
    const int L = static_cast<int>(t_.layers().size());
    if (l < 0 || l >= L) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("layer index ", l, " outside [0, ", L, ")")));
    }
    if (T > 0 && (ids == nullptr || out == nullptr || stride < t_.n_cols())) {  // T == 0: a step with nothing
      return Fail(absl::InvalidArgumentError("lookup: null or bad stride"));
    }
    std::vector<void*> outs(static_cast<size_t>(L), nullptr);
    outs[static_cast<size_t>(l)] = out;
    return Step({ids, stride, 0}, T, l, 1, outs, packed);
  }

  absl::Status Prefetch(const int32_t* hash_ids, int32_t T) override {
    if (hash_ids == nullptr && T > 0) return Fail(absl::InvalidArgumentError("prefetch: null hash ids"));
    const int L = static_cast<int>(t_.layers().size());
    std::vector<void*> outs;
    for (auto& s : staging_) outs.push_back(s.data());
    prefetched_ = Step({hash_ids, static_cast<int64_t>(L) * t_.n_cols(), t_.n_cols()}, T, 0, L, outs, false);
    return prefetched_;
  }
  absl::Status Wait(int l) override {
    if (l < 0 || l >= static_cast<int>(staging_.size())) return absl::InvalidArgumentError("wait: layer out of range");
    return prefetched_;
  }
  uint16_t* staging(int l) const override {
    return l < 0 || l >= static_cast<int>(staging_.size())
               ? nullptr
               : const_cast<uint16_t*>(staging_[static_cast<size_t>(l)].data());
  }

 private:
  // Poisons the engine and tells the group, so no member waits for this one in a step it will never finish.
  absl::Status Fail(absl::Status st) {
    if (failed_.ok()) {
      failed_ = st;
      region_->Abort(absl::StrCat("dp rank ", t_rank(), ": ", st.message()));
      group_->Leave(absl::StrCat("its DP engine failed a step: ", st.message()),
                    absl::IsDeadlineExceeded(st) ? region_->stalled() : std::vector<int32_t>{});
    }
    return failed_;
  }
  int64_t t_rank() const { return plan_.edp_rank; }

  // One collective step over layers [l0, l0 + nl): outs[l] receives bf16 [T, C, D] (or packed [T, C, rb]).
  absl::Status Step(const StepIds& in, int32_t T, int l0, int nl, const std::vector<void*>& outs, bool packed) {
    if (!failed_.ok()) return failed_;
    if (T < 0 || T > max_tokens_) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(T, " tokens; the engine was sized for ", max_tokens_)));
    }
    const int32_t me = static_cast<int32_t>(plan_.edp_rank), n = static_cast<int32_t>(plan_.edp);
    const int64_t C = t_.n_cols(), D = t_.head_dim(), rb = t_.layout().record_bytes();
    const auto timeout = DpStepTimeout(t_.tuning());
    auto broken = [this] { return group_->Broken(); };
    // 1. All-gather of hash ids: publish mine, wait for everyone's.
    DpMemberSlot& mine = region_->member(me);
    mine.count = T;
    mine.l0 = l0;
    mine.nl = nl;
    int32_t* my_ids = region_->ids(me);
    for (int64_t t = 0; t < T; ++t) {
      for (int li = 0; li < nl; ++li) {
        std::memcpy(my_ids + (t * nl + li) * C, in.base + t * in.token_stride + li * in.layer_stride,
                    static_cast<size_t>(C) * sizeof(int32_t));
      }
    }
    ++step_;
    region_->Publish(2 * step_);  // phase 1 was the attach barrier
    if (auto st = region_->WaitAll(2 * step_, broken, timeout); !st.ok()) return Fail(st);
    for (int32_t r = 0; r < n; ++r) {
      const DpMemberSlot& m = region_->member(r);
      if (m.l0 != l0 || m.nl != nl || m.count < 0 || m.count > slot_) {
        return Fail(absl::FailedPreconditionError(absl::StrFormat(
            "DP step mismatch: member %d steps layers [%d, %d) with %d tokens, this member layers [%d, %d) (every "
            "member must make the same Prefetch/Lookup calls in the same order)",
            r, m.l0, m.l0 + m.nl, m.count, l0, l0 + nl)));
      }
    }
    // 2. This rank's columns for every member's tokens, packed, into the member's area.
    const int64_t cb = plan_.owned.col_begin, owned = plan_.owned.col_end - plan_.owned.col_begin;
    for (int32_t d = 0; d < n; ++d) {
      const int64_t Td = region_->member(d).count;
      const int32_t* ids_d = region_->ids(d);
      uint8_t* area = region_->records(me, d);
      for (int li = 0; li < nl; ++li) {
        const int l = l0 + li;
        const auto& layer = t_.layers()[static_cast<size_t>(l)];
        for (int64_t t = 0; t < Td; ++t) {
          std::memcpy(flat_.data() + t * owned, ids_d + (t * nl + li) * C + cb, static_cast<size_t>(owned) * 4);
        }
        const RecordTable table{t_.records(l), layer.row_begin, layer.row_end, D};
        const size_t cnt = static_cast<size_t>(Td * owned);
        if (auto st = LookupPackedCpu(table, {flat_.data(), cnt}, {area + li * Td * owned * rb, cnt * rb}); !st.ok()) {
          return Fail(st);
        }
      }
    }
    region_->Publish(2 * step_ + 1);
    if (auto st = region_->WaitAll(2 * step_ + 1, broken, timeout); !st.ok()) return Fail(st);
    // 3. Every member's columns for my tokens, unpacked in column order.
    for (int li = 0; li < nl; ++li) {
      void* out = outs[static_cast<size_t>(l0 + li)];
      const size_t row_bytes = static_cast<size_t>(packed ? rb : D * 2);
      // Columns outside the group's range stay zero.
      for (int64_t t = 0; t < T; ++t) {
        uint8_t* row = static_cast<uint8_t*>(out) + static_cast<size_t>(t * C) * row_bytes;
        std::memset(row, 0, static_cast<size_t>(plan_.group_col_begin) * row_bytes);
        std::memset(row + static_cast<size_t>(plan_.group_col_end) * row_bytes, 0,
                    static_cast<size_t>(C - plan_.group_col_end) * row_bytes);
      }
      for (int32_t s = 0; s < n; ++s) {
        const ShardRange& src = plan_.members[static_cast<size_t>(s)];
        const int64_t os = src.col_end - src.col_begin;
        const uint8_t* recs = region_->records(s, me) + li * static_cast<int64_t>(T) * os * rb;
        const size_t cnt = static_cast<size_t>(T * os);
        const uint8_t* rows = recs;
        if (!packed) {
          // The packed records as a table of their own (row i = record i): the reference dequantises them.
          const RecordTable got{recs, 0, static_cast<int64_t>(cnt), D};
          if (auto st = LookupBf16Cpu(got, {iota_.data(), cnt}, {rows_.data(), cnt * static_cast<size_t>(D)});
              !st.ok()) {
            return Fail(st);
          }
          rows = reinterpret_cast<const uint8_t*>(rows_.data());
        }
        for (int64_t t = 0; t < T; ++t) {
          std::memcpy(static_cast<uint8_t*>(out) + static_cast<size_t>(t * C + src.col_begin) * row_bytes,
                      rows + static_cast<size_t>(t * os) * row_bytes, static_cast<size_t>(os) * row_bytes);
        }
      }
    }
    return absl::OkStatus();
  }

  const Table& t_;
  int32_t max_tokens_;
  DpShardedPlan plan_;
  std::unique_ptr<DpGroup> group_;
  std::unique_ptr<DpHostRegion> region_;
  std::unique_ptr<LookupEngine> host_;  // hash and gate
  int32_t slot_ = 0;
  uint64_t step_ = 0;
  absl::Status failed_;
  absl::Status prefetched_ = absl::FailedPreconditionError("wait before any prefetch");
  std::vector<std::vector<uint16_t>> staging_;
  std::vector<int32_t> flat_, iota_;
  std::vector<uint16_t> rows_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LookupEngine>> CreateDpEngine(const Table& table, int32_t max_tokens, void* stream,
                                                             const DpEngineOptions& options) {
  const auto* impl = dynamic_cast<const TableImpl*>(&table);
  if (impl == nullptr || impl->session_ == nullptr) {
    return absl::FailedPreconditionError("a DP_SHARDED table without its engramd session (the group's broker)");
  }
  Session& session = *impl->session_;
  const Declaration& d = session.declaration();
  ASSIGN_OR_RETURN(DpShardedPlan plan,
                   PlanDpSharded(table.layout(), d.tp_size, d.tp_rank, d.dp_size, d.dp_rank, d.local_dp_size));
  if (plan.owned.col_begin != table.col_begin() || plan.owned.col_end != table.col_end()) {
    return absl::InternalError("the DP_SHARDED table does not hold this rank's shard");
  }
  if (table.backend() == Backend::kCuda) {
#ifdef ENGRAM_HAVE_CUDA
    return CreateDpDeviceEngine(table, max_tokens, static_cast<cudaStream_t>(stream), session, plan, options.nccl_comm);
#else
    return absl::InternalError("a CUDA table in a build without CUDA");
#endif
  }
  (void)stream;
  (void)options;
  const int32_t me = static_cast<int32_t>(plan.edp_rank);
  std::unique_ptr<DpHostRegion> region;
  GroupJoinRequest join;
  join.transport = "host";
  join.max_tokens = max_tokens;
  join.bytes_per_step = static_cast<uint64_t>(
      DpShardedStepBytes(table.layout(), plan, std::vector<int64_t>(static_cast<size_t>(plan.edp), max_tokens), me)
          .total());
  if (me == 0) {
    ASSIGN_OR_RETURN(region, DpHostRegion::Reserve());
    join.rendezvous = region->name();
  }
  ASSIGN_OR_RETURN(auto group, DpGroup::Join(session, join, DpFormTimeout(table.tuning())));
  const GroupEvent& g = group->formed();
  // From here until every member mapped the region its name is in /dev/shm. A member that gives up in that window
  // aborts the region (if it mapped it), removes the name (whoever created it: a rank 0 that died cannot) and leaves
  // the group, so the others stop at once, naming it, instead of at the step timeout.
  const std::string region_name = g.rendezvous;
  auto give_up = [&](const absl::Status& st) {
    if (region != nullptr) region->Abort(absl::StrCat("dp rank ", d.dp_rank, " gave up: ", st.message()));
    DpHostRegion::RemoveName(region_name);
    group->Leave(absl::StrCat("gave up setting up the host exchange: ", st.message()));
    return st;
  };
  if (static_cast<int64_t>(g.members.size()) != plan.edp) {
    return give_up(absl::InternalError(
        absl::StrCat("the daemon formed a group of ", g.members.size(), " members, expected ", plan.edp)));
  }
  DpRegionShape shape;
  shape.members = static_cast<int32_t>(plan.edp);
  shape.slot = g.slot;
  shape.layers = static_cast<int32_t>(table.layers().size());
  shape.cols = static_cast<int32_t>(table.n_cols());
  shape.record_bytes = static_cast<int32_t>(table.layout().record_bytes());
  shape.part = static_cast<int32_t>(DpHostEngine::PartOf(plan));
  auto broken = [grp = group.get()] { return grp->Broken(); };
  if (me == 0) {
    if (auto st = region->Init(shape, me); !st.ok()) return give_up(st);
    if (Fault(FaultPoint::kDpRank0DiesAfterRegion)) ::raise(SIGKILL);
  } else {
    if (Fault(FaultPoint::kDpGiveUpBeforeMapping)) {
      return give_up(absl::UnavailableError("fault injection: this member gave up before mapping the region"));
    }
    auto opened = DpHostRegion::Open(region_name, shape, me, broken, DpStepTimeout(table.tuning()));
    if (!opened.ok()) return give_up(opened.status());
    region = std::move(*opened);
  }
  // Everyone mapped the region: its name can go.
  region->Publish(1);
  if (auto st = region->WaitAll(1, broken, DpStepTimeout(table.tuning())); !st.ok()) return give_up(st);
  if (me == 0) region->Unlink();
  Log().info("engram: event=dp_group_formed group={} members={} edp_rank={} slot={} region_bytes={}", g.group,
             g.members.size(), me, g.slot, region->bytes());
  return std::unique_ptr<LookupEngine>(
      new DpHostEngine(table, max_tokens, std::move(plan), std::move(group), std::move(region)));
}

}  // namespace engram::client
