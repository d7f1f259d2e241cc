#include "client/log.h"

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "engram/log.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/sink.h"

namespace engram::client {
namespace {

LogLevel FromSpdlog(spdlog::level::level_enum l) {
  switch (l) {
    case spdlog::level::trace:
    case spdlog::level::debug: return LogLevel::kDebug;
    case spdlog::level::info: return LogLevel::kInfo;
    case spdlog::level::warn: return LogLevel::kWarning;
    default: return LogLevel::kError;
  }
}

// Hands each line's record to the host's callback, or writes it, stamped with time and level, to stderr. The callback
// runs with no lock of ours held (it may set another callback or the level); a line it logs itself is dropped, not
// recursed into.
class RoutingSink final : public spdlog::sinks::sink {
 public:
  void Set(LogCallback cb) {
    auto next = cb ? std::make_shared<const LogCallback>(std::move(cb)) : nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    callback_ = std::move(next);
  }

  void log(const spdlog::details::log_msg& msg) override {
    thread_local bool inside = false;
    if (inside) return;
    std::string line;
    std::shared_ptr<const LogCallback> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cb = callback_;
      if (cb == nullptr) {
        spdlog::memory_buf_t buf;
        formatter_->format(msg, buf);
        line.assign(buf.data(), buf.size());
      } else {
        // The host's logger stamps its own time and level: a callback gets the record alone.
        line.assign(msg.payload.data(), msg.payload.size());
      }
    }
    if (cb == nullptr) {
      std::fwrite(line.data(), 1, line.size(), stderr);
      return;
    }
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    inside = true;
    try {
      (*cb)(FromSpdlog(msg.level), line);
    } catch (...) {
      // A host's callback that throws loses its line; the library goes on.
    }
    inside = false;
  }
  void flush() override { std::fflush(stderr); }
  void set_pattern(const std::string& pattern) override {
    std::lock_guard<std::mutex> lock(mu_);
    formatter_ = std::make_unique<spdlog::pattern_formatter>(pattern);
  }
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override {
    std::lock_guard<std::mutex> lock(mu_);
    formatter_ = std::move(f);
  }

 private:
  std::mutex mu_;
  std::unique_ptr<spdlog::formatter> formatter_ = std::make_unique<spdlog::pattern_formatter>();
  std::shared_ptr<const LogCallback> callback_;
};

struct State {
  std::shared_ptr<RoutingSink> sink = std::make_shared<RoutingSink>();
  std::shared_ptr<spdlog::logger> logger;
  State() {
    logger = std::make_shared<spdlog::logger>("engram", sink);
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %l %v");
    logger->set_level(spdlog::level::info);
    logger->flush_on(spdlog::level::warn);
  }
};

State& TheState() {
  static State* s = new State();  // never destroyed: usable from static destructors and detached threads
  return *s;
}

}  // namespace

spdlog::logger& Log() { return *TheState().logger; }

void SetLogCallback(LogCallback callback) { TheState().sink->Set(std::move(callback)); }

void SetLogLevel(LogLevel level) {
  static constexpr spdlog::level::level_enum kLevels[] = {spdlog::level::debug, spdlog::level::info,
                                                          spdlog::level::warn, spdlog::level::err};
  const int i = static_cast<int>(level);
  TheState().logger->set_level(kLevels[i < 0 ? 0 : i > 3 ? 3 : i]);
}

}  // namespace engram::client
