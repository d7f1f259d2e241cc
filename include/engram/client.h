// libengram_client: what a serving replica links to get its TP shard's Engram table (docs/architecture.md, "Data
// flow").
//
//   ASSIGN_OR_RETURN(auto client, engram::client::Client::Create({.socket = "/run/engramd/engramd.sock"}));
//   ASSIGN_OR_RETURN(auto table, client->Attach(request));   // SHARED, or a fallback table with its reasons
//   ASSIGN_OR_RETURN(auto engine, engram::client::LookupEngine::Create(*table, max_tokens, stream));
//   engine->Hash(...);  engine->Prefetch(...);  engine->Wait(layer);  engine->Gate(...);   // lookup_engine.h
//
// Attach declares the replica's topology and engram config to engramd (config precedence as docs/math.md section 9: an
// explicit value, then VLLM_PLE_CPU_OFFLOAD, then the default) and receives a grant or a fallback; the daemon decides
// the mode (daemon/fallback.h), the client adds only what it alone can know (NO_CUDA_DEVICE, DAEMON_UNAVAILABLE,
// PERMISSION_DENIED, SHM_NOT_VISIBLE when neither the descriptor nor the granted path reaches the file,
// REGISTER_FAILED, DP_SHARED_MEMORY_DISABLED) and reports the outcome, so `engramctl status` shows the mode this
// process runs. Shared: engramd passes the segment's read-only descriptor over its socket directory (no shm
// directory on the replica's side, any mount or IPC namespace; the path named in the grant is the fallback), the
// segment is mapped PROT_READ, checked against the grant, the registration ticket taken, the mapping
// pinned, the result reported; the session stays open for the Table's life (it is the lease). Fallback: a private
// table for this TP shard is built from the checkpoint, in host memory (PRIVATE_PINNED) or, with cpu_offload
// false, as the DEVICE table; with dp_shared_memory explicitly true, any fallback is an error carrying the reasons.
// The pieces: client/session/session.h (the conversation with the daemon), client/table/tables.h (mapping, pinning,
// building).
//
// Backends: with a usable GPU (and a CUDA build) the table is registered read-only in chunks (cuMemHostRegister,
// rolled back on failure: REGISTER_FAILED names the chunk) or copied to the GPU (DEVICE), and the LookupEngine runs
// the fused kernels on it. Without one, backend CPU (reason NO_CUDA_DEVICE): the mapping is pinned with mlock and
// the LookupEngine runs the CPU reference over the same records. Client and Table are thread-compatible: one
// thread drives a Table; distinct Tables are independent.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engram/tuning.h"
#include "engram/types.h"

// The library's own types, declared only: the public headers are self-contained (include/engram and abseil). Code
// outside the library reads a table through LayerInfo and the accessors below; layout() and token_map() serve the
// library's own layers (model/layout.h, model/token_map.h), and ClientOptions::env is the tests' OS seam (shm/env.h).
namespace engram {
class Env;
class Layout;
class TokenMap;
}  // namespace engram

namespace engram::client {

struct ClientOptions {
  std::string socket = "/run/engramd/engramd.sock";
  std::chrono::milliseconds timeout{10000};        // connect + answer (the daemon may still be loading); also the
                                                   // most the wait for the registration ticket takes
  size_t register_chunk_bytes = size_t{16} << 30;  // cudaHostRegister chunk (never >= 512 GiB)
  bool use_gpu = true;                             // false: CPU backend even where a GPU is present
  Env* env = nullptr;  // OS seam for mapping, pinning and building tables (shm/env.h); null = the real one
  // Fetch the granted segment as a descriptor over the daemon's descriptor socket (the default); false: open the
  // segment's path only (for diagnosis; SHM_NOT_VISIBLE where this process cannot see the daemon's directory).
  bool descriptor_passing = true;
  // The lookup engines' knobs for the tables this client attaches (engram/tuning.h): each one set here wins over
  // its ENGRAM_<KEY> environment variable; unset ones keep the environment's value or the measured default.
  Tuning tuning;
};

struct AttachRequest {
  std::string checkpoint;  // the replica's checkpoint directory (fingerprint, fallbacks)
  int tp_size = 1, tp_rank = 0;
  int dp_size = 1, dp_rank = 0;
  int local_dp_size = 0;  // DP replicas on this node; 0 = all of them
  bool elastic_ep = false;
  std::optional<bool> cpu_offload;  // unset: VLLM_PLE_CPU_OFFLOAD, then true
  Choice dp_shared_memory = Choice::kAuto;
  bool embedding_across_dp = false;
  // Only for the path fallback, when no descriptor could be passed: where this process sees the daemon's shm
  // directory if it is mounted elsewhere. Empty (the default): the directory named in the grant.
  std::string shm_dir;
  int threads = 0;  // for building a private table; 0 = hardware concurrency
  // false: a table that cannot be shared is not built here; Attach returns FailedPrecondition naming every reason
  // (an engine with a table store of its own, such as vLLM's, keeps that instead of a second private copy).
  // true: the private table is built only when the memory free to this process (MemAvailable, or its cgroup v2
  // room) holds it plus 256 MiB; otherwise Attach returns ResourceExhausted naming the bytes needed and available.
  bool private_fallback = true;
};

struct LayerInfo {
  int64_t layer_id = 0;
  int64_t row_begin = 0, row_end = 0;  // this shard's rows of the layer table
  std::vector<int64_t> multipliers, primes, offsets;
};

// Where an attach spent its time, in seconds (0 for a step it did not take). `engram-replica` prints it; the
// client logs the total with event=attached.
struct AttachTimes {
  double checkpoint = 0;  // opening the checkpoint: config, index, tensor headers, fingerprint
  double gpu = 0;         // finding the GPU (creating its context)
  double session = 0;     // the daemon's answer
  double map = 0;         // fetching the descriptor, mapping and checking the segment
  double populate = 0;    // building this process's page tables for the mapping (before the ticket)
  double ticket = 0;      // waiting for the node's registration ticket
  double pin = 0;         // registering (pinning) the table
  double build = 0;       // building a private table (fallbacks only)
  double total = 0;
};

class Table {
 public:
  virtual ~Table() = default;
  virtual Mode mode() const = 0;
  virtual Backend backend() const = 0;
  virtual const std::vector<Reason>& reasons() const = 0;
  virtual const std::vector<LayerInfo>& layers() const = 0;
  // The hash columns this TP shard owns: [col_begin, col_end) of n_cols.
  virtual int64_t col_begin() const = 0;
  virtual int64_t col_end() const = 0;
  virtual int64_t head_dim() const = 0;
  virtual int64_t n_cols() const = 0;
  virtual const TokenMap& token_map() const = 0;
  virtual const Layout& layout() const = 0;
  // Host-visible records of layer `l` (row_begin's record first); read-only when shared. Null for a DEVICE table
  // on the CUDA backend (the copy lives on the GPU only).
  virtual const uint8_t* records(int l) const = 0;
  // Device-visible records (UVA host pointer of registered memory, or the GPU copy); null on the CPU backend.
  virtual const uint8_t* device_records(int l) const = 0;
  // Seconds spent registering (pinning) the table; -1 when nothing was registered.
  virtual double register_seconds() const = 0;
  // How a SHARED table reached its segment: the descriptor engramd passed, or its path; kNone otherwise.
  virtual AttachMethod attach_method() const { return AttachMethod::kNone; }
  // The attach's time, step by step.
  virtual AttachTimes attach_times() const { return {}; }
  // A lookup engine made on this table says what it chose (LookupEngine::choice): the table's session with engramd
  // reports it, and `engramctl status` shows it for this replica. Best effort; nothing without a session.
  virtual void NoteEngineChoice(const std::string& choice) const { (void)choice; }
  // The knobs its engines use: the attaching client's ClientOptions::tuning over the environment's (a table made
  // elsewhere: the environment's alone).
  virtual const Tuning& tuning() const;
  // Hashing, lookups and the gate go through a LookupEngine (engram/lookup_engine.h): the one lookup API, on the
  // GPU or the CPU, and on the host records of any table (LookupEngine::CreateOnHost).
};

class Client {
 public:
  // Checks the options; nothing connects until Attach (each attach opens its own session).
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);
  absl::StatusOr<std::unique_ptr<Table>> Attach(const AttachRequest& request);

 private:
  explicit Client(ClientOptions o) : options_(std::move(o)) {}
  ClientOptions options_;
};

// The precedence for cpu_offload (docs/math.md section 9): explicit, then VLLM_PLE_CPU_OFFLOAD ("0"/"false"/"no"/"off"
// = false), then true.
bool ResolveCpuOffload(const std::optional<bool>& explicit_value);

}  // namespace engram::client
