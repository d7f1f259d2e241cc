// The status document (client/session/status_json.h; fields: docs/status.md).
#include "client/session/status_json.h"

#include "nlohmann/json.hpp"
#include "proto/printable.h"

namespace engram::client {
namespace {

namespace v1 = engram::v1;
using json = nlohmann::json;

// A replica's reasons twice: their names (what scripts test for) and each with its hint (what to do about it).
json ReasonNames(const google::protobuf::RepeatedPtrField<v1::Reason>& reasons) {
  json out = json::array();
  for (const auto& r : reasons) out.push_back(v1::FallbackReason_Name(r.code()));
  return out;
}

json ReasonHints(const google::protobuf::RepeatedPtrField<v1::Reason>& reasons) {
  json out = json::array();
  for (const auto& r : reasons) out.push_back({{"code", v1::FallbackReason_Name(r.code())}, {"hint", r.hint()}});
  return out;
}

json Shm(const v1::ShmStatus& s) {
  return {{"path", s.path()},
          {"total_bytes", s.total_bytes()},
          {"free_bytes", s.free_bytes()},
          {"engram_bytes", s.engram_bytes()},
          {"huge_pages", s.huge_pages()}};
}

json Segment(const v1::SegmentStatus& g) {
  return {{"name", g.name()},
          {"checkpoint", g.checkpoint()},
          {"tp_rank", g.tp_rank()},
          {"tp_size", g.tp_size()},
          {"bytes", g.bytes()},
          {"state", g.state()},
          {"origin", g.origin()},
          {"load_seconds", g.load_seconds()},
          {"checksum_state", g.checksum_state()},
          {"progress", g.progress()},
          {"error", g.error()},
          {"prewarm",
           {{"state", g.prewarm().state()},
            {"register_seconds", g.prewarm().register_seconds()},
            {"seconds", g.prewarm().seconds()},
            {"at_unix_ms", g.prewarm().at_unix_ms()},
            {"detail", g.prewarm().detail()}}}};
}

json Replica(const v1::ReplicaStatus& r) {
  return {{"pid", r.pid()},
          {"own_pid", r.own_pid()},
          {"uid", r.uid()},
          {"dp_rank", r.dp_rank()},
          {"dp_size", r.dp_size()},
          {"local_dp_size", r.local_dp_size()},
          {"tp_rank", r.tp_rank()},
          {"tp_size", r.tp_size()},
          {"segment", r.segment()},
          {"mode", r.mode()},
          {"backend", r.backend()},
          {"attach", r.attach()},
          {"engine", r.engine()},
          {"reasons", ReasonNames(r.reasons())},
          {"hints", ReasonHints(r.reasons())},
          {"attached_seconds", r.attached_seconds()},
          {"register_seconds", r.register_seconds()},
          {"lease_id", r.lease_id()},
          {"client_version", r.client_version()}};
}

json Member(const v1::GroupMember& m) {
  return {{"pid", m.pid()},
          {"dp_rank", m.dp_rank()},
          {"edp_rank", m.edp_rank()},
          {"max_tokens", m.max_tokens()},
          {"bytes_per_step", m.bytes_per_step()},
          {"lease_id", m.lease_id()},
          {"left", m.left()},
          {"left_reason", m.left_reason()},
          {"stalled", m.stalled()}};
}

json Group(const v1::GroupStatus& g) {
  json members = json::array();
  for (const auto& m : g.members()) members.push_back(Member(m));
  return {{"group", g.group()},
          {"checkpoint", g.checkpoint()},
          {"tp_rank", g.tp_rank()},
          {"tp_size", g.tp_size()},
          {"size", g.size()},
          {"state", g.state()},
          {"transport", g.transport()},
          {"slot", g.slot()},
          {"bytes_per_step", g.bytes_per_step()},
          {"generation", g.generation()},
          {"members", members},
          {"detail", g.detail()},
          {"left_pid", g.left_pid()},
          {"left_dp_rank", g.left_dp_rank()}};
}

}  // namespace

std::string StatusJson(const v1::StatusReply& reply) {
  v1::StatusReply s = reply;
  MakePrintable(&s);  // every string it shows came from a file or a client
  json j;
  j["schema_version"] = kStatusSchemaVersion;
  j["daemon_version"] = s.daemon_version();  // "": an engramd that predates it
  j["epoch"] = s.epoch();
  j["draining"] = s.draining();
  j["shm"] = Shm(s.shm());
  j["segments"] = json::array();
  for (const auto& g : s.segments()) j["segments"].push_back(Segment(g));
  j["replicas"] = json::array();
  for (const auto& r : s.replicas()) j["replicas"].push_back(Replica(r));
  j["groups"] = json::array();
  for (const auto& g : s.groups()) j["groups"].push_back(Group(g));
  j["recent_fallbacks"] = json::array();
  for (const auto& f : s.recent_fallbacks()) j["recent_fallbacks"].push_back(f);
  j["descriptors"] = {
      {"socket", s.descriptors().socket()}, {"sent", s.descriptors().sent()}, {"refused", s.descriptors().refused()}};
  // Bytes that are not UTF-8 (a path from a file) become U+FFFD rather than an exception.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace engram::client
