// SHA-256 (FIPS 180-4) of a byte string, as lower-case hex. Used to name token maps; not for security.
// Pure function; thread-safe.
#pragma once

#include <string>
#include <string_view>

namespace engram {

std::string Sha256Hex(std::string_view data);

}  // namespace engram
