// Log(): the library's own spdlog logger (include/engram/log.h describes where its lines go). Internal to the
// client; never registered in spdlog's registry, so a host's loggers and ours never collide. Thread-safe.
#pragma once

#include "spdlog/logger.h"

namespace engram::client {

spdlog::logger& Log();

}  // namespace engram::client
