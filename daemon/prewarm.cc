#include "daemon/prewarm.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/utf8.h"
#include "spdlog/spdlog.h"

extern char** environ;

namespace engram::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxOutput = 4096;  // of the child's output kept (its report is one short line)
constexpr size_t kMaxRecords = 4096;

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool IsExecutableFile(Env& env, const std::string& path) {
  struct stat s {};
  return env.Stat(path.c_str(), &s) == 0 && S_ISREG(s.st_mode) && env.Access(path.c_str(), X_OK) == 0;
}

// The child's last non-empty line, printable.
std::string LastLine(const std::string& out) {
  std::string line;
  for (absl::string_view l : absl::StrSplit(out, '\n')) {
    l = absl::StripAsciiWhitespace(l);
    if (!l.empty()) line = std::string(l);
  }
  return engram::Printable(engram::Utf8Prefix(line, 512));
}

}  // namespace

std::string_view Name(PrewarmState s) {
  switch (s) {
    case PrewarmState::kOff: return "off";
    case PrewarmState::kQueued: return "queued";
    case PrewarmState::kRunning: return "running";
    case PrewarmState::kDone: return "done";
    case PrewarmState::kSkipped: return "skipped";
    case PrewarmState::kStopped: return "stopped";
    case PrewarmState::kFailed: return "failed";
  }
  return "off";
}

absl::StatusOr<PrewarmOptions> ResolvePrewarmTool(const std::string& setting, const std::string& self_dir,
                                                  Env* env_or_null) {
  Env& env = env_or_null != nullptr ? *env_or_null : *Env::Default();
  PrewarmOptions o;
  if (setting == "off") {
    o.off_reason = "prewarm_registration is off";
    return o;
  }
  if (setting == "auto" || setting.empty()) {
    const std::string tool = absl::StrCat(self_dir, "/engram-prewarm");
    if (IsExecutableFile(env, tool)) {
      o.tool = tool;
    } else {
      o.off_reason = absl::StrCat("engram-prewarm is not installed next to engramd (", tool,
                                  "): engramd was built without CUDA, or the tool was not installed");
    }
    return o;
  }
  if (!IsExecutableFile(env, setting)) {
    return absl::InvalidArgumentError(absl::StrCat("prewarm_registration: '", setting,
                                                   "' is not an executable file (auto, off, or the tool's path)"));
  }
  o.tool = setting;
  return o;
}

RegistrationPrewarm::RegistrationPrewarm(PrewarmOptions options, Hooks hooks)
    : options_(std::move(options)), hooks_(std::move(hooks)) {
  if (enabled()) worker_ = std::thread([this] { Loop(); });
}

RegistrationPrewarm::~RegistrationPrewarm() { Stop(); }

void RegistrationPrewarm::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (const auto& path : queue_) {
      records_[path].state = PrewarmState::kStopped;
      records_[path].detail = "engramd is stopping";
    }
    queue_.clear();
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void RegistrationPrewarm::SegmentReady(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled() || stopping_) return;
  if (auto it = records_.find(path);  // queued or running already: once is enough
      it != records_.end() &&
      (it->second.state == PrewarmState::kQueued || it->second.state == PrewarmState::kRunning)) {
    return;
  }
  if (records_.size() >= kMaxRecords) {  // bounded: settled records of segments long gone go first
    for (auto it = records_.begin(); it != records_.end();) {
      const PrewarmState s = it->second.state;
      it = s != PrewarmState::kQueued && s != PrewarmState::kRunning ? records_.erase(it) : std::next(it);
    }
  }
  PrewarmRecord rec;
  rec.state = PrewarmState::kQueued;
  records_[path] = rec;
  queue_.push_back(path);
  cv_.notify_all();
}

PrewarmRecord RegistrationPrewarm::RecordOf(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  PrewarmRecord rec;
  if (!enabled()) {
    rec.detail = options_.off_reason;
    return rec;
  }
  auto it = records_.find(path);
  if (it != records_.end()) return it->second;
  rec.detail = "the segment is not READY yet";
  return rec;
}

bool RegistrationPrewarm::WaitIdle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return queue_.empty() && !running_; });
}

void RegistrationPrewarm::Settle(const std::string& path, PrewarmRecord rec) {
  rec.at_unix_ms = NowUnixMs();
  const auto log = rec.state == PrewarmState::kFailed ? spdlog::level::warn : spdlog::level::info;
  spdlog::log(log, "event=registration_prewarm segment={} state={} register_seconds={:.3f} seconds={:.3f} detail={}",
              engram::LogValue(path), Name(rec.state), rec.register_seconds, rec.seconds,
              engram::LogQuoted(rec.detail));
  std::lock_guard<std::mutex> lock(mu_);
  records_[path] = std::move(rec);
  running_ = false;
  cv_.notify_all();
}

void RegistrationPrewarm::Loop() {
  while (true) {
    std::string path;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      path = queue_.front();
      queue_.pop_front();
      running_ = true;
      records_[path].state = PrewarmState::kRunning;
    }
    Settle(path, RunOne(path));
  }
}

PrewarmRecord RegistrationPrewarm::RunOne(const std::string& path) {
  PrewarmRecord rec;
  if (hooks_.replica_waiting()) {
    rec.state = PrewarmState::kSkipped;
    rec.detail = "a replica was already waiting for a registration ticket (it pays the first registration)";
    return rec;
  }
  if (!hooks_.try_hold_ticket()) {
    rec.state = PrewarmState::kSkipped;
    rec.detail = "no registration ticket was free (a replica is registering)";
    return rec;
  }
  const auto t0 = Clock::now();
  auto finish = [&](PrewarmState state, std::string detail) {
    hooks_.release_ticket();
    rec.state = state;
    rec.detail = std::move(detail);
    rec.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return rec;
  };
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return finish(PrewarmState::kFailed, absl::StrCat("pipe: ", std::strerror(errno)));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  std::vector<std::string> args = {options_.tool, "--segment", path};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // engramd blocks SIGTERM/SIGINT/SIGHUP for its signal thread and ignores SIGPIPE: the child starts with none
  // blocked and every one at its default, so that it can be stopped like any process.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGPIPE}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, options_.tool.c_str(), &fa, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (err != 0) {
    ::close(fds[0]);
    return finish(PrewarmState::kFailed, absl::StrCat("could not start ", options_.tool, ": ", std::strerror(err)));
  }
  std::string out;
  std::string stopped_why;
  bool timed_out = false;
  // Whether the child must go now: engramd stops, a replica asks for a ticket, or the timeout passed.
  auto must_end = [&] {
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
    }
    if (stopping) {
      stopped_why = "engramd is stopping";
    } else if (hooks_.replica_waiting()) {
      stopped_why = "a replica asked for a registration ticket: it goes first";
    } else if (Clock::now() - t0 > options_.timeout) {
      timed_out = true;
    }
    return !stopped_why.empty() || timed_out;
  };
  bool killed = false;
  for (bool open = true; open && !killed;) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 50) > 0) {
      char buf[512];
      const ssize_t got = ::read(fds[0], buf, sizeof(buf));
      if (got > 0) {
        if (out.size() < kMaxOutput) out.append(buf, std::min(static_cast<size_t>(got), kMaxOutput - out.size()));
      } else if (got == 0 || errno != EINTR) {
        open = false;  // the child closed its output (it ended, or closed it and runs on: waitpid below)
      }
    }
    if (must_end()) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
  }
  ::close(fds[0]);
  int status = 0;
  // Its output closed: it is ending. Wait for it, still giving way to a stop, a replica and the timeout.
  while (!killed && ::waitpid(pid, &status, WNOHANG) == 0) {
    if (must_end()) {
      ::kill(pid, SIGKILL);
      killed = true;
    } else {
      ::usleep(20000);
    }
  }
  if (killed) {
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (timed_out) {
      return finish(PrewarmState::kFailed,
                    absl::StrCat("engram-prewarm ran longer than ", options_.timeout.count(), " ms and was stopped"));
    }
    return finish(PrewarmState::kStopped, stopped_why);
  }
  const std::string line = LastLine(out);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    // "populate_seconds=A register_seconds=B unregister_seconds=C bytes=D"
    double reg = -1;
    for (absl::string_view kv : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      if (absl::ConsumePrefix(&kv, "register_seconds=") && !absl::SimpleAtod(kv, &reg)) reg = -1;
    }
    if (reg < 0) return finish(PrewarmState::kFailed, absl::StrCat("engram-prewarm said no register_seconds: ", line));
    rec.register_seconds = reg;
    return finish(PrewarmState::kDone, line);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) {
    absl::string_view why = line;
    absl::ConsumePrefix(&why, "reason=");
    return finish(PrewarmState::kSkipped, std::string(why));
  }
  absl::string_view why = line;
  absl::ConsumePrefix(&why, "error=");
  const std::string how = WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                                            : absl::StrCat("was killed by signal ", WTERMSIG(status));
  return finish(PrewarmState::kFailed,
                why.empty() ? absl::StrCat("engram-prewarm ", how) : absl::StrCat("engram-prewarm ", how, ": ", why));
}

}  // namespace engram::daemon
