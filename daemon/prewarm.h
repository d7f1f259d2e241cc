// RegistrationPrewarm: pays a machine's first registration of each READY segment before a replica does. A node's
// first cuMemHostRegister of a segment's pages costs more than every later one (bench/RESULTS.md "First attach");
// engramd runs the engram-prewarm tool (tools/prewarm.cc) on each segment once it is READY, in a child process (a
// driver fault ends the child, never the daemon), so that the replicas that come later register at the later rate.
//
// It never makes a replica wait: a prewarm takes a registration ticket only when one is free and no replica is
// queued (Hooks::try_hold_ticket), and stops its child as soon as a replica queues for one (Hooks::replica_waiting)
// or the daemon stops; a segment whose prewarm was skipped or stopped is simply paid for by its first replica.
// Each outcome is logged (`event=registration_prewarm segment=... state=...`) and kept per segment path for status.
//
// Ownership: owns one worker thread and the children it starts (killed and reaped before it returns). The hooks
// must outlive it. Thread-safety: every public method may be called from any thread; no hook is called under the
// internal mutex.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/statusor.h"
#include "shm/env.h"

namespace engram::daemon {

enum class PrewarmState { kOff, kQueued, kRunning, kDone, kSkipped, kStopped, kFailed };
// "off", "queued", "running", "done", "skipped", "stopped", "failed" (as status shows them).
std::string_view Name(PrewarmState s);

struct PrewarmRecord {
  PrewarmState state = PrewarmState::kOff;
  double register_seconds = 0;  // done: what the child's registration took
  double seconds = 0;           // done, stopped, failed: the child's whole run
  int64_t at_unix_ms = 0;       // when it settled (0 while queued or running)
  std::string detail;           // why off, skipped, stopped or failed; the child's report when done
};

struct PrewarmOptions {
  std::string tool;  // the engram-prewarm executable; "" = off (off_reason says why)
  std::string off_reason;
  std::chrono::milliseconds timeout{300000};  // a child running longer is killed (failed)
};

// The tool `--prewarm-registration` names: "off" (empty, with a reason), "auto" (engram-prewarm in `self_dir`, when
// it is there and executable; else empty, with a reason), or the path of the tool (an error when it is not an
// executable file). `env`: the file checks (null = Env::Default()).
absl::StatusOr<PrewarmOptions> ResolvePrewarmTool(const std::string& setting, const std::string& self_dir,
                                                  Env* env = nullptr);

class RegistrationPrewarm {
 public:
  struct Hooks {
    std::function<bool()> try_hold_ticket;  // true: a ticket is held for the prewarm (none queued, one free)
    std::function<void()> release_ticket;
    std::function<bool()> replica_waiting;  // a replica is queued for a ticket now
  };
  RegistrationPrewarm(PrewarmOptions options, Hooks hooks);
  ~RegistrationPrewarm();  // Stop()
  // Kills and reaps a running child, drops the queue and joins the worker; later SegmentReady calls do nothing.
  void Stop();
  RegistrationPrewarm(const RegistrationPrewarm&) = delete;
  RegistrationPrewarm& operator=(const RegistrationPrewarm&) = delete;

  // A segment became READY at `path`: queues its prewarm (off: records why not). A path queued or running already is
  // not queued again.
  void SegmentReady(const std::string& path);
  // The record of `path`: off with the reason when prewarming is off; kOff with "not READY yet" when never queued.
  PrewarmRecord RecordOf(const std::string& path) const;
  bool enabled() const { return !options_.tool.empty(); }
  // Blocks until nothing is queued or running (true) or the timeout passes (tests).
  bool WaitIdle(std::chrono::milliseconds timeout);

 private:
  void Loop();
  PrewarmRecord RunOne(const std::string& path);
  void Settle(const std::string& path, PrewarmRecord rec);

  const PrewarmOptions options_;
  const Hooks hooks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  std::map<std::string, PrewarmRecord> records_;
  bool running_ = false;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace engram::daemon
