#include "tools/synthetic.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include "xxhash.h"

namespace engram::tools {
namespace {

using nlohmann::json;

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

enum class Kind { kE4M3, kScale, kBf16 };

uint8_t Shape(uint8_t b, Kind kind, uint64_t offset) {
  switch (kind) {
    case Kind::kE4M3: return (b & 0x7F) == 0x7F ? static_cast<uint8_t>(b - 1) : b;  // no NaN encodings
    case Kind::kScale: return static_cast<uint8_t>(115 + (b & 0x0F));               // 2^-12 .. 2^3
    case Kind::kBf16:
      // little-endian bf16: odd bytes hold sign + exponent: values of magnitude in [0.5, 2)
      return (offset & 1) ? static_cast<uint8_t>((b & 0x80) | 0x3F) : b;
  }
  return b;
}

void Fill(uint64_t seed, uint64_t tensor_hash, uint64_t offset, uint64_t n, Kind kind, uint8_t* dst) {
  uint64_t i = 0;
  while (i < n) {
    const uint64_t abs = offset + i;
    const uint64_t word = SplitMix(seed ^ tensor_hash ^ SplitMix(abs >> 3));
    for (uint64_t k = abs & 7; k < 8 && i < n; ++k, ++i) {
      dst[i] = Shape(static_cast<uint8_t>(word >> (8 * k)), kind, offset + i);
    }
  }
}

uint64_t NameHash(const std::string& name) { return XXH3_64bits(name.data(), name.size()); }

struct PlannedTensor {
  std::string name;       // as written
  std::string canonical;  // without "model."
  std::string dtype;
  std::vector<int64_t> shape;
  Kind kind = Kind::kE4M3;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // relative to the data start
  // Sparse: only these byte ranges [begin, end) of the tensor are written, the rest is a hole; empty: all of it.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

absl::Status WriteShard(const std::string& path, std::vector<PlannedTensor>& tensors, uint64_t seed, int threads,
                        uint64_t* file_bytes, uint64_t* written_bytes) {
  json header = json::object();
  uint64_t off = 0;
  for (auto& t : tensors) {
    t.offset = off;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes}}};
    off += t.bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"generator", "engram-mkckpt"}};
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  const uint64_t data_start = 8 + text.size();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xFF);
  head += text;
  if (::pwrite(fd, head.data(), head.size(), 0) != static_cast<ssize_t>(head.size())) {
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
  }
  // Chunks of every tensor, filled and written by a pool of threads.
  constexpr uint64_t kChunk = uint64_t{8} << 20;
  struct Chunk {
    const PlannedTensor* t;
    uint64_t begin, n;
  };
  std::vector<Chunk> chunks;
  for (const auto& t : tensors) {
    const std::vector<std::pair<uint64_t, uint64_t>> whole = {{0, t.bytes}};
    for (const auto& [begin, end] : t.ranges.empty() ? whole : t.ranges) {
      for (uint64_t b = begin; b < end; b += kChunk) chunks.push_back({&t, b, std::min(kChunk, end - b)});
    }
  }
  for (const auto& c : chunks) *written_bytes += c.n;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<int> err{0};
  auto worker = [&] {
    std::vector<uint8_t> buf(kChunk);
    for (size_t i = next++; i < chunks.size() && !failed; i = next++) {
      const Chunk& c = chunks[i];
      Fill(seed, NameHash(c.t->canonical), c.begin, c.n, c.t->kind, buf.data());
      uint64_t done = 0;
      while (done < c.n) {
        ssize_t w =
            ::pwrite(fd, buf.data() + done, c.n - done, static_cast<off_t>(data_start + c.t->offset + c.begin + done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          err = errno;
          failed = true;
          return;
        }
        done += static_cast<uint64_t>(w);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(worker);
  for (auto& th : pool) th.join();
  // A sparse tensor at the end of the file leaves it short of its header's claim: the size makes the holes.
  if (!failed && ::ftruncate(fd, static_cast<off_t>(data_start + off)) != 0) {
    err = errno;
    failed = true;
  }
  if (::close(fd) != 0 || failed) {
    return absl::ResourceExhaustedError(absl::StrCat(path, ": write failed: ", std::strerror(err ? err.load() : EIO)));
  }
  *file_bytes += data_start + off;
  return absl::OkStatus();
}

}  // namespace

uint8_t SyntheticByte(uint64_t seed, const std::string& tensor, uint64_t offset, bool is_scale, bool is_bf16) {
  uint8_t b;
  Fill(seed, NameHash(tensor), offset, 1, is_scale ? Kind::kScale : is_bf16 ? Kind::kBf16 : Kind::kE4M3, &b);
  return b;
}

std::string SyntheticTokenizerJson(uint64_t seed) {
  // GPT-2 byte-level alphabet first (ids 0..255), then words in several spellings that compress together.
  std::vector<std::string> bl(256);
  {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      int cp = printable ? b : 256 + extra++;
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      bl[static_cast<size_t>(b)] = s;
    }
  }
  auto piece = [&](const std::string& utf8) {
    std::string p;
    for (unsigned char c : utf8) p += bl[c];
    return p;
  };
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[bl[static_cast<size_t>(b)]] = b;
  static const char* kWords[] = {"the",    "of",     "and",   "to",     "in",     "memory",   "engram",  "table",
                                 "hash",   "token",  "model", "layer",  "share",  "node",     "replica", "segment",
                                 "gate",   "lookup", "prime", "row",    "cache",  "host",     "device",  "page",
                                 "shard",  "café",   "naïve", "résumé", "straße", "über",     "ﬁle",     "ｗｉｄｅ",
                                 "한국어", "日本語", "中文",  "σοφία",  "ΣΟΦΙΑ",  "İstanbul", "déjà",    "coöperate",
                                 "Ωmega",  "①",      "x²",    "\t",     "\n",     "\r\n",     "  ",      "\u00a0"};
  int64_t id = 256;
  uint64_t x = seed;
  for (const char* w : kWords) {
    std::string word = w;
    std::string upper = word, title = word;
    for (auto& c : upper) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 32 : c);
    if (!title.empty() && title[0] >= 'a' && title[0] <= 'z') title[0] = static_cast<char>(title[0] - 32);
    for (const std::string& v : {word, " " + word, title, " " + title, upper, " " + upper}) {
      std::string p = piece(v);
      if (!vocab.contains(p)) vocab[p] = id++;
    }
  }
  // A seed-dependent tail of two-letter pieces, so different seeds give different vocabularies.
  for (int i = 0; i < 64; ++i) {
    x = SplitMix(x);
    std::string v = {static_cast<char>('a' + x % 26), static_cast<char>('a' + (x >> 8) % 26)};
    if (x & 0x10000) v = " " + v;
    std::string p = piece(v);
    if (!vocab.contains(p)) vocab[p] = id++;
  }
  json added = json::array();
  for (const char* special : {"<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|image|>"}) {
    added.push_back({{"id", id++},
                     {"content", special},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  json tok = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", json::array()}}}};
  return tok.dump(1);
}

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
