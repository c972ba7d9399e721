// Native tests of the CPU block cache: freed large blocks come back to a later request of
// about their size, small ones and the excess over the limit go to the previous allocator,
// the last release puts that allocator back, and tensors are made and freed on many threads
// at once (run under ThreadSanitizer and AddressSanitizer by CI).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <thread>
#include <vector>

#include "cpu_cache.h"

using namespace pipedream_fast;

namespace {

constexpr int64_t kMiB = 1024 * 1024;

// A float tensor of `bytes` bytes, written to the end (so every page is touched).
at::Tensor block_of(int64_t bytes) {
  auto t = at::empty({bytes / 4}, at::kFloat);
  t.fill_(1.0f);
  return t;
}

}  // namespace

TEST(CpuCache, ReusesAFreedBlockForTheSameSize) {
  c10::Allocator* before = c10::GetCPUAllocator();
  ASSERT_TRUE(cpu_cache_acquire(64 * kMiB));
  EXPECT_TRUE(cpu_cache_stats().installed);
  void* first = nullptr;
  {
    auto t = block_of(4 * kMiB);
    first = t.data_ptr();
  }
  const auto freed = cpu_cache_stats();
  EXPECT_EQ(freed.cached_bytes, 4 * kMiB);
  EXPECT_EQ(freed.live_bytes, 0);
  {
    auto t = block_of(4 * kMiB);
    EXPECT_EQ(t.data_ptr(), first);  // the same block again, no new mapping
    EXPECT_EQ(cpu_cache_stats().hits, freed.hits + 1);
    EXPECT_EQ(cpu_cache_stats().cached_bytes, 0);
    EXPECT_FLOAT_EQ(t.sum().item<float>(), static_cast<float>(kMiB));
  }
  cpu_cache_release();
  EXPECT_FALSE(cpu_cache_stats().installed);
  EXPECT_EQ(cpu_cache_stats().cached_bytes, 0);  // given back with the last release
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

TEST(CpuCache, SmallRequestsAndAMuchSmallerSizeAreNotServedFromTheCache) {
  ASSERT_TRUE(cpu_cache_acquire(64 * kMiB));
  { auto big = block_of(8 * kMiB); }
  const auto before = cpu_cache_stats();
  { auto small = block_of(kCpuCacheMinBytes / 2); }  // below the minimum: malloc's
  { auto half = block_of(4 * kMiB); }                // would waste half of the 8 MiB block
  const auto after = cpu_cache_stats();
  EXPECT_EQ(after.hits, before.hits);
  EXPECT_EQ(after.misses, before.misses + 1);  // the 4 MiB request only
  EXPECT_EQ(after.cached_bytes, 12 * kMiB);    // both large blocks kept
  cpu_cache_release();
}

TEST(CpuCache, GivesBackWhatIsOverTheLimit) {
  ASSERT_TRUE(cpu_cache_acquire(6 * kMiB));
  const auto before = cpu_cache_stats();
  {
    auto a = block_of(4 * kMiB);
    auto b = block_of(4 * kMiB);
  }  // the first freed is kept, the second would pass the limit
  const auto after = cpu_cache_stats();
  EXPECT_EQ(after.cached_bytes, 4 * kMiB);
  EXPECT_EQ(after.dropped, before.dropped + 1);
  cpu_cache_empty();
  EXPECT_EQ(cpu_cache_stats().cached_bytes, 0);
  EXPECT_TRUE(cpu_cache_stats().installed);
  cpu_cache_release();
}

TEST(CpuCache, HoldsAreCountedAndATensorOutlivesTheCache) {
  c10::Allocator* before = c10::GetCPUAllocator();
  ASSERT_TRUE(cpu_cache_acquire(16 * kMiB));
  ASSERT_TRUE(cpu_cache_acquire(32 * kMiB));  // a second user raises the limit
  EXPECT_EQ(cpu_cache_stats().users, 2);
  EXPECT_EQ(cpu_cache_stats().limit_bytes, 32 * kMiB);
  auto kept = block_of(2 * kMiB);  // made by the cache, freed after it is gone
  cpu_cache_release();
  EXPECT_TRUE(cpu_cache_stats().installed);
  cpu_cache_release();
  EXPECT_FALSE(cpu_cache_stats().installed);
  EXPECT_EQ(c10::GetCPUAllocator(), before);
  EXPECT_FLOAT_EQ(kept.sum().item<float>(), static_cast<float>(kMiB / 2));
  kept.reset();  // goes back to the system, not to a cache that is not installed
  EXPECT_EQ(cpu_cache_stats().cached_bytes, 0);
  EXPECT_EQ(cpu_cache_stats().live_bytes, 0);
  cpu_cache_release();  // one too many: nothing happens
  EXPECT_EQ(cpu_cache_stats().users, 0);
}

TEST(CpuCache, ThreadsAllocateAndFreeAtOnce) {
  ASSERT_TRUE(cpu_cache_acquire(256 * kMiB));
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([k] {
      for (int i = 0; i < 50; ++i) {
        auto a = block_of((1 + (i + k) % 3) * kMiB);
        auto b = block_of(kCpuCacheMinBytes);
        a.add_(b.sum());
        ASSERT_TRUE(a.isfinite().all().item<bool>());
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto stats = cpu_cache_stats();
  EXPECT_EQ(stats.live_bytes, 0);
  EXPECT_GT(stats.hits, 0);
  cpu_cache_release();
}
