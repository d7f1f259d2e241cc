// What the engine's host-gather calibration tries (client/engine/calibration.h): the default thread count, plus
// three quarters of the CPUs (at most 24) when that is more and the count was not fixed by hand; and the shares
// client/tuning.h lists. Needs the CUDA build (the calibration's library), not a GPU.
#include <vector>

#include "client/engine/calibration.h"
#include "gtest/gtest.h"

namespace engram::client {
namespace {

TEST(CalibrationCandidates, ThreadCounts) {
  EXPECT_EQ(HostGatherCalibrationThreads(16, 8, false), (std::vector<int>{8, 12}));
  EXPECT_EQ(HostGatherCalibrationThreads(64, 16, false), (std::vector<int>{16, 24})) << "at most 24";
  EXPECT_EQ(HostGatherCalibrationThreads(16, 8, true), (std::vector<int>{8})) << "fixed by hand: only it";
  EXPECT_EQ(HostGatherCalibrationThreads(2, 1, false), (std::vector<int>{1})) << "three quarters of 2 is not more";
  EXPECT_EQ(HostGatherCalibrationThreads(16, 14, false), (std::vector<int>{14}));
}

TEST(CalibrationCandidates, Shares) {
  EXPECT_EQ(HostGatherCalibrationShares(), (std::vector<double>{0.15, 0.25, 0.35, 0.45}));
}

}  // namespace
}  // namespace engram::client
