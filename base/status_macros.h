// Status plumbing used across engram: flat call sites for absl::Status / absl::StatusOr.
//
//   RETURN_IF_ERROR(expr);            returns the status of `expr` when it is not OK.
//   ASSIGN_OR_RETURN(lhs, expr);      evaluates a StatusOr, returns its status on error, else assigns the value.
//
// Header-only, no state; safe from any thread.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ENGRAM_CONCAT_INNER_(a, b) a##b
#define ENGRAM_CONCAT_(a, b) ENGRAM_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status engram_status_ = (expr);          \
    if (!engram_status_.ok()) return engram_status_; \
  } while (0)

#define ENGRAM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) ENGRAM_ASSIGN_OR_RETURN_IMPL_(ENGRAM_CONCAT_(engram_statusor_, __LINE__), lhs, expr)
