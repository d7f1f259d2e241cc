// The tokenizer.json of a synthetic checkpoint (tools/synthetic.h): a byte-level BPE vocabulary of the GPT-2 byte
// alphabet, words in several spellings that compress together, a seed-dependent tail and four special tokens.
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tools/synthetic.h"
#include "tools/synthetic_shard.h"

namespace engram::tools {

using nlohmann::json;
using synthetic_internal::SplitMix;

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

}  // namespace engram::tools
