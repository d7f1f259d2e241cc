// PeerInfo: who is on the other end of a connection, as the kernel reports it (SO_PEERCRED on the Unix socket),
// never as the client claims. The listener records it per connection; the service and the replica registry copy it.
// Plain value type.
#pragma once

#include <cstdint>

namespace engram::daemon {

struct PeerInfo {
  int32_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
};

}  // namespace engram::daemon
