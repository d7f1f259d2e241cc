// Synthetic checkpoints (tools/synthetic.h): the known model geometries, the regions of a sparse table, and the
// checkpoint directory itself (config.json, the tokenizer files, the shards, the index and the pattern file).
#include "tools/synthetic.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "model/config.h"
#include "model/file_util.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/synthetic_shard.h"

namespace engram::tools {

using nlohmann::json;
using synthetic_internal::Kind;
using synthetic_internal::PlannedTensor;
using synthetic_internal::WriteShard;

std::vector<std::string> KnownModels() { return {"deepseek-v4.1-flash"}; }

absl::StatusOr<SyntheticSpec> LikeModel(const std::string& name) {
  SyntheticSpec s;
  if (name == "deepseek-v4.1-flash") {
    // DeepSeek-V4.1-Flash's config.json: engram_layer_ids, engram_n_heads, engram_max_ngram_size, engram_head_dim,
    // engram_vocab_size, hidden_size, hc_mult.
    s.layers = {1, 14};
    s.heads = 8;
    s.max_ngram = 4;
    s.head_dim = 256;
    s.engram_vocab_size = 16000000;
    s.hidden = 5120;
    s.hc_mult = 4;
  } else {
    std::string known;
    for (const auto& k : KnownModels()) absl::StrAppend(&known, known.empty() ? "" : ", ", k);
    return absl::InvalidArgumentError(absl::StrCat("no geometry is known for '", name, "' (known: ", known, ")"));
  }
  s.sparse = true;
  s.shards = static_cast<int64_t>(s.layers.size());
  return s;
}

std::vector<PatternRegion> SparsePatternRegions(const std::vector<int64_t>& rows, int64_t layer,
                                                const std::vector<int64_t>& column_offsets, int64_t head_dim) {
  const int64_t n = rows[static_cast<size_t>(layer)], half = kPatternRegionRows / 2;
  const uint64_t record = static_cast<uint64_t>(head_dim + head_dim / 32);
  uint64_t before = 0;  // records of the earlier layers in a TP 1 segment
  for (int64_t l = 0; l < layer; ++l) before += static_cast<uint64_t>(rows[static_cast<size_t>(l)]) * record;
  std::vector<PatternRegion> want;
  auto around = [&](int64_t row, std::string why) {
    want.push_back({std::max<int64_t>(0, row - half), std::min<int64_t>(n, row + half), std::move(why)});
  };
  want.push_back({0, std::min<int64_t>(n, kPatternRegionRows), "first rows"});
  want.push_back({std::max<int64_t>(0, n - kPatternRegionRows), n, "last rows"});
  for (size_t c = 1; c < column_offsets.size(); ++c) around(column_offsets[c], absl::StrCat("column ", c, " starts"));
  for (int k = 31; k <= 36; ++k) {
    const uint64_t at = uint64_t{1} << k;
    // The row whose record, or whose weight bytes, hold byte 2^k.
    if (at >= before && (at - before) / record < static_cast<uint64_t>(n)) {
      around(static_cast<int64_t>((at - before) / record), absl::StrCat("record bytes cross 2^", k));
    }
    if (at / static_cast<uint64_t>(head_dim) < static_cast<uint64_t>(n)) {
      around(static_cast<int64_t>(at / static_cast<uint64_t>(head_dim)), absl::StrCat("weight bytes cross 2^", k));
    }
  }
  std::sort(want.begin(), want.end(),
            [](const PatternRegion& a, const PatternRegion& b) { return a.row_begin < b.row_begin; });
  std::vector<PatternRegion> out;
  for (auto& r : want) {
    if (r.row_end <= r.row_begin) continue;
    if (!out.empty() && r.row_begin <= out.back().row_end) {  // overlapping or touching: one region
      out.back().row_end = std::max(out.back().row_end, r.row_end);
      absl::StrAppend(&out.back().why, "; ", r.why);
    } else {
      out.push_back(std::move(r));
    }
  }
  return out;
}

absl::StatusOr<SyntheticResult> WriteSyntheticCheckpoint(const SyntheticSpec& spec) {
  const auto t0 = std::chrono::steady_clock::now();
  if (spec.out_dir.empty()) return absl::InvalidArgumentError("--out is required");
  if (spec.shards < 1) return absl::InvalidArgumentError("--shards must be >= 1");
  if (::mkdir(spec.out_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat(spec.out_dir, ": cannot create: ", std::strerror(errno)));
  }
  const int threads =
      spec.threads > 0 ? spec.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  SyntheticResult res;
  // Shards of an earlier checkpoint in the same directory would be read with this one's (another file count leaves
  // them in place, and the index of the earlier one): removed first.
  if (DIR* d = ::opendir(spec.out_dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind("model", 0) == 0 && (n.find(".safetensors") != std::string::npos)) {
        ::unlink((spec.out_dir + "/" + n).c_str());
      }
    }
    ::closedir(d);
  }

  const std::string tok_text = SyntheticTokenizerJson(spec.seed);
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Parse(tok_text, "synthetic tokenizer"));
  TokenMap map = TokenMap::Build(tok);
  res.compressed_vocab = map.compressed_size();
  res.raw_vocab = map.raw_size();

  // engram_vocab_size sets the prime range: every column has about that many rows.
  const int64_t n_cols = (spec.max_ngram - 1) * spec.heads;
  const int64_t rec = spec.head_dim + spec.head_dim / 32;
  const double rows_total = spec.table_mib * 1048576.0 / static_cast<double>(rec);
  int64_t vocab_engram = spec.engram_vocab_size > 0
                             ? spec.engram_vocab_size
                             : static_cast<int64_t>(rows_total / static_cast<double>(spec.layers.size() * n_cols));
  vocab_engram = std::max<int64_t>(vocab_engram, res.compressed_vocab + 1);
  res.engram_vocab_size = vocab_engram;
  auto primes = EngramPrimes(spec.layers, spec.max_ngram, spec.heads, vocab_engram);
  std::vector<int64_t> num_embeddings;
  for (const auto& p : primes) {
    int64_t s = 0;
    for (int64_t v : p) s += v;
    num_embeddings.push_back(s);
  }

  json cfg = {{"architectures", {"DeepseekV41ForCausalLM"}},
              {"model_type", "deepseek_v41"},
              {"engram_layer_ids", spec.layers},
              {"engram_num_embeddings", num_embeddings},
              {"engram_max_ngram_size", spec.max_ngram},
              {"engram_n_heads", spec.heads},
              {"engram_head_dim", spec.head_dim},
              {"engram_vocab_size", vocab_engram},
              {"engram_compressed_vocab_size", res.compressed_vocab},
              {"engram_pad_token_id", res.raw_vocab - 2},  // <|pad|>
              {"hidden_size", spec.hidden},
              {"hc_mult", spec.hc_mult},
              {"num_hidden_layers", *std::max_element(spec.layers.begin(), spec.layers.end()) + 1},
              {"vocab_size", res.raw_vocab},
              {"rms_norm_eps", 1e-6},
              {"torch_dtype", "bfloat16"},
              {"quantization_config",
               {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"}, {"weight_block_size", {32, 32}}}}};
  ASSIGN_OR_RETURN(EngramConfig parsed, ParseEngramConfig(cfg.dump()));
  ASSIGN_OR_RETURN(Layout layout, Layout::Build(parsed));  // checks the primes against num_embeddings
  res.table_bytes = static_cast<uint64_t>(layout.table_bytes());

  RETURN_IF_ERROR(WriteFileAtomic(spec.out_dir + "/config.json", cfg.dump(2) + "\n"));
  RETURN_IF_ERROR(WriteFileAtomic(spec.out_dir + "/tokenizer.json", tok_text));
  json tok_cfg = {{"bos_token", "<|begin_of_text|>"},
                  {"eos_token", "<|end_of_text|>"},
                  {"pad_token", "<|pad|>"},
                  {"tokenizer_class", "PreTrainedTokenizerFast"},
                  {"model_max_length", 131072}};
  RETURN_IF_ERROR(WriteFileAtomic(spec.out_dir + "/tokenizer_config.json", tok_cfg.dump(2) + "\n"));

  // Tensors, layers spread round-robin over the shard files.
  std::vector<std::vector<PlannedTensor>> files(
      static_cast<size_t>(std::min<int64_t>(spec.shards, static_cast<int64_t>(spec.layers.size()))));
  const std::string prefix = spec.model_prefix ? "model." : "";
  const int64_t kv_rows = spec.hidden * (spec.hc_mult + 1), kv_cols = n_cols * spec.head_dim;
  json pattern_layers = json::array();
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    const std::string base = absl::StrCat("layers.", spec.layers[l], ".engram.");
    const int64_t rows = num_embeddings[l];
    std::vector<PatternRegion> regions;
    if (spec.sparse) {
      regions = SparsePatternRegions(num_embeddings, static_cast<int64_t>(l), layout.offsets(static_cast<int64_t>(l)),
                                     spec.head_dim);
      json jr = json::array();
      for (const auto& r : regions) jr.push_back({{"row_begin", r.row_begin}, {"row_end", r.row_end}, {"why", r.why}});
      pattern_layers.push_back({{"layer_id", spec.layers[l]}, {"rows", rows}, {"regions", jr}});
    }
    auto add = [&](const std::string& n, const char* dtype, std::vector<int64_t> shape, Kind kind, int64_t esize,
                   int64_t row_bytes = 0) {
      uint64_t bytes = static_cast<uint64_t>(esize);
      for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
      PlannedTensor t;
      t.name = prefix + base + n;
      t.canonical = base + n;
      t.dtype = dtype;
      t.shape = std::move(shape);
      t.kind = kind;
      t.bytes = bytes;
      if (spec.sparse && row_bytes > 0) {  // a layer table: only the pattern regions hold data
        for (const auto& r : regions) {
          t.ranges.push_back({static_cast<uint64_t>(r.row_begin) * static_cast<uint64_t>(row_bytes),
                              static_cast<uint64_t>(r.row_end) * static_cast<uint64_t>(row_bytes)});
        }
      }
      files[l % files.size()].push_back(std::move(t));
    };
    add("embed.weight", "F8_E4M3", {rows, spec.head_dim}, Kind::kE4M3, 1, spec.head_dim);
    add("embed.scale", "F8_E8M0", {rows, spec.head_dim / 32}, Kind::kScale, 1, spec.head_dim / 32);
    add("wkv.weight", "F8_E4M3", {kv_rows, kv_cols}, Kind::kE4M3, 1);
    add("wkv.scale", "F8_E8M0", {(kv_rows + 31) / 32, (kv_cols + 31) / 32}, Kind::kScale, 1);
    add("q_weight", "BF16", {spec.hc_mult, spec.hidden}, Kind::kBf16, 2);
    add("k_weight", "BF16", {spec.hc_mult, spec.hidden}, Kind::kBf16, 2);
  }
  json weight_map = json::object();
  const int64_t n_files = static_cast<int64_t>(files.size());
  for (int64_t f = 0; f < n_files; ++f) {
    const std::string name =
        n_files == 1 ? "model.safetensors" : absl::StrFormat("model-%05d-of-%05d.safetensors", f + 1, n_files);
    RETURN_IF_ERROR(WriteShard(spec.out_dir + "/" + name, files[static_cast<size_t>(f)], spec.seed, threads,
                               &res.file_bytes, &res.written_bytes));
    for (const auto& t : files[static_cast<size_t>(f)]) weight_map[t.name] = name;
  }
  const std::string pattern_path = spec.out_dir + "/" + kPatternFileName;
  if (spec.sparse) {
    json pattern = {
        {"generator", "engram-mkckpt"},
        {"seed", spec.seed},
        {"note", "rows outside these regions of each layer's embed.weight / embed.scale are holes (zero rows)"},
        {"layers", pattern_layers}};
    RETURN_IF_ERROR(WriteFileAtomic(pattern_path, pattern.dump(1) + "\n"));
  } else {
    ::unlink(pattern_path.c_str());  // a dense checkpoint written over a sparse one
  }
  if (n_files > 1) {
    json index = {{"metadata", {{"total_size", res.file_bytes}}}, {"weight_map", weight_map}};
    RETURN_IF_ERROR(WriteFileAtomic(spec.out_dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace engram::tools
