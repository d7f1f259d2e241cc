// Segment: one file per (checkpoint fingerprint, TP size, TP rank) in the shm directory, holding a TP shard's
// Engram rows as 264-byte records (256 e4m3 + 8 ue8m0 bytes side by side).
//
// File layout:
//   [0, 4096)                 SegmentHeader (below): magic, version, state, instance/epoch, fingerprint, offsets
//   [4096, data_offset)       the SegmentDescriptor protobuf (engram.v1), desc_bytes long, xxh3 in the header
//   [data_offset, data_offset + data_bytes)   the records, layer after layer (data_offset is 2 MiB aligned)
//   [.., total)               zero padding up to a 2 MiB multiple: the file is made of whole huge pages, so that a
//                             hugetlbfs mount (2 MiB pages) can hold it and every mapping of it ends on a huge page
// States move CREATING -> LOADING -> READY (-> RETIRED); only the daemon writes, and a READY segment is never
// written again. Anything not READY that a daemon finds at start is debris from a crash and is removed.
//
// Name: engram-<fingerprint, 16 hex>-tp<rank>of<size>. Files are created 0600 with O_EXCL; every open refuses
// symlinks (O_NOFOLLOW) and anything but a regular file. All OS calls go through an Env (shm/env.h).
// SegmentWriter is single-owner (the publisher); SegmentReader maps read-only and is immutable after Open.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shm/env.h"

namespace engram {

enum class SegmentState : uint32_t { kCreating = 1, kLoading = 2, kReady = 3, kRetired = 4 };
std::string SegmentStateName(SegmentState s);

inline constexpr char kSegmentMagic[8] = {'E', 'N', 'G', 'R', 'A', 'M', 'S', 'G'};
inline constexpr uint32_t kSegmentVersion = 1;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kDataAlign = uint64_t{2} << 20;

struct SegmentHeader {
  char magic[8];
  uint32_t version;
  uint32_t state;        // SegmentState; written and read atomically (std::atomic_ref) through a shared mapping
  uint64_t instance_id;  // the daemon instance that created it
  uint64_t epoch;
  uint64_t fingerprint;
  uint32_t tp_size;
  uint32_t tp_rank;
  uint64_t desc_offset;
  uint64_t desc_bytes;
  uint64_t desc_checksum;  // xxh3 of the descriptor bytes
  uint64_t data_offset;
  uint64_t data_bytes;
  uint64_t total_bytes;
  uint64_t created_unix_ms;
  uint64_t ready_unix_ms;
  double load_seconds;
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

std::string SegmentName(uint64_t fingerprint, int64_t tp_size, int64_t tp_rank);
// Parses a segment file name; false for anything else.
bool ParseSegmentName(const std::string& name, uint64_t* fingerprint, int64_t* tp_size, int64_t* tp_rank);

// Where the records start, and the total file size (a multiple of kDataAlign), for a descriptor of `desc_bytes` and
// `data_bytes` of records.
uint64_t SegmentDataOffset(uint64_t desc_bytes);
uint64_t SegmentFileBytes(uint64_t desc_bytes, uint64_t data_bytes);

// How SegmentWriter::Create reserves the file's memory:
//   kWhole    fallocate the whole file (ENOSPC surfaces at Create; the zeroing runs in the creating thread)
//   kWriters  fallocate the header and the last page only; whoever fills the data populates its pages first
//             (madvise MADV_POPULATE_WRITE, from as many threads as fill it: see populate_data()), so that ENOSPC
//             (or a short hugetlb pool) comes back as an error from there, never as SIGBUS. Where the kernel lacks
//             MADV_POPULATE_WRITE (< 5.14), Create falls back to kWhole.
//   kAuto     kWriters on huge pages: hugetlbfs (its fallocate zeroes every huge page in the calling thread: a 16 GiB
//             publish ran at 0.17 of the first-touch copy, 0.74 with kWriters, H200 host 2026-11-30) and a
//             huge=always tmpfs (its fallocate allocates the 2 MiB pages in the calling thread: since the publish
//             streams its stores, kWriters won 3 of 4 same-run comparisons there, 0.74-0.86 vs 0.73-0.79,
//             bench/RESULTS.md "Publish");
//             kWhole on 4 KiB pages (a tmpfs's fallocate only allocates, its pages are zeroed at first touch in
//             parallel anyway, and parallel allocation contends on the file's page index: 4 KiB tmpfs publish
//             4.3-4.8 GiB/s with kWriters, 5.2-5.8 with kWhole).
enum class SegmentReserve { kWhole, kWriters, kAuto };

// Creates, sizes (fallocate: ENOSPC surfaces here, not as SIGBUS later; see SegmentReserve) and maps a new segment
// read-write. The file is 0600, the creator's: replicas receive a read-only descriptor from the daemon (or open it by
// path where their uid may). On hugetlbfs the mount's huge page size must divide the file size (2 MiB pages do;
// 1 GiB pages are refused with FailedPrecondition); the huge pages are reserved when the file is mapped (ENOMEM
// from a short pool is ResourceExhausted).
class SegmentWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SegmentWriter>> Create(const std::string& dir, uint64_t fingerprint,
                                                               int64_t tp_size, int64_t tp_rank,
                                                               const std::string& descriptor, uint64_t data_bytes,
                                                               uint64_t instance_id, uint64_t epoch,
                                                               Env* env = Env::Default(),
                                                               SegmentReserve reserve = SegmentReserve::kWhole);
  ~SegmentWriter();  // unmaps; a segment not Finish()ed is removed
  SegmentWriter(const SegmentWriter&) = delete;
  SegmentWriter& operator=(const SegmentWriter&) = delete;

  uint8_t* data() { return base_ + header()->data_offset; }
  uint64_t data_bytes() const { return header()->data_bytes; }
  const std::string& path() const { return path_; }
  // True when the data's pages are not reserved yet (kWriters granted): the filler must populate each range before
  // writing it (PopulateForWrite) to get ENOSPC as an error.
  bool populate_data() const { return populate_; }
  // The mount's page size for this file: 4096, or a hugetlbfs / huge=always tmpfs page (2 MiB on x86-64).
  uint64_t page_bytes() const { return page_; }
  // The file's pages are larger than the system's (hugetlbfs, a huge=always tmpfs): what kAuto and the publish's
  // streamed stores go by.
  bool huge_pages() const { return huge_; }
  void SetLoading();
  // Marks READY (after an msync of the data) and keeps the file.
  absl::Status Finish(double load_seconds);
  // Drops this writer's page-table entries for the records before READY (MADV_DONTNEED of a shared mapping: the file
  // keeps every byte; data() must not be read or written afterwards), from `threads` threads in 2 MiB-aligned
  // slices, so that tearing them down is not left to the destructor's munmap, after READY, beside the first
  // replicas' attach (0.3 s for 94 GiB of 4 KiB pages in parallel; it did not by itself make the first attach after
  // a publish faster, bench/RESULTS.md "Full scale"). Returns the seconds it took.
  double ReleaseDataMapping(int threads);

 private:
  SegmentWriter() = default;
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  Env* env_ = nullptr;
  std::string path_;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t page_ = 4096;  // the mount's page size for this file (4096, or a hugetlbfs / huge=always tmpfs page)
  bool huge_ = false;     // page_ above the system page
  bool populate_ = false;
  bool finished_ = false;
};

// Populates [p, p + n) of a shared writable mapping for writing (MADV_POPULATE_WRITE, widened to whole system pages):
// OK, or ResourceExhausted when the mount (or the hugetlb pool) has no room, instead of a SIGBUS on the write.
absl::Status PopulateForWrite(uint8_t* p, uint64_t n, Env* env = Env::Default());

// Maps an existing segment read-only and validates its header (magic, version, sizes, descriptor checksum).
class SegmentReader {
 public:
  static absl::StatusOr<std::unique_ptr<SegmentReader>> Open(const std::string& path, Env* env = Env::Default());
  // The same over a descriptor the caller already holds (one engramd passed: SCM_RIGHTS); takes ownership of `fd`
  // (closed once mapped, or on failure). `name` is for messages.
  static absl::StatusOr<std::unique_ptr<SegmentReader>> OpenDescriptor(int fd, const std::string& name,
                                                                       Env* env = Env::Default());
  ~SegmentReader();
  SegmentReader(const SegmentReader&) = delete;
  SegmentReader& operator=(const SegmentReader&) = delete;

  const SegmentHeader& header() const { return *reinterpret_cast<const SegmentHeader*>(base_); }
  SegmentState state() const {
    return static_cast<SegmentState>(
        std::atomic_ref<uint32_t>(const_cast<uint32_t&>(header().state)).load(std::memory_order_acquire));
  }
  std::string descriptor_bytes() const;
  const uint8_t* data() const { return base_ + header().data_offset; }
  uint64_t file_bytes() const { return size_; }
  uint64_t device() const { return dev_; }
  uint64_t inode() const { return ino_; }

 private:
  SegmentReader() = default;
  Env* env_ = nullptr;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0, dev_ = 0, ino_ = 0;
};

// Reads only the header of a file (no mapping); fails on foreign or truncated files.
absl::StatusOr<SegmentHeader> ReadSegmentHeader(const std::string& path, Env* env = Env::Default());
// The same for a file the daemon is about to adopt or modify: also PermissionDenied unless it is owned by `owner`
// (the daemon's uid) and writable by nobody else, so a file planted in a world-writable directory is never served.
absl::StatusOr<SegmentHeader> ReadOwnedSegmentHeader(const std::string& path, uid_t owner, Env* env = Env::Default());

// Changes the state byte of an existing segment file (daemon only: e.g. READY -> RETIRED).
absl::Status SetSegmentState(const std::string& path, SegmentState state, Env* env = Env::Default());

// The segment files (by name) in `dir`.
std::vector<std::string> ListSegments(const std::string& dir, Env* env = Env::Default());

}  // namespace engram
