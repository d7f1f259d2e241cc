// The client's environment (client/environment.h) and fault hook (client/fault_points.h): every variable parses
// into its typed field, malformed and empty values leave the field unset, and the hook answers only while installed.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <map>
#include <string>

#include "client/environment.h"
#include "client/fault_points.h"
#include "client/log.h"
#include "client/tuning.h"
#include "engram/engram_c.h"
#include "engram/log.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

#include <sstream>
#include <stdexcept>
#include <vector>

namespace engram::client {
namespace {

ClientEnvironment From(const std::map<std::string, std::string>& vars) {
  return ParseClientEnvironment([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(ClientEnvironment, UnsetLeavesEveryFieldEmpty) {
  const ClientEnvironment e = From({});
  EXPECT_TRUE(e.tuning.lookup_path.empty());
  EXPECT_FALSE(e.tuning.lookup_sort_min_items.has_value());
  EXPECT_FALSE(e.tuning.host_gather_uva_share.has_value());
  EXPECT_FALSE(e.tuning.dp_step_timeout_ms.has_value());
  EXPECT_FALSE(e.vllm_ple_cpu_offload.has_value());
  EXPECT_FALSE(e.nccl_split_shares_resources);
}

TEST(ClientEnvironment, TypedFields) {
  const ClientEnvironment e = From({{"ENGRAM_LOOKUP_PATH", "host"},
                                    {"ENGRAM_LOOKUP_SORT_MIN_ITEMS", "4096"},
                                    {"ENGRAM_HOST_GATHER_CPUS", "8-15"},
                                    {"ENGRAM_ENGINE_CALIBRATE", "off"},
                                    {"ENGRAM_HOST_GATHER_UVA_SHARE", "0.25"},
                                    {"ENGRAM_HOST_GATHER_ISSUE_MIN_ROWS", "2048"},
                                    {"ENGRAM_DP_STEP_TIMEOUT_MS", "1500"},
                                    {"ENGRAM_DP_A2A", "graph"},
                                    {"ENGRAM_DP_GROUP", "deployment-b"},
                                    {"VLLM_PLE_CPU_OFFLOAD", "Off"},
                                    {"NCCL_COMM_SPLIT_SHARE_RESOURCES", "1"}});
  EXPECT_EQ(e.tuning.lookup_path, "host");
  EXPECT_EQ(e.tuning.lookup_sort_min_items, 4096);
  EXPECT_EQ(e.tuning.host_gather_cpus, "8-15");
  EXPECT_EQ(e.tuning.engine_calibrate, false);
  EXPECT_DOUBLE_EQ(e.tuning.host_gather_uva_share.value_or(-1), 0.25);
  EXPECT_EQ(e.tuning.host_gather_issue_min_rows, 2048);
  EXPECT_EQ(e.tuning.dp_step_timeout_ms, 1500);
  EXPECT_EQ(e.tuning.dp_a2a, "graph");
  EXPECT_EQ(e.dp_group, "deployment-b");
  EXPECT_EQ(e.vllm_ple_cpu_offload, false);
  EXPECT_TRUE(e.nccl_split_shares_resources);
}

// Every knob Tuning::Keys() names is read from ENGRAM_<KEY>: a knob added to the record is reachable from the
// environment, and only that knob is set (oracle: the expected "key=value" text, written here).
TEST(ClientEnvironment, EveryTuningKeyIsReadFromItsVariable) {
  ASSERT_GE(Tuning::Keys().size(), 20u);
  for (const std::string& key : Tuning::Keys()) {
    SCOPED_TRACE(key);
    std::string name = "ENGRAM_";
    for (char ch : key) name += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    const std::string value = key == "lookup_path" ? "uva" : key == "dp_a2a" ? "pipelined" : "1";
    EXPECT_EQ(TuningText(From({{name, value}}).tuning), key + "=" + value);
  }
}

TEST(ClientEnvironment, MalformedAndEmptyNumbersAreIgnored) {
  const ClientEnvironment e = From({{"ENGRAM_LOOKUP_SORT_MIN_ITEMS", "12k"},
                                    {"ENGRAM_HOST_GATHER_UVA_SHARE", ""},
                                    {"ENGRAM_DP_CHUNK_KIB", "9999999999999999999999"},
                                    {"ENGRAM_LOOKUP_PATH", "fastest"},
                                    {"NCCL_COMM_SPLIT_SHARE_RESOURCES", "yes"}});
  EXPECT_FALSE(e.tuning.lookup_sort_min_items.has_value());
  EXPECT_FALSE(e.tuning.host_gather_uva_share.has_value());
  EXPECT_FALSE(e.tuning.dp_chunk_kib.has_value());
  EXPECT_TRUE(e.tuning.lookup_path.empty());
  EXPECT_FALSE(e.nccl_split_shares_resources);
}

TEST(ClientEnvironment, NonFiniteNumbersOddFlagsAndOutOfRangeDurationsAreIgnored) {
  const ClientEnvironment e = From({{"ENGRAM_HOST_GATHER_UVA_SHARE", "nan"},
                                    {"ENGRAM_ENGINE_CALIBRATE", " 0 "},
                                    {"VLLM_PLE_CPU_OFFLOAD", "disable"},
                                    {"ENGRAM_DP_STEP_TIMEOUT_MS", "10000000000000"},
                                    {"ENGRAM_DP_FORM_TIMEOUT_MS", "-5"}});
  EXPECT_FALSE(e.tuning.host_gather_uva_share.has_value());
  EXPECT_EQ(e.tuning.engine_calibrate, false);
  EXPECT_FALSE(e.vllm_ple_cpu_offload.has_value());
  EXPECT_FALSE(e.tuning.dp_step_timeout_ms.has_value());
  EXPECT_FALSE(e.tuning.dp_form_timeout_ms.has_value());
  EXPECT_FALSE(From({{"ENGRAM_HOST_GATHER_UVA_SHARE", "inf"}}).tuning.host_gather_uva_share.has_value());
  EXPECT_FALSE(From({{"ENGRAM_HOST_GATHER_UVA_SHARE", "1.5"}}).tuning.host_gather_uva_share.has_value());
  // A malformed CPU list leaves the gather threads unpinned (no engine creation fails on it); a 0/1 knob's words.
  EXPECT_TRUE(From({{"ENGRAM_HOST_GATHER_CPUS", "8-x"}}).tuning.host_gather_cpus.empty());
  EXPECT_FALSE(From({{"ENGRAM_LOOKUP_SORT_MIN_ITEMS", "-1"}}).tuning.lookup_sort_min_items.has_value());
  EXPECT_FALSE(From({{"ENGRAM_HOST_GATHER_NT", "2"}}).tuning.host_gather_nt.has_value());
  EXPECT_EQ(From({{"ENGRAM_HOST_GATHER_NT", "off"}}).tuning.host_gather_nt, 0);
}

TEST(ClientEnvironment, RemovedVariablesAreNamedNotRead) {
  EXPECT_TRUE(From({}).removed.empty());
  EXPECT_EQ(From({{"ENGRAM_HOST_GATHER_DEDUP", "1"}, {"ENGRAM_HOST_GATHER_STREAM_UNPACK", "0"}}).removed,
            (std::vector<std::string>{"ENGRAM_HOST_GATHER_DEDUP", "ENGRAM_HOST_GATHER_STREAM_UNPACK"}));
  EXPECT_TRUE(From({{"ENGRAM_HOST_GATHER_DEDUP", ""}}).removed.empty()) << "an empty variable is unset";
}

TEST(ClientEnvironment, ReloadReadsTheProcessEnvironmentAgainAndKeepsEarlierReferencesValid) {
  ::setenv("ENGRAM_LOOKUP_PATH", "uva", 1);
  ReloadEnvironment();
  const ClientEnvironment& before = Environment();
  EXPECT_EQ(before.tuning.lookup_path, "uva");
  ::setenv("ENGRAM_LOOKUP_PATH", "host", 1);
  EXPECT_EQ(Environment().tuning.lookup_path, "uva") << "read once: a change alone is not seen";
  ReloadEnvironment();
  EXPECT_EQ(Environment().tuning.lookup_path, "host");
  EXPECT_EQ(before.tuning.lookup_path, "uva");  // the earlier record is still alive
  ::unsetenv("ENGRAM_LOOKUP_PATH");
  ReloadEnvironment();
}

TEST(FaultPoints, AHookThatReplacesItselfDoesNotDeadlock) {
  SetFaultHook([](FaultPoint, int64_t) {
    SetFaultHook(nullptr);
    return true;
  });
  EXPECT_TRUE(Fault(FaultPoint::kDpPeerOpen));
  EXPECT_FALSE(Fault(FaultPoint::kDpPeerOpen));
}

TEST(FaultPoints, FalseWithoutAHookAndOnlyWhereTheHookSays) {
  EXPECT_FALSE(Fault(FaultPoint::kRegisterChunk, 3));
  SetFaultHook([](FaultPoint p, int64_t arg) { return p == FaultPoint::kRegisterChunk && arg == 3; });
  EXPECT_TRUE(Fault(FaultPoint::kRegisterChunk, 3));
  EXPECT_FALSE(Fault(FaultPoint::kRegisterChunk, 2));
  EXPECT_FALSE(Fault(FaultPoint::kDpPeerOpen));
  SetFaultHook(nullptr);
  EXPECT_FALSE(Fault(FaultPoint::kRegisterChunk, 3));
  EXPECT_EQ(FaultPointName(FaultPoint::kDpPeerOpen), "dp_peer_open");
}

// The library's lines reach the host's callback (C++ and C), never the host's own default logger, and the level
// filters them.
TEST(LibraryLog, LinesGoToTheCallbackNotToTheHostsDefaultLogger) {
  std::ostringstream host_out;
  auto host = std::make_shared<spdlog::logger>("host", std::make_shared<spdlog::sinks::ostream_sink_mt>(host_out));
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(host);
  std::vector<std::pair<LogLevel, std::string>> got;
  SetLogCallback([&got](LogLevel l, std::string_view line) { got.emplace_back(l, std::string(line)); });
  Log().warn("engram: event=test_line n={}", 7);
  Log().debug("engram: event=dropped");
  SetLogLevel(LogLevel::kWarning);
  Log().info("engram: event=dropped_too");
  SetLogLevel(LogLevel::kInfo);
  SetLogCallback(nullptr);
  spdlog::set_default_logger(previous);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].first, LogLevel::kWarning);
  EXPECT_NE(got[0].second.find("event=test_line n=7"), std::string::npos) << got[0].second;
  EXPECT_EQ(got[0].second, "engram: event=test_line n=7") << "the record alone: no time, level or newline";
  EXPECT_TRUE(host_out.str().empty()) << host_out.str();

  struct Seen {
    int level = -1;
    std::string line;
  } seen;
  engram_set_log_callback(
      [](int level, const char* line, void* user) {
        auto* s = static_cast<Seen*>(user);
        s->level = level;
        s->line = line;
      },
      &seen);
  Log().error("engram: event=c_line");
  engram_set_log_callback(nullptr, nullptr);
  EXPECT_EQ(seen.level, 3);
  EXPECT_NE(seen.line.find("event=c_line"), std::string::npos);
}

// A callback may replace itself, log, or throw: no hang, no recursion, the library goes on.
TEST(LibraryLog, ACallbackThatCallsBackIntoTheLogNeitherHangsNorRecurses) {
  int calls = 0;
  SetLogCallback([&calls](LogLevel, std::string_view) {
    ++calls;
    Log().warn("engram: event=from_inside");  // dropped
    SetLogCallback(nullptr);                  // may set another destination
  });
  Log().warn("engram: event=outer");
  EXPECT_EQ(calls, 1);
  SetLogCallback([](LogLevel, std::string_view) { throw std::runtime_error("host bug"); });
  Log().warn("engram: event=thrown");  // swallowed
  SetLogCallback(nullptr);
}

}  // namespace
}  // namespace engram::client
