// CgroupAvailableBytes against hand-made cgroup trees (v2 and v1, a limit on the group, on an ancestor, and on the
// mount's root as inside a container): the least of limit - usage is what a private copy may take.
#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "model/file_util.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using testing::TempDir;

void Put(const std::string& dir, const std::string& name, const std::string& value) {
  std::filesystem::create_directories(dir);
  testing::WriteFile(dir + "/" + name, value + "\n");
}

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(CgroupMemoryTest, V2GroupAndAncestorLimitsBind) {
  TempDir t;
  const std::string root = t.path();
  Put(root + "/kubepods/pod", "memory.max", "max");
  Put(root + "/kubepods/pod", "memory.current", std::to_string(1 * kGiB));
  EXPECT_EQ(CgroupAvailableBytes("0::/kubepods/pod\n", root), ~uint64_t{0}) << "no limit anywhere";
  Put(root + "/kubepods", "memory.max", std::to_string(8 * kGiB));
  Put(root + "/kubepods", "memory.current", std::to_string(6 * kGiB));
  EXPECT_EQ(CgroupAvailableBytes("0::/kubepods/pod\n", root), 2 * kGiB) << "the parent's limit binds";
  Put(root + "/kubepods/pod", "memory.max", std::to_string(kGiB + kGiB / 2));
  EXPECT_EQ(CgroupAvailableBytes("0::/kubepods/pod\n", root), kGiB / 2);
}

TEST(CgroupMemoryTest, V1MemoryHierarchyIsRead) {
  TempDir t;
  const std::string root = t.path();
  const std::string text = "12:cpuset:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n";
  Put(root + "/memory/docker/abc", "memory.limit_in_bytes", std::to_string(2 * kGiB));
  Put(root + "/memory/docker/abc", "memory.usage_in_bytes", std::to_string(kGiB / 4));
  Put(root + "/memory", "memory.limit_in_bytes", "9223372036854771712");  // the host's root: unlimited
  Put(root + "/memory", "memory.usage_in_bytes", std::to_string(20 * kGiB));
  EXPECT_EQ(CgroupAvailableBytes(text, root), 2 * kGiB - kGiB / 4);
}

TEST(CgroupMemoryTest, V1CoMountedAndInsideAContainer) {
  TempDir t;
  const std::string root = t.path();
  // Inside a container the host's path does not exist; the mount's root is the container's own group.
  Put(root + "/cpu,memory", "memory.limit_in_bytes", std::to_string(2 * kGiB));
  Put(root + "/cpu,memory", "memory.usage_in_bytes", std::to_string(kGiB));
  EXPECT_EQ(CgroupAvailableBytes("3:cpu,memory:/kubepods/burstable/pod1/c2\n", root), kGiB);
  EXPECT_EQ(CgroupAvailableBytes("3:cpu,memory:/../../etc\n", root), ~uint64_t{0}) << "no path climbs out";
  EXPECT_EQ(CgroupAvailableBytes("garbage\n::\n0::x\n4:memory:x\n", root), ~uint64_t{0}) << "and it ends";
}

TEST(CgroupMemoryTest, DotsInsideANameAreNotAParent) {
  TempDir t;
  const std::string root = t.path();
  Put(root + "/system.slice/a..b.service", "memory.max", std::to_string(3 * kGiB));
  Put(root + "/system.slice/a..b.service", "memory.current", std::to_string(kGiB));
  EXPECT_EQ(CgroupAvailableBytes("0::/system.slice/a..b.service\n", root), 2 * kGiB);
}

}  // namespace
}  // namespace engram
