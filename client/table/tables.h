// Tables: where a replica's rows live and how they got there (docs/architecture.md, "Data flow" step 3).
//   OpenSharedTable   maps the granted segment PROT_READ (from the descriptor engramd passed, or by path), checks
//                     it against the grant (the same file, READY, fingerprint, size), and prefaults this process's
//                     page tables (outside the node's registration ticket).
//   PinTable          registers the table for the GPU (read-only, chunked, rolled back on failure) on the CUDA
//                     backend, or pins it with mlock on the CPU backend; says how long it took or why it failed.
//   BuildPrivateTable reads this TP shard's records from the checkpoint into private memory (PRIVATE_PINNED, then
//                     registered) or onto the GPU (DEVICE).
// TableImpl is the one concrete Table: it owns the mapping or private memory, the registrations (released before
// the memory) and the daemon session (released last of all but the memory: it is the lease). All OS calls go
// through an Env (shm/env.h) so tests can make mlock or mmap fail. Thread-compatible; internal to the client.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/environment.h"
#include "client/session/session.h"
#include "engram/client.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "shm/env.h"
#include "shm/segment.h"

namespace engram::client {

class TableImpl final : public Table {
 public:
  explicit TableImpl(Env* env) : env_(env), tuning_(Environment().tuning) {}
  ~TableImpl() override;

  Mode mode() const override { return mode_; }
  Backend backend() const override { return backend_; }
  const std::vector<Reason>& reasons() const override { return reasons_; }
  const std::vector<LayerInfo>& layers() const override { return layers_; }
  int64_t col_begin() const override { return col_begin_; }
  int64_t col_end() const override { return col_end_; }
  int64_t head_dim() const override { return layout_->config().head_dim; }
  int64_t n_cols() const override { return layout_->n_cols(); }
  const TokenMap& token_map() const override { return *map_; }
  const Layout& layout() const override { return *layout_; }
  const uint8_t* records(int l) const override { return records_[static_cast<size_t>(l)]; }
  const uint8_t* device_records(int l) const override {
    return device_records_.empty() ? nullptr : device_records_[static_cast<size_t>(l)];
  }
  double register_seconds() const override { return register_seconds_; }
  AttachMethod attach_method() const override { return attach_; }
  AttachTimes attach_times() const override { return times_; }
  void NoteEngineChoice(const std::string& choice) const override;
  const Tuning& tuning() const override { return tuning_; }

  // The bytes the table's records span (one mapping or allocation), for pinning.
  const uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }

  Env* env_;
  Tuning tuning_;  // the attaching client's knobs over the environment's
  Mode mode_ = Mode::kPrivatePinned;
  Backend backend_ = Backend::kCpu;
  double register_seconds_ = -1;
  AttachMethod attach_ = AttachMethod::kNone;
  AttachTimes times_;
  std::vector<Reason> reasons_;
  std::vector<LayerInfo> layers_;
  int64_t col_begin_ = 0, col_end_ = 0;
  std::unique_ptr<Layout> layout_;
  std::unique_ptr<TokenMap> map_;
  std::vector<const uint8_t*> records_;
  std::vector<const uint8_t*> device_records_;
  std::vector<std::shared_ptr<void>> keep_;  // registrations / device copies: released before the memory
  std::unique_ptr<Session> session_;         // the lease, or the record of a fallback in `engramctl status`
  std::unique_ptr<SegmentReader> segment_;   // shared: the read-only mapping
  uint8_t* private_ = nullptr;               // private: our own mapping
  const uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  bool mlocked_ = false;
};

// Maps the granted segment and checks it against the grant and the replica's fingerprint: from `fd` when >= 0 (the
// descriptor engramd passed, taken over: closed once mapped or on failure; the table's attach method is then
// kDescriptor), else from `path` (kPath). NotFound / PermissionDenied when the path cannot be opened or holds
// another file than the granted one (the caller's SHM_NOT_VISIBLE), FailedPrecondition when the granted file
// disagrees with the grant or this replica's checkpoint (FINGERPRINT_MISMATCH).
absl::StatusOr<std::unique_ptr<TableImpl>> OpenSharedTable(const Grant& grant, int fd, const std::string& path,
                                                           uint64_t fingerprint, const Layout& layout,
                                                           const ShardRange& shard, Env* env);

// Pins the table's records: CUDA registration (chunks of `chunk_bytes`) when `cuda`, else mlock. On success the table's
// backend and register_seconds are set.
RegistrationReport PinTable(TableImpl& table, bool cuda, size_t chunk_bytes);

// A private copy of this TP shard from the checkpoint: host memory (then pinned/registered like a shared table,
// PRIVATE_PINNED) or a GPU copy (DEVICE) when `cpu_offload` is false and `cuda` is true.
absl::StatusOr<std::unique_ptr<TableImpl>> BuildPrivateTable(const Checkpoint& ckpt, const Layout& layout,
                                                             const ShardRange& shard, bool cpu_offload, bool cuda,
                                                             int threads, size_t chunk_bytes, Env* env);

}  // namespace engram::client
