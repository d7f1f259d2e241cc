// engram-mkckpt: writes a synthetic DeepseekV41ForCausalLM checkpoint (see synthetic.h).
#include <algorithm>
#include <iostream>

#include "absl/strings/str_format.h"
#include "engram/version.h"
#include "tools/args.h"
#include "tools/synthetic.h"

int main(int argc, char** argv) {
  using engram::tools::Args;
  Args a;
  auto st = a.Parse(argc, argv, 1,
                    {"--out", "--table-mib", "--layers", "--heads", "--max-ngram", "--head-dim", "--hidden",
                     "--hc-mult", "--seed", "--shards", "--threads", "--like", "--engram-vocab-size"},
                    {"--model-prefix", "--sparse", "--help", "--version"});
  if (st.ok() && a.Has("--version")) {
    std::cout << "engram-mkckpt " << ENGRAM_VERSION_STRING << "\n";
    return 0;
  }
  if (!st.ok() || a.Has("--help") || !a.Has("--out")) {
    if (!st.ok()) std::cerr << "engram-mkckpt: " << st.message() << "\n";
    std::cerr
        << "usage: engram-mkckpt --out DIR [--table-mib N] [--layers 1,3] [--heads N] [--max-ngram N]\n"
           "                     [--head-dim N] [--hidden N] [--hc-mult N] [--engram-vocab-size N] [--sparse]\n"
           "                     [--seed N] [--shards N] [--model-prefix] [--threads N]\n"
           "       engram-mkckpt --out DIR --like deepseek-v4.1-flash [--layers 1] [--seed N] [--shards N]\n"
           "  --sparse: full tensor shapes, pattern rows in a few regions (engram-pattern.json), holes elsewhere\n"
           "       engram-mkckpt --version | --help\n"
           "  --like MODEL: that model's real geometry, sparse (--layers picks some of its layer ids)\n";
    return a.Has("--help") && st.ok() ? 0 : 2;
  }
  engram::tools::SyntheticSpec spec;
  if (a.Has("--like")) {
    for (const char* f :
         {"--table-mib", "--heads", "--max-ngram", "--head-dim", "--hidden", "--hc-mult", "--engram-vocab-size"}) {
      if (a.Has(f)) {
        std::cerr << "engram-mkckpt: " << f << " conflicts with --like (the model sets the geometry)\n";
        return 2;
      }
    }
    auto like = engram::tools::LikeModel(a.Get("--like"));
    if (!like.ok()) {
      std::cerr << "engram-mkckpt: --like: " << like.status().message() << "\n";
      return 2;
    }
    spec = *like;
  }
  spec.out_dir = a.Get("--out");
  try {
    spec.table_mib = std::stod(a.Get("--table-mib", "64"));
  } catch (...) {
    std::cerr << "engram-mkckpt: --table-mib wants a number\n";
    return 2;
  }
  if (a.Has("--layers")) {
    auto l = engram::tools::ParseIntList("--layers", a.Get("--layers"));
    if (!l.ok()) {
      std::cerr << "engram-mkckpt: " << l.status().message() << "\n";
      return 2;
    }
    if (a.Has("--like")) {
      for (int64_t id : *l) {
        if (std::find(spec.layers.begin(), spec.layers.end(), id) == spec.layers.end()) {
          std::cerr << "engram-mkckpt: --layers: " << id << " is not one of " << a.Get("--like")
                    << "'s Engram layers\n";
          return 2;
        }
      }
      // A layer's primes depend on every layer before it in the list: only a prefix of the model's layers keeps
      // the model's rows and primes.
      if (l->size() > spec.layers.size() || !std::equal(l->begin(), l->end(), spec.layers.begin())) {
        std::cerr << "engram-mkckpt: --layers: with --like, the first layers of the model in order (its prime "
                     "buckets depend on the layers before): e.g. --layers "
                  << spec.layers.front() << "\n";
        return 2;
      }
      spec.shards = static_cast<int64_t>(l->size());
    }
    spec.layers = *l;
  }
  spec.sparse = spec.sparse || a.Has("--sparse");
  struct {
    const char* name;
    int64_t* field;
  } ints[] = {{"--heads", &spec.heads},
              {"--max-ngram", &spec.max_ngram},
              {"--head-dim", &spec.head_dim},
              {"--hidden", &spec.hidden},
              {"--hc-mult", &spec.hc_mult},
              {"--shards", &spec.shards},
              {"--engram-vocab-size", &spec.engram_vocab_size}};
  for (auto& i : ints) {
    auto v = a.GetInt(i.name, *i.field);
    if (!v.ok()) {
      std::cerr << "engram-mkckpt: " << v.status().message() << "\n";
      return 2;
    }
    *i.field = *v;
  }
  if (spec.engram_vocab_size < 0) {
    std::cerr << "engram-mkckpt: --engram-vocab-size must be positive\n";
    return 2;
  }
  auto seed = a.GetInt("--seed", 1);
  auto threads = a.GetInt("--threads", 0);
  if (!seed.ok() || !threads.ok()) {
    std::cerr << "engram-mkckpt: --seed and --threads want integers\n";
    return 2;
  }
  spec.seed = static_cast<uint64_t>(*seed);
  spec.threads = static_cast<int>(*threads);
  spec.model_prefix = a.Has("--model-prefix");
  auto r = engram::tools::WriteSyntheticCheckpoint(spec);
  if (!r.ok()) {
    std::cerr << "engram-mkckpt: " << r.status().message() << "\n";
    return 1;
  }
  std::cout << absl::StrFormat(
      "wrote %s: compressed vocab %d of %d raw ids, engram_vocab_size %d, tables %.1f MiB, files %.1f MiB%s in %.2f s "
      "(%.2f GiB/s)\n",
      spec.out_dir, r->compressed_vocab, r->raw_vocab, r->engram_vocab_size, r->table_bytes / 1048576.0,
      r->file_bytes / 1048576.0,
      spec.sparse ? absl::StrFormat(" (sparse: %.1f MiB of data, the pattern in engram-pattern.json)",
                                    r->written_bytes / 1048576.0)
                  : std::string(),
      r->seconds, r->written_bytes / 1073741824.0 / std::max(r->seconds, 1e-9));
  return 0;
}
