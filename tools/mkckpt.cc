// engram-mkckpt: writes a synthetic DeepseekV41ForCausalLM checkpoint (see synthetic.h).
#include <iostream>

#include "absl/strings/str_format.h"
#include "tools/args.h"
#include "tools/synthetic.h"

int main(int argc, char** argv) {
  using engram::tools::Args;
  Args a;
  auto st = a.Parse(argc, argv, 1,
                    {"--out", "--table-mib", "--layers", "--heads", "--max-ngram", "--head-dim", "--hidden",
                     "--hc-mult", "--seed", "--shards", "--threads"},
                    {"--model-prefix", "--help"});
  if (!st.ok() || a.Has("--help") || !a.Has("--out")) {
    if (!st.ok()) std::cerr << "engram-mkckpt: " << st.message() << "\n";
    std::cerr << "usage: engram-mkckpt --out DIR [--table-mib N] [--layers 1,3] [--heads N] [--max-ngram N]\n"
                 "                     [--head-dim N] [--hidden N] [--hc-mult N] [--seed N] [--shards N]\n"
                 "                     [--model-prefix] [--threads N]\n";
    return a.Has("--help") && st.ok() ? 0 : 2;
  }
  engram::tools::SyntheticSpec spec;
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
    spec.layers = *l;
  }
  struct {
    const char* name;
    int64_t* field;
  } ints[] = {{"--heads", &spec.heads},   {"--max-ngram", &spec.max_ngram}, {"--head-dim", &spec.head_dim},
              {"--hidden", &spec.hidden}, {"--hc-mult", &spec.hc_mult},     {"--shards", &spec.shards}};
  for (auto& i : ints) {
    auto v = a.GetInt(i.name, *i.field);
    if (!v.ok()) {
      std::cerr << "engram-mkckpt: " << v.status().message() << "\n";
      return 2;
    }
    *i.field = *v;
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
      "wrote %s: compressed vocab %d of %d raw ids, engram_vocab_size %d, tables %.1f MiB, files %.1f MiB in %.2f s "
      "(%.2f GiB/s)\n",
      spec.out_dir, r->compressed_vocab, r->raw_vocab, r->engram_vocab_size, r->table_bytes / 1048576.0,
      r->file_bytes / 1048576.0, r->seconds, r->file_bytes / 1073741824.0 / std::max(r->seconds, 1e-9));
  return 0;
}
