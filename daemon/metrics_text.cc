#include "daemon/metrics_text.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/fallback.h"
#include "daemon/histogram.h"
#include "daemon/segment_registry.h"

namespace engram::daemon {
namespace {

// One family at a time: its HELP and TYPE lines, then its samples.
class Writer {
 public:
  void Family(const char* name, const char* type, const char* help) {
    absl::StrAppend(&out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  void Int(const std::string& name, const std::string& labels, uint64_t v) {
    absl::StrAppend(&out_, name, Braces(labels), " ", v, "\n");
  }
  void Real(const std::string& name, const std::string& labels, double v) {
    absl::StrAppend(&out_, name, Braces(labels), " ", std::isfinite(v) ? absl::StrFormat("%.9g", v) : "NaN", "\n");
  }
  void Seconds(const char* name, const char* help, const Histogram& h) {
    Family(name, "histogram", help);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < kSecondsBounds.size(); ++i) {
      cumulative += h.buckets[i];
      Int(absl::StrCat(name, "_bucket"), absl::StrFormat("le=\"%g\"", kSecondsBounds[i]), cumulative);
    }
    Int(absl::StrCat(name, "_bucket"), "le=\"+Inf\"", h.count);
    Real(absl::StrCat(name, "_sum"), "", h.sum);
    Int(absl::StrCat(name, "_count"), "", h.count);
  }
  std::string Take() { return std::move(out_); }

 private:
  static std::string Braces(const std::string& labels) { return labels.empty() ? "" : "{" + labels + "}"; }
  std::string out_;
};

std::string Label(const char* key, const std::string& value) {
  return absl::StrCat(key, "=\"", EscapeLabelValue(value), "\"");
}

}  // namespace

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string MetricsText(const engram::v1::StatusReply& s, const ReplicaCounters& counters) {
  Writer w;
  w.Family("engram_build_info", "gauge", "This engramd's version (always 1).");
  w.Int("engram_build_info", Label("version", s.daemon_version()), 1);

  w.Family("engram_shm_bytes", "gauge", "shm directory capacity.");
  w.Int("engram_shm_bytes", "kind=\"total\"", s.shm().total_bytes());
  w.Int("engram_shm_bytes", "kind=\"free\"", s.shm().free_bytes());
  w.Int("engram_shm_bytes", "kind=\"engram\"", s.shm().engram_bytes());

  std::map<std::string, uint64_t> by_state;
  for (ServingState st : {ServingState::kPending, ServingState::kLoading, ServingState::kReady, ServingState::kFailed,
                          ServingState::kRetired}) {
    by_state[std::string(Name(st))] = 0;
  }
  for (const auto& g : s.segments()) ++by_state[g.state()];
  w.Family("engram_segments", "gauge", "Segments by state.");
  for (const auto& [st, n] : by_state) w.Int("engram_segments", Label("state", st), n);

  w.Family("engram_segment_bytes", "gauge", "Size of each segment, by state.");
  for (const auto& g : s.segments()) {
    w.Int("engram_segment_bytes",
          absl::StrCat(Label("segment", g.name()), ",", Label("state", g.state()), ",", Label("origin", g.origin())),
          g.bytes());
  }

  w.Family("engram_publish_bytes", "gauge",
           "Publish (or, for an adopted segment, verification) progress of each segment: bytes done and in all.");
  for (const auto& g : s.segments()) {
    const double progress = std::clamp(g.progress(), 0.0, 1.0);
    const auto done = static_cast<uint64_t>(std::llround(static_cast<double>(g.bytes()) * progress));
    w.Int("engram_publish_bytes", absl::StrCat(Label("segment", g.name()), ",kind=\"done\""), done);
    w.Int("engram_publish_bytes", absl::StrCat(Label("segment", g.name()), ",kind=\"total\""), g.bytes());
  }

  w.Family("engram_publish_gib_per_second", "gauge", "Publish rate of each published segment.");
  for (const auto& g : s.segments()) {
    if (g.origin() == Name(SegmentOrigin::kPublished) && g.state() == Name(ServingState::kReady) &&
        g.load_seconds() > 0) {
      w.Real("engram_publish_gib_per_second", Label("segment", g.name()), g.bytes() / 1073741824.0 / g.load_seconds());
    }
  }

  std::map<std::string, uint64_t> by_mode;
  for (const auto& r : s.replicas()) ++by_mode[r.mode()];
  w.Family("engram_replicas", "gauge", "Attached replicas by mode.");
  for (const char* m : {"SHARED", "PRIVATE_PINNED", "DEVICE", "DP_SHARDED"}) {
    w.Int("engram_replicas", Label("mode", m), by_mode[m]);
  }

  // Every reason the API knows, at 0 until it first happens.
  std::map<std::string, uint64_t> by_reason = counters.fallbacks_by_reason;
  const auto* reasons = engram::v1::FallbackReason_descriptor();
  for (int i = 0; i < reasons->value_count(); ++i) {
    const auto code = static_cast<engram::v1::FallbackReason>(reasons->value(i)->number());
    if (code != engram::v1::REASON_UNSPECIFIED) by_reason.emplace(ReasonName(code), 0);
  }
  w.Family("engram_fallbacks_total", "counter", "Fallback decisions since start, by reason.");
  for (const auto& [reason, n] : by_reason) w.Int("engram_fallbacks_total", Label("reason", reason), n);

  w.Family("engram_sessions_total", "counter", "Replica sessions since start.");
  w.Int("engram_sessions_total", "", counters.sessions_total);

  w.Seconds("engram_register_seconds", "Registration time reported by replicas (failed registrations too).",
            counters.register_seconds);
  w.Seconds("engram_attach_seconds",
            "Seconds from a replica's grant to its registration report (mapping, ticket wait, registration).",
            counters.attach_seconds);
  return w.Take();
}

}  // namespace engram::daemon
