#include "client/log.h"

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "engram/log.h"
#include "spdlog/sinks/base_sink.h"

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

// Formats each line and hands it to the host's callback, or writes it to stderr.
class RoutingSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void Set(LogCallback cb) {
    std::lock_guard<std::mutex> lock(mutex_);
    callback_ = std::move(cb);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    std::string line(buf.data(), buf.size());
    if (callback_) {
      while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
      callback_(FromSpdlog(msg.level), line);
    } else {
      std::fwrite(line.data(), 1, line.size(), stderr);
    }
  }
  void flush_() override { std::fflush(stderr); }

 private:
  LogCallback callback_;
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
