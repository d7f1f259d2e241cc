// ReplicaRegistry (daemon/replica_registry.h), in-process: leases, FIFO registration tickets (capacity 1 and 2),
// tickets given back on detach, queued waiters removed on detach, capacity changes (also through Coordinator's
// SIGHUP path), outcomes recorded and validated, recent fallbacks bounded, the versions in status. Threads wait on
// conditions, not sleeps.
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "base/utf8.h"
#include "daemon/coordinator.h"
#include "daemon/options.h"
#include "daemon/replica_registry.h"
#include "daemon/status_report.h"
#include "engram/version.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram::daemon {
namespace {

const std::string kSegment = "/ckpt/engram-0000000000001234-tp0of1";

engram::v1::Hello MakeHello(int dp_rank = 0) {
  engram::v1::Hello h;
  h.set_fingerprint(0x1234);
  h.set_tp_size(1);
  h.set_dp_size(64);
  h.set_dp_rank(dp_rank);
  return h;
}

Decision Shared() {
  Decision d;
  d.share = true;
  d.mode = engram::v1::SHARED;
  return d;
}

Decision Fallback(engram::v1::FallbackReason code = engram::v1::DP_SIZE_ONE) {
  Decision d;
  d.mode = engram::v1::PRIVATE_PINNED;
  d.reasons.push_back(MakeReason(code, "hint"));
  return d;
}

// Waits (without a time limit of its own: ctest's timeout bounds a hang) until `cond` holds.
void WaitUntil(const std::function<bool()>& cond) {
  while (!cond()) std::this_thread::yield();
}

const ReplicaInfo* Find(const std::vector<ReplicaInfo>& all, const std::string& lease) {
  for (const auto& r : all) {
    if (r.lease_id == lease) return &r;
  }
  return nullptr;
}

// A replica waiting for a ticket on its own thread.
class Waiter {
 public:
  Waiter(ReplicaRegistry& reg, std::string lease) : lease_(std::move(lease)) {
    thread_ =
        std::thread([this, &reg] { result_ = reg.AcquireTicket(lease_, [this] { return cancel_.load(); }) ? 1 : 0; });
  }
  ~Waiter() {
    cancel_ = true;
    thread_.join();
  }
  bool done() const { return result_ >= 0; }
  bool got() const { return result_ == 1; }

 private:
  std::string lease_;
  std::atomic<bool> cancel_{false};
  std::atomic<int> result_{-1};
  std::thread thread_;
};

TicketState TicketOf(const ReplicaRegistry& reg, const std::string& lease) {
  const auto all = reg.Replicas();
  const ReplicaInfo* r = Find(all, lease);
  return r ? r->ticket : TicketState::kNone;
}

TEST(ReplicaRegistryTest, LeasesFollowSharedSessions) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), PeerCred{100, 1, 1}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), PeerCred{101, 1, 1}, Shared(), kSegment, nullptr);
  const std::string c = reg.Attach(MakeHello(2), PeerCred{102, 1, 1}, Fallback(), kSegment, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(reg.leases_on(kSegment), 2) << "a fallback holds no lease";
  EXPECT_EQ(reg.Replicas().size(), 3u);
  reg.Detach(a);
  EXPECT_EQ(reg.leases_on(kSegment), 1);
  reg.ForgetSegmentsOf("/ckpt");
  EXPECT_EQ(reg.leases_on(kSegment), 0) << "an unloaded checkpoint's leases are forgotten";
  reg.Detach(b);
  reg.Detach(c);
  reg.Detach(c);  // twice is harmless
  EXPECT_TRUE(reg.Replicas().empty());
  EXPECT_EQ(reg.Counters().sessions_total, 3u);
}

TEST(ReplicaRegistryTest, FailedRegistrationReleasesTheLeaseAndFallsBack) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(), PeerCred{100, 1, 1}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  EXPECT_EQ(TicketOf(reg, a), TicketState::kHeld);
  engram::v1::RegisterResult res;
  res.set_ok(false);
  res.set_failed_chunk(3);
  res.set_error("ENOMEM");
  reg.ReportRegistration(a, res);
  EXPECT_EQ(reg.tickets_free(), 1);
  EXPECT_EQ(reg.leases_on(kSegment), 0);
  const auto all = reg.Replicas();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].mode, engram::v1::PRIVATE_PINNED);
  EXPECT_EQ(all[0].reasons.back().code(), engram::v1::REGISTER_FAILED);
  EXPECT_EQ(reg.Counters().fallbacks_by_reason.at("REGISTER_FAILED"), 1u);
  EXPECT_NE(reg.RecentFallbacks().back().find("REGISTER_FAILED (chunk 3)"), std::string::npos);
}

TEST(ReplicaRegistryTest, OneTicketIsHandedOutFirstInFirstOut) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), {}, Shared(), kSegment, nullptr);
  const std::string c = reg.Attach(MakeHello(2), {}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  EXPECT_EQ(reg.tickets_free(), 0);
  Waiter wb(reg, b);
  WaitUntil([&] { return TicketOf(reg, b) == TicketState::kQueued; });
  Waiter wc(reg, c);
  WaitUntil([&] { return reg.ticket_queue_length() == 2; });
  EXPECT_FALSE(wb.done());
  EXPECT_FALSE(wc.done());
  engram::v1::RegisterResult ok;
  ok.set_ok(true);
  ok.set_backend("cpu");
  reg.ReportRegistration(a, ok);
  WaitUntil([&] { return wb.done(); });
  EXPECT_TRUE(wb.got());
  EXPECT_EQ(TicketOf(reg, b), TicketState::kHeld);
  EXPECT_EQ(TicketOf(reg, c), TicketState::kQueued) << "c queued after b: it waits for b";
  EXPECT_FALSE(wc.done());
  reg.ReportRegistration(b, ok);
  WaitUntil([&] { return wc.done(); });
  EXPECT_TRUE(wc.got());
  reg.ReportRegistration(c, ok);
  EXPECT_EQ(reg.tickets_free(), 1);
  EXPECT_EQ(reg.Counters().register_seconds.count, 3u);
  EXPECT_EQ(reg.Counters().attach_seconds.count, 3u) << "each report observes the grant-to-report time too";
}

TEST(ReplicaRegistryTest, TwoTicketsGoToTwoReplicasAtOnce) {
  ReplicaRegistry reg(7, 2);
  const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), {}, Shared(), kSegment, nullptr);
  const std::string c = reg.Attach(MakeHello(2), {}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  ASSERT_TRUE(reg.AcquireTicket(b, [] { return false; }));
  EXPECT_EQ(reg.tickets_free(), 0);
  Waiter wc(reg, c);
  WaitUntil([&] { return TicketOf(reg, c) == TicketState::kQueued; });
  EXPECT_FALSE(wc.done());
  engram::v1::RegisterResult ok;
  ok.set_ok(true);
  reg.ReportRegistration(b, ok);
  WaitUntil([&] { return wc.done(); });
  EXPECT_TRUE(wc.got());
  EXPECT_EQ(reg.tickets_free(), 0);
}

TEST(ReplicaRegistryTest, DetachOfTheHolderGivesTheTicketBack) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), {}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  Waiter wb(reg, b);
  WaitUntil([&] { return TicketOf(reg, b) == TicketState::kQueued; });
  reg.Detach(a);  // killed while registering
  WaitUntil([&] { return wb.done(); });
  EXPECT_TRUE(wb.got());
}

TEST(ReplicaRegistryTest, DetachOfAQueuedWaiterRemovesItFromTheQueue) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), {}, Shared(), kSegment, nullptr);
  const std::string c = reg.Attach(MakeHello(2), {}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  Waiter wb(reg, b);
  WaitUntil([&] { return TicketOf(reg, b) == TicketState::kQueued; });
  Waiter wc(reg, c);
  WaitUntil([&] { return reg.ticket_queue_length() == 2; });
  reg.Detach(b);
  WaitUntil([&] { return wb.done(); });
  EXPECT_FALSE(wb.got()) << "a detached replica gets no ticket";
  EXPECT_EQ(reg.ticket_queue_length(), 1u);
  reg.Detach(a);
  WaitUntil([&] { return wc.done(); });
  EXPECT_TRUE(wc.got()) << "the waiter behind the detached one moves up";
  EXPECT_EQ(reg.ticket_queue_length(), 0u);
}

TEST(ReplicaRegistryTest, CancelledWaiterLeavesTheQueue) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), {}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  int polls = 0;
  EXPECT_FALSE(reg.AcquireTicket(b, [&] { return ++polls > 1; }));
  EXPECT_EQ(reg.ticket_queue_length(), 0u);
  EXPECT_EQ(TicketOf(reg, b), TicketState::kNone);
}

TEST(ReplicaRegistryTest, TicketCapacityChangesTakeEffect) {
  ReplicaRegistry reg(7, 1);
  std::vector<std::string> leases;
  for (int i = 0; i < 3; ++i) leases.push_back(reg.Attach(MakeHello(i), {}, Shared(), kSegment, nullptr));
  ASSERT_TRUE(reg.AcquireTicket(leases[0], [] { return false; }));
  Waiter w1(reg, leases[1]);
  WaitUntil([&] { return TicketOf(reg, leases[1]) == TicketState::kQueued; });
  reg.SetTicketCapacity(2);  // SIGHUP with tickets = 2: the waiter gets the new ticket at once
  WaitUntil([&] { return w1.done(); });
  EXPECT_TRUE(w1.got());
  EXPECT_EQ(reg.ticket_capacity(), 2);
  EXPECT_EQ(reg.tickets_free(), 0);
  // Shrinking below the tickets in use: none free (never negative) until enough come back.
  reg.SetTicketCapacity(1);
  EXPECT_EQ(reg.tickets_free(), 0);
  reg.Detach(leases[0]);
  EXPECT_EQ(reg.tickets_free(), 0) << "two held, capacity one: one given back leaves none free";
  int polls = 0;
  EXPECT_FALSE(reg.AcquireTicket(leases[2], [&] { return ++polls > 1; }));
  reg.Detach(leases[1]);
  EXPECT_EQ(reg.tickets_free(), 1);
  EXPECT_TRUE(reg.AcquireTicket(leases[2], [] { return false; }));
  reg.SetTicketCapacity(0);  // refused values are clamped to one
  EXPECT_EQ(reg.ticket_capacity(), 1);
}

// The same through Coordinator::Reload, the SIGHUP path main() calls: the registry's capacity changes, not only the
// option.
TEST(ReplicaRegistryTest, ReloadChangesTheTicketCapacity) {
  testing::TempDir dir;
  Options opts;
  opts.shm_dir = dir.path();
  opts.tickets = 1;
  Coordinator state(opts);
  ASSERT_TRUE(state.Start().ok());
  std::vector<std::string> leases(2);
  for (int i = 0; i < 2; ++i) {
    auto m = state.Attach(
        MakeHello(i), PeerCred{}, [] { return false; }, nullptr, &leases[i]);
    ASSERT_TRUE(m.ok()) << m.status();
  }
  ASSERT_TRUE(state.AcquireTicket(leases[0], [] { return false; }));
  int polls = 0;
  EXPECT_FALSE(state.AcquireTicket(leases[1], [&] { return ++polls > 1; })) << "one ticket, in use";
  Options more = opts;
  more.tickets = 2;
  ASSERT_TRUE(state.Reload(more).ok());
  polls = 0;
  EXPECT_TRUE(state.AcquireTicket(leases[1], [&] { return ++polls > 1; })) << "the second ticket exists now";
  EXPECT_EQ(state.options().tickets, 2);
}

TEST(ReplicaRegistryTest, StatusShowsRegisteringWhileATicketIsHeld) {
  testing::TempDir dir;
  SegmentRegistry segments(dir.path(), 1, 7);
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(), PeerCred{55, 0, 0}, Shared(), kSegment, nullptr);
  EXPECT_EQ(BuildStatus(segments, reg, false).replicas(0).backend(), "unknown");
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  EXPECT_EQ(BuildStatus(segments, reg, false).replicas(0).backend(), "registering");
  engram::v1::RegisterResult ok;
  ok.set_ok(true);
  ok.set_backend("cpu");
  reg.ReportRegistration(a, ok);
  const auto s = BuildStatus(segments, reg, true);
  EXPECT_EQ(s.replicas(0).backend(), "cpu");
  EXPECT_EQ(s.replicas(0).mode(), "SHARED");
  EXPECT_EQ(s.replicas(0).pid(), 55);
  EXPECT_TRUE(s.draining());
}

// A ticket held past --ticket-hold-ms is reclaimed when status (or a metrics scrape) is read, not only when another
// replica waits: status then shows the holder no longer registering, and the expiry among the recent fallbacks.
TEST(ReplicaRegistryTest, AnExpiredTicketIsReclaimedByStatusWithNobodyWaiting) {
  testing::TempDir dir;
  Options opts;
  opts.shm_dir = dir.path();
  opts.tickets = 1;
  opts.ticket_hold_ms = 1;
  Coordinator state(opts);
  ASSERT_TRUE(state.Start().ok());
  std::string lease;
  auto m = state.Attach(
      MakeHello(), PeerCred{77, 0, 0}, [] { return false; }, nullptr, &lease);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(state.AcquireTicket(lease, [] { return false; }));
  const auto taken = std::chrono::steady_clock::now();
  WaitUntil([&] { return std::chrono::steady_clock::now() - taken > std::chrono::milliseconds(2); });  // past 1 ms
  const engram::v1::StatusReply s = state.Status();
  ASSERT_EQ(s.replicas_size(), 1);
  EXPECT_NE(s.replicas(0).backend(), "registering") << "the expired ticket is still shown held";
  bool named = false;
  for (const auto& f : s.recent_fallbacks()) named |= f.find("ticket_expired pid 77") != std::string::npos;
  EXPECT_TRUE(named) << "the expiry is not among the recent fallbacks";
}

// Status carries the daemon's version and, per replica, the client_version its hello said ("" when none), through
// its registration and its outcome.
TEST(ReplicaRegistryTest, StatusCarriesTheDaemonsAndEachReplicasVersion) {
  testing::TempDir dir;
  SegmentRegistry segments(dir.path(), 1, 7);
  ReplicaRegistry reg(7, 1);
  engram::v1::Hello with = MakeHello(0);
  with.set_client_version("7.8.9-rc1");
  const std::string a = reg.Attach(with, PeerCred{55, 0, 0}, Shared(), kSegment, nullptr);
  const std::string b = reg.Attach(MakeHello(1), PeerCred{56, 0, 0}, Fallback(), "", nullptr);
  engram::v1::RegisterResult ok;
  ok.set_ok(true);
  ok.set_backend("cpu");
  ASSERT_TRUE(reg.AcquireTicket(a, [] { return false; }));
  reg.ReportRegistration(a, ok);
  engram::v1::Outcome shared;
  shared.set_mode(engram::v1::SHARED);
  shared.set_backend("cpu");
  shared.set_attach(engram::v1::ATTACH_DESCRIPTOR);
  ASSERT_TRUE(reg.RecordOutcome(a, shared).ok());
  const auto s = BuildStatus(segments, reg, false);
  EXPECT_EQ(s.daemon_version(), ENGRAM_VERSION_STRING);
  ASSERT_EQ(s.replicas_size(), 2);
  for (const auto& r : s.replicas()) EXPECT_EQ(r.client_version(), r.pid() == 55 ? "7.8.9-rc1" : "") << r.pid();
  const auto all = reg.Replicas();
  EXPECT_EQ(Find(all, a)->hello.client_version(), "7.8.9-rc1");
  EXPECT_EQ(Find(all, b)->hello.client_version(), "");
}

engram::v1::Outcome MakeOutcome(engram::v1::Mode mode, const std::string& backend,
                                std::vector<engram::v1::FallbackReason> codes = {}) {
  engram::v1::Outcome o;
  o.set_mode(mode);
  o.set_backend(backend);
  if (mode == engram::v1::SHARED) o.set_attach(engram::v1::ATTACH_DESCRIPTOR);
  for (auto c : codes) *o.add_reasons() = MakeReason(c, "client hint");
  return o;
}

TEST(ReplicaRegistryTest, OutcomeIsRecordedExactlyAndOnlyOnce) {
  testing::TempDir dir;
  SegmentRegistry segments(dir.path(), 1, 7);
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
  ASSERT_TRUE(reg.RecordOutcome(a, MakeOutcome(engram::v1::SHARED, "cuda")).ok());
  auto s = BuildStatus(segments, reg, false);
  EXPECT_EQ(s.replicas(0).mode(), "SHARED");
  EXPECT_EQ(s.replicas(0).backend(), "cuda");
  EXPECT_EQ(s.replicas(0).attach(), "descriptor");
  EXPECT_EQ(s.replicas(0).reasons_size(), 0);
  EXPECT_EQ(reg.leases_on(kSegment), 1);
  auto again = reg.RecordOutcome(a, MakeOutcome(engram::v1::SHARED, "cuda"));
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_EQ(reg.RecordOutcome("nobody", MakeOutcome(engram::v1::SHARED, "cpu")).code(), absl::StatusCode::kNotFound);
}

TEST(ReplicaRegistryTest, OutcomeOtherThanSharedReleasesTheLease) {
  testing::TempDir dir;
  SegmentRegistry segments(dir.path(), 1, 7);
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), PeerCred{9, 0, 0}, Shared(), kSegment, nullptr);
  ASSERT_EQ(reg.leases_on(kSegment), 1);
  ASSERT_TRUE(reg.RecordOutcome(a, MakeOutcome(engram::v1::PRIVATE_PINNED, "cpu", {engram::v1::NO_CUDA_DEVICE})).ok());
  EXPECT_EQ(reg.leases_on(kSegment), 0);
  auto s = BuildStatus(segments, reg, false);
  EXPECT_EQ(s.replicas(0).mode(), "PRIVATE_PINNED");
  EXPECT_EQ(s.replicas(0).backend(), "cpu");
  ASSERT_EQ(s.replicas(0).reasons_size(), 1);
  EXPECT_EQ(s.replicas(0).reasons(0).code(), engram::v1::NO_CUDA_DEVICE);
  EXPECT_EQ(s.replicas(0).reasons(0).hint(), "client hint");
  EXPECT_NE(reg.RecentFallbacks().back().find("NO_CUDA_DEVICE -> PRIVATE_PINNED"), std::string::npos);
  EXPECT_EQ(reg.Counters().fallbacks_by_reason.at("NO_CUDA_DEVICE"), 1u);
}

TEST(ReplicaRegistryTest, OutcomeAfterAFallbackReplacesTheDecision) {
  ReplicaRegistry reg(7, 1);
  Decision d = Fallback(engram::v1::SHM_NOT_VISIBLE);
  d.reasons.push_back(MakeReason(engram::v1::DP_SHARDED_NOT_BUILT, "h"));
  const std::string a = reg.Attach(MakeHello(0), {}, d, "", nullptr);
  ASSERT_TRUE(reg.RecordOutcome(a, MakeOutcome(engram::v1::DEVICE, "cuda", {engram::v1::SHM_NOT_VISIBLE})).ok());
  const auto all = reg.Replicas();
  EXPECT_EQ(all[0].mode, engram::v1::DEVICE);
  EXPECT_EQ(all[0].backend, "cuda");
  ASSERT_EQ(all[0].reasons.size(), 1u);
  EXPECT_EQ(all[0].reasons[0].code(), engram::v1::SHM_NOT_VISIBLE);
  EXPECT_TRUE(all[0].outcome_reported);
  EXPECT_EQ(reg.Counters().fallbacks_by_reason.at("SHM_NOT_VISIBLE"), 1u) << "not counted twice";
}

// Status never lists SHARED for a replica the daemon did not grant, or whose lease is gone (e.g. after a failed
// registration): such an outcome is refused.
TEST(ReplicaRegistryTest, SharedOutcomeWithoutAGrantIsRefused) {
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Fallback(engram::v1::DP_SIZE_ONE), "", nullptr);
  EXPECT_EQ(reg.RecordOutcome(a, MakeOutcome(engram::v1::SHARED, "cpu")).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.Replicas()[0].mode, engram::v1::PRIVATE_PINNED) << "the decision stands";
  EXPECT_TRUE(reg.RecordOutcome(a, MakeOutcome(engram::v1::PRIVATE_PINNED, "cpu", {engram::v1::DP_SIZE_ONE})).ok())
      << "a true outcome is still accepted after a refused one";
}

TEST(ReplicaRegistryTest, MalformedOutcomesAreRefused) {
  std::vector<engram::v1::Outcome> bad;
  bad.push_back(MakeOutcome(engram::v1::MODE_UNSPECIFIED, "cpu"));
  bad.push_back(MakeOutcome(static_cast<engram::v1::Mode>(99), "cpu"));
  bad.push_back(MakeOutcome(engram::v1::SHARED, "gpu"));
  bad.push_back(MakeOutcome(engram::v1::SHARED, ""));
  bad.push_back(MakeOutcome(engram::v1::SHARED, "cpu", {static_cast<engram::v1::FallbackReason>(999)}));
  bad.push_back(MakeOutcome(engram::v1::SHARED, "cpu", {engram::v1::REASON_UNSPECIFIED}));
  bad.push_back(MakeOutcome(engram::v1::PRIVATE_PINNED, "cpu",
                            std::vector<engram::v1::FallbackReason>(33, engram::v1::NO_CUDA_DEVICE)));
  // The attach method: no mode but SHARED has one, and it is a known value.
  bad.push_back(MakeOutcome(engram::v1::PRIVATE_PINNED, "cpu"));
  bad.back().set_attach(engram::v1::ATTACH_PATH);
  bad.push_back(MakeOutcome(engram::v1::SHARED, "cpu"));
  bad.back().set_attach(static_cast<engram::v1::AttachMethod>(7));
  ReplicaRegistry reg(7, 1);
  for (const auto& o : bad) {
    const std::string a = reg.Attach(MakeHello(0), {}, Shared(), kSegment, nullptr);
    auto st = reg.RecordOutcome(a, o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << o.ShortDebugString();
    EXPECT_FALSE(reg.Replicas().back().outcome_reported);
    EXPECT_EQ(reg.Replicas().back().mode, engram::v1::SHARED) << "nothing recorded";
    reg.Detach(a);
  }
  engram::v1::Outcome clean;
  engram::v1::Outcome older = MakeOutcome(engram::v1::SHARED, "cuda");
  older.set_attach(engram::v1::ATTACH_NONE);
  EXPECT_TRUE(ValidateOutcome(older, &clean).ok()) << "a client older than descriptor passing names no method";
  EXPECT_TRUE(ValidateOutcome(MakeOutcome(engram::v1::DP_SHARDED, "cpu",
                                          std::vector<engram::v1::FallbackReason>(32, engram::v1::NO_CUDA_DEVICE)),
                              &clean)
                  .ok())
      << "32 reasons are allowed";
}

// A replica's hints reach status and the operator's terminal: control characters cannot forge a status row or
// drive the terminal (printed raw, they could).
TEST(ReplicaRegistryTest, HintsLoseTheirControlCharacters) {
  engram::v1::Outcome o = MakeOutcome(engram::v1::PRIVATE_PINNED, "cpu", {engram::v1::NO_CUDA_DEVICE});
  o.mutable_reasons(0)->set_hint("fine\n4242   0      0/1    0/1    SHARED \x1b[2Jforged\r\x7f\t\xC3\xA9");
  engram::v1::Outcome clean;
  ASSERT_TRUE(ValidateOutcome(o, &clean).ok());
  EXPECT_EQ(clean.reasons(0).hint(), "fine?4242   0      0/1    0/1    SHARED ?[2Jforged???\xC3\xA9");
  EXPECT_EQ(EchoOf("/ckpt\n/evil"), "/ckpt?/evil");
  // C1 controls (CSI as U+009B) and bidirectional overrides cannot reach a terminal either; other text stays.
  EXPECT_EQ(engram::Printable("a\xC2\x9B"
                              "2Jb\xE2\x80\xAE"
                              "c\xE2\x81\xA6"
                              "d\xC3\xA9"),
            "a?2Jb?c?d\xC3\xA9");
}

TEST(ReplicaRegistryTest, LongHintsAreCutAtACharacterBoundary) {
  engram::v1::Outcome o = MakeOutcome(engram::v1::PRIVATE_PINNED, "cpu", {engram::v1::NO_CUDA_DEVICE});
  o.mutable_reasons(0)->set_hint(std::string(2000, 'x'));
  engram::v1::Outcome clean;
  ASSERT_TRUE(ValidateOutcome(o, &clean).ok());
  EXPECT_EQ(clean.reasons(0).hint(), std::string(512, 'x'));
  // 511 ASCII bytes then a 2-byte character straddling the limit: the character goes whole.
  o.mutable_reasons(0)->set_hint(std::string(511, 'y') + "\xC3\xA9" + "zzz");
  ASSERT_TRUE(ValidateOutcome(o, &clean).ok());
  EXPECT_EQ(clean.reasons(0).hint(), std::string(511, 'y'));
  ReplicaRegistry reg(7, 1);
  const std::string a = reg.Attach(MakeHello(0), {}, Fallback(), "", nullptr);
  ASSERT_TRUE(reg.RecordOutcome(a, o).ok());
  EXPECT_EQ(reg.Replicas()[0].reasons[0].hint().size(), 511u);
}

TEST(ReplicaRegistryTest, RecentFallbacksAreBounded) {
  ReplicaRegistry reg(7, 1);
  for (int i = 0; i < 40; ++i) {
    reg.Attach(MakeHello(i), PeerCred{1000 + i, 0, 0}, Fallback(), "", nullptr);
  }
  const auto recent = reg.RecentFallbacks();
  ASSERT_EQ(recent.size(), kMaxRecentFallbacks);
  EXPECT_EQ(recent.front().rfind("pid 1008 dp 8 tp 0: DP_SIZE_ONE -> PRIVATE_PINNED", 0), 0u) << recent.front();
  EXPECT_EQ(recent.back().rfind("pid 1039 ", 0), 0u) << recent.back();
  EXPECT_EQ(reg.Counters().fallbacks_by_reason.at("DP_SIZE_ONE"), 40u) << "counters are not bounded";
}

TEST(ReplicaRegistryTest, NotifyAllReachesEverySession) {
  ReplicaRegistry reg(7, 1);
  int calls = 0;
  for (int i = 0; i < 3; ++i) {
    reg.Attach(MakeHello(i), {}, Fallback(), "",
               [&](const engram::v1::ServerMessage& m) { calls += m.event().kind() == engram::v1::Event::DRAINING; });
  }
  engram::v1::ServerMessage m;
  m.mutable_event()->set_kind(engram::v1::Event::DRAINING);
  EXPECT_EQ(reg.NotifyAll(m), 3u);
  EXPECT_EQ(calls, 3);
}

}  // namespace
}  // namespace engram::daemon
