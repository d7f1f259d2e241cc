// PrintableSink: the sink of engramd's logger. Every line's message passes through engram::Printable (base/utf8.h)
// before the wrapped sink writes it, so that text taken from a checkpoint or a client (a directory name, a config
// value, an error quoting either) can hold no newline or escape: one event is one line, and no line is forged.
// Owns nothing but the wrapped sink; thread-safe as the wrapped sink is (the daemon wraps an _mt sink).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "base/utf8.h"
#include "spdlog/details/log_msg.h"
#include "spdlog/sinks/sink.h"

namespace engram::daemon {

class PrintableSink final : public spdlog::sinks::sink {
 public:
  explicit PrintableSink(std::shared_ptr<spdlog::sinks::sink> inner) : inner_(std::move(inner)) {}
  void log(const spdlog::details::log_msg& msg) override {
    const std::string clean = Printable(std::string(msg.payload.data(), msg.payload.size()));
    spdlog::details::log_msg copy(msg);
    copy.payload = spdlog::string_view_t(clean.data(), clean.size());
    inner_->log(copy);
  }
  void flush() override { inner_->flush(); }
  void set_pattern(const std::string& pattern) override { inner_->set_pattern(pattern); }
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override { inner_->set_formatter(std::move(f)); }

 private:
  std::shared_ptr<spdlog::sinks::sink> inner_;
};

}  // namespace engram::daemon
