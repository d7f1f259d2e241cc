// The entry point every fuzz target in tests/fuzz defines, with libFuzzer's signature, so that one source builds
// both as a libFuzzer binary (clang, -fsanitize=fuzzer) and with replay_main.cc as a deterministic replay + mutation
// driver that any compiler builds (the CI run). A target returns 0 and must never crash, abort, hang or leak an
// exception for any input. Not thread-safe (libFuzzer calls it from one thread).
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
