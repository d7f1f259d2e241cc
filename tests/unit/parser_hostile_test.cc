// The checkpoint parsers (config.json, safetensors headers and files, tokenizer.json, the safetensors index) fed
// hostile files: deep nesting, wrong field types, huge values in error paths, FIFOs in a file's place and
// catastrophically backtracking regexes. Each must come back as an absl::Status naming the file and the field,
// promptly, without a crash, an abort or a hang.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <string>

#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/file_util.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::TempDir;

// Error messages carry at most ~100 characters of any untrusted value; allow the fixed text around it.
constexpr size_t kMaxMessage = 600;

std::string Nested(size_t depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

std::string ConfigText() { return testing::ReadFile(testing::DataPath("configs/small-two-layers.json")); }

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A minimal tokenizer.json with the given decoder (JSON text).
std::string TokenizerWith(const std::string& decoder, const std::string& vocab = R"({"a": 0, "b": 1})") {
  return R"({"model": {"type": "BPE", "vocab": )" + vocab + R"(}, "decoder": )" + decoder + "}";
}

// ---- Nesting depth and error excerpts ----

TEST(HostileJsonTest, DeepNestingInConfigIsRefused) {
  // The bad element is an array nested a million deep: printing it in the error recursed once per level.
  const std::string text =
      R"({"architectures": ["DeepseekV41ForCausalLM"], "engram_layer_ids": [1, )" + Nested(1'000'000) + "]}";
  auto c = ParseEngramConfig(text);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nested more than 128 levels"), std::string::npos) << c.status();
  auto plain = ParseEngramConfig(Nested(1'000'000));
  EXPECT_FALSE(plain.ok());
}

TEST(HostileJsonTest, DeepNestingInASafetensorsHeaderIsRefused) {
  const std::string header =
      R"({"w": {"dtype": "F8_E4M3", "shape": [)" + Nested(1'000'000) + R"(], "data_offsets": [0, 1]}})";
  auto h = ParseSafetensorsHeader("x.safetensors", header, 8 + header.size(), 8 + header.size() + 1, nullptr);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("x.safetensors"), std::string::npos) << h.status();
  EXPECT_NE(h.status().message().find("nested more than 128 levels"), std::string::npos) << h.status();
}

TEST(HostileJsonTest, DeepNestingInATokenizerIsRefused) {
  const std::string text = R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"id": )" +
                           Nested(1'000'000) + R"(, "content": "x"}]})";
  auto t = Tokenizer::Parse(text, "tok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tok.json: JSON nested more than 128 levels"), std::string::npos) << t.status();
  // Deeply nested Sequence decoders recurse in the parser too.
  std::string seq;
  for (int i = 0; i < 200'000; ++i) seq += R"({"type": "Sequence", "decoders": [)";
  seq += R"({"type": "Fuse"})";
  for (int i = 0; i < 200'000; ++i) seq += "]}";
  auto s = Tokenizer::Parse(TokenizerWith(seq), "tok.json");
  EXPECT_FALSE(s.ok());
}

TEST(HostileJsonTest, DeepNestingInTheIndexIsRefused) {
  TempDir dir;
  testing::WriteFile(dir / "config.json", ConfigText());
  testing::WriteFile(dir / "model.safetensors.index.json", R"({"weight_map": )" + Nested(1'000'000) + "}");
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("model.safetensors.index.json: JSON nested more than 128 levels"),
            std::string::npos)
      << ck.status();
}

TEST(HostileJsonTest, NestingUpToTheLimitAndBracketsInStringsAreFine) {
  // 127 levels inside the tokenizer's own 1 (the root object): exactly at the limit, still parsed.
  const std::string deep_ok = TokenizerWith("null", R"({"a": 0})");
  std::string text = deep_ok.substr(0, deep_ok.size() - 1) + R"(, "extra": )" + Nested(127) + "}";
  EXPECT_TRUE(Tokenizer::Parse(text, "tok.json").ok()) << Tokenizer::Parse(text, "tok.json").status();
  text = deep_ok.substr(0, deep_ok.size() - 1) + R"(, "extra": )" + Nested(128) + "}";
  EXPECT_FALSE(Tokenizer::Parse(text, "tok.json").ok());
  // Brackets and escaped quotes inside strings do not count.
  const std::string piece = std::string(1000, '[') + "\\\"" + std::string(1000, '{');
  auto t = Tokenizer::Parse(TokenizerWith("null", R"({")" + piece + R"(": 0})"), "tok.json");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->IdToToken(0)->size(), 2001u);
}

TEST(HostileJsonTest, HugeValuesAreExcerptedInErrors) {
  const std::string huge(1'000'000, 'q');
  // config.json: an unknown architecture, a huge non-integer field.
  json cfg = json::parse(ConfigText());
  cfg["architectures"] = {huge};
  auto c = ParseEngramConfig(cfg.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_LT(c.status().message().size(), kMaxMessage) << c.status().message().substr(0, 300);
  cfg = json::parse(ConfigText());
  cfg["engram_n_heads"] = huge;
  c = ParseEngramConfig(cfg.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("engram_n_heads"), std::string::npos);
  EXPECT_LT(c.status().message().size(), kMaxMessage) << c.status().message().substr(0, 300);
  // safetensors: a huge dtype string, a huge tensor name.
  json h = {{"w", {{"dtype", huge}, {"shape", {1}}, {"data_offsets", {0, 1}}}}};
  auto r = ParseSafetensorsHeader("x.safetensors", h.dump(), 100, 101, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown dtype"), std::string::npos);
  EXPECT_LT(r.status().message().size(), kMaxMessage) << r.status().message().substr(0, 300);
  h = {{huge, {{"dtype", "F4"}, {"shape", {1}}, {"data_offsets", {0, 1}}}}};
  r = ParseSafetensorsHeader("x.safetensors", h.dump(), 100, 101, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(r.status().message().size(), kMaxMessage) << r.status().message().substr(0, 300);
  // tokenizer.json: a malformed added token holding a huge array.
  json tok = json::parse(TokenizerWith("null"));
  tok["added_tokens"] = {{{"id", json::array()}, {"content", huge}}};
  for (int i = 0; i < 100'000; ++i) tok["added_tokens"][0]["id"].push_back(i);
  auto t = Tokenizer::Parse(tok.dump(), "tok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("malformed added_tokens entry"), std::string::npos);
  EXPECT_LT(t.status().message().size(), kMaxMessage) << t.status().message().substr(0, 300);
}

// ---- Type errors become statuses naming the file and the field ----

TEST(HostileJsonTest, StripDecoderWithAStringStartIsAnError) {
  auto t = Tokenizer::Parse(TokenizerWith(R"({"type": "Strip", "content": " ", "start": "x", "stop": 0})"), "tok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tok.json"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("`start`"), std::string::npos) << t.status();
  t = Tokenizer::Parse(TokenizerWith(R"({"type": "Strip", "content": " ", "start": 1, "stop": [2]})"), "tok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("`stop`"), std::string::npos) << t.status();
  t = Tokenizer::Parse(TokenizerWith(R"({"type": "Strip", "content": " ", "start": 18446744073709551615, "stop": 0})"),
                       "tok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("does not fit in int64"), std::string::npos) << t.status();
  // Well-typed Strip still works.
  t = Tokenizer::Parse(TokenizerWith(R"({"type": "Strip", "content": "a", "start": 1, "stop": 0})", R"({"aab": 0})"),
                       "tok.json");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->Decode(0).text, "ab");
}

TEST(HostileJsonTest, WrongTypesEverywhereInTheTokenizerAreStatuses) {
  const char* bad[] = {
      R"([])",
      R"({"model": []})",
      R"({"model": {"vocab": 3}})",
      R"({"model": {"vocab": {"a": "zero"}}})",
      R"({"model": {"vocab": {"a": 18446744073709551615}}})",
      R"({"model": {"vocab": [["a", 0], 3]}})",
      R"({"model": {"vocab": {"a": 0}}, "added_tokens": [3]})",
      R"({"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": "1", "content": "x"}]})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": 3})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": 3}})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Sequence", "decoders": {"type": "Fuse"}}})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Replace", "pattern": "x", "content": "y"}})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Replace", "pattern": {"Regex": 3}}})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Replace", "pattern": {"Regex": "("}}})",
      R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Nope"}})",
  };
  for (const char* text : bad) {
    auto t = Tokenizer::Parse(text, "tok.json");
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_NE(t.status().message().find("tok.json"), std::string::npos) << text << " -> " << t.status();
  }
}

TEST(HostileJsonTest, IntegersOutsideInt64InConfigNameTheField) {
  json cfg = json::parse(ConfigText());
  cfg["engram_head_dim"] = 18446744073709551584ull;  // would wrap to -32
  auto c = ParseEngramConfig(cfg.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("`engram_head_dim` = 18446744073709551584 does not fit in int64"),
            std::string::npos)
      << c.status();
  cfg = json::parse(ConfigText());
  cfg["engram_num_embeddings"] = {8214, 18446744073709551615ull};
  c = ParseEngramConfig(cfg.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("engram_num_embeddings[1]"), std::string::npos) << c.status();
}

TEST(HostileJsonTest, IndexWithWrongTypesIsAnError) {
  TempDir dir;
  testing::WriteFile(dir / "config.json", ConfigText());
  for (const char* text : {R"([])", R"({"weight_map": []})", R"({"weight_map": {"a": 3}})",
                           R"({"weight_map": {"a": "../x.safetensors"}})", R"({"weight_map": {"a": "x.safeten)"}) {
    testing::WriteFile(dir / "model.safetensors.index.json", text);
    auto ck = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ck.ok()) << text;
    EXPECT_NE(ck.status().message().find("model.safetensors.index.json"), std::string::npos)
        << text << " -> " << ck.status();
  }
}

TEST(HostileJsonTest, SafetensorsHeaderEdgeCases) {
  // data_start past the end of the file (only reachable through the exposed parser): no wrap-around.
  json h = {{"w", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {0, 1}}}}};
  EXPECT_FALSE(ParseSafetensorsHeader("x.safetensors", h.dump(), 200, 100, nullptr).ok());
  // A shape with a million dimensions of 1.
  json shape = json::array();
  for (int i = 0; i < 1'000'000; ++i) shape.push_back(1);
  h = {{"w", {{"dtype", "U8"}, {"shape", shape}, {"data_offsets", {0, 1}}}}};
  auto r = ParseSafetensorsHeader("x.safetensors", h.dump(), 100, 101, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("dimensions"), std::string::npos) << r.status();
}

// ---- FIFOs and other non-regular files ----

// Runs `fn` on its own thread. The parsers return at once; code that blocks in open() on the FIFO would never
// return, so after a generous wait the test fails and opens the FIFO for writing to release the thread. This
// is a watchdog against a hang, not a timing assertion.
absl::Status NoHang(const std::string& fifo, std::function<absl::Status()> fn) {
  auto fut = std::async(std::launch::async, std::move(fn));
  if (fut.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "blocked opening the FIFO " << fifo;
    int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    absl::Status st = fut.get();
    if (w >= 0) ::close(w);
    return st;
  }
  return fut.get();
}

void ExpectNotRegular(const absl::Status& st, const std::string& path) {
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(path), std::string::npos) << st;
  EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st;
}

TEST(HostileFileTest, FifosAreRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ExpectNotRegular(NoHang(fifo, [&] { return ReadSmallFile(fifo).status(); }), fifo);
  ExpectNotRegular(NoHang(fifo, [&] { return LoadEngramConfig(fifo).status(); }), fifo);
  ExpectNotRegular(NoHang(fifo, [&] { return Tokenizer::Load(fifo).status(); }), fifo);
  ExpectNotRegular(NoHang(fifo, [&] { return SafetensorsFile::Open(fifo).status(); }), fifo);
}

TEST(HostileFileTest, FifosInACheckpointAreRefusedWithoutBlocking) {
  TempDir dir;
  // config.json as a FIFO.
  ASSERT_EQ(::mkfifo((dir / "config.json").c_str(), 0600), 0);
  ExpectNotRegular(NoHang(dir / "config.json", [&] { return Checkpoint::Open(dir.path()).status(); }),
                   dir / "config.json");
  ASSERT_EQ(::unlink((dir / "config.json").c_str()), 0);
  testing::WriteFile(dir / "config.json", ConfigText());
  // A shard found by listing the directory.
  ASSERT_EQ(::mkfifo((dir / "a.safetensors").c_str(), 0600), 0);
  ExpectNotRegular(NoHang(dir / "a.safetensors", [&] { return Checkpoint::Open(dir.path()).status(); }),
                   dir / "a.safetensors");
  // A shard named by the index.
  testing::WriteFile(dir / "model.safetensors.index.json", R"({"weight_map": {"w": "a.safetensors"}})");
  ExpectNotRegular(NoHang(dir / "a.safetensors", [&] { return Checkpoint::Open(dir.path()).status(); }),
                   dir / "a.safetensors");
  // The index itself.
  ASSERT_EQ(::unlink((dir / "model.safetensors.index.json").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir / "model.safetensors.index.json").c_str(), 0600), 0);
  ExpectNotRegular(NoHang(dir / "model.safetensors.index.json", [&] { return Checkpoint::Open(dir.path()).status(); }),
                   dir / "model.safetensors.index.json");
}

TEST(HostileFileTest, SymlinksToRegularFilesStillWork) {
  // Hugging Face caches link each file of a snapshot to a blob.
  TempDir dir;
  std::filesystem::create_directory(dir / "blobs");
  std::filesystem::create_directory(dir / "snapshot");
  testing::WriteFile(dir / "blobs/cfg", ConfigText());
  std::filesystem::create_symlink("../blobs/cfg", dir / "snapshot/config.json");
  auto c = LoadEngramConfig(dir / "snapshot/config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  const std::string header = R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})";
  testing::WriteFile(dir / "blobs/st", Le64(header.size()) + header + "ab");
  std::filesystem::create_symlink("../blobs/st", dir / "snapshot/model.safetensors");
  auto f = SafetensorsFile::Open(dir / "snapshot/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  char buf[2];
  ASSERT_TRUE((*f)->ReadRange(*(*f)->Find("w"), 0, buf, 2).ok());
  EXPECT_EQ(std::string(buf, 2), "ab");
  // A symlink to a FIFO is refused like the FIFO.
  ASSERT_EQ(::mkfifo((dir / "blobs/fifo").c_str(), 0600), 0);
  std::filesystem::create_symlink("../blobs/fifo", dir / "snapshot/tokenizer.json");
  ExpectNotRegular(
      NoHang(dir / "blobs/fifo", [&] { return Tokenizer::Load(dir / "snapshot/tokenizer.json").status(); }),
      dir / "snapshot/tokenizer.json");
  // A directory is not a file either.
  ExpectNotRegular(ReadSmallFile(dir / "blobs").status(), dir / "blobs");
}

// ---- Regex work is bounded ----

TEST(HostileRegexTest, CatastrophicBacktrackingFailsTheLoad) {
  const std::string decoder = R"({"type": "Replace", "pattern": {"Regex": "^(x+x+)+y$"}, "content": "z"})";
  const std::string vocab = R"({"a": 0, ")" + std::string(30, 'x') + R"(": 1})";
  auto t = Tokenizer::Parse(TokenizerWith(decoder, vocab), "tok.json");
  ASSERT_FALSE(t.ok()) << "a 30-character token against ^(x+x+)+y$ must hit ICU's limits";
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
  EXPECT_NE(t.status().message().find("tok.json: id 1: Replace decoder regex `^(x+x+)+y$`"), std::string::npos)
      << t.status();
  EXPECT_NE(t.status().message().find("limit"), std::string::npos) << t.status();
  // A long pattern is excerpted in the message.
  const std::string long_decoder =
      R"({"type": "Replace", "pattern": {"Regex": "^(x+x+)+y$|)" + std::string(5000, 'q') + R"("}, "content": ""})";
  t = Tokenizer::Parse(TokenizerWith(long_decoder, vocab), "tok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_LT(t.status().message().size(), kMaxMessage) << t.status().message().substr(0, 300);
}

TEST(HostileRegexTest, OrdinaryRegexDecodersStillDecode) {
  const std::string decoder = R"({"type": "Replace", "pattern": {"Regex": "_+"}, "content": " "})";
  auto t = Tokenizer::Parse(TokenizerWith(decoder, R"({"a__b_c": 0, "d": 1})"), "tok.json");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->Decode(0).text, "a b c");
  EXPECT_FALSE(t->Decode(0).lossy);
  EXPECT_EQ(t->Decode(1).text, "d");
}

}  // namespace
}  // namespace engram
