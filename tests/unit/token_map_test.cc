// Token map against goldens made by the Hugging Face tokenizers library (tests/data/goldens/tokenmap-*.bin, from
// tests/data/golden_tokenmap.js), entry by entry; normaliser behaviour; refusals.
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/normalize.h"
#include "model/token_map.h"
#include "model/tokenizer.h"
#include "tests/test_util.h"

namespace engram {
namespace {

std::vector<int32_t> ReadGolden(const std::string& name) {
  std::string raw = testing::ReadFile(testing::DataPath("goldens/tokenmap-" + name + ".bin"));
  std::vector<int32_t> out(raw.size() / 4);
  std::memcpy(out.data(), raw.data(), out.size() * 4);
  return out;
}

class GoldenTokenMapTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTokenMapTest, EqualsTheReferenceLibraryEntryByEntry) {
  auto tok = Tokenizer::Load(testing::DataPath("tokenizers/" + GetParam() + ".json"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  TokenMap map = TokenMap::Build(*tok);
  std::vector<int32_t> gold = ReadGolden(GetParam());
  ASSERT_EQ(map.raw_size(), static_cast<int64_t>(gold.size()));
  for (size_t i = 0; i < gold.size(); ++i) {
    ASSERT_EQ(map[static_cast<int64_t>(i)], gold[i])
        << "raw id " << i << " piece '" << tok->IdToToken(static_cast<int64_t>(i)).value_or("<none>") << "' key '"
        << TokenMapKey(*tok, static_cast<int64_t>(i)) << "'";
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, GoldenTokenMapTest,
                         ::testing::Values("bytelevel-mixed", "llama-bytefallback", "unigram-metaspace",
                                           "wordlevel-nodecoder"));

TEST(NormalizeTest, MergesCaseAccentsWidthAndSpace) {
  EXPECT_EQ(NormalizeEngramKey(" The"), "the");
  EXPECT_EQ(NormalizeEngramKey("THE"), "the");
  EXPECT_EQ(NormalizeEngramKey("Café"), "cafe");
  EXPECT_EQ(NormalizeEngramKey("Ｗｉｄｅ"), "wide");
  EXPECT_EQ(NormalizeEngramKey("ﬁle"), "file");
  EXPECT_EQ(NormalizeEngramKey("a \t\r\n b"), "a b");
  EXPECT_EQ(NormalizeEngramKey("   "), " ");  // a run of spaces collapses to one that survives the strip
  EXPECT_EQ(NormalizeEngramKey("\n"), " ");
  EXPECT_EQ(NormalizeEngramKey("\u00a0"), " ");   // NFKC makes it a space
  EXPECT_EQ(NormalizeEngramKey("\u3000x"), "x");  // ideographic space: NFKC space, then stripped
  EXPECT_EQ(NormalizeEngramKey("ΟΣ"), "οσ");      // per-code-point lowercase: no final sigma
  EXPECT_EQ(NormalizeEngramKey("İ"), "i");        // i + U+0307, then the mark is stripped
  EXPECT_EQ(NormalizeEngramKey("का"), "क");       // U+093E is a spacing mark (Mc): stripped too
  EXPECT_EQ(NormalizeEngramKey(""), "");
}

TEST(TokenMapTest, SizeMismatchNamesBothNumbers) {
  auto tok = Tokenizer::Load(testing::DataPath("tokenizers/bytelevel-mixed.json"));
  ASSERT_TRUE(tok.ok());
  TokenMap map = TokenMap::Build(*tok);
  EngramConfig cfg;
  cfg.compressed_vocab_size = map.compressed_size() + 1;
  auto st = map.CheckAgainst(cfg);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find(std::to_string(map.compressed_size()) + " ids"), std::string::npos) << st;
  EXPECT_NE(st.message().find(std::to_string(map.compressed_size() + 1)), std::string::npos) << st;
  EXPECT_NE(st.message().find("silently rehashed"), std::string::npos);
  cfg.compressed_vocab_size = map.compressed_size();
  EXPECT_TRUE(map.CheckAgainst(cfg).ok());
  cfg.pad_token_id = map.raw_size();
  EXPECT_FALSE(map.CheckAgainst(cfg).ok());
}

TEST(TokenMapTest, ShaOfLittleEndianBytes) {
  TokenMap m = TokenMap::FromIds({0, 1, 0, 2});
  EXPECT_EQ(m.compressed_size(), 3);
  EXPECT_EQ(m.Bytes(), std::string("\0\0\0\0\1\0\0\0\0\0\0\0\2\0\0\0", 16));
  // sha256 of the empty string and of "abc" (FIPS 180-4 examples) through the same code path
  EXPECT_EQ(TokenMap::FromIds({}).Sha256Hex(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(TokenizerTest, RefusesMalformedFiles) {
  struct Case {
    std::string json;
    std::string expect;
  } cases[] = {
      {"[]", "not a JSON object"},
      {"{}", "no `model` object"},
      {R"({"model": {"type": "BPE"}})", "no `vocab`"},
      {R"({"model": {"vocab": {"a": "x"}}})", "non-integer id"},
      {R"({"model": {"vocab": {"a": -4}}})", "out of range"},
      {R"({"model": {"vocab": {}}})", "empty vocabulary"},
      {R"({"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1}]})", "malformed added_tokens"},
      {R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "WordPiece"}})", "`WordPiece` is not supported"},
      {R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Replace", "pattern": {"Regex": "("}, "content": ""}})",
       "does not compile"},
  };
  for (const auto& c : cases) {
    auto t = Tokenizer::Parse(c.json, "tok.json");
    ASSERT_FALSE(t.ok()) << c.json;
    EXPECT_NE(t.status().message().find(c.expect), std::string::npos) << c.json << " -> " << t.status();
    EXPECT_NE(t.status().message().find("tok.json"), std::string::npos);
  }
  EXPECT_FALSE(Tokenizer::Load("/nonexistent/tokenizer.json").ok());
}

}  // namespace
}  // namespace engram
