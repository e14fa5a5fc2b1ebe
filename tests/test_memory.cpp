// The CPU tracking allocator counts exactly the bytes of the tensors made and freed,
// and the peak resets per phase.
#include "train/memory.hpp"

#include <torch/types.h>

#include <gtest/gtest.h>

using flashdraft::MemoryTracker;

TEST(MemoryTracker, CountsExactBytes) {
  MemoryTracker::install();
  ASSERT_TRUE(MemoryTracker::installed());
  const int64_t base = MemoryTracker::live_bytes();
  {
    at::Tensor a = torch::empty({1000}, torch::kFloat);  // 4000 bytes
    EXPECT_EQ(MemoryTracker::live_bytes() - base, 4000);
    at::Tensor b = torch::empty({3, 7, 11}, torch::kDouble);  // 1848 bytes
    EXPECT_EQ(MemoryTracker::live_bytes() - base, 4000 + 1848);
    a.reset();
    EXPECT_EQ(MemoryTracker::live_bytes() - base, 1848);
  }
  EXPECT_EQ(MemoryTracker::live_bytes(), base);
}

TEST(MemoryTracker, PeakResetsPerPhase) {
  MemoryTracker::install();
  const int64_t base = MemoryTracker::live_bytes();
  MemoryTracker::reset_peak();
  EXPECT_EQ(MemoryTracker::peak_bytes(), base);
  {
    at::Tensor big = torch::empty({1 << 20}, torch::kByte);  // 1 MiB
  }
  at::Tensor small = torch::empty({1 << 18}, torch::kByte);  // 256 KiB, kept
  EXPECT_EQ(MemoryTracker::peak_bytes() - base, 1 << 20);
  MemoryTracker::reset_peak();  // next phase: the peak starts at what is live now
  EXPECT_EQ(MemoryTracker::peak_bytes() - base, 1 << 18);
  { at::Tensor mid = torch::empty({1 << 19}, torch::kByte); }
  EXPECT_EQ(MemoryTracker::peak_bytes() - base, (1 << 18) + (1 << 19));
}

TEST(MemoryTracker, SeesLibTorchOperations) {
  MemoryTracker::install();
  at::Tensor x = torch::randn({256, 256});
  const int64_t before = MemoryTracker::live_bytes();
  MemoryTracker::reset_peak();
  at::Tensor y = torch::matmul(x, x);  // one 256x256 float result
  EXPECT_GE(MemoryTracker::peak_bytes() - before, 256 * 256 * 4);
  EXPECT_EQ(MemoryTracker::live_bytes() - before, 256 * 256 * 4);
}
