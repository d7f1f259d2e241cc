// bench_model: CPU-side costs of the model library, each next to a ceiling measured in the same run.
//   ceiling   single-thread memcpy of 256 MiB (bytes read + written per second)
//   hash      HashIdsCpu on the V4.1-Flash layout (2 layers x 24 columns), T = 1 .. 8192 tokens
//   lookup    LookupBf16Cpu / LookupPackedCpu of random rows from a 1 GiB record table (1 thread)
//   tokenmap  TokenMap::Build on a tokenizer.json (the DeepSeek-V3 one when given), parse + build
// Usage: bench_model CONFIG_JSON [TOKENIZER_JSON ...]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "model/layout.h"
#include "model/reference.h"
#include "model/token_map.h"
#include "model/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double SecondsPerCall(F&& f, double min_seconds = 0.3) {
  f();  // warm
  int64_t n = 0;
  const auto t0 = Clock::now();
  double el = 0;
  do {
    f();
    ++n;
    el = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (el < min_seconds);
  return el / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_model CONFIG_JSON [TOKENIZER_JSON ...]\n");
    return 2;
  }
  // Ceiling: memcpy.
  const size_t kCopy = size_t{256} << 20;
  std::vector<char> src(kCopy, 1), dst(kCopy, 0);
  const double copy_s = SecondsPerCall([&] { std::memcpy(dst.data(), src.data(), kCopy); });
  const double memcpy_gbs = 2.0 * kCopy / copy_s / 1e9;
  std::printf("ceiling  memcpy 256 MiB, 1 thread: %.2f GB/s (read + write)\n\n", memcpy_gbs);

  auto cfg = engram::LoadEngramConfig(argv[1]);
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  auto layout = engram::Layout::Build(*cfg);
  if (!layout.ok()) return 1;
  std::vector<int32_t> ident(static_cast<size_t>(cfg->compressed_vocab_size));
  for (size_t i = 0; i < ident.size(); ++i) ident[i] = static_cast<int32_t>(i);
  engram::TokenMap map = engram::TokenMap::FromIds(ident);
  std::mt19937_64 rng(42);
  std::printf("hash     %s: %lld layers x %lld columns\n", argv[1], static_cast<long long>(layout->n_layers()),
              static_cast<long long>(layout->n_cols()));
  std::printf("  %-6s %-12s %-14s %-12s %s\n", "T", "us/call", "Mtokens/s", "out GB/s", "vs memcpy");
  for (int T : {1, 4, 64, 1024, 4096, 8192}) {
    std::vector<int32_t> tokens(static_cast<size_t>(T));
    std::vector<int64_t> pos(static_cast<size_t>(T));
    for (int i = 0; i < T; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % ident.size());
      pos[static_cast<size_t>(i)] = 100 + i;
    }
    std::vector<int32_t> qsl = {0, T};
    std::vector<int32_t> lookback(static_cast<size_t>(layout->max_ngram() - 1), 7);
    std::vector<int32_t> out(static_cast<size_t>(T * layout->n_layers() * layout->n_cols()));
    engram::HashBatch b{tokens, pos, qsl, lookback, {}};
    const double s = SecondsPerCall([&] { (void)engram::HashIdsCpu(*layout, map, b, out); });
    const double gbs = out.size() * 4.0 / s / 1e9;
    std::printf("  %-6d %-12.2f %-14.2f %-12.2f %.3f\n", T, s * 1e6, T / s / 1e6, gbs, gbs / memcpy_gbs);
  }

  // Lookup from a 1 GiB table of 264-byte records.
  const int64_t D = 256, rb = 264;
  const int64_t rows = (int64_t{1} << 30) / rb;
  std::vector<uint8_t> table(static_cast<size_t>(rows * rb));
  for (size_t i = 0; i < table.size(); i += 4096) table[i] = static_cast<uint8_t>(i);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<uint8_t>((i * 2654435761u) >> 13) & 0x7E;
  engram::RecordTable rt{table.data(), 0, rows, D};
  const int n = 1 << 16;
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(rows));
  std::vector<uint16_t> bf(static_cast<size_t>(n * D));
  std::vector<uint8_t> packed(static_cast<size_t>(n * rb));
  const double s_bf = SecondsPerCall([&] { (void)engram::LookupBf16Cpu(rt, ids, bf); });
  const double s_pk = SecondsPerCall([&] { (void)engram::LookupPackedCpu(rt, ids, packed); });
  std::printf("\nlookup   1 GiB table, %d random rows, 1 thread\n", n);
  std::printf("  bf16    %.2f Mrows/s, %.2f GB/s of records (%.3f of memcpy)\n", n / s_bf / 1e6, n * rb / s_bf / 1e9,
              2 * n * rb / s_bf / 1e9 / memcpy_gbs);
  std::printf("  packed  %.2f Mrows/s, %.2f GB/s of records (%.3f of memcpy)\n", n / s_pk / 1e6, n * rb / s_pk / 1e9,
              2 * n * rb / s_pk / 1e9 / memcpy_gbs);

  for (int i = 2; i < argc; ++i) {
    const auto t0 = Clock::now();
    auto tok = engram::Tokenizer::Load(argv[i]);
    const auto t1 = Clock::now();
    if (!tok.ok()) {
      std::fprintf(stderr, "%s\n", std::string(tok.status().message()).c_str());
      return 1;
    }
    engram::TokenMap m = engram::TokenMap::Build(*tok);
    const auto t2 = Clock::now();
    std::printf("\ntokenmap %s\n  %lld raw -> %lld compressed: parse %.1f ms, build %.1f ms (%.2f us per id)\n",
                argv[i], static_cast<long long>(m.raw_size()), static_cast<long long>(m.compressed_size()),
                std::chrono::duration<double, std::milli>(t1 - t0).count(),
                std::chrono::duration<double, std::milli>(t2 - t1).count(),
                std::chrono::duration<double, std::micro>(t2 - t1).count() / static_cast<double>(m.raw_size()));
  }
  return 0;
}
