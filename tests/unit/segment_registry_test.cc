// SegmentRegistry (daemon/segment_registry.h), in-process over a temporary shm directory and a small synthetic
// checkpoint: publish, offers for hellos, adoption by a second registry (checksums verified in the background),
// a corrupted adopted segment republished, debris removed, unserved READY segments retired, load/unload, and a
// missing shm directory. Waits are on conditions, never on time.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "daemon/fallback.h"
#include "daemon/segment_registry.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "shm/env.h"
#include "shm/segment.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram::daemon {
namespace {

using testing::TempDir;

void WaitUntil(const std::function<bool()>& cond) {
  while (!cond()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

class SegmentRegistryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    for (int seed : {1, 2}) {
      tools::SyntheticSpec spec;
      spec.out_dir = *dir_ / ("ck" + std::to_string(seed));
      spec.table_mib = 1;
      spec.seed = static_cast<uint64_t>(seed);
      spec.threads = 2;
      auto r = tools::WriteSyntheticCheckpoint(spec);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
  static void TearDownTestSuite() { delete dir_; }

  void SetUp() override {
    shm_ = std::make_unique<TempDir>();
    ck1_ = *dir_ / "ck1";
    ck2_ = *dir_ / "ck2";
    auto c = Checkpoint::Open(ck1_);
    ASSERT_TRUE(c.ok()) << c.status();
    fp1_ = (*c)->Fingerprint();
  }

  engram::v1::Hello HelloFor(uint64_t fp, int tp_size, int tp_rank) const {
    engram::v1::Hello h;
    h.set_fingerprint(fp);
    h.set_tp_size(tp_size);
    h.set_tp_rank(tp_rank);
    h.set_dp_size(2);
    return h;
  }

  static std::vector<SegmentInfo> Settled(SegmentRegistry& reg) {
    EXPECT_TRUE(reg.WaitSettled(std::chrono::hours(1)));
    return reg.Segments();
  }

  static TempDir* dir_;
  std::unique_ptr<TempDir> shm_;
  std::string ck1_, ck2_;
  uint64_t fp1_ = 0;
};

TempDir* SegmentRegistryTest::dir_ = nullptr;

const auto kNever = [] { return false; };

TEST_F(SegmentRegistryTest, PublishesEveryShardAndOffersIt) {
  SegmentRegistry reg(shm_->path(), 2, 99);
  ASSERT_TRUE(reg.Start({ck1_}, {1, 2}).ok());
  const auto segs = Settled(reg);
  ASSERT_EQ(segs.size(), 3u);
  for (const auto& s : segs) {
    EXPECT_EQ(Name(s.state), "READY") << s.name << " " << s.error;
    EXPECT_EQ(Name(s.origin), "published");
    EXPECT_EQ(Name(s.checksum), "ok");
    EXPECT_EQ(s.checkpoint, ck1_);
    struct stat st {};
    ASSERT_EQ(::stat(s.path.c_str(), &st), 0) << s.path;
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), s.bytes);
    auto h = ReadSegmentHeader(s.path);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->instance_id, 99u);
  }
  EXPECT_EQ(reg.LoadProgressLine(), "3/3 segments ready, 100% of rows");

  auto offer = reg.Offer(HelloFor(fp1_, 2, 1), kNever, kNever);
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_TRUE(offer->ready);
  EXPECT_TRUE(offer->node.checkpoint_served);
  EXPECT_FALSE(offer->node.segment_failed);
  EXPECT_EQ(offer->segment_path, shm_->path() + "/" + SegmentName(fp1_, 2, 1));
  EXPECT_EQ(offer->segment_key(), ck1_ + "/" + SegmentName(fp1_, 2, 1));
  ASSERT_NE(offer->descriptor, nullptr);
  EXPECT_EQ(offer->descriptor->tp_rank(), 1);
  EXPECT_EQ(offer->descriptor->fingerprint(), fp1_);
  EXPECT_EQ(offer->node.tables_bytes, segs[1].bytes + segs[2].bytes) << "both shards of TP 2";

  auto unknown = reg.Offer(HelloFor(fp1_ + 1, 1, 0), kNever, kNever);
  ASSERT_TRUE(unknown.ok());
  EXPECT_FALSE(unknown->node.checkpoint_served);
  EXPECT_FALSE(unknown->ready);

  auto tp4 = reg.Offer(HelloFor(fp1_, 4, 0), kNever, kNever);
  ASSERT_TRUE(tp4.ok());
  EXPECT_TRUE(tp4->node.segment_failed);
  EXPECT_NE(tp4->node.segment_error.find("TP size 4 is not served (engramd --tp 1,2)"), std::string::npos)
      << tp4->node.segment_error;
}

// The OS seam reaches the daemon: fallocate refusing (ENOSPC) after the capacity probe passed fails the segment as
// too small and removes the partial file, and the decision names SHM_TOO_SMALL; without root and without filling a
// real filesystem.
class NoSpaceEnv : public PosixEnv {
 public:
  int PosixFallocate(int, off_t, off_t) override { return ENOSPC; }
};

TEST_F(SegmentRegistryTest, NoSpaceDuringAPublishIsShmTooSmall) {
  NoSpaceEnv env;
  SegmentRegistry reg(shm_->path(), 2, 5, &env);
  ASSERT_TRUE(reg.Start({ck1_}, {1}).ok());
  const auto segs = Settled(reg);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(Name(segs[0].state), "FAILED");
  EXPECT_NE(segs[0].error.find("reserve"), std::string::npos) << segs[0].error;
  EXPECT_FALSE(Exists(segs[0].path)) << "no partial segment is left";
  auto offer = reg.Offer(HelloFor(fp1_, 1, 0), kNever, kNever);
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_FALSE(offer->ready);
  EXPECT_TRUE(offer->node.shm_too_small);
  const Decision d = Decide(HelloFor(fp1_, 1, 0), offer->node);
  ASSERT_FALSE(d.share);
  EXPECT_EQ(d.reasons.at(0).code(), engram::v1::SHM_TOO_SMALL);
}

// A TP size dropped and served again while its shard publishes: the publish of the dropped plan records nothing in
// the new one (here it fails, ENOSPC), and the new plan's own publish makes it READY with no error left over.
class GatedFallocateEnv : public PosixEnv {
 public:
  int PosixFallocate(int fd, off_t offset, off_t len) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!armed_) return PosixEnv::PosixFallocate(fd, offset, len);
    armed_ = false;
    blocked_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    return ENOSPC;
  }
  void Arm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
  }
  void WaitBlocked() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return blocked_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, blocked_ = false, released_ = false;
};

TEST_F(SegmentRegistryTest, ATpSizeServedAgainDuringItsPublishShowsOnlyItsOwnOutcome) {
  GatedFallocateEnv env;
  SegmentRegistry reg(shm_->path(), 2, 7, &env);
  ASSERT_TRUE(reg.Start({ck1_}, {1}).ok());
  ASSERT_EQ(Settled(reg).size(), 1u);
  env.Arm();
  ASSERT_TRUE(reg.Reconfigure({ck1_}, {1, 2}).ok());
  env.WaitBlocked();  // TP 2 rank 0's publish is in its reservation
  ASSERT_TRUE(reg.Reconfigure({ck1_}, {1}).ok());
  ASSERT_TRUE(reg.Reconfigure({ck1_}, {1, 2}).ok());
  env.Release();  // the dropped plan's publish fails now
  const auto segs = Settled(reg);
  ASSERT_EQ(segs.size(), 3u);
  for (const auto& s : segs) {
    EXPECT_EQ(Name(s.state), "READY") << s.name << " " << s.error;
    EXPECT_EQ(s.error, "") << s.name << ": an earlier plan's failure is not this segment's";
    EXPECT_TRUE(Exists(s.path)) << s.path;
  }
  auto offer = reg.Offer(HelloFor(fp1_, 2, 0), kNever, kNever);
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_TRUE(offer->ready);
  EXPECT_FALSE(offer->node.shm_too_small);
}

TEST_F(SegmentRegistryTest, RestartAdoptsVerifiesRetiresAndRemovesDebris) {
  std::string ck2_segment;
  {
    SegmentRegistry first(shm_->path(), 2, 1);
    ASSERT_TRUE(first.Start({ck1_, ck2_}, {1}).ok());
    const auto segs = Settled(first);
    ASSERT_EQ(segs.size(), 2u);
    ck2_segment = segs[1].path;
  }
  // Debris: a segment-named file that is not a READY segment.
  const std::string debris = shm_->path() + "/" + SegmentName(0xdead, 1, 0);
  testing::WriteFile(debris, std::string(8192, '\0'));
  ASSERT_TRUE(Exists(debris));

  SegmentRegistry second(shm_->path(), 2, 2);
  ASSERT_TRUE(second.Start({ck1_}, {1}).ok());
  EXPECT_FALSE(Exists(debris)) << "debris is removed at start";
  EXPECT_FALSE(Exists(ck2_segment)) << "a READY segment no longer served is retired";
  auto segs = second.Segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(Name(segs[0].state), "READY") << "adopted at once";
  EXPECT_EQ(Name(segs[0].origin), "adopted");
  WaitUntil([&] { return second.Segments()[0].checksum != ChecksumState::kVerifying; });
  EXPECT_EQ(Name(second.Segments()[0].checksum), "ok");
  auto h = ReadSegmentHeader(segs[0].path);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->instance_id, 1u) << "adopted, not rewritten";
}

TEST_F(SegmentRegistryTest, CorruptedAdoptedSegmentIsRepublished) {
  std::string path;
  {
    SegmentRegistry first(shm_->path(), 2, 1);
    ASSERT_TRUE(first.Start({ck1_}, {1}).ok());
    path = Settled(first)[0].path;
  }
  auto h = ReadSegmentHeader(path);
  ASSERT_TRUE(h.ok());
  {
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(h->data_offset + 7)), 1);
    b ^= 0xff;
    ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(h->data_offset + 7)), 1);
    ::close(fd);
  }
  SegmentRegistry second(shm_->path(), 2, 2);
  ASSERT_TRUE(second.Start({ck1_}, {1}).ok());
  EXPECT_EQ(Name(second.Segments()[0].origin), "adopted");
  WaitUntil([&] {
    const auto s = second.Segments()[0];
    return s.origin == SegmentOrigin::kPublished && s.state == ServingState::kReady;
  });
  const auto s = second.Segments()[0];
  EXPECT_EQ(Name(s.checksum), "ok");
  auto again = ReadSegmentHeader(path);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->instance_id, 2u) << "the mismatching segment was replaced by a fresh publish";
}

TEST_F(SegmentRegistryTest, LoadAndUnload) {
  SegmentRegistry reg(shm_->path(), 2, 1);
  ASSERT_TRUE(reg.Start({ck1_}, {1}).ok());
  Settled(reg);
  EXPECT_EQ(reg.Load(ck1_, {1}).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(reg.Load(*dir_ / "missing", {1}).ok());
  ASSERT_TRUE(reg.Load(ck2_, {1, 2}).ok());
  auto segs = Settled(reg);
  ASSERT_EQ(segs.size(), 4u);
  for (const auto& s : segs) EXPECT_EQ(Name(s.state), "READY") << s.name;
  EXPECT_EQ(reg.CheckpointDirs(), (std::vector<std::string>{ck1_, ck2_}));
  EXPECT_EQ(ListSegments(shm_->path()).size(), 4u);

  ASSERT_TRUE(reg.Unload(ck1_).ok());
  EXPECT_EQ(reg.Unload(ck1_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ListSegments(shm_->path()).size(), 3u);
  EXPECT_EQ(reg.Segments().size(), 3u);
  auto offer = reg.Offer(HelloFor(fp1_, 1, 0), kNever, kNever);
  ASSERT_TRUE(offer.ok());
  EXPECT_FALSE(offer->node.checkpoint_served) << "an unloaded checkpoint is not offered";
}

TEST_F(SegmentRegistryTest, MissingShmDirectoryFailsEverySegment) {
  SegmentRegistry reg(shm_->path() + "/nope", 1, 1);
  ASSERT_TRUE(reg.Start({ck1_}, {1}).ok()) << "not a startup error: replicas fall back";
  const auto segs = Settled(reg);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(Name(segs[0].state), "FAILED");
  EXPECT_FALSE(segs[0].error.empty());
  auto offer = reg.Offer(HelloFor(fp1_, 1, 0), kNever, kNever);
  ASSERT_TRUE(offer.ok());
  EXPECT_FALSE(offer->node.shm_exists);
  EXPECT_TRUE(offer->node.segment_failed);
  EXPECT_FALSE(offer->ready);
}

TEST_F(SegmentRegistryTest, BadCheckpointIsAStartupError) {
  SegmentRegistry reg(shm_->path(), 1, 1);
  EXPECT_FALSE(reg.Start({*dir_ / "missing"}, {1}).ok());
  SegmentRegistry tp(shm_->path(), 1, 1);
  EXPECT_EQ(tp.Start({ck1_}, {16}).code(), absl::StatusCode::kInvalidArgument) << "8 columns cannot feed 16 shards";
}

TEST(SegmentNamesTest, StatusStringsStayAsTheyWere) {
  EXPECT_EQ(Name(ServingState::kPending), "PENDING");
  EXPECT_EQ(Name(ServingState::kLoading), "LOADING");
  EXPECT_EQ(Name(ServingState::kReady), "READY");
  EXPECT_EQ(Name(ServingState::kFailed), "FAILED");
  EXPECT_EQ(Name(ServingState::kRetired), "RETIRED");
  EXPECT_EQ(Name(ChecksumState::kPending), "pending");
  EXPECT_EQ(Name(ChecksumState::kVerifying), "verifying");
  EXPECT_EQ(Name(ChecksumState::kOk), "ok");
  EXPECT_EQ(Name(ChecksumState::kMismatch), "mismatch");
  EXPECT_EQ(Name(SegmentOrigin::kPublished), "published");
  EXPECT_EQ(Name(SegmentOrigin::kAdopted), "adopted");
  EXPECT_EQ(Name(SegmentOrigin::kNone), "");
}

}  // namespace
}  // namespace engram::daemon
