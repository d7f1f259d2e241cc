// Small file helpers shared by the model library: opening checkpoint files as hostile input, whole-file reads of
// small files (configs, headers, tokenizers) with errors that name the path. Large tensors never go through here
// (see safetensors.h for ranged reads).
//
// Every checkpoint file is opened through OpenRegularFile: O_NONBLOCK so that a FIFO (or a device) put where a file
// should be cannot block the open, then fstat on the descriptor, refusing anything but a regular file, then
// O_NONBLOCK cleared. Symlinks are followed (Hugging Face caches link every file into a blob store); it is the
// target that must be regular. AvailableMemoryBytes is the one reader of the memory a process may still take.
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace engram {

// Opens `path` read-only (O_CLOEXEC) and returns the descriptor, which the caller closes. NotFound when absent,
// PermissionDenied when it cannot be opened, InvalidArgument ("not a regular file") for FIFOs, sockets, devices
// and directories.
absl::StatusOr<int> OpenRegularFile(const std::string& path);

// Reads a whole file; refuses files larger than `max_bytes` (a guard against a wrong path pointing at a table).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes = size_t{1} << 30);

// Writes `data` to `path` atomically (temporary file in the same directory, then rename).
absl::Status WriteFileAtomic(const std::string& path, const std::string& data);

// The value of `key` ("MemAvailable", "HugePages_Free", ...) in the text of /proc/meminfo, as written (kB for sizes,
// a count for page counts); nullopt when the key is absent or its value does not parse. The one parser of that file.
std::optional<uint64_t> MeminfoValue(const std::string& meminfo, const std::string& key);
// The memory this process may still take: /proc/meminfo's MemAvailable, or less where the process's memory cgroup
// or one above it leaves less (CgroupAvailableBytes). ~0 when none can be read. The first form reads the files
// (model/ and io/ code, which have no Env); the second takes their text (Env::AvailableMemoryBytes reads them).
uint64_t AvailableMemoryBytes();
uint64_t AvailableMemoryBytes(const std::string& meminfo, const std::string& self_cgroup, const std::string& sys_root);
// What the memory cgroups named by `self_cgroup` (the text of /proc/self/cgroup) leave under `sys_root`
// (/sys/fs/cgroup): the least, over the group, its ancestors and the mount's root, of limit - usage (v2: memory.max
// and memory.current; v1: the memory hierarchy's memory.limit_in_bytes and memory.usage_in_bytes). ~0 when none
// has a limit.
uint64_t CgroupAvailableBytes(const std::string& self_cgroup, const std::string& sys_root);

}  // namespace engram
