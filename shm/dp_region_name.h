// The name of a DP_SHARDED host-transport group's exchange region (a POSIX shm object): "/engram-dp-<pid>-<random>",
// made by the group's rank 0 (client/dp/host_transport.h) and removed by it, or by engramd when the group is gone
// (daemon/group_registry.h). IsDpRegionName says whether a name is of that form (one component, the prefix), so
// that nothing else is ever removed under it. Constants and a pure function.
#pragma once

#include <cstring>
#include <string>

namespace engram {

inline constexpr char kDpRegionPrefix[] = "/engram-dp-";

inline bool IsDpRegionName(const std::string& name) {
  return name.size() <= 255 && name.rfind(kDpRegionPrefix, 0) == 0 && name.find('/', 1) == std::string::npos &&
         name.size() > std::strlen(kDpRegionPrefix);
}

}  // namespace engram
