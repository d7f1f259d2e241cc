// engramd hardening, as real processes: text from checkpoints and clients is printable wherever it is shown. Quotes and
// spaces in hostile text forge no logfmt key; escape sequences and newlines in checkpoint directory names reach no log
// line, engramctl error or status as control bytes.
//
// See tests/integration/daemon_hardening.h for what the hardening tests share.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engram/v1/engram.grpc.pb.h"
#include "engram/version.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tests/integration/daemon_hardening.h"
#include "tests/integration/daemon_harness.h"
#include "tests/integration/json_lines.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::Daemon;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::Process;
using testing::TempDir;
using namespace std::chrono_literals;

// --- text from checkpoints and clients is printable wherever it is shown -----------------------------------------

// Control bytes of `text` other than its line ends.
int ControlBytes(const std::string& text) {
  int n = 0;
  for (const unsigned char c : text) n += (c < 0x20 && c != '\n') || c == 0x7f ? 1 : 0;
  return n;
}

// The keys of one logfmt line (key=value pairs; a value in double quotes may hold spaces and \-escaped quotes), as a
// log shipper parses it: an independent reading of the line, not the daemon's quoting code.
std::vector<std::string> LogfmtKeys(const std::string& line) {
  std::vector<std::string> keys;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    const size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '=' && line[i] != '"') ++i;
    if (i < line.size() && line[i] == '=') {
      keys.push_back(line.substr(start, i - start));
      ++i;
    }
    if (i < line.size() && line[i] == '"') {
      for (++i; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\') ++i;
      }
      ++i;
    } else {
      while (i < line.size() && line[i] != ' ') ++i;
    }
  }
  return keys;
}

// Quotes and spaces in a checkpoint directory's name, in a config.json value and in a reloaded setting forge no
// key: every line of the log holds one event= as a logfmt reader splits it.
TEST(DaemonHardeningTest, QuotesInHostileTextForgeNoLogKey) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 2, "a", 1);
  const std::string forge = "\" event=ready detail=\"every segment ready";
  const std::string bad = dir / ("q" + forge);
  std::filesystem::rename(MakeCheckpoint(dir, 2, "c", 3), bad);
  {
    json cfg = json::parse(testing::ReadFile(bad + "/config.json"));
    cfg["engram_head_dim"] = "1" + forge;
    testing::WriteFile(bad + "/config.json", cfg.dump());
  }
  const std::string conf = dir / "engramd.conf";
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  Process load({BinPath("engramctl"), "load", "--checkpoint", bad, "--socket", d.socket()}, dir / "load.log");
  EXPECT_NE(load.Wait(60s), 0) << load.Output();
  ASSERT_TRUE(d.WaitLog("event=load_failed")) << d.Log();
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + forge + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(d.WaitLog("key=shm_dir")) << d.Log();
  // A refused reload names the value in its detail (an unknown group, a log level that is none).
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + "\ngroup = nosuch" + forge + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(d.WaitLog("event=reload_failed")) << d.Log();
  const std::string log = d.Log();
  std::istringstream lines(log);
  int checked = 0;
  for (std::string line; std::getline(lines, line);) {
    const std::vector<std::string> keys = LogfmtKeys(line);
    EXPECT_LE(std::count(keys.begin(), keys.end(), "event"), 1) << "a forged key: " << line;
    EXPECT_LE(std::count(keys.begin(), keys.end(), "detail"), 1) << "a forged key: " << line;
    checked += line.find("every segment ready") != std::string::npos ? 1 : 0;
  }
  EXPECT_GE(checked, 3) << "the hostile text is logged (quoted): " << log;
  EXPECT_TRUE(d.proc().Running());
}

// Checkpoint directories whose names hold an escape sequence and a newline followed by a forged log line: loading,
// unloading and failing to load them is logged one line per event, and neither the daemon's log, engramctl's error
// nor its status (text or JSON) carries a control byte.
TEST(DaemonHardeningTest, HostileCheckpointTextIsPrintableEverywhere) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 2, "a", 1);
  const std::string forged = "2026-01-01T00:00:00.000 info event=unload dir=forged";  // no '/': one name
  const std::string good = dir / ("good\x1b[31m\n" + forged);
  std::filesystem::rename(MakeCheckpoint(dir, 2, "b", 2), good);
  const std::string bad = dir / ("bad\x1b[2J\n" + forged);
  std::filesystem::rename(MakeCheckpoint(dir, 2, "c", 3), bad);
  ASSERT_EQ(::truncate((bad + "/model-00002-of-00002.safetensors").c_str(),
                       static_cast<off_t>(std::filesystem::file_size(bad + "/model-00002-of-00002.safetensors") / 2)),
            0);
  // A config.json value with an escape and a newline too.
  {
    json cfg = json::parse(testing::ReadFile(bad + "/config.json"));
    cfg["architectures"] = json::array({"Evil\x1b[2J\n" + forged});
    testing::WriteFile(bad + "/config.json", cfg.dump());
  }
  Daemon d(dir, {"--checkpoint", a, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  auto ctl = [&](const std::vector<std::string>& args, const std::string& name) {
    std::vector<std::string> argv = {BinPath("engramctl")};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back("--socket");
    argv.push_back(d.socket());
    Process p(argv, dir / name);
    const int rc = p.Wait(60s);
    return std::make_pair(rc, p.Output());
  };
  const auto loaded = ctl({"load", "--checkpoint", good}, "load-good.log");
  EXPECT_EQ(loaded.first, 0) << loaded.second;
  EXPECT_EQ(ControlBytes(loaded.second), 0) << loaded.second;
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const auto failed = ctl({"load", "--checkpoint", bad}, "load-bad.log");
  EXPECT_NE(failed.first, 0) << failed.second;
  EXPECT_EQ(ControlBytes(failed.second), 0) << failed.second;
  EXPECT_EQ(std::count(failed.second.begin(), failed.second.end(), '\n'), 1) << "one line of error: " << failed.second;
  const auto text = ctl({"status"}, "status.log");
  EXPECT_EQ(text.first, 0) << text.second;
  EXPECT_EQ(ControlBytes(text.second), 0) << text.second;
  EXPECT_EQ(text.second.find("\n" + forged), std::string::npos) << text.second;
  const auto j = ctl({"status", "--json"}, "status-json.log");
  EXPECT_EQ(j.first, 0) << j.second;
  const json s = testing::JsonLine(j.second, false);
  ASSERT_FALSE(s.is_null()) << j.second;
  EXPECT_EQ(s.dump().find("\\u001b"), std::string::npos) << s.dump();
  EXPECT_EQ(s.dump().find("\\n"), std::string::npos) << s.dump();
  const auto unloaded = ctl({"unload", "--checkpoint", good}, "unload.log");
  EXPECT_EQ(unloaded.first, 0) << unloaded.second;
  ASSERT_TRUE(d.WaitLog("event=unload dir=")) << d.Log();
  ASSERT_TRUE(d.WaitLog("event=load_failed dir=")) << d.Log();
  const std::string log = d.Log();
  EXPECT_EQ(ControlBytes(log), 0) << log;
  std::istringstream lines(log);
  std::string line;
  int loads = 0, unloads = 0;
  while (std::getline(lines, line)) {
    EXPECT_NE(line.rfind(forged, 0), 0u) << "a forged line: " << line;
    const size_t at = line.find("event=");  // the line's own event (a quoted name may hold more text)
    const std::string event = at == std::string::npos ? "" : line.substr(at, line.find(' ', at) - at);
    loads += event == "event=load" ? 1 : 0;
    unloads += event == "event=unload" ? 1 : 0;
  }
  EXPECT_EQ(loads, 1) << log;
  EXPECT_EQ(unloads, 1) << log;
  EXPECT_TRUE(d.proc().Running());
}

}  // namespace
}  // namespace engram
