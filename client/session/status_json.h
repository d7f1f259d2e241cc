// The status document: engramd's StatusReply as the one JSON shape both doors give, `engramctl status --json` and the
// C ABI's engram_status_json (Python's engram.status()). docs/status.md lists every field with its type;
// kStatusSchemaVersion is the document's `schema_version`, raised on any change a reader could trip over (a field
// removed, renamed or retyped); a field added keeps it. Numbers are JSON numbers (64-bit counters included), names
// are snake_case, and every field is present in every document (an empty string, 0, false or [] when it does not
// apply), so a reader never tests for a key. Strings pass through MakePrintable (proto/printable.h) first, whatever
// the daemon sent. A pure function of its argument; thread-safe.
#pragma once

#include <string>

#include "engram/v1/engram.pb.h"

namespace engram::client {

inline constexpr int kStatusSchemaVersion = 1;

// One line of JSON (no trailing newline) for `reply`.
std::string StatusJson(const engram::v1::StatusReply& reply);

}  // namespace engram::client
