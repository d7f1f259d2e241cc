// config.json parsing: both architectures, both pad spellings, text_config nesting, and every refusal.
#include <string>

#include "gtest/gtest.h"
#include "model/config.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;

json Base() { return json::parse(testing::ReadFile(testing::DataPath("configs/small-two-layers.json"))); }

std::string ErrorOf(const json& j) {
  auto c = ParseEngramConfig(j.dump());
  return c.ok() ? "" : std::string(c.status().message());
}

TEST(ConfigTest, ParsesEngramFields) {
  auto c = ParseEngramConfig(Base().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "DeepseekV41ForCausalLM");
  EXPECT_EQ(c->kind, ModelKind::kEngram);
  EXPECT_EQ(c->layer_ids, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c->n_cols(), 8);
  EXPECT_EQ(c->record_bytes(), 66);
  EXPECT_EQ(c->pad_token_id, 0);
}

TEST(ConfigTest, PadIdSpellingAndTextConfigNesting) {
  auto c = LoadEngramConfig(testing::DataPath("configs/nested-text-config.json"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->pad_token_id, 2);
  EXPECT_EQ(c->layer_ids, std::vector<int64_t>{5});
  EXPECT_EQ(c->max_ngram_size, 5);
}

TEST(ConfigTest, RecognisesQwenPle) {
  for (const char* arch : {"Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"}) {
    json j = {{"architectures", {arch}}, {"ple_layer_ids", {0, 2}}, {"hidden_size", 64}};
    auto c = ParseEngramConfig(j.dump());
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->kind, ModelKind::kPle);
    EXPECT_EQ(c->layer_ids, (std::vector<int64_t>{0, 2}));
  }
}

TEST(ConfigTest, ModelWithoutEngramLayersIsAClearError) {
  json j = Base();
  j["architectures"] = {"LlamaForCausalLM"};
  EXPECT_NE(ErrorOf(j).find("no n-gram embedding layers"), std::string::npos) << ErrorOf(j);
  j = Base();
  j.erase("engram_layer_ids");
  EXPECT_NE(ErrorOf(j).find("declares no Engram layers"), std::string::npos) << ErrorOf(j);
  j = Base();
  j["engram_layer_ids"] = json::array();
  EXPECT_NE(ErrorOf(j).find("declares no Engram layers"), std::string::npos);
}

TEST(ConfigTest, RefusesInsaneValues) {
  struct Case {
    const char* field;
    json value;
    const char* expect;
  } cases[] = {
      {"engram_head_dim", 100, "multiple of 32"},
      {"engram_head_dim", 0, "multiple of 32"},
      {"engram_max_ngram_size", 1, "engram_max_ngram_size"},
      {"engram_n_heads", 0, "engram_n_heads"},
      {"engram_compressed_vocab_size", 0, "engram_compressed_vocab_size"},
      {"engram_num_embeddings", {8214}, "has 1 entries for 2"},
      {"engram_num_embeddings", {8214, int64_t{1} << 31}, "hash ids are int32"},
      {"engram_layer_ids", {1, 1}, "listed twice"},
      {"engram_pad_token_id", -1, "< 0"},
      {"engram_n_heads", "8", "must be an integer"},
      {"engram_layer_ids", {1, "x"}, "list of integers"},
      {"hc_mult", 0, "hc_mult"},
  };
  for (const auto& c : cases) {
    json j = Base();
    j[c.field] = c.value;
    std::string err = ErrorOf(j);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.field << " -> '" << err << "'";
  }
  json j = Base();
  j.erase("engram_vocab_size");
  EXPECT_NE(ErrorOf(j).find("missing field `engram_vocab_size`"), std::string::npos);
  EXPECT_NE(ErrorOf("[1,2]").find("not a JSON object"), std::string::npos);
  EXPECT_FALSE(ParseEngramConfig("{not json").ok());
}

TEST(ConfigTest, MissingFileNamesThePath) {
  auto c = LoadEngramConfig("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace engram
