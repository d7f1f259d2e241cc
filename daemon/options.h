// engramd's configuration: command-line flags over an optional config file (/etc/engramd/engramd.conf).
//
// Config file: one `key = value` per line, `#` comments. Keys: checkpoint (repeatable), tp (comma list), shm_dir,
// socket, group, admin_group, tickets, ticket_hold_ms, max_sessions, max_sessions_per_uid, max_streams_per_uid,
// max_connections_per_uid, reflection (on|off), threads, log_level, metrics_file, metrics_address,
// prewarm_registration (auto|off|PATH). Flags:
// --checkpoint DIR (repeatable), --tp 1,2,
// --shm-dir DIR, --socket PATH, --group NAME, --admin-group NAME, --tickets N, --threads N, --log-level LEVEL,
// --metrics-file PATH, --metrics-address HOST:PORT, --config FILE. A flag given on the command line replaces the
// file's value for that key (checkpoints too: flags replace the file's list). Plain value type.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/publish_tuning.h"
#include "shm/env.h"

namespace engram::daemon {

struct Options {
  std::vector<std::string> checkpoints;
  std::vector<int64_t> tp_sizes = {1};
  // How segments are published: the ENGRAM_PUBLISH_* variables, read once by main() (PublishTuning::FromEnvironment).
  PublishTuning publish_tuning;
  std::string shm_dir = "/dev/shm";
  std::string socket = "/run/engramd/engramd.sock";
  std::string group;  // members may connect; empty: the daemon's own uid and root only
  // Members may also run the operator calls (Load, Unload, Drain); root and the daemon's uid always may. Engines
  // (the --group) attach and read status only: one engine cannot take sharing away from the others.
  std::string admin_group;
  int tickets = 1;  // replicas registering at once
  // How long a replica may hold a registration ticket before the daemon reclaims it (event=ticket_expired): well
  // above a whole shard's cuMemHostRegister (a 94 GiB shard registers in tens of seconds).
  int ticket_hold_ms = 120000;
  // Sessions open at once, in all and per uid: each holds a server thread, so that no peer can exhaust them (status
  // and the other engines' replicas keep working); one more is refused with RESOURCE_EXHAUSTED.
  int max_sessions = 2048;
  int max_sessions_per_uid = 512;
  // Other streams open at once per uid (health Watch, reflection): daemon/stream_bound.h.
  int max_streams_per_uid = 16;
  // Connections open at once per uid, root and the daemon's uid exempt (daemon/listener.h): each costs a descriptor.
  int max_connections_per_uid = 256;
  // gRPC reflection (ServerReflectionInfo), off by default; when on, operators only (daemon/stream_bound.h).
  bool reflection = false;
  int threads = 0;  // publish/verify workers; 0 = hardware concurrency (at most 32)
  std::string log_level = "info";
  std::string metrics_file;  // Prometheus text format, rewritten every 2 s (node_exporter textfile collector)
  // HTTP /metrics for Prometheus (daemon/metrics_http.h), "" = off; validated by ParseMetricsAddress.
  std::string metrics_address;
  // engramd's own first CUDA registration of each READY segment (daemon/prewarm.h): auto (engram-prewarm next to
  // engramd, when installed), off, or the tool's path.
  std::string prewarm_registration = "auto";
  std::string config_file;  // where the file values came from ("" when none)
};

absl::StatusOr<Options> ParseOptions(int argc, char** argv);
// The one name of a checkpoint directory, so that aliases (a trailing slash, `.`/`..`, a symlink) are the same
// checkpoint everywhere the daemon takes one (config, Load, Unload, Reload): realpath(3) when the directory exists,
// else the absolute, lexically normal path without a trailing slash.
std::string CanonicalCheckpointPath(const std::string& dir, Env* env = Env::Default());
// Parses config file text into `opts` (only keys present change).
absl::Status ApplyConfigText(const std::string& text, const std::string& origin, Options* opts);

}  // namespace engram::daemon
