#include "client/capi/handles.h"

#include <cstring>
#include <new>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace engram::capi {

int Fail(const absl::Status& st, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const std::string m(st.message());
    std::strncpy(err, m.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(st.code());
}

bool LayerOk(const engram_table* t, int l) {
  return t != nullptr && l >= 0 && l < static_cast<int>(t->table->layers().size());
}

absl::Status CheckTokens(int32_t n, int32_t max_tokens) {
  if (n < 0 || n > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(n, " tokens; the engine was sized for ", max_tokens));
  }
  return absl::OkStatus();
}

absl::Status Owned(pid_t owner, const char* what) {
  if (owner == ::getpid()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this ", what, " belongs to process ", owner, "; process ", ::getpid(),
                   " is a fork of it and may not use it (the parent keeps it): attach again in this process"));
}

namespace {
std::atomic<pid_t> g_grpc_pid{0};
}  // namespace

absl::Status GrpcHere() {
  const pid_t me = ::getpid();
  pid_t first = 0;
  if (g_grpc_pid.compare_exchange_strong(first, me) || first == me) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("process ", first, " spoke to engramd before process ", me,
                   " was forked from it: a forked child cannot (gRPC does not survive fork); start it with exec "
                   "(Python: multiprocessing's 'spawn')"));
}

void Release(engram_table* t) {
  if (t->refs.fetch_sub(1) == 1) delete t;
}

int Done(const absl::Status& st, char* err, size_t err_len) { return st.ok() ? 0 : Fail(st, err, err_len); }

int CaughtException(char* err, size_t err_len) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("out of memory"), err, err_len);
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(absl::StrCat("internal error: ", e.what())), err, err_len);
  } catch (...) {
    return Fail(absl::InternalError("internal error: an unknown exception"), err, err_len);
  }
}

}  // namespace engram::capi
