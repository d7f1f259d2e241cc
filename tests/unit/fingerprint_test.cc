// A checkpoint's fingerprint is the identity of its exact files (model/checkpoint.h): a copy, a rewrite in place or
// a new revision with the same shapes gets another fingerprint, so a daemon never adopts or serves a segment
// published from other files; opening the same files twice gives the same fingerprint.
#include <fcntl.h>
#include <sys/stat.h>

#include <filesystem>

#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using testing::TempDir;

std::string Make(const std::string& dir, uint64_t seed) {
  tools::SyntheticSpec spec;
  spec.out_dir = dir;
  spec.table_mib = 1;
  spec.seed = seed;
  spec.threads = 1;
  EXPECT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  return dir;
}

uint64_t Fp(const std::string& dir) {
  auto c = Checkpoint::Open(dir);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? (*c)->Fingerprint() : 0;
}

TEST(FingerprintTest, StableForTheSameFiles) {
  TempDir t;
  const std::string a = Make(t / "a", 1);
  EXPECT_EQ(Fp(a), Fp(a));
}

TEST(FingerprintTest, ARewriteWithEqualShapesIsAnotherCheckpoint) {
  TempDir t;
  const std::string a = Make(t / "a", 1);
  const uint64_t before = Fp(a);
  Make(a, 2);  // a new revision written into the same directory: same config shapes, other rows
  EXPECT_NE(Fp(a), before);
}

TEST(FingerprintTest, AnotherDirectoryWithEqualShapesIsAnotherCheckpoint) {
  TempDir t;
  const std::string a = Make(t / "a", 1);
  const std::string b = t / "b";
  std::filesystem::copy(a, b, std::filesystem::copy_options::recursive);  // same bytes, new files
  EXPECT_NE(Fp(a), Fp(b));
}

TEST(FingerprintTest, ATableByteEditedInPlaceChangesIt) {
  TempDir t;
  const std::string a = Make(t / "a", 1);
  const uint64_t before = Fp(a);
  std::string shard;
  for (const auto& e : std::filesystem::directory_iterator(a)) {
    if (e.path().extension() == ".safetensors") shard = e.path();
  }
  ASSERT_FALSE(shard.empty());
  struct stat st {};
  ASSERT_EQ(::stat(shard.c_str(), &st), 0);
  std::string bytes = testing::ReadFile(shard);
  bytes[bytes.size() - 1] ^= 0x5a;
  // A later modification time, as any writer leaves (whole seconds apart, whatever the filesystem's resolution).
  testing::WriteFile(shard, bytes);
  struct timespec times[2] = {st.st_atim, st.st_mtim};
  times[1].tv_sec += 5;
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  EXPECT_NE(Fp(a), before);
}

TEST(FingerprintTest, TokenizerAndConfigContentsCount) {
  TempDir t;
  const std::string a = Make(t / "a", 1);
  const uint64_t before = Fp(a);
  std::string tok = testing::ReadFile(a + "/tokenizer.json");
  testing::WriteFile(a + "/tokenizer.json", tok + "\n");  // equal tokens, other bytes
  const uint64_t after_tok = Fp(a);
  EXPECT_NE(after_tok, before);
  std::string cfg = testing::ReadFile(a + "/config.json");
  testing::WriteFile(a + "/config.json", cfg + " ");
  EXPECT_NE(Fp(a), after_tok);
}

}  // namespace
}  // namespace engram
