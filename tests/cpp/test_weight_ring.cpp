// Native tests of WeightRing: parameter rebinding, bulk snapshots, version bookkeeping and
// errors, and concurrent use of the slot table under ThreadSanitizer.
#include <gtest/gtest.h>

#include <c10/core/GradMode.h>

#include <thread>
#include <vector>

#include "errors.h"
#include "weight_ring.h"

using namespace pipedream_fast;

namespace {

std::vector<at::Tensor> make_params() {
  return {at::randn({4, 3}).requires_grad_(), at::randn({3}).requires_grad_(),
          at::randn({2, 2}, at::kDouble).requires_grad_(), at::arange(5, at::kFloat)};
}

}  // namespace

TEST(WeightRing, RebindsParametersWithoutChangingValues) {
  auto params = make_params();
  std::vector<at::Tensor> before;
  for (auto& p : params) before.push_back(p.detach().clone());
  WeightRing ring(params, 2);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i], before[i])) << i;
    EXPECT_TRUE(ring.live_tensors()[i].is_same(params[i]));
  }
  // Two dtypes: float and double, so two live buffers.
  ASSERT_EQ(ring.live_buffers().size(), 2u);
  EXPECT_EQ(ring.bytes_per_version(), (12 + 3 + 5) * 4 + 4 * 8);
  // An in-place update of a parameter lands in the live buffer.
  {
    c10::NoGradGuard no_grad;
    params[0].fill_(1.5);
  }
  EXPECT_EQ(ring.live_buffers()[0][0].item<float>(), 1.5f);
}

TEST(WeightRing, SnapshotIsACopyThatLaterUpdatesDoNotTouch) {
  auto params = make_params();
  WeightRing ring(params, 2);
  const auto expected = params[1].detach().clone();
  const int64_t v = ring.snapshot();
  {
    c10::NoGradGuard no_grad;
    for (auto& p : params) p.add_(1);
  }
  EXPECT_TRUE(at::equal(ring.tensors(v)[1], expected));
  EXPECT_TRUE(ring.tensors(v)[0].requires_grad());
  EXPECT_FALSE(ring.tensors(v)[3].requires_grad());
  EXPECT_TRUE(ring.tensors(v)[0].is_leaf());
}

TEST(WeightRing, TracksVersionsAndRejectsMisuse) {
  auto params = make_params();
  WeightRing ring(params, 2);
  EXPECT_EQ(ring.snapshot(), 0);
  EXPECT_EQ(ring.snapshot(5), 5);
  EXPECT_EQ(ring.free_slots(), 0);
  EXPECT_THROW(ring.snapshot(), VersionError);
  EXPECT_EQ(ring.held_versions(), (std::vector<int64_t>{0, 5}));
  ring.release(0);
  EXPECT_THROW(ring.release(0), VersionError);
  EXPECT_THROW(ring.tensors(0), VersionError);
  EXPECT_THROW(ring.snapshot(5), VersionError);
  EXPECT_EQ(ring.snapshot(), 6);  // the counter continues after the largest id
  EXPECT_TRUE(ring.holds(6));
  EXPECT_FALSE(ring.holds(0));
}

TEST(WeightRing, RejectsBadConstruction) {
  EXPECT_THROW(WeightRing(make_params(), 0), std::invalid_argument);
  auto params = make_params();
  EXPECT_THROW(WeightRing({params[0], params[1], params[0]}, 2), std::invalid_argument);
  EXPECT_THROW(WeightRing(std::vector<at::Tensor>{}, 2), std::invalid_argument);
#ifndef PIPEDREAM_FAST_WITH_CUDA
  EXPECT_THROW(WeightRing(make_params(), 2, /*offload=*/true), std::invalid_argument);
#endif
}

TEST(WeightRing, SlotTableIsSafeAcrossThreads) {
  auto params = make_params();
  WeightRing ring(params, 4);
  std::vector<std::thread> threads;
  std::atomic<int> snapshots{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        int64_t v = -1;
        try {
          v = ring.snapshot();
        } catch (const VersionError&) {
          continue;  // every slot busy at this instant: fine
        }
        ++snapshots;
        EXPECT_TRUE(ring.holds(v));
        ring.release(v);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(snapshots.load(), 0);
  EXPECT_EQ(ring.free_slots(), 4);
}
