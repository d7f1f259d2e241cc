// The DP engine's step watchdog clock (client/dp/dp_device_engine.cc): which queued steps count as overdue. The caller
// reports finishes oldest first (steps on two streams, the engine's and its prefetch stream, may finish out of
// order: a younger step's finish is then reported late, when the older one's is, never early); a step is overdue
// when steps are queued and none has finished for `timeout`, counted from the later of the moment the queue became
// non-empty and the last finish. A host that keeps
// enqueueing steps behind a stalled member therefore does not push the deadline back (were each enqueue to restart
// it). Pure bookkeeping (the caller observes the finishes, e.g. by querying one CUDA event per step); not
// thread-safe: the caller's lock guards it. Header-only.
#pragma once

#include <chrono>
#include <cstdint>

namespace engram::client {

class StepWatch {
 public:
  using Clock = std::chrono::steady_clock;
  explicit StepWatch(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  // A step was enqueued at `now`.
  void Enqueued(Clock::time_point now) {
    if (queued_ == 0) since_ = now;
    ++queued_;
  }
  // The oldest queued step was seen finished at `now` (ignored when none is queued).
  void Finished(Clock::time_point now) {
    if (queued_ == 0) return;
    --queued_;
    since_ = now;
  }
  int64_t queued() const { return queued_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool Overdue(Clock::time_point now) const { return queued_ > 0 && now - since_ > timeout_; }

 private:
  std::chrono::milliseconds timeout_;
  int64_t queued_ = 0;
  Clock::time_point since_{};
};

}  // namespace engram::client
