// The descriptor side channel's words, shared by its two ends (daemon/descriptor_server.h serves it,
// client/session/descriptor_client.h asks it): a request is "ENGRAM-FD/1 <lease> <token>\n"; the reply "OK\n" with the
// segment's descriptor (SCM_RIGHTS), or "ERR <message>\n". A message that starts with kSegmentGone says the granted
// segment no longer exists (retired or unloaded between the grant and the fetch): the replica's reason is then
// SEGMENT_NOT_READY, not a visibility problem. Constants only.
#pragma once

#include <string_view>

namespace engram {

inline constexpr char kDescriptorProtocol[] = "ENGRAM-FD/1";
inline constexpr char kSegmentGone[] = "segment gone";

inline bool SegmentGone(std::string_view descriptor_error) {
  return descriptor_error.find(kSegmentGone) != std::string_view::npos;
}

}  // namespace engram
