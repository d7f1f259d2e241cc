// The Prometheus rendering (daemon/metrics_text.h): every family declared once with HELP and TYPE, values exact,
// label values escaped, histograms cumulative, and every reason and mode present before it first happens.
#include "daemon/metrics_text.h"

#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace engram::daemon {
namespace {

engram::v1::StatusReply SomeStatus() {
  engram::v1::StatusReply s;
  s.set_daemon_version("9.8.7");
  s.mutable_shm()->set_total_bytes(101468602368);  // more digits than %g keeps
  auto* seg = s.add_segments();
  seg->set_name("engram-abc-tp0of2");
  seg->set_state("LOADING");
  seg->set_origin("published");
  seg->set_bytes(1000);
  seg->set_progress(0.25);
  auto* ready = s.add_segments();
  ready->set_name("weird\"name\\x\n");
  ready->set_state("READY");
  ready->set_origin("published");
  ready->set_bytes(2048);
  ready->set_progress(1);
  ready->set_load_seconds(2);
  s.add_replicas()->set_mode("SHARED");
  return s;
}

// Sample lines by name and labels; every family's HELP and TYPE lines.
struct Parsed {
  std::map<std::string, std::string> samples;  // "name{labels}" -> value
  std::map<std::string, std::string> types;    // family -> type
  std::set<std::string> helped;
};

Parsed Parse(const std::string& text) {
  Parsed p;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) {
      const std::string rest = line.substr(7);
      const size_t sp = rest.find(' ');
      EXPECT_TRUE(p.types.emplace(rest.substr(0, sp), rest.substr(sp + 1)).second) << "declared twice: " << line;
    } else if (line.rfind("# HELP ", 0) == 0) {
      p.helped.insert(line.substr(7, line.find(' ', 7) - 7));
    } else {
      const size_t sp = line.rfind(' ');
      p.samples[line.substr(0, sp)] = line.substr(sp + 1);
    }
  }
  return p;
}

TEST(MetricsTextTest, FamiliesValuesAndLabels) {
  ReplicaCounters c;
  c.sessions_total = 5;
  c.fallbacks_by_reason["ELASTIC_EP"] = 2;
  const Parsed p = Parse(MetricsText(SomeStatus(), c));
  for (const auto& [family, type] : p.types) EXPECT_TRUE(p.helped.count(family)) << family << " has no HELP";
  EXPECT_EQ(p.types.at("engram_build_info"), "gauge");
  EXPECT_EQ(p.samples.at("engram_build_info{version=\"9.8.7\"}"), "1");
  EXPECT_EQ(p.samples.at("engram_shm_bytes{kind=\"total\"}"), "101468602368");
  EXPECT_EQ(p.samples.at("engram_segments{state=\"LOADING\"}"), "1");
  EXPECT_EQ(p.samples.at("engram_segments{state=\"FAILED\"}"), "0") << "every state, 0 included";
  EXPECT_EQ(p.samples.at("engram_publish_bytes{segment=\"engram-abc-tp0of2\",kind=\"done\"}"), "250");
  EXPECT_EQ(p.samples.at("engram_publish_bytes{segment=\"engram-abc-tp0of2\",kind=\"total\"}"), "1000");
  EXPECT_EQ(p.samples.at("engram_publish_bytes{segment=\"weird\\\"name\\\\x\\n\",kind=\"done\"}"), "2048")
      << "label values escaped";
  EXPECT_EQ(p.samples.at("engram_replicas{mode=\"SHARED\"}"), "1");
  EXPECT_EQ(p.samples.at("engram_replicas{mode=\"DEVICE\"}"), "0");
  EXPECT_EQ(p.types.at("engram_fallbacks_total"), "counter");
  EXPECT_EQ(p.samples.at("engram_fallbacks_total{reason=\"ELASTIC_EP\"}"), "2");
  EXPECT_EQ(p.samples.at("engram_fallbacks_total{reason=\"SHM_NOT_VISIBLE\"}"), "0") << "every reason, 0 included";
  EXPECT_EQ(p.samples.count("engram_fallbacks_total{reason=\"REASON_UNSPECIFIED\"}"), 0u);
  EXPECT_EQ(p.samples.at("engram_sessions_total"), "5");
}

TEST(MetricsTextTest, HistogramsAreCumulative) {
  ReplicaCounters c;
  for (double v : {0.003, 0.2, 0.2, 3.0, 1e6}) c.register_seconds.Observe(v);
  c.register_seconds.Observe(-1);                                        // ignored
  c.register_seconds.Observe(std::numeric_limits<double>::quiet_NaN());  // ignored
  c.attach_seconds.Observe(1);
  const Parsed p = Parse(MetricsText(engram::v1::StatusReply(), c));
  EXPECT_EQ(p.types.at("engram_register_seconds"), "histogram");
  EXPECT_EQ(p.samples.at("engram_register_seconds_bucket{le=\"0.01\"}"), "1");
  EXPECT_EQ(p.samples.at("engram_register_seconds_bucket{le=\"0.25\"}"), "3");
  EXPECT_EQ(p.samples.at("engram_register_seconds_bucket{le=\"5\"}"), "4");
  EXPECT_EQ(p.samples.at("engram_register_seconds_bucket{le=\"320\"}"), "4");
  EXPECT_EQ(p.samples.at("engram_register_seconds_bucket{le=\"+Inf\"}"), "5");
  EXPECT_EQ(p.samples.at("engram_register_seconds_count"), "5");
  EXPECT_EQ(p.samples.at("engram_attach_seconds_count"), "1");
  EXPECT_EQ(p.samples.at("engram_attach_seconds_bucket{le=\"1\"}"), "1");
  EXPECT_EQ(p.samples.at("engram_attach_seconds_sum"), "1");
}

}  // namespace
}  // namespace engram::daemon
