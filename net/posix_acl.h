// POSIX access ACLs on the daemon's socket files: one extra group given the same access as the file's own group.
// engramd's sockets are 0660 with the `--group` gid; an operator who is only in `--admin-group` could not connect
// to them at all. GrantGroup adds that group as a named ACL entry (system.posix_acl_access, written through
// setxattr in the kernel's own format, so no libacl is needed); ClearAcl takes every such entry away again.
//
// Errors: the errno of stat/setxattr/removexattr as a Status (FailedPrecondition for a filesystem without ACLs,
// PermissionDenied when the caller does not own the file). Stateless; thread-safe.
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"

namespace engram::net {

// Gives group `gid` what the file's own group has (its mode's group bits), keeping owner, group and other as the
// mode says. Replaces any access ACL the file had.
absl::Status GrantGroup(const std::string& path, gid_t gid);

// Removes the file's access ACL (its mode stays); OK when it had none or its filesystem keeps none.
absl::Status ClearAcl(const std::string& path);

}  // namespace engram::net
