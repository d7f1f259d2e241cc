#include "client/environment.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "client/tuning.h"

namespace engram::client {
namespace {

struct Reader {
  const std::function<const char*(const char*)>& lookup;

  std::string Text(const char* name) const {
    const char* v = lookup(name);
    return v == nullptr ? std::string() : std::string(v);
  }
  std::optional<int64_t> Int(const char* name) const {
    int64_t x = 0;
    const std::string v = Text(name);
    if (v.empty() || !absl::SimpleAtoi(v, &x)) return std::nullopt;
    return x;
  }
  // 1/true/yes/on and 0/false/no/off (any case, surrounding blanks ignored); anything else leaves it unset.
  std::optional<bool> Flag(const char* name) const {
    const std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(Text(name)));
    if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
    if (v == "0" || v == "false" || v == "no" || v == "off") return false;
    return std::nullopt;
  }
};

}  // namespace

ClientEnvironment ParseClientEnvironment(const std::function<const char*(const char*)>& lookup) {
  const Reader r{lookup};
  ClientEnvironment e;
  e.tuning = ParseTuning(lookup);
  e.dp_group = r.Text("ENGRAM_DP_GROUP");
  e.vllm_ple_cpu_offload = r.Flag("VLLM_PLE_CPU_OFFLOAD");
  const std::optional<int64_t> share = r.Int("NCCL_COMM_SPLIT_SHARE_RESOURCES");
  e.nccl_split_shares_resources = share.has_value() && *share != 0;
  for (const char* gone : {"ENGRAM_HOST_GATHER_DEDUP", "ENGRAM_HOST_GATHER_STREAM_UNPACK"}) {
    if (!r.Text(gone).empty()) e.removed.push_back(gone);
  }
  return e;
}

namespace {

// Every record parsed so far, kept for the whole process (references handed out stay valid across a reload).
const ClientEnvironment* ParseProcessEnvironment() {
  static auto* mu = new std::mutex();
  static auto* kept = new std::vector<std::unique_ptr<const ClientEnvironment>>();
  auto parsed = std::make_unique<const ClientEnvironment>(
      ParseClientEnvironment([](const char* name) { return std::getenv(name); }));
  std::lock_guard<std::mutex> lock(*mu);
  kept->push_back(std::move(parsed));
  return kept->back().get();
}

std::atomic<const ClientEnvironment*>& Current() {
  static std::atomic<const ClientEnvironment*> current{ParseProcessEnvironment()};
  return current;
}

}  // namespace

const ClientEnvironment& Environment() { return *Current().load(std::memory_order_acquire); }

void ReloadEnvironment() { Current().store(ParseProcessEnvironment(), std::memory_order_release); }

}  // namespace engram::client
