#include "client/tuning.h"

#include <cmath>
#include <string>
#include <type_traits>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/cpu_list.h"

namespace engram::client {
namespace {

// What a knob's value may be; Set checks it.
enum class Kind {
  kCount,       // >= 0
  kMillis,      // a duration in ms: (0, 24 h]
  kShare,       // a fraction in [0, 1]
  kFlag,        // 1/true/yes/on or 0/false/no/off
  kBit,         // the same words, kept as the integer 0 or 1
  kCpuList,     // a CPU list ("8-15,24"; base/cpu_list.h)
  kPath,        // a non-empty string
  kLookupPath,  // auto | uva | host | host_gather
  kA2a,         // auto | sequential | pipelined | graph
};

using Field = std::variant<std::optional<int64_t> Tuning::*, std::optional<double> Tuning::*,
                           std::optional<bool> Tuning::*, std::string Tuning::*>;

struct Knob {
  const char* key;
  Field field;
  Kind kind;
};

// The knobs in the order of the struct's fields.
const std::vector<Knob>& Knobs() {
  static const auto* knobs = new std::vector<Knob>{
      {"lookup_path", &Tuning::lookup_path, Kind::kLookupPath},
      {"lookup_path_table", &Tuning::lookup_path_table, Kind::kPath},
      {"host_gather_min_items", &Tuning::host_gather_min_items, Kind::kCount},
      {"lookup_sort_min_items", &Tuning::lookup_sort_min_items, Kind::kCount},
      {"lookup_sort_variant", &Tuning::lookup_sort_variant, Kind::kCount},
      {"lookup_sort_blocks", &Tuning::lookup_sort_blocks, Kind::kCount},
      {"engine_calibrate", &Tuning::engine_calibrate, Kind::kFlag},
      {"host_gather_threads", &Tuning::host_gather_threads, Kind::kCount},
      {"host_gather_cpus", &Tuning::host_gather_cpus, Kind::kCpuList},
      {"host_gather_uva_share", &Tuning::host_gather_uva_share, Kind::kShare},
      {"host_gather_prefetch", &Tuning::host_gather_prefetch, Kind::kCount},
      {"host_gather_nt", &Tuning::host_gather_nt, Kind::kBit},
      {"host_gather_fused", &Tuning::host_gather_fused, Kind::kBit},
      {"host_gather_issuer", &Tuning::host_gather_issuer, Kind::kBit},
      {"host_gather_spin_us", &Tuning::host_gather_spin_us, Kind::kCount},
      {"host_gather_dispatch_spin_us", &Tuning::host_gather_dispatch_spin_us, Kind::kCount},
      {"host_gather_pass_spin_us", &Tuning::host_gather_pass_spin_us, Kind::kCount},
      {"host_gather_prewake", &Tuning::host_gather_prewake, Kind::kBit},
      {"host_gather_issue_min_rows", &Tuning::host_gather_issue_min_rows, Kind::kCount},
      {"dp_form_timeout_ms", &Tuning::dp_form_timeout_ms, Kind::kMillis},
      {"dp_step_timeout_ms", &Tuning::dp_step_timeout_ms, Kind::kMillis},
      {"dp_chunk_kib", &Tuning::dp_chunk_kib, Kind::kCount},
      {"dp_peer_max_slot", &Tuning::dp_peer_max_slot, Kind::kCount},
      {"dp_graph_max_slot", &Tuning::dp_graph_max_slot, Kind::kCount},
      {"dp_nccl_blocking", &Tuning::dp_nccl_blocking, Kind::kBit},
      {"dp_a2a", &Tuning::dp_a2a, Kind::kA2a},
  };
  return *knobs;
}

constexpr int64_t kMaxMillis = int64_t{24} * 3600 * 1000;

absl::string_view View(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Bad(const Knob& k, std::string_view value, std::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrCat("tuning ", k.key, "=\"", absl::CEscape(View(value)), "\": want ", View(want)));
}

bool FlagWord(const std::string& lower, bool* out) {
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") {
    *out = true;
    return true;
  }
  *out = false;
  return lower == "0" || lower == "false" || lower == "no" || lower == "off";
}

// The range checks of the integer and fraction kinds; `shown` is the value as the caller gave it.
absl::Status CheckInt(const Knob& k, int64_t x, std::string_view shown) {
  if (k.kind == Kind::kCount && x < 0) return Bad(k, shown, "an integer >= 0");
  if (k.kind == Kind::kMillis && (x <= 0 || x > kMaxMillis)) return Bad(k, shown, "milliseconds in 1 .. 86400000");
  if (k.kind == Kind::kBit && x != 0 && x != 1) return Bad(k, shown, "1/true/yes/on or 0/false/no/off");
  return absl::OkStatus();
}

absl::Status CheckShare(const Knob& k, double x, std::string_view shown) {
  if (!std::isfinite(x) || x < 0 || x > 1) return Bad(k, shown, "a number in 0 .. 1");
  return absl::OkStatus();
}

// A text knob's value as the engines read it (trimmed; the word knobs in lower case), or why it is refused.
absl::StatusOr<std::string> CheckText(const Knob& k, std::string_view raw) {
  std::string value(absl::StripAsciiWhitespace(View(raw)));
  const std::string lower = absl::AsciiStrToLower(value);
  switch (k.kind) {
    case Kind::kPath:
      if (value.empty()) return Bad(k, raw, "a non-empty value");
      return value;
    case Kind::kCpuList:
      if (!ParseCpuList(value).ok()) return Bad(k, raw, "a CPU list such as 8-15,24");
      return value;
    case Kind::kLookupPath:
      if (lower != "auto" && lower != "uva" && lower != "host" && lower != "host_gather") {
        return Bad(k, raw, "auto, uva, host or host_gather");
      }
      return lower;
    case Kind::kA2a:
      if (lower != "auto" && lower != "sequential" && lower != "pipelined" && lower != "graph") {
        return Bad(k, raw, "auto, sequential, pipelined or graph");
      }
      return lower;
    default: return Bad(k, raw, "a known kind");
  }
}

// Parses `value` for knob `k` into `t`; `t` is unchanged on an error.
absl::Status SetKnob(const Knob& k, std::string_view raw, Tuning& t) {
  const std::string value(absl::StripAsciiWhitespace(View(raw)));
  const std::string lower = absl::AsciiStrToLower(value);
  switch (k.kind) {
    case Kind::kCount:
    case Kind::kMillis: {
      int64_t x = 0;
      if (!absl::SimpleAtoi(value, &x)) return Bad(k, raw, "an integer");
      if (auto st = CheckInt(k, x, raw); !st.ok()) return st;
      t.*std::get<std::optional<int64_t> Tuning::*>(k.field) = x;
      return absl::OkStatus();
    }
    case Kind::kBit: {
      bool x = false;
      if (!FlagWord(lower, &x)) return Bad(k, raw, "1/true/yes/on or 0/false/no/off");
      t.*std::get<std::optional<int64_t> Tuning::*>(k.field) = x ? 1 : 0;
      return absl::OkStatus();
    }
    case Kind::kShare: {
      double x = 0;
      if (!absl::SimpleAtod(value, &x)) return Bad(k, raw, "a number in 0 .. 1");
      if (auto st = CheckShare(k, x, raw); !st.ok()) return st;
      t.*std::get<std::optional<double> Tuning::*>(k.field) = x;
      return absl::OkStatus();
    }
    case Kind::kFlag: {
      bool x = false;
      if (!FlagWord(lower, &x)) return Bad(k, raw, "1/true/yes/on or 0/false/no/off");
      t.*std::get<std::optional<bool> Tuning::*>(k.field) = x;
      return absl::OkStatus();
    }
    default: {
      absl::StatusOr<std::string> text = CheckText(k, raw);
      if (!text.ok()) return text.status();
      t.*std::get<std::string Tuning::*>(k.field) = *std::move(text);
      return absl::OkStatus();
    }
  }
}

// Checks knob `k` of `in` as Set would have, writing its normalised value into `out`.
absl::Status NormalizeKnob(const Knob& k, const Tuning& in, Tuning& out) {
  return std::visit(
      [&](auto member) -> absl::Status {
        const auto& f = in.*member;
        using F = std::decay_t<decltype(f)>;
        if constexpr (std::is_same_v<F, std::string>) {
          if (f.empty()) return absl::OkStatus();
          absl::StatusOr<std::string> text = CheckText(k, f);
          if (!text.ok()) return text.status();
          out.*member = *std::move(text);
          return absl::OkStatus();
        } else if constexpr (std::is_same_v<F, std::optional<double>>) {
          return f ? CheckShare(k, *f, absl::StrCat(*f)) : absl::OkStatus();
        } else if constexpr (std::is_same_v<F, std::optional<int64_t>>) {
          return f ? CheckInt(k, *f, absl::StrCat(*f)) : absl::OkStatus();
        } else {
          return absl::OkStatus();  // a bool is always valid
        }
      },
      k.field);
}

}  // namespace

absl::Status Tuning::Set(std::string_view key, std::string_view value) {
  for (const Knob& k : Knobs()) {
    if (key == k.key) return SetKnob(k, value, *this);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tuning: no knob \"", absl::CEscape(View(key)), "\" (Tuning::Keys() lists them)"));
}

absl::Status Tuning::Normalize() {
  Tuning out = *this;
  for (const Knob& k : Knobs()) {
    if (auto st = NormalizeKnob(k, *this, out); !st.ok()) return st;
  }
  *this = std::move(out);
  return absl::OkStatus();
}

Tuning Tuning::Over(const Tuning& base) const {
  Tuning t = *this;
  for (const Knob& k : Knobs()) {
    std::visit(
        [&](auto member) {
          auto& mine = t.*member;
          if constexpr (std::is_same_v<std::decay_t<decltype(mine)>, std::string>) {
            if (mine.empty()) mine = base.*member;
          } else {
            if (!mine.has_value()) mine = base.*member;
          }
        },
        k.field);
  }
  return t;
}

const std::vector<std::string>& Tuning::Keys() {
  static const auto* keys = [] {
    auto* v = new std::vector<std::string>();
    for (const Knob& k : Knobs()) v->push_back(k.key);
    return v;
  }();
  return *keys;
}

std::string TuningText(const Tuning& tuning) {
  std::string out;
  for (const Knob& k : Knobs()) {
    std::string v;
    std::visit(
        [&](auto member) {
          const auto& f = tuning.*member;
          using F = std::decay_t<decltype(f)>;
          if constexpr (std::is_same_v<F, std::string>) {
            v = f;
          } else if constexpr (std::is_same_v<F, std::optional<double>>) {
            if (f) v = absl::StrCat(*f);
          } else if constexpr (std::is_same_v<F, std::optional<bool>>) {
            if (f) v.push_back(*f ? '1' : '0');
          } else {
            if (f) v = absl::StrCat(*f);
          }
        },
        k.field);
    if (!v.empty()) absl::StrAppend(&out, out.empty() ? "" : ",", k.key, "=", v);
  }
  return out;
}

Tuning ParseTuning(const std::function<const char*(const char*)>& lookup) {
  Tuning t;
  for (const Knob& k : Knobs()) {
    const std::string name = absl::StrCat("ENGRAM_", absl::AsciiStrToUpper(k.key));
    const char* v = lookup(name.c_str());
    if (v == nullptr || *v == '\0') continue;
    (void)SetKnob(k, v, t);  // a malformed value leaves the knob unset: the default applies
  }
  return t;
}

}  // namespace engram::client
