// Native tests of ActivationQueue: ordering, blocking, timeouts, close, and a many-thread
// stress run that ThreadSanitizer checks in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "activation_queue.h"
#include "errors.h"

using namespace pipedream_fast;

namespace {

Bundle tagged(int64_t microbatch) { return Bundle{{at::full({2}, microbatch)}, microbatch, 7}; }

}  // namespace

TEST(ActivationQueue, KeepsFifoOrderAndTags) {
  ActivationQueue q(4, "fifo");
  for (int i = 0; i < 4; ++i) q.push(tagged(i));
  for (int i = 0; i < 4; ++i) {
    Bundle b = q.pop();
    EXPECT_EQ(b.microbatch, i);
    EXPECT_EQ(b.version, 7);
    EXPECT_EQ(b.tensors.at(0)[0].item<int64_t>(), i);
    EXPECT_GT(b.enqueued_ns, 0);
  }
  EXPECT_EQ(q.size(), 0);
}

TEST(ActivationQueue, PopTimesOutWhenEmpty) {
  ActivationQueue q(1, "empty");
  EXPECT_THROW(q.pop(0.01), QueueTimeout);
  EXPECT_FALSE(q.try_pop().has_value());
}

TEST(ActivationQueue, PushTimesOutWhenFull) {
  ActivationQueue q(1, "full");
  q.push(tagged(0));
  EXPECT_THROW(q.push(tagged(1), 0.01), QueueTimeout);
  EXPECT_EQ(q.size(), 1);
}

TEST(ActivationQueue, PushBlocksUntilPop) {
  ActivationQueue q(1, "block");
  q.push(tagged(0));
  std::atomic<bool> pushed{false};
  std::thread producer([&] {
    q.push(tagged(1));
    pushed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(pushed.load());
  EXPECT_EQ(q.pop().microbatch, 0);
  producer.join();
  EXPECT_TRUE(pushed.load());
  EXPECT_EQ(q.pop().microbatch, 1);
  EXPECT_GT(q.stats().push_wait_ns, 0);
}

TEST(ActivationQueue, CloseWakesEveryWaiter) {
  ActivationQueue empty(1, "empty");
  ActivationQueue full(1, "full");
  full.push(tagged(0));
  std::atomic<int> closed_errors{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      try {
        empty.pop();
      } catch (const QueueClosed&) {
        ++closed_errors;
      }
    });
    waiters.emplace_back([&] {
      try {
        full.push(tagged(1));
      } catch (const QueueClosed&) {
        ++closed_errors;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  empty.close();
  full.close();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(closed_errors.load(), 6);
}

TEST(ActivationQueue, PopDrainsBeforeReportingClosed) {
  ActivationQueue q(2, "drain");
  q.push(tagged(0));
  q.push(tagged(1));
  q.close();
  EXPECT_THROW(q.push(tagged(2)), QueueClosed);
  EXPECT_EQ(q.pop().microbatch, 0);
  EXPECT_EQ(q.pop().microbatch, 1);
  EXPECT_THROW(q.pop(), QueueClosed);
}

TEST(ActivationQueue, RejectsZeroCapacity) {
  EXPECT_THROW(ActivationQueue(0, "zero"), std::invalid_argument);
}

// 4 producers and 4 consumers through a queue of 3 slots; every item arrives exactly once.
void stress(double spin_us) {
  constexpr int kProducers = 4, kConsumers = 4, kPerProducer = 500;
  ActivationQueue q(3, "stress", spin_us);
  std::mutex seen_mutex;
  std::multiset<int64_t> seen;
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < kPerProducer; ++i) q.push(tagged(p * kPerProducer + i));
    });
  }
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&] {
      while (true) {
        try {
          Bundle b = q.pop(5.0);
          std::lock_guard<std::mutex> lock(seen_mutex);
          seen.insert(b.microbatch);
        } catch (const QueueClosed&) {
          return;
        }
      }
    });
  }
  for (int p = 0; p < kProducers; ++p) threads[static_cast<size_t>(p)].join();
  q.close();
  for (size_t c = kProducers; c < threads.size(); ++c) threads[c].join();
  ASSERT_EQ(seen.size(), static_cast<size_t>(kProducers * kPerProducer));
  for (int64_t i = 0; i < kProducers * kPerProducer; ++i) EXPECT_EQ(seen.count(i), 1u) << i;
  const QueueStats stats = q.stats();
  EXPECT_EQ(stats.pushed, kProducers * kPerProducer);
  EXPECT_EQ(stats.popped, kProducers * kPerProducer);
  EXPECT_LE(stats.high_water, 3);
  EXPECT_GE(stats.high_water, 1);
}

TEST(ActivationQueue, ManyThreadsLoseAndDuplicateNothing) { stress(0.0); }

TEST(ActivationQueue, SpinningWaitersLoseAndDuplicateNothing) { stress(20.0); }
