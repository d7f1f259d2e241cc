// engram-replica: a stand-in for one serving-engine replica process. It attaches through libengram_client with the
// given topology and engram config, streams random token batches through hash -> lookup, checks a sample of rows
// against the checkpoint itself (read directly from the safetensors by the independent row oracle,
// tools/row_oracle.h, which shares no code with the reader that filled the table), and prints mode,
// backend, reasons and throughput. The last line of output is one JSON object; exit 0 only when every checked row
// matched (and, with --write-probe, a write into the table faulted in a child process).
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <iostream>
#include <random>
#include <thread>

#include "engram/client.h"
#include "engram/lookup_engine.h"
#include "engram/version.h"
#include "model/token_map.h"

#ifdef ENGRAM_HAVE_CUDA
#include <cuda_runtime_api.h>

#endif
#include "nlohmann/json.hpp"
#include "tools/args.h"
#include "tools/replica.h"
#include "tools/row_oracle.h"

namespace {

using engram::tools::replica::PatternRow;
using engram::tools::replica::PatternRows;
using engram::tools::replica::RowFromCheckpoint;
using engram::tools::replica::RunDpSharded;
using nlohmann::json;

}  // namespace

int main(int argc, char** argv) {
  engram::tools::Args a;
  auto st = a.Parse(argc, argv, 1,
                    {"--socket", "--checkpoint", "--tp-size", "--tp-rank", "--dp-size", "--dp-rank", "--local-dp-size",
                     "--dp-shared-memory", "--cpu-offload", "--batches", "--tokens", "--hold", "--shm-dir",
                     "--timeout-ms", "--verify", "--device"},
                    {"--embedding-across-dp", "--elastic-ep", "--write-probe", "--no-descriptor", "--version"});
  if (st.ok() && a.Has("--version")) {
    std::cout << "engram-replica " << ENGRAM_VERSION_STRING << "\n";
    return 0;
  }
  for (const char* choice : {"--cpu-offload", "--dp-shared-memory"}) {  // auto (the default), true or false
    const std::string v = a.Get(choice, "auto");
    if (st.ok() && v != "auto" && v != "true" && v != "false") {
      st = absl::InvalidArgumentError(std::string(choice) + " takes auto, true or false, not '" + v + "'");
    }
  }
  if (!st.ok() || !a.Has("--checkpoint")) {
    std::cerr
        << "engram-replica: " << (st.ok() ? "--checkpoint DIR is required" : std::string(st.message())) << "\n"
        << "usage: engram-replica --socket PATH --checkpoint DIR --tp-size N --tp-rank R --dp-size N --dp-rank R\n"
           "       [--local-dp-size N (DP ranks on this node; 0: all)] [--timeout-ms MS]\n"
           "       [--verify ROWS (rows per batch and layer checked against the checkpoint)]\n"
           "       [--dp-shared-memory auto|true|false] [--cpu-offload auto|true|false] [--embedding-across-dp]\n"
           "       [--elastic-ep] [--batches N] [--tokens N] [--hold SECONDS] [--write-probe]\n"
           "       [--no-descriptor] [--shm-dir DIR (path fallback: the daemon's shm dir as seen here)]\n"
           "       [--device N (CUDA device, e.g. one per DP rank)]\n"
           "       engram-replica --version\n";
    return 2;
  }
  auto geti = [&](const char* n, int64_t d) { return a.GetInt(n, d).value_or(d); };
#ifdef ENGRAM_HAVE_CUDA
  if (a.Has("--device")) cudaSetDevice(static_cast<int>(geti("--device", 0)));  // e.g. one GPU per DP rank
#endif
  engram::client::ClientOptions opts;
  opts.socket = a.Get("--socket", opts.socket);
  opts.timeout = std::chrono::milliseconds(geti("--timeout-ms", 10000));
  opts.descriptor_passing = !a.Has("--no-descriptor");
  engram::client::AttachRequest req;
  req.checkpoint = a.Get("--checkpoint");
  req.tp_size = static_cast<int>(geti("--tp-size", 1));
  req.tp_rank = static_cast<int>(geti("--tp-rank", 0));
  req.dp_size = static_cast<int>(geti("--dp-size", 1));
  req.dp_rank = static_cast<int>(geti("--dp-rank", 0));
  req.local_dp_size = static_cast<int>(geti("--local-dp-size", 0));
  req.elastic_ep = a.Has("--elastic-ep");
  req.embedding_across_dp = a.Has("--embedding-across-dp");
  req.shm_dir = a.Get("--shm-dir", "");
  if (a.Get("--cpu-offload", "auto") != "auto") req.cpu_offload = a.Get("--cpu-offload") == "true";
  const std::string dsm = a.Get("--dp-shared-memory", "auto");
  req.dp_shared_memory = dsm == "true"    ? engram::client::Choice::kTrue
                         : dsm == "false" ? engram::client::Choice::kFalse
                                          : engram::client::Choice::kAuto;
  auto client = engram::client::Client::Create(opts);
  auto table =
      client.ok() ? (*client)->Attach(req) : absl::StatusOr<std::unique_ptr<engram::client::Table>>(client.status());
  if (!table.ok()) {
    std::cout << json{{"error", std::string(table.status().message())}}.dump() << std::endl;
    return 1;
  }
  std::string oracle_error;
  auto oracle = engram::oracle::RowOracle::Open(req.checkpoint, &oracle_error);
  if (!oracle) std::cerr << "engram-replica: " << oracle_error << "\n";
  const auto& t = **table;
  if (t.mode() == engram::client::Mode::kDpSharded) {
    return RunDpSharded(t, oracle.get(), geti("--tokens", 256), geti("--batches", 4), geti("--verify", 64), req,
                        geti("--hold", 0));
  }
  const int64_t D = t.head_dim(), L = static_cast<int64_t>(t.layers().size()), C = t.n_cols();
  const int64_t T = geti("--tokens", 256), batches = geti("--batches", 4), verify = geti("--verify", 64);
  if (T < 1) {
    std::cout << json{{"error", "--tokens must be at least 1"}}.dump() << std::endl;
    return 2;
  }
  std::mt19937_64 rng(std::random_device{}());
  int64_t verified = 0, mismatches = 0, hash_mismatches = 0;
  double busy = 0, gpu_busy = 0;
  std::vector<int32_t> tokens(static_cast<size_t>(T)), qsl = {0, static_cast<int32_t>(T)},
                                                       ids(static_cast<size_t>(T * L * C));
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::vector<uint16_t> rows(static_cast<size_t>(T * C * D));
  // On the CPU backend this is the serving engine (Create reports its choice to engramd); on CUDA, the checker.
  const int32_t max_tokens = static_cast<int32_t>(std::max<int64_t>(T, 1));
  auto host_engine = t.backend() == engram::client::Backend::kCpu
                         ? engram::client::LookupEngine::Create(t, max_tokens, nullptr)
                         : engram::client::LookupEngine::CreateOnHost(t, max_tokens);
  if (!host_engine.ok()) {
    std::cout << json{{"error", std::string(host_engine.status().message())}}.dump() << std::endl;
    return 1;
  }
  auto& host = *host_engine;
#ifdef ENGRAM_HAVE_CUDA
  // CUDA backend: hash and lookups run as kernels through the table's LookupEngine; the host engine checks them.
  std::unique_ptr<engram::client::LookupEngine> engine;
  int32_t *d_tokens = nullptr, *d_qsl = nullptr, *d_ids = nullptr;
  int64_t* d_pos = nullptr;
  uint16_t* d_rows = nullptr;
  if (t.backend() == engram::client::Backend::kCuda) {
    auto e = engram::client::LookupEngine::Create(t, static_cast<int32_t>(T), nullptr);
    if (!e.ok()) {
      std::cout << json{{"error", std::string(e.status().message())}}.dump() << std::endl;
      return 1;
    }
    engine = std::move(*e);
    cudaMalloc(reinterpret_cast<void**>(&d_tokens), static_cast<size_t>(T) * 4);
    cudaMalloc(reinterpret_cast<void**>(&d_qsl), 8);
    cudaMalloc(reinterpret_cast<void**>(&d_ids), static_cast<size_t>(T * L * C) * 4);
    cudaMalloc(reinterpret_cast<void**>(&d_pos), static_cast<size_t>(T) * 8);
    cudaMalloc(reinterpret_cast<void**>(&d_rows), static_cast<size_t>(T * C * D) * 2);
  }
#endif
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < T; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(t.token_map().raw_size()));
      pos[static_cast<size_t>(i)] = i;
    }
    auto since = [](std::chrono::steady_clock::time_point x) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - x).count();
    };
    const auto t0 = std::chrono::steady_clock::now();
    if (!host->Hash(tokens.data(), pos.data(), qsl.data(), nullptr, nullptr, static_cast<int32_t>(T), 1, ids.data())
             .ok()) {
      return 1;
    }
    busy += since(t0);
#ifdef ENGRAM_HAVE_CUDA
    if (engine) {
      // The GPU path end to end on the stream; its hash ids must equal the CPU reference's.
      cudaMemcpy(d_tokens, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_pos, pos.data(), pos.size() * 8, cudaMemcpyHostToDevice);
      cudaMemcpy(d_qsl, qsl.data(), 8, cudaMemcpyHostToDevice);
      cudaMemset(d_ids, 0xA5, ids.size() * 4);
      const auto g0 = std::chrono::steady_clock::now();
      bool ok = engine->Hash(d_tokens, d_pos, d_qsl, nullptr, nullptr, static_cast<int32_t>(T), 1, d_ids).ok();
      for (int l = 0; l < L && ok; ++l) {
        ok = engine->Lookup(l, d_ids + l * C, static_cast<int32_t>(T), L * C, d_rows, false).ok();
        // Timed pass only: the check below runs each layer's lookup again and reads that one back.
      }
      cudaStreamSynchronize(nullptr);
      gpu_busy += since(g0);
      std::vector<int32_t> gpu_ids(ids.size());
      cudaMemcpy(gpu_ids.data(), d_ids, ids.size() * 4, cudaMemcpyDeviceToHost);
      hash_mismatches += gpu_ids != ids;
      if (!ok) return 1;
    }
#endif
    for (int l = 0; l < L; ++l) {
      std::vector<int32_t> layer_ids(static_cast<size_t>(T * C));
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t c = 0; c < C; ++c)
          layer_ids[static_cast<size_t>(i * C + c)] = ids[static_cast<size_t>((i * L + l) * C + c)];
      }
      const auto t1 = std::chrono::steady_clock::now();
      bool host_ok = false;
#ifdef ENGRAM_HAVE_CUDA
      if (engine) {  // the rows the verification reads come from the GPU lookup of this layer
        host_ok = engine->Lookup(l, d_ids + l * C, static_cast<int32_t>(T), L * C, d_rows, false).ok() &&
                  cudaMemcpy(rows.data(), d_rows, rows.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
      }
#endif
      if (!host_ok && !host->Lookup(l, layer_ids.data(), static_cast<int32_t>(T), C, rows.data(), false).ok()) return 1;
      busy += since(t1);
      for (int64_t k = 0; k < verify / std::max<int64_t>(1, batches) + 1; ++k) {
        const size_t idx = static_cast<size_t>(rng() % static_cast<uint64_t>(T * C));
        const int32_t id = layer_ids[idx];
        const auto& li = t.layers()[static_cast<size_t>(l)];
        std::vector<uint16_t> want = id >= li.row_begin && id < li.row_end
                                         ? RowFromCheckpoint(oracle.get(), li.layer_id, id, D)
                                         : std::vector<uint16_t>(static_cast<size_t>(D), 0);
        ++verified;
        mismatches += !std::equal(want.begin(), want.end(), rows.begin() + static_cast<long>(idx * D));
      }
    }
  }
  // A sparse checkpoint's pattern: rows in every region, the table's last row, holes next to them.
  std::string pattern_error;
  const std::vector<PatternRow> pattern =
      verify > 0 ? PatternRows(req.checkpoint, t, &pattern_error) : std::vector<PatternRow>();
  int64_t pattern_checked = 0, pattern_mismatches = 0, pattern_nonzero = 0;
  if (!pattern_error.empty()) {
    std::cerr << "engram-replica: " << pattern_error << "\n";
    ++pattern_mismatches;
  }
  for (int l = 0; l < L; ++l) {
    std::vector<int32_t> rows_of_layer;
    std::vector<bool> in_region;
    for (const auto& pr : pattern) {
      if (pr.layer == l) {
        rows_of_layer.push_back(pr.row);
        in_region.push_back(pr.in_region);
      }
    }
    // T tokens of C ids per lookup; unused slots ask for row -1 (a zero row).
    for (size_t first = 0; first < rows_of_layer.size(); first += static_cast<size_t>(T * C)) {
      std::vector<int32_t> ids_chunk(static_cast<size_t>(T * C), -1);
      const size_t n = std::min(rows_of_layer.size() - first, static_cast<size_t>(T * C));
      std::copy_n(rows_of_layer.begin() + static_cast<long>(first), n, ids_chunk.begin());
      bool looked_up = false;
#ifdef ENGRAM_HAVE_CUDA
      if (engine) {
        looked_up = cudaMemcpy(d_ids, ids_chunk.data(), ids_chunk.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
                    engine->Lookup(l, d_ids, static_cast<int32_t>(T), C, d_rows, false).ok() &&
                    cudaMemcpy(rows.data(), d_rows, rows.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
        if (!looked_up) return 1;
      }
#endif
      if (!looked_up && !host->Lookup(l, ids_chunk.data(), static_cast<int32_t>(T), C, rows.data(), false).ok()) {
        return 1;
      }
      for (size_t k = 0; k < n; ++k) {
        const auto want =
            RowFromCheckpoint(oracle.get(), t.layers()[static_cast<size_t>(l)].layer_id, rows_of_layer[first + k], D);
        const bool zero = std::all_of(want.begin(), want.end(), [](uint16_t v) { return (v & 0x7FFF) == 0; });
        ++pattern_checked;
        pattern_nonzero += in_region[first + k] && !zero;
        // The lookup must return the checkpoint's row; a row of a region must hold data (its scale bytes are never
        // 0 in the generator's pattern), or the pattern file and the checkpoint disagree.
        pattern_mismatches += !std::equal(want.begin(), want.end(), rows.begin() + static_cast<long>(k * D));
        pattern_mismatches += in_region[first + k] == zero;  // data in a region, a hole after it
      }
    }
  }
  json out = {{"mode", engram::client::ModeName(t.mode())},
              {"backend", engram::client::BackendName(t.backend())},
              {"attach", engram::client::AttachMethodName(t.attach_method())},
              {"reasons", json::array()},
              {"verified", verified},
              {"mismatches", mismatches},
              {"tokens_per_s", (gpu_busy > 0 ? gpu_busy : busy) > 0
                                   ? static_cast<double>(T * batches) / (gpu_busy > 0 ? gpu_busy : busy)
                                   : 0.0}};
  if (t.register_seconds() >= 0) out["register_seconds"] = t.register_seconds();
  const engram::client::AttachTimes at = t.attach_times();
  out["attach_seconds"] = {{"checkpoint", at.checkpoint},
                           {"gpu", at.gpu},
                           {"session", at.session},
                           {"map", at.map},
                           {"populate", at.populate},
                           {"ticket", at.ticket},
                           {"pin", at.pin},
                           {"build", at.build},
                           {"total", at.total}};
  if (!pattern.empty() || !pattern_error.empty()) {
    out["pattern_rows"] = pattern_checked;
    out["pattern_nonzero_rows"] = pattern_nonzero;
    out["pattern_mismatches"] = pattern_mismatches;
  }
  mismatches += pattern_mismatches;
  if (gpu_busy > 0) out["hash_mismatches"] = hash_mismatches;
  mismatches += hash_mismatches;
  out["mismatches"] = mismatches;
  for (const auto& r : t.reasons()) out["reasons"].push_back(engram::client::ReasonName(r.code));
  bool ok = mismatches == 0;
  if (a.Has("--write-probe")) {
    // A replica can never write the table: a write faults in the writing process only.
    pid_t child = ::fork();
    if (child == 0) {
      *const_cast<volatile uint8_t*>(t.records(0)) = 0x42;
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    const bool faulted = WIFSIGNALED(status) && (WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS);
    out["write_faulted"] = faulted;
    ok = ok && faulted;
    if (t.mode() == engram::client::Mode::kShared) {
      // Nor make its mapping writable: the file was opened read-only (by engramd, or by path), so the kernel refuses.
      const uintptr_t page = reinterpret_cast<uintptr_t>(t.records(0)) & ~uintptr_t{4095};
      void* p = reinterpret_cast<void*>(page);
      const bool refused = ::mprotect(p, 4096, PROT_READ | PROT_WRITE) != 0 && errno == EACCES;
      if (!refused) ::mprotect(p, 4096, PROT_READ);
      out["mprotect_refused"] = refused;
      ok = ok && refused;
    }
  }
  const int64_t hold = geti("--hold", 0);
  if (hold > 0) {
    std::cout << json{{"attached", true}, {"mode", out["mode"]}, {"attach", out["attach"]}}.dump() << std::endl;
    std::this_thread::sleep_for(std::chrono::seconds(hold));
  }
  std::cout << out.dump() << std::endl;
  return ok ? 0 : 1;
}
