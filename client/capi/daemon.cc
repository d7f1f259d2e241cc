// The C ABI: the daemon's status and the library's log (include/engram/engram_c.h).
#include "client/capi/handles.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/session/session.h"
#include "engram/log.h"

using namespace engram::capi;  // NOLINT: the entry points' shared helpers

extern "C" {

int engram_status_json(const char* socket, int timeout_ms, char** json, char* err, size_t err_len) {
  try {
    if (socket == nullptr || json == nullptr) {
      return Fail(absl::InvalidArgumentError("engram_status_json: null socket or output"), err, err_len);
    }
    *json = nullptr;
    if (auto st = GrpcHere(); !st.ok()) return Fail(st, err, err_len);
    auto fetched =
        engram::client::FetchStatusJson(socket, std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 5000));
    if (!fetched.ok()) return Fail(fetched.status(), err, err_len);
    const std::string& text = *fetched;
    *json = static_cast<char*>(std::malloc(text.size() + 1));
    if (*json == nullptr) return Fail(absl::ResourceExhaustedError("status: out of memory"), err, err_len);
    std::memcpy(*json, text.c_str(), text.size() + 1);
    return 0;
  } catch (...) {
    return CaughtException(err, err_len);
  }
}

void engram_string_free(char* s) { std::free(s); }

void engram_set_log_callback(engram_log_fn fn, void* user) {
  try {
    if (fn == nullptr) {
      engram::client::SetLogCallback(nullptr);
      return;
    }
    engram::client::SetLogCallback([fn, user](engram::client::LogLevel level, std::string_view line) {
      const std::string text(line);  // NUL-terminated for C
      fn(static_cast<int>(level), text.c_str(), user);
    });
  } catch (...) {
    // Out of memory while installing: the previous destination stays.
  }
}

void engram_set_log_level(int level) {
  engram::client::SetLogLevel(static_cast<engram::client::LogLevel>(level < 0 ? 0 : level > 3 ? 3 : level));
}

}  // extern "C"
