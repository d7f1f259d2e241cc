// engramd's options (daemon/options.h): defaults, every flag in both spellings, the config file, flags over the
// file (checkpoint flags replace the file's list), and bad values refused with errors that name what is wrong.
#include <initializer_list>
#include <string>
#include <vector>

#include "daemon/options.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram::daemon {
namespace {

absl::StatusOr<Options> Parse(std::initializer_list<std::string> args) {
  std::vector<std::string> storage = {"engramd"};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  return ParseOptions(static_cast<int>(storage.size()), argv.data());
}

std::string ErrorOf(const absl::StatusOr<Options>& o) {
  return o.ok() ? "(parsed)" : std::string(o.status().message());
}

TEST(OptionsTest, DefaultsWithOneCheckpoint) {
  auto o = Parse({"--checkpoint", "/ck"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->checkpoints, std::vector<std::string>{"/ck"});
  EXPECT_EQ(o->tp_sizes, std::vector<int64_t>{1});
  EXPECT_EQ(o->shm_dir, "/dev/shm");
  EXPECT_EQ(o->socket, "/run/engramd/engramd.sock");
  EXPECT_EQ(o->group, "");
  EXPECT_EQ(o->tickets, 1);
  EXPECT_EQ(o->threads, 0);
  EXPECT_EQ(o->log_level, "info");
  EXPECT_EQ(o->metrics_file, "");
  EXPECT_EQ(o->config_file, "");
}

TEST(OptionsTest, EveryFlagInBothSpellings) {
  auto o = Parse({"--checkpoint", "/a", "--checkpoint=/b", "--tp", "1, 2,4", "--shm-dir=/mnt/huge", "--socket",
                  "/tmp/e.sock", "--group=engram", "--tickets", "3", "--threads=5", "--log-level", "debug",
                  "--metrics-file", "/var/lib/e.prom"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->checkpoints, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(o->tp_sizes, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(o->shm_dir, "/mnt/huge");
  EXPECT_EQ(o->socket, "/tmp/e.sock");
  EXPECT_EQ(o->group, "engram");
  EXPECT_EQ(o->tickets, 3);
  EXPECT_EQ(o->threads, 5);
  EXPECT_EQ(o->log_level, "debug");
  EXPECT_EQ(o->metrics_file, "/var/lib/e.prom");
}

TEST(OptionsTest, ConfigFileAndFlagsOverIt) {
  testing::TempDir dir;
  const std::string conf = dir / "engramd.conf";
  testing::WriteFile(conf,
                     "# engramd\n\n"
                     "checkpoint = /file/a\n"
                     "checkpoint=/file/b\n"
                     "  tp = 2,8  \n"
                     "shm_dir = /file/shm\n"
                     "socket = /file/sock\n"
                     "group = g\n"
                     "tickets = 2\n"
                     "threads = 7\n"
                     "log_level = warn\n"
                     "metrics_file = /file/m.prom\n");
  auto o = Parse({"--config", conf});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->config_file, conf);
  EXPECT_EQ(o->checkpoints, (std::vector<std::string>{"/file/a", "/file/b"}));
  EXPECT_EQ(o->tp_sizes, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(o->shm_dir, "/file/shm");
  EXPECT_EQ(o->socket, "/file/sock");
  EXPECT_EQ(o->group, "g");
  EXPECT_EQ(o->tickets, 2);
  EXPECT_EQ(o->threads, 7);
  EXPECT_EQ(o->log_level, "warn");
  EXPECT_EQ(o->metrics_file, "/file/m.prom");

  // A flag replaces the file's value for its key; checkpoint flags replace the whole list. The file is read
  // first wherever --config stands.
  o = Parse({"--tickets", "4", "--checkpoint", "/flag/c", "--config=" + conf, "--shm-dir", "/flag/shm"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->checkpoints, std::vector<std::string>{"/flag/c"});
  EXPECT_EQ(o->tickets, 4);
  EXPECT_EQ(o->shm_dir, "/flag/shm");
  EXPECT_EQ(o->tp_sizes, (std::vector<int64_t>{2, 8})) << "keys without a flag keep the file's value";
  EXPECT_EQ(o->socket, "/file/sock");
}

TEST(OptionsTest, ApplyConfigTextChangesOnlyTheKeysPresent) {
  Options o;
  o.socket = "/keep";
  ASSERT_TRUE(ApplyConfigText("# only tickets\ntickets = 9\n", "t", &o).ok());
  EXPECT_EQ(o.tickets, 9);
  EXPECT_EQ(o.socket, "/keep");
  EXPECT_TRUE(o.checkpoints.empty());
}

TEST(OptionsTest, BadFlagsAreRefusedClearly) {
  struct Case {
    std::vector<std::string> args;
    std::string error;
  } cases[] = {
      {{"--checkpoint", "/a", "--tickets", "0"}, "tickets wants an integer >= 1, got '0'"},
      {{"--checkpoint", "/a", "--tickets", "many"}, "tickets wants an integer >= 1, got 'many'"},
      {{"--checkpoint", "/a", "--threads", "-1"}, "threads wants an integer >= 0, got '-1'"},
      {{"--checkpoint", "/a", "--tp", "0"}, "tp wants a comma list of sizes >= 1, got '0'"},
      {{"--checkpoint", "/a", "--tp", "1,x"}, "tp wants a comma list of sizes >= 1, got '1,x'"},
      {{"--checkpoint", "/a", "--tp", "2048"}, "got '2048'"},
      {{"--checkpoint", "/a", "--tp", ","}, "tp is empty"},
      {{"--checkpoint", "/a", "--colour", "red"}, "command line: unknown key 'colour'"},
      {{"--checkpoint", "/a", "stray"}, "unexpected argument 'stray'"},
      {{"--checkpoint", "/a", "--tickets"}, "--tickets needs a value"},
      {{"--tp", "2"}, "no checkpoint to serve: give --checkpoint DIR"},
      {{"--checkpoint", "/a", "--config", "/nonexistent/engramd.conf"}, "/nonexistent/engramd.conf"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> storage = {"engramd"};
    storage.insert(storage.end(), c.args.begin(), c.args.end());
    std::vector<char*> argv;
    for (auto& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);
    auto o = ParseOptions(static_cast<int>(storage.size()), argv.data());
    ASSERT_FALSE(o.ok()) << c.error;
    if (c.args.size() < 2 || c.args[c.args.size() - 2] != "--config") {
      EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << c.error;
    }
    EXPECT_NE(ErrorOf(o).find(c.error), std::string::npos) << "want '" << c.error << "', got '" << ErrorOf(o) << "'";
  }
}

TEST(OptionsTest, BadConfigFileLinesNameFileAndLine) {
  testing::TempDir dir;
  const std::string conf = dir / "bad.conf";
  testing::WriteFile(conf, "checkpoint = /a\n# fine\nthis line has no equals sign\n");
  auto o = Parse({"--config", conf});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(ErrorOf(o).find(conf + ":3: expected `key = value`"), std::string::npos) << ErrorOf(o);

  testing::WriteFile(conf, "checkpoint = /a\nshm-dir = /x\n");
  o = Parse({"--config", conf});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(ErrorOf(o).find(conf + ":2: unknown key 'shm-dir'"), std::string::npos) << ErrorOf(o);

  testing::WriteFile(conf, "checkpoint = /a\n\ntickets = -2\n");
  o = Parse({"--config", conf});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(ErrorOf(o).find(conf + ":3: tickets wants an integer >= 1, got '-2'"), std::string::npos) << ErrorOf(o);
}

TEST(OptionsTest, MetricsAddressFromFlagOrFileCheckedAtParse) {
  auto off = Parse({"--checkpoint", "/ck"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->metrics_address, "") << "off unless asked for";
  auto flag = Parse({"--checkpoint", "/ck", "--metrics-address", "127.0.0.1:9464"});
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_EQ(flag->metrics_address, "127.0.0.1:9464");
  Options o;
  ASSERT_TRUE(ApplyConfigText("metrics_address = :9464\n", "f.conf", &o).ok());
  EXPECT_EQ(o.metrics_address, ":9464");
  ASSERT_TRUE(ApplyConfigText("metrics_address =\n", "f.conf", &o).ok()) << "empty turns it off";
  EXPECT_EQ(o.metrics_address, "");
  auto bad = ApplyConfigText("metrics_address = example.com:9464\n", "f.conf", &o);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("f.conf:1"), std::string::npos) << bad;
  EXPECT_NE(ErrorOf(Parse({"--checkpoint", "/ck", "--metrics-address", "9464"})).find("no port"), std::string::npos);
}

}  // namespace
}  // namespace engram::daemon
