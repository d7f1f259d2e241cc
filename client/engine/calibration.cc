#include "client/engine/calibration.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "client/tuning.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::client {
namespace {

// Device memory freed on every return path.
struct DeviceAlloc {
  void* p = nullptr;
  ~DeviceAlloc() {
    if (p != nullptr) cudaFree(p);
  }
  absl::Status Make(size_t bytes, const char* what) { return kernels::CudaStatus(cudaMalloc(&p, bytes), what); }
};

struct Events {
  cudaEvent_t a = nullptr, b = nullptr;
  ~Events() {
    if (a != nullptr) cudaEventDestroy(a);
    if (b != nullptr) cudaEventDestroy(b);
  }
  absl::Status Make() {
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventCreate(&a), "calibration event"));
    return kernels::CudaStatus(cudaEventCreate(&b), "calibration event");
  }
  absl::StatusOr<float> Ms() {
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventSynchronize(b), "calibration timing"));
    float ms = 0;
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventElapsedTime(&ms, a, b), "calibration timing"));
    return ms;
  }
};

// Random rows of [begin, end) (xorshift: fresh rows without a library generator's cost).
void FillRows(std::vector<int32_t>& ids, size_t from, size_t n, int64_t begin, int64_t end, uint64_t& x) {
  const uint64_t span = static_cast<uint64_t>(std::max<int64_t>(end - begin, 1));
  for (size_t i = from; i < from + n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    ids[i] = static_cast<int32_t>(begin + static_cast<int64_t>(x % span));
  }
}

kernels::LookupArgs LayerArgs(const CalibrationTarget& t, size_t l, const int32_t* ids, int64_t items, void* out) {
  kernels::LookupArgs a;
  a.records = t.layers[l].device_records;
  a.row_begin = t.layers[l].row_begin;
  a.row_end = t.layers[l].row_end;
  a.head_dim = t.head_dim;
  a.ids = ids;
  a.num_tokens = static_cast<int32_t>(items / t.n_cols);
  a.num_cols = t.n_cols;
  a.ids_stride = t.n_cols;
  a.out = out;
  a.sort_scratch = t.sort_scratch;
  a.sort_scratch_bytes = t.sort_bytes;
  return a;
}

std::string Threshold(int64_t v) {
  return v == std::numeric_limits<int64_t>::max() ? std::string("never") : absl::StrCat(v);
}

}  // namespace

// Whether the row-order gather pays depends on the table in hand: on a large host table address translation bounds
// a random gather and walking it in row order wins from some batch size on; on a small one (or in HBM) the sort is
// pure cost (a 512 MiB table: 0.35-0.8 of vLLM's plain Triton kernel at 1024 tokens with the sort, measured on an
// H200). Both are timed for each output format and grid at a few batch sizes; the threshold is the smallest size from
// which the row order won at every larger measured size.
absl::StatusOr<RowOrderChoice> CalibrateRowOrder(const CalibrationTarget& t, cudaStream_t stream) {
  RowOrderChoice choice;
  if (t.layers.empty()) return choice;
  const auto& li = t.layers[0];
  const int64_t rows = li.row_end - li.row_begin, C = t.n_cols;
  const int64_t cap = static_cast<int64_t>(t.max_tokens) * C;
  std::vector<int64_t> sizes;
  for (int64_t n : {int64_t{6144}, int64_t{24576}, int64_t{98304}, int64_t{196608}}) {
    if (n <= cap) sizes.push_back(n);
  }
  if (rows <= 0 || sizes.empty()) {
    choice.text = "untimed(batches below 6144 items)";
    return choice;
  }
  constexpr int kReps = 3;                // timed rounds after one warm-up round
  constexpr int kSets = 2 * (kReps + 1);  // a fresh id set for every launch
  const int64_t most = sizes.back();
  DeviceAlloc out, d_ids;
  RETURN_IF_ERROR(out.Make(static_cast<size_t>(most) * t.head_dim * 2, "calibration output"));
  RETURN_IF_ERROR(d_ids.Make(static_cast<size_t>(most) * kSets * 4, "calibration ids"));
  Events ev;
  RETURN_IF_ERROR(ev.Make());
  std::vector<int32_t> ids(static_cast<size_t>(most) * kSets);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  FillRows(ids, 0, ids.size(), li.row_begin, li.row_end, x);
  RETURN_IF_ERROR(
      kernels::CudaStatus(cudaMemcpy(d_ids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "calibration ids"));
  auto time_one = [&](int64_t items, int set, bool packed, bool background, bool sorted) -> absl::StatusOr<float> {
    kernels::LookupArgs a = LayerArgs(t, 0, static_cast<const int32_t*>(d_ids.p) + set * most, items, out.p);
    a.packed = packed;
    if (background) a.max_blocks = std::max(1, kernels::DeviceSmCount() / 2);
    a.sort_min_items = sorted ? 0 : std::numeric_limits<int64_t>::max();
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(ev.a, stream), "calibration event"));
    RETURN_IF_ERROR(kernels::CudaStatus(kernels::LaunchLookup(a, stream), "calibration lookup"));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(ev.b, stream), "calibration event"));
    return ev.Ms();
  };
  for (int packed = 0; packed < 2; ++packed) {
    for (int background = 0; background < 2; ++background) {
      int64_t threshold = std::numeric_limits<int64_t>::max();
      for (auto it = sizes.rbegin(); it != sizes.rend(); ++it) {
        float best[2] = {1e30f, 1e30f};  // [sorted]: the best of the fresh batches
        for (int rep = 0; rep < kReps + 1; ++rep) {
          for (int k = 0; k < 2; ++k) {
            const int sorted = (rep + k) % 2;  // alternate which goes first
            ASSIGN_OR_RETURN(const float ms, time_one(*it, 2 * rep + k, packed != 0, background != 0, sorted != 0));
            if (rep > 0) best[sorted] = std::min(best[sorted], ms);  // the first round warms up
          }
        }
        if (best[1] >= best[0]) break;  // the row order lost here: not from any smaller size either
        threshold = *it;
      }
      choice.from_items[packed][background] = threshold;
      absl::StrAppend(&choice.text, choice.text.empty() ? "" : ",", packed ? "packed" : "bf16", background ? "_bg" : "",
                      ":", Threshold(threshold));
    }
  }
  return choice;
}

void DecodeShapes::For(bool packed, int32_t num_tokens, int32_t* rows_out, int32_t* warps_out) const {
  *rows_out = 0;
  *warps_out = 0;
  if (num_tokens < 1 || num_tokens > 2 * kTokens[kSizes - 1]) return;
  int best = -1;
  double best_d = 0;
  for (int i = 0; i < kSizes; ++i) {
    if (rows[packed][i] == 0) continue;
    const double d = std::fabs(std::log(static_cast<double>(num_tokens)) - std::log(static_cast<double>(kTokens[i])));
    if (best < 0 || d < best_d) best = i, best_d = d;
  }
  if (best < 0) return;
  *rows_out = rows[packed][best];
  *warps_out = warps[packed][best];
}

// Each shape is timed as a decode step runs it: kPerGraph dependent lookups captured in one CUDA graph, every node
// with its own fresh ids (copied in before each replay, outside the timed span); the best of a few replays.
absl::StatusOr<DecodeShapes> CalibrateDecode(const CalibrationTarget& t) {
  DecodeShapes shapes;
  if (t.layers.empty() || t.layers[0].row_end <= t.layers[0].row_begin) return shapes;
  constexpr int kPerGraph = 20, kReplays = 3, kPool = 2 * (kReplays + 1);
  const int64_t C = t.n_cols, rb = t.head_dim + t.head_dim / 32;
  const int64_t most =
      static_cast<int64_t>(std::min(t.max_tokens, DecodeShapes::kTokens[DecodeShapes::kSizes - 1])) * C;
  const size_t row_out = static_cast<size_t>(std::max<int64_t>(rb, 2 * t.head_dim));
  DeviceAlloc out, live, pool;
  RETURN_IF_ERROR(out.Make(static_cast<size_t>(most) * kPerGraph * row_out, "calibration output"));
  RETURN_IF_ERROR(live.Make(static_cast<size_t>(most) * kPerGraph * 4, "calibration ids"));
  RETURN_IF_ERROR(pool.Make(static_cast<size_t>(most) * kPerGraph * kPool * 4, "calibration ids"));
  {
    std::vector<int32_t> ids(static_cast<size_t>(most) * kPerGraph * kPool);
    uint64_t x = 0xD1B54A32D192ED03ull;
    FillRows(ids, 0, ids.size(), t.layers[0].row_begin, t.layers[0].row_end, x);
    RETURN_IF_ERROR(
        kernels::CudaStatus(cudaMemcpy(pool.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "calibration ids"));
  }
  cudaStream_t s = nullptr;
  RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "calibration stream"));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{s};
  Events ev;
  RETURN_IF_ERROR(ev.Make());
  int next = 0;
  // Microseconds per lookup of `tokens` tokens in shape r x w (0 x 0: the kernels' default).
  auto time_shape = [&](int32_t tokens, bool packed, int32_t r, int32_t w) -> absl::StatusOr<double> {
    const int64_t items = static_cast<int64_t>(tokens) * C;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture"));
    cudaError_t launch = cudaSuccess;
    for (int i = 0; i < kPerGraph && launch == cudaSuccess; ++i) {
      kernels::LookupArgs a = LayerArgs(t, 0, static_cast<const int32_t*>(live.p) + i * items, items,
                                        static_cast<uint8_t*>(out.p) + static_cast<size_t>(i * items) * row_out);
      a.sort_scratch = nullptr;  // decode sizes take the plain gather
      a.packed = packed;
      a.plain_rows = r;
      a.plain_block_warps = w;
      launch = kernels::LaunchLookup(a, s);
    }
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    RETURN_IF_ERROR(kernels::CudaStatus(launch, "calibration lookup"));
    RETURN_IF_ERROR(kernels::CudaStatus(end, "capture"));
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    RETURN_IF_ERROR(kernels::CudaStatus(inst, "calibration graph"));
    double best = 1e30;
    absl::Status st;
    for (int rep = 0; rep < kReplays + 1 && st.ok(); ++rep) {
      st = kernels::CudaStatus(
          cudaMemcpyAsync(live.p, static_cast<int32_t*>(pool.p) + (next++ % kPool) * most * kPerGraph,
                          static_cast<size_t>(items) * kPerGraph * 4, cudaMemcpyDeviceToDevice, s),
          "calibration ids");
      if (st.ok()) st = kernels::CudaStatus(cudaEventRecord(ev.a, s), "calibration event");
      if (st.ok()) st = kernels::CudaStatus(cudaGraphLaunch(exec, s), "calibration graph");
      if (st.ok()) st = kernels::CudaStatus(cudaEventRecord(ev.b, s), "calibration event");
      if (!st.ok()) break;
      absl::StatusOr<float> ms = ev.Ms();
      st = ms.status();
      if (st.ok() && rep > 0) best = std::min(best, 1e3 * *ms / kPerGraph);
    }
    cudaGraphExecDestroy(exec);
    RETURN_IF_ERROR(st);
    return best;
  };
  // The shapes that won some decode size in bench_decode's sweep of all 16 (bench/RESULTS.md), besides the
  // kernels' default (1 x 4 at these sizes), and the larger batches' 4 x 8.
  const int32_t candidates[][2] = {{1, 2}, {1, 8}, {2, 1}, {2, 2}, {2, 4}, {4, 1}, {4, 8}};
  for (int packed = 0; packed < 2; ++packed) {
    for (int i = 0; i < DecodeShapes::kSizes; ++i) {
      const int32_t tokens = DecodeShapes::kTokens[i];
      if (tokens > t.max_tokens) continue;
      // A first graph of each size warms what the first launches pay (instantiation, caches); untimed.
      RETURN_IF_ERROR(time_shape(tokens, packed != 0, 0, 0).status());
      ASSIGN_OR_RETURN(const double dflt, time_shape(tokens, packed != 0, 0, 0));
      double best = dflt;
      int32_t br = 0, bw = 0;
      for (const auto& c : candidates) {
        ASSIGN_OR_RETURN(const double us, time_shape(tokens, packed != 0, c[0], c[1]));
        if (us < best) best = us, br = c[0], bw = c[1];
      }
      // A shape is kept only when it beat the default by more than the timing's spread (2%).
      if (best > 0.98 * dflt) best = dflt, br = 0, bw = 0;
      shapes.rows[packed][i] = br;
      shapes.warps[packed][i] = bw;
      shapes.us[packed][i] = best;
      shapes.default_us[packed][i] = dflt;
      absl::StrAppend(&shapes.text, shapes.text.empty() ? "" : ",", packed ? "packed:" : "bf16:", tokens, "=",
                      br == 0 ? std::string("default") : absl::StrCat(br, "x", bw),
                      absl::StrFormat("(%.2fus;default %.2fus)", best, dflt));
    }
  }
  return shapes;
}

std::vector<int> HostGatherCalibrationThreads(int cpus, int base, bool fixed) {
  std::vector<int> threads = {base};
  const int more = std::min(cpus * 3 / 4, 24);
  if (!fixed && more > base) threads.push_back(more);
  return threads;
}

std::vector<double> HostGatherCalibrationShares() {
  return {std::begin(tuning_default::kHostGatherCalibrationShares),
          std::end(tuning_default::kHostGatherCalibrationShares)};
}

absl::StatusOr<HostPlan> CalibrateHostGather(
    const CalibrationTarget& t, const std::vector<int>& threads, const std::vector<double>& shares,
    const std::function<absl::StatusOr<std::unique_ptr<HostGather>>(int threads)>& make, cudaStream_t stream,
    std::unique_ptr<HostGather>* kept) {
  HostPlan plan;
  const int64_t L = static_cast<int64_t>(t.layers.size()), C = t.n_cols;
  const int64_t cap = static_cast<int64_t>(t.max_tokens) * C;
  std::vector<int64_t> sizes;
  for (int64_t n : {int64_t{6144}, int64_t{24576}, int64_t{196608}, int64_t{1048560}}) {
    if (n <= cap) sizes.push_back(n / C * C);
  }
  if (L == 0 || sizes.empty() || threads.empty() || shares.empty()) return plan;
  constexpr int kRounds = 2;  // timed rounds (after one warm-up batch per gather)
  const int64_t most = sizes.back();
  // Host ids [tokens, L, C], a fresh set per round, and the same on the device for the UVA side.
  std::vector<std::vector<int32_t>> sets(kRounds + 1);
  uint64_t x = 0x2545F4914F6CDD1Dull;
  for (auto& ids : sets) {
    ids.resize(static_cast<size_t>(most * L));
    for (int64_t i = 0; i < most; i += C) {
      for (int64_t l = 0; l < L; ++l) {
        FillRows(ids, static_cast<size_t>(i * L + l * C), static_cast<size_t>(C), t.layers[l].row_begin,
                 t.layers[l].row_end, x);
      }
    }
  }
  DeviceAlloc d_ids;
  RETURN_IF_ERROR(d_ids.Make(static_cast<size_t>(most) * 4, "calibration ids"));
  Events ev;
  RETURN_IF_ERROR(ev.Make());
  // The UVA row-order gather of every layer (layer l's ids packed per layer on the device), ms.
  std::vector<double> uva_ms(sizes.size(), 1e30);
  std::vector<int32_t> layer_ids(static_cast<size_t>(most));
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t items = sizes[k];
    for (int round = 0; round <= kRounds; ++round) {
      double total = 0;
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t i = 0; i < items; ++i) {
          layer_ids[static_cast<size_t>(i)] = sets[round][static_cast<size_t>((i / C) * L * C + l * C + i % C)];
        }
        RETURN_IF_ERROR(kernels::CudaStatus(
            cudaMemcpy(d_ids.p, layer_ids.data(), static_cast<size_t>(items) * 4, cudaMemcpyHostToDevice),
            "calibration ids"));
        kernels::LookupArgs a =
            LayerArgs(t, static_cast<size_t>(l), static_cast<const int32_t*>(d_ids.p), items, t.layers[l].staging);
        a.sort_min_items = 0;  // the row-order gather: the UVA path's choice at these sizes on a large table
        RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(ev.a, stream), "calibration event"));
        RETURN_IF_ERROR(kernels::CudaStatus(kernels::LaunchLookup(a, stream), "calibration lookup"));
        RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(ev.b, stream), "calibration event"));
        ASSIGN_OR_RETURN(const float ms, ev.Ms());
        total += ms;
      }
      if (round > 0) uva_ms[k] = std::min(uva_ms[k], total);
    }
  }
  // The host path, every thread count x share; ms of one batch from Prefetch until the GPU holds every layer.
  struct Tried {
    int threads;
    std::vector<HostPoint> points;
    double score = 0;  // the geometric mean of the best host time over the sizes
  };
  std::vector<Tried> tried;
  std::unique_ptr<HostGather> best_gather;
  size_t best = 0;
  for (int th : threads) {
    ASSIGN_OR_RETURN(std::unique_ptr<HostGather> g, make(th));
    Tried tr{g->threads(), {}, 0};
    auto batch = [&](int64_t items, const std::vector<int32_t>& ids) -> absl::StatusOr<double> {
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(g->Prefetch(ids.data(), static_cast<int32_t>(items / C), L * C, stream));
      for (int64_t l = 0; l < L; ++l) RETURN_IF_ERROR(g->Wait(static_cast<int32_t>(l), stream));
      RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamSynchronize(stream), "calibration batch"));
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    g->set_uva_share(shares.front());
    RETURN_IF_ERROR(batch(sizes.front(), sets[0]).status());  // wakes the threads, touches the staging
    for (size_t k = 0; k < sizes.size(); ++k) {
      HostPoint p{sizes[k], false, shares.front(), 1e30, uva_ms[k], ""};
      for (double share : shares) {
        g->set_uva_share(share);
        double ms = 1e30;
        for (int round = 1; round <= kRounds; ++round) {
          ASSIGN_OR_RETURN(const double one, batch(sizes[k], sets[round]));
          ms = std::min(ms, one);
        }
        if (ms < p.host_ms) p.host_ms = ms, p.share = share;
        absl::StrAppend(&p.tried, p.tried.empty() ? "" : ",", absl::StrFormat("%.2f:%.3f", share, ms));
      }
      p.host = p.host_ms < p.uva_ms;
      tr.score += std::log(p.host_ms) / static_cast<double>(sizes.size());
      tr.points.push_back(p);
    }
    tried.push_back(tr);
    // The first count (the default) is kept unless another is faster by more than 3%.
    if (tried.size() == 1 || tr.score < tried[best].score - std::log(1.03)) {
      best = tried.size() - 1;
      best_gather = std::move(g);
    }
  }
  plan.threads = tried[best].threads;
  plan.points = tried[best].points;
  plan.text = absl::StrCat("threads=", plan.threads);
  if (tried.size() > 1) {
    absl::StrAppend(&plan.text, "(tried");
    for (const auto& tr : tried) {
      absl::StrAppend(&plan.text, absl::StrFormat(" %d:%.3f", tr.threads, std::exp(tr.score)));
    }
    absl::StrAppend(&plan.text, "ms)");
  }
  for (const auto& p : plan.points) {
    absl::StrAppend(&plan.text, absl::StrFormat(" %d:%s@%.2f(host %sms;uva %.3fms)", p.items, p.host ? "host" : "uva",
                                                p.share, p.tried, p.uva_ms));
  }
  *kept = std::move(best_gather);
  return plan;
}

}  // namespace engram::client
