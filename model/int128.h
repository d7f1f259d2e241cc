// uint128: GCC/Clang's unsigned 128-bit integer under a name that -Wpedantic accepts. Header-only.
#pragma once

namespace engram {
__extension__ typedef unsigned __int128 uint128;
}  // namespace engram
