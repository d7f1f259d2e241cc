// WriteMetricsFile: engramd's --metrics-file (Prometheus text for node_exporter's textfile collector), replaced
// atomically. The text goes to a fresh file of a name of its own beside the target (`<file>.tmp.<pid>.<n>`, opened
// with O_CREAT|O_EXCL|O_NOFOLLOW, so nothing planted there, a symlink least of all, is ever opened or written through),
// then renamed over the target (a link planted at the target is replaced, its target untouched). The directory is
// reached one component at a time from / (or the working directory), each checked before the next is looked up: it
// must be root's or the daemon's, and one that others may write must be sticky; a symlink on the way is followed only
// when root's or the daemon's. Otherwise the write is refused (FailedPrecondition naming the directory, owner and
// mode), so that no one who may write a directory on the way can move the file onto a segment.
// Errors: FailedPrecondition for such a directory, Internal naming the call and errno otherwise. Stateless;
// thread-safe.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "shm/env.h"

namespace engram::daemon {

// `env`: the OS calls (shm/env.h); null = Env::Default().
absl::Status WriteMetricsFile(const std::string& path, const std::string& text, Env* env = nullptr);

}  // namespace engram::daemon
