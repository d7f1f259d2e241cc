#include "net/posix_acl.h"

#include <linux/posix_acl.h>
#include <linux/posix_acl_xattr.h>
#include <sys/stat.h>
#include <sys/xattr.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace engram::net {

namespace {

constexpr char kAccessAcl[] = "system.posix_acl_access";

// One entry as the kernel reads it: little-endian tag, permission bits (rwx = 4/2/1) and id.
void Put(std::string* out, uint16_t tag, uint16_t perm, uint32_t id) {
  const uint8_t bytes[8] = {static_cast<uint8_t>(tag),      static_cast<uint8_t>(tag >> 8),
                            static_cast<uint8_t>(perm),     static_cast<uint8_t>(perm >> 8),
                            static_cast<uint8_t>(id),       static_cast<uint8_t>(id >> 8),
                            static_cast<uint8_t>(id >> 16), static_cast<uint8_t>(id >> 24)};
  out->append(reinterpret_cast<const char*>(bytes), sizeof(bytes));
}

absl::Status FromErrno(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOTSUP) return absl::FailedPreconditionError(absl::StrCat(msg, " (the filesystem keeps no ACLs)"));
  if (err == EPERM || err == EACCES) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

}  // namespace

absl::Status GrantGroup(const std::string& path, gid_t gid) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return FromErrno(errno, absl::StrCat("stat ", path));
  const uint16_t owner = (st.st_mode >> 6) & 7, group = (st.st_mode >> 3) & 7, other = st.st_mode & 7;
  // The kernel wants the entries ordered by tag; the mask bounds the named group to what the owning group has.
  std::string acl;
  const uint32_t version = POSIX_ACL_XATTR_VERSION;
  for (int i = 0; i < 4; ++i) acl.push_back(static_cast<char>(version >> (8 * i)));
  const uint32_t none = static_cast<uint32_t>(ACL_UNDEFINED_ID);
  Put(&acl, ACL_USER_OBJ, owner, none);
  Put(&acl, ACL_GROUP_OBJ, group, none);
  if (gid != st.st_gid) Put(&acl, ACL_GROUP, group, static_cast<uint32_t>(gid));
  Put(&acl, ACL_MASK, group, none);
  Put(&acl, ACL_OTHER, other, none);
  if (::setxattr(path.c_str(), kAccessAcl, acl.data(), acl.size(), 0) != 0) {
    return FromErrno(errno, absl::StrCat("set the ACL of ", path));
  }
  return absl::OkStatus();
}

absl::Status ClearAcl(const std::string& path) {
  // ENOTSUP: a filesystem without ACLs has none to remove.
  if (::removexattr(path.c_str(), kAccessAcl) != 0 && errno != ENODATA && errno != ENOTSUP) {
    return FromErrno(errno, absl::StrCat("remove the ACL of ", path));
  }
  return absl::OkStatus();
}

}  // namespace engram::net
