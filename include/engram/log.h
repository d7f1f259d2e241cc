// The client library's log. libengram_client (and so libengram_c.so and the Python package) logs through a logger
// of its own, never through the host process's default logger: lines go to stderr unless the host (an engine)
// hands the library a callback, which then receives every line at or above the level set. Lines are single
// `key=value` records ("engram: event=attached mode=SHARED ..."): on stderr after the time and level, to a callback
// bare (the host's logger adds its own). Both calls are thread-safe; the callback may be
// called from any thread of the library (attach, the lease watcher, DP group threads), with no lock of the
// library held: it may set another callback or the level; a line logged from inside it is dropped, and an
// exception it throws is swallowed. A host whose runtime shuts down (an interpreter at exit) removes its callback
// first. gRPC's own diagnostics are gRPC's and are not routed here.
#pragma once

#include <functional>
#include <string_view>

namespace engram::client {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

using LogCallback = std::function<void(LogLevel level, std::string_view line)>;

// Routes the library's lines to `callback`; an empty function restores stderr.
void SetLogCallback(LogCallback callback);

// Lines below `level` are dropped (default kInfo).
void SetLogLevel(LogLevel level);

}  // namespace engram::client
