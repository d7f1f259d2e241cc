// MakePrintable: every string field of a message, at any depth (repeated fields and maps included), passed through
// engram::Printable (base/utf8.h): control characters, C1 controls and bidirectional overrides replaced. engramd
// applies it to the status it answers and engramctl to what it shows, so a string that came from a checkpoint file
// or a client (a path, a config value, a tensor name, an error quoting one) can never forge a line or drive an
// operator's terminal. Bytes fields are left alone. Stateless; thread-safe for distinct messages.
#pragma once

#include <google/protobuf/message.h>

namespace engram {

void MakePrintable(google::protobuf::Message* msg);

}  // namespace engram
