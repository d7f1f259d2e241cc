// The status document (client/session/status_json.h) against its documentation (docs/status.md): from a reply with
// one of everything, every field the library writes is listed in the docs with its type, and every listed field is
// written. Also: 64-bit counters are numbers, the schema version is the documented one, text is made printable.
#include "client/session/status_json.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "nlohmann/json.hpp"

namespace engram::client {
namespace {

using json = nlohmann::json;

std::string ReadDoc() {
  std::ifstream f(std::string(ENGRAM_SOURCE_DIR) + "/docs/status.md");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// {path: type} from the doc's tables: a "### `segments[]`" heading names the object, each "| `name` | type |" row a
// field of it ("(top level)" is the document itself).
std::map<std::string, std::string> DocumentedFields(const std::string& doc) {
  std::map<std::string, std::string> out;
  std::istringstream in(doc);
  std::string line, object;
  bool in_fields = false;
  while (std::getline(in, line)) {
    if (line == "## Fields") in_fields = true;
    if (!in_fields) continue;
    if (line.rfind("### ", 0) == 0) {
      std::string title = line.substr(4);
      while (!title.empty() && title.back() == ' ') title.pop_back();
      if (title == "(top level)") {
        object = "";
      } else if (title.size() > 2 && title.front() == '`' && title.back() == '`') {
        object = title.substr(1, title.size() - 2) + ".";
      }
      continue;
    }
    // "| `name` | type |": name of [a-z0-9_], type of [a-z ].
    if (line.rfind("| `", 0) != 0) continue;
    const size_t name_end = line.find("` | ", 3);
    if (name_end == std::string::npos) continue;
    const std::string name = line.substr(3, name_end - 3);
    const size_t type_end = line.find(" |", name_end + 4);
    if (type_end == std::string::npos) continue;
    const std::string type = line.substr(name_end + 4, type_end - name_end - 4);
    auto only = [](const std::string& text, auto allowed) {
      if (text.empty()) return false;
      for (char c : text)
        if (!allowed(c)) return false;
      return true;
    };
    if (!only(name, [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; })) continue;
    if (!only(type, [](char c) { return (c >= 'a' && c <= 'z') || c == ' '; })) continue;
    out[object + name] = type;
  }
  return out;
}

std::string TypeOf(const json& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer()) return "integer";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_object()) return "object";
  if (v.is_array() && !v.empty() && v[0].is_string()) return "array of string";
  if (v.is_array() && !v.empty() && v[0].is_object()) return "array of object";
  return "array (empty)";
}

// {path: type} of a document: an array's elements under "name[]".
void Walk(const json& o, const std::string& prefix, std::map<std::string, std::string>* out) {
  for (const auto& [k, v] : o.items()) {
    const std::string path = prefix + k;
    (*out)[path] = TypeOf(v);
    if (v.is_object()) Walk(v, path + ".", out);
    if (v.is_array() && !v.empty() && v[0].is_object()) Walk(v[0], path + "[].", out);
  }
}

// One of everything, every scalar non-zero (a field the library forgot is then missing, not just empty).
engram::v1::StatusReply Full() {
  engram::v1::StatusReply s;
  s.set_daemon_version("0.2.0");
  s.set_epoch(7);
  s.set_draining(true);
  auto* shm = s.mutable_shm();
  shm->set_path("/dev/shm");
  shm->set_total_bytes(uint64_t{1} << 60);  // past 2^53: a number still, exactly
  shm->set_free_bytes(3);
  shm->set_engram_bytes(4);
  shm->set_huge_pages("always");
  auto* g = s.add_segments();
  g->set_name("engram-1-tp0of1");
  g->set_checkpoint("/ckpt");
  g->set_tp_rank(0);
  g->set_tp_size(1);
  g->set_bytes(uint64_t{200} << 30);
  g->set_state("READY");
  g->set_origin("published");
  g->set_load_seconds(1.5);
  g->set_checksum_state("ok");
  g->set_progress(0.5);
  g->set_error("e");
  g->mutable_prewarm()->set_state("done");
  g->mutable_prewarm()->set_register_seconds(1.25);
  g->mutable_prewarm()->set_seconds(2.5);
  g->mutable_prewarm()->set_at_unix_ms(int64_t{1} << 40);
  g->mutable_prewarm()->set_detail("register_seconds=1.250");
  auto* r = s.add_replicas();
  r->set_pid(10);
  r->set_own_pid(11);
  r->set_uid(1000);
  r->set_dp_rank(1);
  r->set_dp_size(2);
  r->set_local_dp_size(2);
  r->set_tp_rank(0);
  r->set_tp_size(1);
  r->set_segment("engram-1-tp0of1");
  r->set_mode("PRIVATE_PINNED");
  r->set_backend("cpu");
  r->set_attach("");
  r->set_engine("backend=cpu");
  auto* reason = r->add_reasons();
  reason->set_code(engram::v1::SHM_NOT_VISIBLE);
  reason->set_hint("run with --ipc=host");
  r->set_attached_seconds(2.5);
  r->set_register_seconds(-1);
  r->set_lease_id("L1");
  r->set_client_version("0.2.0");
  auto* grp = s.add_groups();
  grp->set_group("g");
  grp->set_checkpoint("/ckpt");
  grp->set_tp_rank(0);
  grp->set_tp_size(1);
  grp->set_size(2);
  grp->set_state("BROKEN");
  grp->set_transport("host");
  grp->set_slot(64);
  grp->set_bytes_per_step(9);
  grp->set_generation(3);
  grp->set_detail("member dp rank 1 left");
  grp->set_left_pid(12);
  grp->set_left_dp_rank(1);
  auto* m = grp->add_members();
  m->set_pid(12);
  m->set_dp_rank(1);
  m->set_edp_rank(1);
  m->set_max_tokens(64);
  m->set_bytes_per_step(5);
  m->set_lease_id("L2");
  m->set_left(true);
  m->set_left_reason("its session with engramd ended");
  m->set_stalled(true);
  s.add_recent_fallbacks("event=fallback pid=10 reasons=SHM_NOT_VISIBLE");
  auto* d = s.mutable_descriptors();
  d->set_socket("engramd.fd.sock");
  d->set_sent(uint64_t{1} << 40);
  d->set_refused(2);
  return s;
}

TEST(StatusJsonTest, EveryFieldIsDocumentedWithItsTypeAndEveryDocumentedFieldIsThere) {
  const std::map<std::string, std::string> documented = DocumentedFields(ReadDoc());
  ASSERT_GT(documented.size(), 50u) << "docs/status.md: no field tables found";
  std::map<std::string, std::string> produced;
  Walk(json::parse(StatusJson(Full())), "", &produced);
  for (const auto& [path, type] : produced) {
    auto it = documented.find(path);
    if (it == documented.end()) {
      ADD_FAILURE() << path << " (" << type << ") is in the document but not in docs/status.md";
    } else {
      EXPECT_EQ(it->second, type) << path << ": docs/status.md says " << it->second << ", the document has " << type;
    }
  }
  for (const auto& [path, type] : documented) {
    EXPECT_TRUE(produced.count(path)) << path << " is in docs/status.md but not in the document";
  }
}

TEST(StatusJsonTest, CountersAreNumbersAndTheSchemaVersionIsTheDocumentedOne) {
  const json j = json::parse(StatusJson(Full()));
  EXPECT_EQ(j["schema_version"], kStatusSchemaVersion);
  EXPECT_NE(ReadDoc().find("**`schema_version`** is " + std::to_string(kStatusSchemaVersion) + "."), std::string::npos)
      << "docs/status.md states another schema version";
  ASSERT_TRUE(j["shm"]["total_bytes"].is_number_unsigned());
  EXPECT_EQ(j["shm"]["total_bytes"].get<uint64_t>(), uint64_t{1} << 60);
  EXPECT_EQ(j["descriptors"]["sent"].get<uint64_t>(), uint64_t{1} << 40);
  EXPECT_EQ(j["replicas"][0]["reasons"], json::array({"SHM_NOT_VISIBLE"}));
  EXPECT_EQ(j["replicas"][0]["hints"], json::parse(R"([{"code":"SHM_NOT_VISIBLE","hint":"run with --ipc=host"}])"));
}

TEST(StatusJsonTest, AnEmptyReplyHasEveryTopLevelField) {
  const json j = json::parse(StatusJson(engram::v1::StatusReply()));
  for (const char* k : {"schema_version", "daemon_version", "epoch", "draining", "shm", "segments", "replicas",
                        "groups", "recent_fallbacks", "descriptors"}) {
    EXPECT_TRUE(j.contains(k)) << k << " missing: " << j.dump();
  }
  EXPECT_TRUE(j["segments"].is_array() && j["groups"].is_array() && j["recent_fallbacks"].is_array()) << j.dump();
  EXPECT_EQ(j["shm"]["free_bytes"], 0);
}

TEST(StatusJsonTest, TextIsMadePrintableAndBytesThatAreNotUtf8DoNotThrow) {
  engram::v1::StatusReply s;
  s.mutable_shm()->set_path("/dev/shm\n\x1b[31mforged");
  s.add_recent_fallbacks(std::string("bad \xff\xfe bytes"));
  const json j = json::parse(StatusJson(s));
  const std::string path = j["shm"]["path"];
  EXPECT_EQ(path.find('\n'), std::string::npos) << path;
  EXPECT_EQ(path.find('\x1b'), std::string::npos) << path;
  EXPECT_EQ(j["recent_fallbacks"].size(), 1u);
}

}  // namespace
}  // namespace engram::client
