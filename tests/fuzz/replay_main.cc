// A main() for the fuzz targets that needs no libFuzzer (any compiler, the CI run): replays every seed file given
// (files, or directories of files), then runs `--runs` inputs made by mutating the seeds with a PRNG seeded by
// `--seed`, so that a run is deterministic and reproducible. A crash, abort or uncaught exception ends the process
// abnormally, failing the test; the input that caused it is first written to `fuzz-crash-<pid>.bin` in the current
// directory (replay it with `TARGET fuzz-crash-<pid>.bin`, or with the libFuzzer binary).
//
//   fuzz_tokenizer [--runs N] [--seed S] [--max-len BYTES] PATH...
//
// The mutations are structure-aware only in a small way: besides bit flips, byte edits, deletions, duplications and
// splices of two seeds, they insert JSON fragments that the parsers treat specially (brackets, huge and negative
// numbers, wrong types, the field names of the three formats). Single-threaded.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_target.h"

namespace {

// The input being run, for the crash handler (which may only use async-signal-safe calls).
const std::string* g_current = nullptr;

void OnCrash(int sig) {
  if (g_current != nullptr) {
    char name[64];
    std::snprintf(name, sizeof(name), "fuzz-crash-%d.bin", static_cast<int>(::getpid()));
    int fd = ::open(name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      size_t done = 0;
      while (done < g_current->size()) {
        ssize_t n = ::write(fd, g_current->data() + done, g_current->size() - done);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      ::close(fd);
      static const char kMsg[] = "fuzz: crashing input written to fuzz-crash-<pid>.bin\n";
      (void)!::write(2, kMsg, sizeof(kMsg) - 1);
    }
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void InstallCrashHandler() {
  // An alternate stack, so that a stack overflow can still be reported.
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = OnCrash;
  sa.sa_flags = SA_ONSTACK;
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) ::sigaction(sig, &sa, nullptr);
}

void Run(const std::string& input) {
  g_current = &input;
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  g_current = nullptr;
}

const char* const kFragments[] = {
    "[",
    "]",
    "{",
    "}",
    "\"",
    ",",
    ":",
    "\\",
    "\\u0000",
    "\\ud800",
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1e400",
    "-0",
    "1.5",
    "18446744073709551615",
    "9223372036854775808",
    "-9223372036854775809",
    "4294967296",
    "\"x\"",
    "[]",
    "{}",
    "[[[[[[[[",
    "]]]]]]]]",
    "\"type\"",
    "\"Sequence\"",
    "\"decoders\"",
    "\"Replace\"",
    "\"Regex\"",
    "\"String\"",
    "\"Strip\"",
    "\"start\"",
    "\"stop\"",
    "\"content\"",
    "\"ByteLevel\"",
    "\"ByteFallback\"",
    "\"Metaspace\"",
    "\"Fuse\"",
    "\"replacement\"",
    "\"prepend_scheme\"",
    "\"model\"",
    "\"vocab\"",
    "\"added_tokens\"",
    "\"id\"",
    "\"decoder\"",
    "\"<0xFF>\"",
    "\"(a+)+$\"",
    "\"dtype\"",
    "\"shape\"",
    "\"data_offsets\"",
    "\"__metadata__\"",
    "\"F8_E4M3\"",
    "\"BF16\"",
    "\"U8\"",
    "\"architectures\"",
    "\"DeepseekV41ForCausalLM\"",
    "\"text_config\"",
    "\"engram_layer_ids\"",
    "\"engram_num_embeddings\"",
    "\"engram_n_heads\"",
    "\"engram_head_dim\"",
    "\"engram_max_ngram_size\"",
    "\"engram_vocab_size\"",
    "\"hc_mult\"",
    "\"\xe2\x96\x81\"",
    "\"\xc4\xa0\"",
};

std::string Mutate(std::string s, const std::vector<std::string>& seeds, std::mt19937_64& rng, size_t max_len) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 7) {
      case 0:  // flip a bit
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // overwrite a byte with a JSON-significant or random one
        if (!s.empty()) {
          static const char kJson[] = "{}[]\":,0123456789-.eE\\ ntfu";
          s[pick(s.size())] = rng() % 2 ? kJson[pick(sizeof(kJson) - 1)] : static_cast<char>(rng());
        }
        break;
      case 2: {  // delete a range
        if (s.empty()) break;
        size_t at = pick(s.size());
        s.erase(at, 1 + pick(std::min<size_t>(s.size() - at, 64)));
        break;
      }
      case 3: {  // duplicate a range
        if (s.empty()) break;
        size_t at = pick(s.size()), len = 1 + pick(std::min<size_t>(s.size() - at, 256));
        s.insert(pick(s.size() + 1), s.substr(at, len));
        break;
      }
      case 4:  // insert a fragment
      case 5: s.insert(pick(s.size() + 1), kFragments[pick(sizeof(kFragments) / sizeof(kFragments[0]))]); break;
      case 6: {  // splice with another seed
        const std::string& o = seeds[pick(seeds.size())];
        size_t cut = pick(s.size() + 1), from = pick(o.size() + 1);
        s = s.substr(0, cut) + o.substr(from);
        break;
      }
    }
  }
  if (s.size() > max_len) s.resize(max_len);
  return s;
}

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  long runs = 1000;
  unsigned long long seed = 1;
  size_t max_len = 1 << 16;
  std::vector<std::string> seeds;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc) {
      runs = std::atol(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--max-len" && i + 1 < argc) {
      max_len = static_cast<size_t>(std::atol(argv[++i]));
    } else if (std::filesystem::is_directory(a)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(a)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());  // directory order is not deterministic
      for (const auto& f : files) seeds.push_back(ReadAll(f));
    } else if (std::filesystem::is_regular_file(a)) {
      seeds.push_back(ReadAll(a));
    } else {
      std::fprintf(stderr, "usage: %s [--runs N] [--seed S] [--max-len BYTES] FILE_OR_DIR...\n", argv[0]);
      return 2;
    }
  }
  if (seeds.empty()) seeds.push_back("{}");
  InstallCrashHandler();
  for (const auto& s : seeds) Run(s);
  std::mt19937_64 rng(seed);
  for (long r = 0; r < runs; ++r) {
    std::string input = Mutate(seeds[static_cast<size_t>(rng() % seeds.size())], seeds, rng, max_len);
    Run(input);
  }
  std::printf("fuzz: %zu seeds and %ld mutations (seed %llu) ran cleanly\n", seeds.size(), runs, seed);
  return 0;
}
