#include "daemon/group_registry.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/utf8.h"
#include "daemon/fallback.h"
#include "shm/dp_region_name.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {
namespace {

bool NameOk(const std::string& name) {
  return std::all_of(name.begin(), name.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '-' || ch == '_' ||
           ch == '.';
  });
}

}  // namespace

int32_t GroupRegistry::EdpSize(const engram::v1::Hello& h) {
  const int32_t dp = std::max(1, h.dp_size());
  const int32_t local = h.local_dp_size() > 0 ? h.local_dp_size() : dp;
  return std::gcd(dp, local);
}

absl::Status GroupRegistry::Join(const std::string& lease_id, const engram::v1::Hello& h, const PeerCred& peer,
                                 const engram::v1::GroupJoin& join, Notify notify) {
  if (!h.config().embedding_across_dp()) {
    return absl::FailedPreconditionError("group join: this session's hello did not ask for embedding_across_dp");
  }
  const int32_t edp = EdpSize(h);
  if (edp < 2) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "group join: dp %d with %d replicas on this node gives a DP group of %d: nothing to shard across", h.dp_size(),
        h.local_dp_size(), edp));
  }
  if (join.name().size() > kMaxGroupNameBytes || !NameOk(join.name())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("group join: the name must be at most %d bytes of [A-Za-z0-9._-]", kMaxGroupNameBytes));
  }
  if (join.transport() != "host" && join.transport() != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("group join: transport \"", EchoOf(join.transport(), 32), "\" is neither \"host\" nor \"nccl\""));
  }
  if (join.max_tokens() < 1 || join.max_tokens() > kMaxGroupSlot) {
    return absl::InvalidArgumentError(
        absl::StrFormat("group join: max_tokens %d is not in [1, %d]", join.max_tokens(), kMaxGroupSlot));
  }
  if (join.bytes_per_step() > (uint64_t{1} << 42)) {
    return absl::InvalidArgumentError("group join: bytes_per_step is implausibly large");
  }
  const int32_t edp_rank = h.dp_rank() % edp, index = h.dp_rank() / edp;
  if (join.rendezvous().size() > kMaxRendezvousBytes || (edp_rank == 0 && join.rendezvous().empty())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("group join: rendezvous is %d bytes; the rank-0 member must give 1..%d bytes",
                        join.rendezvous().size(), kMaxRendezvousBytes));
  }
  // The key scopes a group to its uid (another uid's sessions can neither take nor squat it) and to the deployment's
  // name (two deployments of one checkpoint on a node, ENGRAM_DP_GROUP); edp: one size a group.
  const std::string key =
      absl::StrFormat("%su%d/%016x/tp%dof%d/dp%d/e%d/g%d", join.name().empty() ? "" : join.name() + "/", peer.uid,
                      h.fingerprint(), h.tp_rank(), h.tp_size(), h.dp_size(), edp, index);

  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lease_group_.count(lease_id)) {
      return absl::FailedPreconditionError(
          "group join: this session is a member of a DP group already (leave it first: GroupLeave)");
    }
    auto it = groups_.find(key);
    if (it != groups_.end() && it->second.status.state() == "BROKEN") {
      // A new member under the key of a broken group starts a new group; the broken one stays in the history.
      for (const auto& m : it->second.members) {
        if (!m.info.left()) lease_group_.erase(m.lease_id);
      }
      RetireLocked(it);
      it = groups_.end();
    }
    if (it == groups_.end()) {
      Group g;
      g.generation = next_generation_++;
      g.status.set_group(key);
      g.status.set_checkpoint(EchoOf(h.checkpoint()));
      g.status.set_tp_rank(h.tp_rank());
      g.status.set_tp_size(h.tp_size());
      g.status.set_size(edp);
      g.status.set_state("FORMING");
      g.status.set_transport(join.transport());
      g.status.set_generation(g.generation);
      it = groups_.emplace(key, std::move(g)).first;
    }
    Group& g = it->second;
    if (g.status.state() != "FORMING") {
      return absl::AlreadyExistsError(
          absl::StrCat("group join: group ", key, " is ", g.status.state(),
                       ": no member joins a group that already formed (a second deployment of this "
                       "checkpoint with the same DP layout on this node as this uid "
                       "needs its own DP group name: ENGRAM_DP_GROUP=<name>)"));
    }
    // A group is one uid's: another uid (another tenant admitted by --group) may not take a rank in it, break it
    // while it forms, or name its exchange region.
    if (!g.members.empty() && g.members.front().peer.uid != peer.uid) {
      return absl::PermissionDeniedError(absl::StrCat("group join: group ", key, " belongs to uid ",
                                                      g.members.front().peer.uid, ", not to uid ", peer.uid));
    }
    if (g.status.transport() != join.transport()) {
      return absl::FailedPreconditionError(absl::StrCat("group join: group ", key, " uses transport ",
                                                        g.status.transport(), ", this member asked for ",
                                                        join.transport()));
    }
    for (const auto& m : g.members) {
      if (m.info.edp_rank() == edp_rank) {
        return absl::AlreadyExistsError(absl::StrFormat(
            "group join: edp rank %d of group %s is taken by pid %d (dp rank %d): another deployment of this "
            "checkpoint with the same DP layout runs on this node as this uid; give each deployment its own DP group "
            "name (ENGRAM_DP_GROUP=<name> in each of its replicas)",
            edp_rank, key, m.peer.pid, m.info.dp_rank()));
      }
    }
    Member m;
    m.lease_id = lease_id;
    m.peer = peer;
    m.notify = std::move(notify);
    m.info.set_pid(peer.pid);
    m.info.set_dp_rank(h.dp_rank());
    m.info.set_edp_rank(edp_rank);
    m.info.set_max_tokens(join.max_tokens());
    m.info.set_bytes_per_step(join.bytes_per_step());
    m.info.set_lease_id(lease_id);
    m.join_id = join.join_id();
    if (edp_rank == 0) g.rendezvous = join.rendezvous();
    g.members.push_back(std::move(m));
    lease_group_[lease_id] = key;
    RefreshStatus(g);
    spdlog::info("event=group_join group={} pid={} dp_rank={} edp_rank={} members={}/{}", engram::LogValue(key),
                 peer.pid, h.dp_rank(), edp_rank, g.members.size(), edp);
    if (static_cast<int32_t>(g.members.size()) == edp) FormLocked(g, &out);
  }
  Send(out);
  return absl::OkStatus();
}

void GroupRegistry::Enqueue(Group& g, const Member& m, const engram::v1::ServerMessage& msg, Outbox* out) {
  if (!m.notify) return;
  if (out->delivery == nullptr) {
    out->delivery = g.delivery;
    out->ticket = g.delivery->next_ticket++;
  }
  out->updates.push_back({m.notify, msg});
  out->updates.back().msg.mutable_group_update()->set_join_id(m.join_id);
}

void GroupRegistry::Send(Outbox& out) {
  if (out.delivery == nullptr) return;
  Delivery& d = *out.delivery;
  {
    std::unique_lock<std::mutex> lock(d.mu);
    d.cv.wait(lock, [&] { return d.serving == out.ticket; });
  }
  for (auto& o : out.updates) o.notify(o.msg);
  {
    std::lock_guard<std::mutex> lock(d.mu);
    ++d.serving;
  }
  d.cv.notify_all();
  out = Outbox();
}

void GroupRegistry::RetireLocked(std::map<std::string, Group>::iterator it) {
  // A host-transport group's exchange region (a POSIX shm object its rank 0 named as the rendezvous) goes with
  // the group: its creator may have died before removing it, or every member while it existed. Only a name of
  // the region's own form is removed (kDpRegionPrefix, one component), and only a region owned by the group's uid:
  // a member may name any region as its rendezvous, and a daemon running as root would otherwise remove another
  // tenant's. Where this daemon may not remove it (another uid's, the daemon not root) the log says so.
  const Group& g = it->second;
  if (g.status.transport() == "host" && IsDpRegionName(g.rendezvous) && !g.members.empty()) {
    const uint32_t group_uid = g.members.front().peer.uid;
    struct stat st {};
    if (env_->Lstat(("/dev/shm" + g.rendezvous).c_str(), &st) != 0) {
      // gone already: its creator removed it
    } else if (!S_ISREG(st.st_mode) || st.st_uid != group_uid) {
      spdlog::warn(
          "event=group_region_kept group={} region={} owner_uid={} group_uid={}: not the group's, left in place",
          engram::LogValue(it->first), engram::LogValue(g.rendezvous), st.st_uid, group_uid);
    } else if (env_->ShmUnlink(g.rendezvous.c_str()) == 0) {
      spdlog::info("event=group_region_removed group={} region={}", engram::LogValue(it->first),
                   engram::LogValue(g.rendezvous));
    } else if (errno != ENOENT) {
      spdlog::warn("event=group_region_left group={} region={} errno={}: remove it by hand",
                   engram::LogValue(it->first), engram::LogValue(g.rendezvous), errno);
    }
  }
  history_.push_front(it->second.status);
  if (history_.size() > kMaxGroupHistory) history_.pop_back();
  groups_.erase(it);
}

void GroupRegistry::RefreshStatus(Group& g) {
  std::sort(g.members.begin(), g.members.end(),
            [](const Member& a, const Member& b) { return a.info.edp_rank() < b.info.edp_rank(); });
  g.status.clear_members();
  int32_t slot = 0;
  uint64_t bytes = 0;
  for (const auto& m : g.members) {
    *g.status.add_members() = m.info;
    slot = std::max(slot, m.info.max_tokens());
    bytes += m.info.bytes_per_step();
  }
  g.status.set_slot(slot);
  g.status.set_bytes_per_step(bytes);
}

void GroupRegistry::FormLocked(Group& g, Outbox* out) {
  g.status.set_state("FORMED");
  engram::v1::ServerMessage msg;
  auto* u = msg.mutable_group_update();
  u->set_state(engram::v1::GroupUpdate::FORMED);
  u->set_group(g.status.group());
  u->set_rendezvous(g.rendezvous);
  u->set_slot(g.status.slot());
  *u->mutable_members() = g.status.members();
  u->set_generation(g.generation);
  for (auto& m : g.members) Enqueue(g, m, msg, out);
  spdlog::info("event=group_formed group={} size={} slot={} transport={} bytes_per_step={}",
               engram::LogValue(g.status.group()), g.members.size(), g.status.slot(), g.status.transport(),
               g.status.bytes_per_step());
}

void GroupRegistry::DepartLocked(const std::string& key, const std::string& lease_id, const std::string& reason,
                                 bool breaks_forming, Outbox* out, const std::vector<int32_t>& stalled) {
  lease_group_.erase(lease_id);
  auto it = groups_.find(key);
  if (it == groups_.end()) return;
  Group& g = it->second;
  auto self = std::find_if(g.members.begin(), g.members.end(), [&](const Member& m) { return m.lease_id == lease_id; });
  if (self == g.members.end() || self->info.left()) return;
  const std::string state = g.status.state();
  if (state == "FORMING" && !breaks_forming) {
    // Its session ended before the group formed: another process may take its edp rank.
    g.members.erase(self);
    RefreshStatus(g);
    if (g.members.empty()) groups_.erase(it);
    return;
  }
  self->notify = nullptr;
  self->info.set_left(true);
  self->info.set_left_reason(reason);
  const Member gone = *self;
  // The first member it named stalled that is still in the group (not itself): the group's cause of the break.
  const Member* cause = nullptr;
  for (int32_t r : stalled) {
    for (Member& m : g.members) {
      if (m.info.edp_rank() != r || m.lease_id == lease_id || m.info.left()) continue;
      m.info.set_stalled(true);
      if (cause == nullptr) cause = &m;
    }
  }
  const Member culprit = cause != nullptr ? *cause : gone;
  RefreshStatus(g);  // sorts the members: `self` and `cause` are stale from here
  if (state != "BROKEN") {
    g.status.set_state("BROKEN");
    g.status.set_left_pid(culprit.peer.pid);
    g.status.set_left_dp_rank(culprit.info.dp_rank());
    if (cause != nullptr) {
      g.status.set_detail(absl::StrFormat(
          "member dp rank %d (edp rank %d, pid %d) stalled: member dp rank %d (pid %d) gave up waiting for it: %s",
          culprit.info.dp_rank(), culprit.info.edp_rank(), culprit.peer.pid, gone.info.dp_rank(), gone.peer.pid,
          reason));
    } else {
      g.status.set_detail(absl::StrFormat("member dp rank %d (edp rank %d, pid %d) left%s: %s", gone.info.dp_rank(),
                                          gone.info.edp_rank(), gone.peer.pid,
                                          state == "FORMING" ? " before the group formed" : "", reason));
    }
    engram::v1::ServerMessage msg;
    auto* u = msg.mutable_group_update();
    u->set_state(engram::v1::GroupUpdate::BROKEN);
    u->set_group(key);
    u->set_detail(g.status.detail());
    u->set_left_pid(culprit.peer.pid);
    u->set_left_dp_rank(culprit.info.dp_rank());
    u->set_generation(g.generation);
    for (auto& m : g.members) {
      if (!m.info.left()) Enqueue(g, m, msg, out);
    }
    spdlog::warn("event=group_broken group={} left_pid={} left_dp_rank={} cause_pid={} reason={}",
                 engram::LogValue(key), gone.peer.pid, gone.info.dp_rank(), culprit.peer.pid,
                 engram::LogQuoted(reason));
  }
  if (std::all_of(g.members.begin(), g.members.end(), [](const Member& m) { return m.info.left(); })) RetireLocked(it);
}

void GroupRegistry::Leave(const std::string& lease_id) {
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto lg = lease_group_.find(lease_id);
    if (lg == lease_group_.end()) return;
    const std::string key = lg->second;
    DepartLocked(key, lease_id, "its session with engramd ended; the group's exchange cannot continue",
                 /*breaks_forming=*/false, &out);
  }
  Send(out);
}

absl::StatusOr<engram::v1::GroupLeft> GroupRegistry::LeaveGroup(const std::string& lease_id,
                                                                const engram::v1::GroupLeave& leave) {
  if (leave.reason().size() > kMaxLeaveReasonBytes) {
    return absl::InvalidArgumentError(absl::StrFormat("group leave: the reason is %d bytes, at most %d are accepted",
                                                      leave.reason().size(), kMaxLeaveReasonBytes));
  }
  const std::string reason =
      leave.reason().empty() ? std::string("it left the group (no reason given)") : Printable(leave.reason());
  engram::v1::GroupLeft left;
  Outbox out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto lg = lease_group_.find(lease_id);
    if (lg == lease_group_.end()) {
      return absl::FailedPreconditionError(
          "group leave: this session is not a member of any DP group (it never joined, it left already, or its "
          "broken group was replaced)");
    }
    const std::string key = lg->second;
    if (!leave.group().empty() && leave.group() != key) {
      if (groups_.count(leave.group())) {
        return absl::PermissionDeniedError(
            absl::StrCat("group leave: this session is not a member of group ", EchoOf(leave.group()),
                         ": a session leaves only its own membership (it is a member of ", key, ")"));
      }
      return absl::NotFoundError(absl::StrCat("group leave: there is no group ", EchoOf(leave.group()),
                                              " (this session is a member of ", key, ")"));
    }
    // A session's group lives while it is a member (lease_group_ loses the lease before the group goes).
    const Group& g = groups_.find(key)->second;
    if (leave.generation() != 0 && leave.generation() != g.generation) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "group leave: generation %d of group %s is not this session's (it is a member of generation %d)",
          leave.generation(), key, g.generation));
    }
    left.set_group(key);
    left.set_generation(g.generation);
    spdlog::info("event=group_leave group={} lease={} reason={}", engram::LogValue(key), lease_id,
                 engram::LogQuoted(reason));
    if (leave.stalled_edp_ranks_size() > g.status.size()) {
      return absl::InvalidArgumentError(absl::StrFormat("group leave: %d stalled members named in a group of %d",
                                                        leave.stalled_edp_ranks_size(), g.status.size()));
    }
    const std::vector<int32_t> stalled(leave.stalled_edp_ranks().begin(), leave.stalled_edp_ranks().end());
    DepartLocked(key, lease_id, reason, /*breaks_forming=*/true, &out, stalled);
  }
  Send(out);
  return left;
}

std::vector<engram::v1::GroupStatus> GroupRegistry::Groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<engram::v1::GroupStatus> out;
  for (const auto& [key, g] : groups_) out.push_back(g.status);
  out.insert(out.end(), history_.begin(), history_.end());
  return out;
}

}  // namespace engram::daemon
