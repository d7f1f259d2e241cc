// The segment registry's small helpers on files of its shm directory (daemon/segment_registry.h): whose a file is
// (and removing one that is not this daemon's), reading a published segment's descriptor back, and bounding
// untrusted text for a log line. Stateless; thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/segment_registry.h"
#include "engram/v1/engram.pb.h"
#include "shm/env.h"

namespace engram::daemon {

// Whether a segment is still on its way (PENDING or LOADING).
bool Unsettled(ServingState s);

// What occupies a segment's `path`: nothing (or a foreign file, now removed) -> false; this daemon's own regular
// file -> true; a foreign file that cannot be removed -> FailedPrecondition naming its owner. Foreign: a symlink,
// anything but a regular file, another owner, or writable by group/others (a world-writable shm directory lets
// anyone plant a file under our name before we start).
absl::StatusOr<bool> OursOrClear(const std::string& path, Env* env);

// The identity of the file at `path` now (lstat; zeros when it cannot be read).
FileIdentity FileIdentityOf(const std::string& path, Env* env);

// Empty when the file at `path` is a regular file of exactly `bytes` bytes and, when `expected` is known, the same
// file; otherwise why it is not (its size, another file in its place, or that it is gone or not a regular file): a
// READY segment whose file was truncated or replaced, whatever its size, is not served.
std::string SizeProblem(const std::string& path, uint64_t bytes, Env* env, FileIdentity expected = {});

// `s` cut to at most `max` bytes on a UTF-8 boundary, with "..." when cut.
std::string Bounded(const std::string& s, size_t max);

// The descriptor stored in the segment at `path`; null when it cannot be read or parsed.
std::shared_ptr<const engram::v1::SegmentDescriptor> ReadDescriptor(const std::string& path, Env* env);

}  // namespace engram::daemon
