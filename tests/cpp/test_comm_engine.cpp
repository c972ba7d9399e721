// Native tests of CommEngine over an in-process loopback ProcessGroup: ordering, tags, links
// per receiving stage, shape negotiation, timeouts and shutdown, with two engines driven from two threads (and so checked
// by ThreadSanitizer in CI). The loopback group stands in for gloo, whose headers libtorch does
// not ship; CommEngine only uses ProcessGroup::send/recv and Work::wait.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <tuple>

#include <ATen/Parallel.h>

#include "comm_engine.h"
#include "errors.h"

using namespace pipedream_fast;

namespace {

struct Mailbox {
  std::mutex mutex;
  std::condition_variable arrived;
  std::map<std::tuple<int, int, int>, std::deque<at::Tensor>> messages;  // (src, dst, tag)
  int transfers = 0;  // sends the engines made, headers included
};

class DoneWork : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds) override { return true; }
};

class RecvWork : public c10d::Work {
 public:
  RecvWork(std::shared_ptr<Mailbox> box, std::tuple<int, int, int> key, at::Tensor out)
      : box_(std::move(box)), key_(key), out_(std::move(out)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(box_->mutex);
    auto& queue = box_->messages[key_];
    if (!box_->arrived.wait_for(lock, timeout, [&] { return !queue.empty(); })) {
      throw std::runtime_error("loopback receive timed out");
    }
    // As gloo: a message may be shorter than the posted buffer (it fills the front), never
    // longer. Shapes are not matched, only bytes.
    const at::Tensor sent = queue.front().reshape({-1}).view(at::kByte);
    const at::Tensor into = out_.view({-1}).view(at::kByte);
    if (sent.numel() > into.numel()) {
      throw std::runtime_error("loopback receive: a message of " + std::to_string(sent.numel()) +
                               " bytes for a buffer of " + std::to_string(into.numel()));
    }
    into.narrow(0, 0, sent.numel()).copy_(sent);
    queue.pop_front();
    return true;
  }

 private:
  std::shared_ptr<Mailbox> box_;
  std::tuple<int, int, int> key_;
  at::Tensor out_;
};

class LoopbackGroup : public c10d::ProcessGroup {
 public:
  LoopbackGroup(std::shared_ptr<Mailbox> box, int rank, int size)
      : c10d::ProcessGroup(rank, size), box_(std::move(box)) {}
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    {
      std::lock_guard<std::mutex> lock(box_->mutex);
      box_->messages[{getRank(), dst, tag}].push_back(tensors.at(0).clone());
      ++box_->transfers;
    }
    box_->arrived.notify_all();
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return c10::make_intrusive<RecvWork>(box_, std::make_tuple(src, getRank(), tag), tensors.at(0));
  }

 private:
  std::shared_ptr<Mailbox> box_;
};

// CMakeLists.txt runs these tests twice: transfers on the caller's thread (the CPU default)
// and, with PIPEDREAM_FAST_LINK_THREADS=1, on link threads (the GPU way).
bool link_threads() {
  const char* value = std::getenv("PIPEDREAM_FAST_LINK_THREADS");
  return value != nullptr && std::string(value) == "1";
}


struct Pair {
  std::shared_ptr<Mailbox> box = std::make_shared<Mailbox>();
  CommEngine a{c10::make_intrusive<LoopbackGroup>(box, 0, 2), 5.0, CommEngine::kDefaultDepth,
               at::kCPU, 0.0, CommEngine::kDefaultRecvPool, link_threads()};
  CommEngine b{c10::make_intrusive<LoopbackGroup>(box, 1, 2), 5.0, CommEngine::kDefaultDepth,
               at::kCPU, 0.0, CommEngine::kDefaultRecvPool, link_threads()};
};

}  // namespace

TEST(CommEngine, ActivationsForwardAndGradientsBackInOrder) {
  Pair pair;
  constexpr int kMicrobatches = 50;
  std::thread stage1([&] {
    for (int mb = 0; mb < kMicrobatches; ++mb) pair.b.post_recv(0, Channel::kActivation, 1, mb);
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      auto got = pair.b.wait_recv(0, Channel::kActivation, 1, mb);
      ASSERT_EQ(got.size(), 2u);
      EXPECT_EQ(got[0][1][2].item<float>(), static_cast<float>(mb));
      EXPECT_EQ(got[1][0].item<int64_t>(), mb);
      pair.b.send(0, Channel::kGradient, 0, mb, {got[0] * -1});
    }
    pair.b.flush();
  });
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    pair.a.send(1, Channel::kActivation, 1, mb,
                {at::full({3, 4}, static_cast<float>(mb)), at::full({1}, mb, at::kLong)});
    pair.a.post_recv(1, Channel::kGradient, 0, mb);
  }
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    auto grad = pair.a.wait_recv(1, Channel::kGradient, 0, mb);
    EXPECT_EQ(grad.at(0)[0][0].item<float>(), -static_cast<float>(mb));
  }
  stage1.join();
  pair.a.flush();
  EXPECT_TRUE(pair.a.unfinished_sends().empty());  // flushed: nothing queued
  const CommStats stats = pair.a.stats();
  EXPECT_EQ(stats.messages_sent, kMicrobatches);
  EXPECT_EQ(stats.messages_received, kMicrobatches);
  EXPECT_EQ(stats.bytes_sent, kMicrobatches * (12 * 4 + 8));
}

TEST(CommEngine, SmallMessagesOfSeveralTensorsTravelPackedAndLargeOnesTensorByTensor) {
  // One intra-op thread: ops on the 3 MiB tensors would otherwise run on libgomp's thread
  // team, whose synchronisation ThreadSanitizer cannot see (false data races in libtorch).
  at::set_num_threads(1);
  Pair pair;
  // Mixed dtypes and odd sizes: every tensor must come back exactly, in one transfer.
  std::vector<at::Tensor> small{at::arange(3, at::kHalf), at::arange(5, at::kLong),
                                at::arange(7, at::kByte), at::arange(6, at::kFloat).view({2, 3}),
                                at::full({}, 2.5, at::kDouble)};
  // Two 3 MiB tensors: over the packing limit, so a prefix and two transfers, no copy.
  std::vector<at::Tensor> large{at::arange(3 << 18, at::kFloat),
                                at::arange(3 << 18, at::kFloat) * -1};
  constexpr int kMessages = 3;
  for (int mb = 0; mb < kMessages; ++mb) {
    pair.b.post_recv(0, Channel::kActivation, 1, mb);
    pair.b.post_recv(0, Channel::kActivation, 2, mb);
  }
  for (int mb = 0; mb < kMessages; ++mb) {
    std::vector<at::Tensor> message;
    for (const auto& t : small) message.push_back(t + mb);
    pair.a.send(1, Channel::kActivation, 1, mb, message);
    pair.a.send(1, Channel::kActivation, 2, mb, large);
  }
  for (int mb = 0; mb < kMessages; ++mb) {
    auto got = pair.b.wait_recv(0, Channel::kActivation, 1, mb);
    ASSERT_EQ(got.size(), small.size());
    for (size_t i = 0; i < small.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), small[i].scalar_type());
      EXPECT_TRUE(got[i].equal(small[i] + mb)) << "tensor " << i << " of microbatch " << mb;
    }
    auto big = pair.b.wait_recv(0, Channel::kActivation, 2, mb);
    ASSERT_EQ(big.size(), 2u);
    EXPECT_TRUE(big[0].equal(large[0]) && big[1].equal(large[1]));
  }
  pair.a.flush();
  std::lock_guard<std::mutex> lock(pair.box->mutex);
  // Per link one header, then one transfer per small message and a prefix and two transfers
  // per large one.
  EXPECT_EQ(pair.box->transfers, 2 + kMessages * (1 + 3));
}

TEST(CommEngine, RejectsABoundaryWhoseTensorsChangeInNumberOrDimensions) {
  Pair pair;
  pair.a.send(1, Channel::kActivation, 1, 0, {at::zeros({2, 2})});
  try {
    pair.a.send(1, Channel::kActivation, 1, 1, {at::zeros({2, 2, 1})});
    FAIL() << "expected a tensor with another number of dimensions to be rejected";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("for stage 1"), std::string::npos) << what;
    EXPECT_NE(what.find("[2, 2, 1]"), std::string::npos) << what;
    EXPECT_NE(what.find("[2, 2]"), std::string::npos) << what;
    EXPECT_NE(what.find("their dimensions must stay fixed"), std::string::npos) << what;
  }
  EXPECT_THROW(pair.a.send(1, Channel::kActivation, 1, 1, {at::zeros({2, 2}), at::zeros({2})}),
               std::invalid_argument);
  // Another size or dtype is carried; another stage is another link, with shapes of its own.
  pair.a.send(1, Channel::kActivation, 1, 1, {at::zeros({3, 2}, at::kDouble)});
  pair.a.send(1, Channel::kActivation, 3, 0, {at::zeros({3, 2, 1})});
  pair.a.flush();
}

// Shapes that vary from message to message, on a packed link (several small tensors) and on a
// split one (a tensor over the packing limit): smaller than the first (a short batch), larger
// (the rest on the overflow tag), another dtype, empty, and back; each must arrive exactly.
TEST(CommEngine, SizesAndDtypesMayChangeFromMessageToMessage) {
  at::set_num_threads(1);  // see SmallMessagesOfSeveralTensors...
  Pair pair;
  auto message = [](int64_t rows, int64_t cols, at::ScalarType dtype, int mb) {
    return std::vector<at::Tensor>{
        (at::arange(rows * cols, at::kDouble).view({rows, cols}) + mb).to(dtype),
        at::arange(rows, at::kLong) * (mb + 1)};
  };
  auto large = [](int64_t numel, int mb) {  // 1 MiB per 2^18 floats: over kPackOneMaxBytes
    return std::vector<at::Tensor>{at::arange(numel, at::kFloat) + mb};
  };
  const std::vector<std::tuple<int64_t, int64_t, at::ScalarType>> packed_shapes{
      {4, 9, at::kFloat}, {4, 5, at::kFloat}, {4, 64, at::kFloat},  {2, 9, at::kFloat},
      {4, 9, at::kDouble}, {0, 9, at::kFloat}, {4, 9, at::kFloat}, {8, 300, at::kFloat}};
  const std::vector<int64_t> split_sizes{1 << 18, 1 << 16, 3 << 18, 0, 1 << 18, 5 << 18};
  const int n_packed = static_cast<int>(packed_shapes.size());
  const int n_split = static_cast<int>(split_sizes.size());
  for (int mb = 0; mb < n_packed; ++mb) pair.b.post_recv(0, Channel::kActivation, 1, mb);
  for (int mb = 0; mb < n_split; ++mb) pair.b.post_recv(0, Channel::kGradient, 0, mb);
  std::thread rank0([&] {
    for (int mb = 0; mb < std::max(n_packed, n_split); ++mb) {
      if (mb < n_packed) {
        const auto& [rows, cols, dtype] = packed_shapes[mb];
        pair.a.send(1, Channel::kActivation, 1, mb, message(rows, cols, dtype, mb));
      }
      if (mb < n_split) pair.a.send(1, Channel::kGradient, 0, mb, large(split_sizes[mb], mb));
    }
    pair.a.flush();
  });
  std::vector<std::vector<at::Tensor>> held;  // held, so pooled buffers are never reused
  for (int mb = 0; mb < std::max(n_packed, n_split); ++mb) {
    if (mb < n_packed) {
      const auto& [rows, cols, dtype] = packed_shapes[mb];
      auto got = pair.b.wait_recv(0, Channel::kActivation, 1, mb);
      auto want = message(rows, cols, dtype, mb);
      ASSERT_EQ(got.size(), 2u);
      for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(got[i].scalar_type(), want[i].scalar_type()) << "microbatch " << mb;
        EXPECT_TRUE(got[i].sizes() == want[i].sizes() && got[i].equal(want[i]))
            << "tensor " << i << " of microbatch " << mb << ": " << got[i].sizes();
      }
      held.push_back(got);
    }
    if (mb < n_split) {
      auto got = pair.b.wait_recv(0, Channel::kGradient, 0, mb);
      ASSERT_EQ(got.size(), 1u);
      EXPECT_TRUE(got[0].equal(large(split_sizes[mb], mb)[0])) << "split microbatch " << mb;
      held.push_back(got);
    }
  }
  rank0.join();
}

TEST(CommEngine, WaitingForAMessageThatNeverComesTimesOut) {
  auto box = std::make_shared<Mailbox>();
  CommEngine engine(c10::make_intrusive<LoopbackGroup>(box, 1, 2), 0.2);
  engine.post_recv(0, Channel::kActivation, 3, 7);
  try {
    engine.wait_recv(0, Channel::kActivation, 3, 7);
    FAIL() << "expected a timeout";
  } catch (const QueueTimeout& e) {
    // This wait's timeout or the receive thread's (which can win the race): the same type,
    // and both messages name the transfer.
    EXPECT_NE(std::string(e.what()).find("activation of stage 3, microbatch 7 from rank 0"),
              std::string::npos)
        << e.what();
  }
  engine.shutdown(0.5);
}

TEST(CommEngine, ATransferTimingOutInALinkThreadStaysAQueueTimeout) {
  auto box = std::make_shared<Mailbox>();
  CommEngine engine(c10::make_intrusive<LoopbackGroup>(box, 1, 2), 0.2);
  engine.post_recv(0, Channel::kGradient, 2, 9);
  // The receive thread's transfer times out (the loopback group throws a runtime_error for
  // it); wait_recv then finds the link closed and rethrows what the thread stored.
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  try {
    engine.wait_recv(0, Channel::kGradient, 2, 9);
    FAIL() << "expected a timeout";
  } catch (const QueueTimeout& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("timed out after 0.2 s receiving the gradient of stage 2, microbatch 9 "
                        "from rank 0"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("loopback receive timed out"), std::string::npos) << what;
  }
  engine.shutdown(0.5);
}

namespace {

// An error type of a backend, to check that link threads pass errors on with their type.
class PeerGone : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class FailingWork : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds) override { throw PeerGone("connection closed by peer"); }
};

// Every transfer fails at once, as a backend's does when the peer died.
class FailingGroup : public c10d::ProcessGroup {
 public:
  FailingGroup(int rank, int size) : c10d::ProcessGroup(rank, size) {}
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>&, int, int) override {
    return c10::make_intrusive<FailingWork>();
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>&, int, int) override {
    return c10::make_intrusive<FailingWork>();
  }
};

}  // namespace

TEST(CommEngine, LinkThreadErrorsAreRethrownWithTheirType) {
  CommEngine engine(c10::make_intrusive<FailingGroup>(0, 2), 5.0);
  engine.post_recv(1, Channel::kGradient, 0, 0);
  EXPECT_THROW(engine.wait_recv(1, Channel::kGradient, 0, 0), PeerGone);
  engine.send(1, Channel::kActivation, 1, 0, {at::zeros(2)});
  EXPECT_THROW(engine.flush(), PeerGone);
  // The failed link refuses later sends with the same error.
  EXPECT_THROW(engine.send(1, Channel::kActivation, 1, 1, {at::zeros(2)}), PeerGone);
  engine.shutdown(0.5);
}

TEST(CommEngine, RejectsItselfAndUnknownPeers) {
  Pair pair;
  EXPECT_THROW(pair.a.send(0, Channel::kActivation, 1, 0, {at::zeros(1)}), std::invalid_argument);
  EXPECT_THROW(pair.a.post_recv(5, Channel::kActivation, 1, 0), std::invalid_argument);
}

TEST(CommEngine, RejectsStagesThatDoNotFitInATag) {
  Pair pair;
  EXPECT_THROW(pair.a.post_recv(1, Channel::kGradient, -1, 0), std::invalid_argument);
  try {
    pair.a.send(1, Channel::kActivation, CommEngine::kMaxStages, 0, {at::zeros(1)});
    FAIL() << "expected stage " << CommEngine::kMaxStages << " to be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("stage 512"), std::string::npos) << e.what();
  }
  pair.a.send(1, Channel::kActivation, CommEngine::kMaxStages - 1, 0, {at::zeros(1)});
  pair.a.flush();
}

// Rank 0 holds stages 0 and 2, rank 1 holds stages 1 and 3: the boundaries 0->1 and 2->3 share
// the rank pair. Each runs the same microbatch numbers, in opposite orders and with different
// shapes; every message must arrive intact on its own link.
TEST(CommEngine, StagesSharingARankPairHaveTheirOwnLinks) {
  Pair pair;
  constexpr int kMicrobatches = 20;
  auto value = [](int stage, int mb) { return static_cast<float>(stage * 1000 + mb); };
  auto expect_message = [&](int stage, int mb, std::vector<int64_t> shape) {
    auto got = pair.b.wait_recv(0, Channel::kActivation, stage, mb);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].sizes().vec(), shape) << "stage " << stage << ", microbatch " << mb;
    EXPECT_TRUE(at::equal(got[0], at::full(shape, value(stage, mb))))
        << "stage " << stage << ", microbatch " << mb;
  };
  std::thread rank1([&] {
    try {
      for (int i = 0; i < kMicrobatches; ++i) {
        pair.b.post_recv(0, Channel::kActivation, 3, kMicrobatches - 1 - i);
        pair.b.post_recv(0, Channel::kActivation, 1, i);
      }
      // Drain stage 3 first: its messages must not be held up behind stage 1's.
      for (int i = 0; i < kMicrobatches; ++i) expect_message(3, kMicrobatches - 1 - i, {5});
      for (int mb = 0; mb < kMicrobatches; ++mb) expect_message(1, mb, {2, 3});
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();  // e.g. a message that landed on the other stage's link
    }
  });
  for (int i = 0; i < kMicrobatches; ++i) {
    pair.a.send(1, Channel::kActivation, 1, i, {at::full({2, 3}, value(1, i))});
    const int mb = kMicrobatches - 1 - i;
    pair.a.send(1, Channel::kActivation, 3, mb, {at::full({5}, value(3, mb))});
  }
  pair.a.flush();
  rank1.join();
  EXPECT_EQ(pair.a.stats().messages_sent, 2 * kMicrobatches);
  EXPECT_EQ(pair.b.stats().messages_received, 2 * kMicrobatches);
}

TEST(CommEngine, MicrobatchesWrapAroundTheirTagField) {
  Pair pair;
  constexpr int64_t kWrap = int64_t{1} << 19;  // same tag as microbatch 0
  std::thread rank1([&] {
    try {
      for (int64_t mb : {int64_t{0}, kWrap, 2 * kWrap + 1}) {
        pair.b.post_recv(0, Channel::kActivation, 1, mb);
        EXPECT_EQ(pair.b.wait_recv(0, Channel::kActivation, 1, mb).at(0).item<int64_t>(), mb);
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  });
  for (int64_t mb : {int64_t{0}, kWrap, 2 * kWrap + 1}) {
    pair.a.send(1, Channel::kActivation, 1, mb, {at::full({1}, mb, at::kLong)});
  }
  pair.a.flush();
  rank1.join();
}

TEST(CommEngine, ShutdownStopsIdleLinksAndRefusesNewWork) {
  Pair pair;
  pair.a.post_recv(1, Channel::kGradient, 0, 0);  // starts a link whose threads now wait
  pair.a.shutdown(1.0);
  EXPECT_THROW(pair.a.send(1, Channel::kActivation, 1, 0, {at::zeros(1)}), QueueClosed);
}

TEST(CommEngine, ShutdownReleasesTheGroupsAndTransfersAndKeepsTheCounts) {
  // A closed engine may live on (a Python cycle keeps it till interpreter teardown): it must
  // hold no process group and no transfer by then, or the backend's threads run into exit().
  auto box = std::make_shared<Mailbox>();
  auto group_a = c10::make_intrusive<LoopbackGroup>(box, 0, 2);
  auto group_b = c10::make_intrusive<LoopbackGroup>(box, 1, 2);
  auto gradients_a = c10::make_intrusive<LoopbackGroup>(box, 0, 2);
  CommEngine a{group_a, 5.0, CommEngine::kDefaultDepth, at::kCPU, 0.0,
               CommEngine::kDefaultRecvPool, link_threads(), gradients_a};
  CommEngine b{group_b, 5.0, CommEngine::kDefaultDepth, at::kCPU, 0.0,
               CommEngine::kDefaultRecvPool, link_threads()};
  a.send(1, Channel::kActivation, 1, 0, {at::full({4}, 1.0f)});
  b.post_recv(0, Channel::kActivation, 1, 0);
  EXPECT_EQ(b.wait_recv(0, Channel::kActivation, 1, 0).at(0)[3].item<float>(), 1.0f);
  a.flush();
  if (!link_threads()) {
    // A receive posted and never matched: its transfer is dropped with its link (on link
    // threads the receive thread would be inside it until its timeout).
    a.post_recv(1, Channel::kGradient, 0, 0);
  }
  const int64_t box_users = box.use_count();
  EXPECT_GT(group_a.use_count(), 1u);
  EXPECT_GT(gradients_a.use_count(), 1u);
  const CommStats before = a.stats();
  a.shutdown(1.0);
  b.shutdown(1.0);
  EXPECT_EQ(group_a.use_count(), 1u);
  EXPECT_EQ(gradients_a.use_count(), 1u);
  EXPECT_EQ(group_b.use_count(), 1u);
  if (!link_threads()) EXPECT_EQ(box.use_count(), box_users - 1);  // the posted receive's
  EXPECT_TRUE(a.split_channels());
  const CommStats after = a.stats();
  EXPECT_EQ(after.messages_sent, 1);
  EXPECT_EQ(after.messages_sent, before.messages_sent);
  EXPECT_EQ(after.bytes_sent, before.bytes_sent);
  EXPECT_EQ(b.stats().messages_received, 1);
  EXPECT_THROW(a.post_recv(1, Channel::kGradient, 0, 1), QueueClosed);
}

TEST(CommEngine, KnobsChangeHowMessagesTravelNeverWhatArrives) {
  // Depth 1, spinning queues and a pool of one buffer set: while the receiver holds every
  // tensor it got, each receive must come in a fresh buffer, never overwrite a held one.
  auto box = std::make_shared<Mailbox>();
  CommEngine a(c10::make_intrusive<LoopbackGroup>(box, 0, 2), 5.0, /*depth=*/1, at::kCPU,
               /*spin_us=*/20.0, /*recv_pool=*/1);
  CommEngine b(c10::make_intrusive<LoopbackGroup>(box, 1, 2), 5.0, /*depth=*/1, at::kCPU,
               /*spin_us=*/20.0, /*recv_pool=*/1);
  EXPECT_EQ(b.depth(), 1);
  EXPECT_EQ(b.spin_us(), 20.0);
  EXPECT_EQ(b.recv_pool(), 1);
  constexpr int kMicrobatches = 20;
  std::thread rank0([&] {
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      a.send(1, Channel::kActivation, 1, mb, {at::full({4}, static_cast<float>(mb))});
    }
    a.flush();
  });
  std::vector<at::Tensor> held;
  for (int mb = 0; mb < kMicrobatches; ++mb) b.post_recv(0, Channel::kActivation, 1, mb);
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    held.push_back(b.wait_recv(0, Channel::kActivation, 1, mb).at(0));
  }
  rank0.join();
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    EXPECT_TRUE(held[mb].equal(at::full({4}, static_cast<float>(mb)))) << "microbatch " << mb;
  }
}

TEST(CommEngine, RejectsKnobsOutOfRange) {
  auto group = c10::make_intrusive<LoopbackGroup>(std::make_shared<Mailbox>(), 0, 2);
  EXPECT_THROW(CommEngine(group, 5.0, /*depth=*/0), std::invalid_argument);
  EXPECT_THROW(CommEngine(group, 5.0, 8, at::kCPU, /*spin_us=*/-1.0), std::invalid_argument);
  EXPECT_THROW(CommEngine(group, 5.0, 8, at::kCPU, 0.0, /*recv_pool=*/0), std::invalid_argument);
  CommEngine defaults(group, 5.0);
  EXPECT_EQ(defaults.depth(), CommEngine::kDefaultDepth);
  EXPECT_EQ(defaults.recv_pool(), CommEngine::kDefaultRecvPool);
  EXPECT_EQ(defaults.spin_us(), 0.0);
}

TEST(CommEngine, GradientsTravelOnTheGradientGroupWhenGiven) {
  auto main_box = std::make_shared<Mailbox>();
  auto gradient_box = std::make_shared<Mailbox>();
  CommEngine a{c10::make_intrusive<LoopbackGroup>(main_box, 0, 2), 5.0, CommEngine::kDefaultDepth,
               at::kCPU, 0.0, CommEngine::kDefaultRecvPool, link_threads(),
               c10::make_intrusive<LoopbackGroup>(gradient_box, 0, 2)};
  CommEngine b{c10::make_intrusive<LoopbackGroup>(main_box, 1, 2), 5.0, CommEngine::kDefaultDepth,
               at::kCPU, 0.0, CommEngine::kDefaultRecvPool, link_threads(),
               c10::make_intrusive<LoopbackGroup>(gradient_box, 1, 2)};
  EXPECT_TRUE(a.split_channels());
  constexpr int kMicrobatches = 5;
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    b.post_recv(0, Channel::kActivation, 1, mb);
    a.post_recv(1, Channel::kGradient, 0, mb);
  }
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    a.send(1, Channel::kActivation, 1, mb, {at::full({2}, static_cast<float>(mb))});
    EXPECT_EQ(b.wait_recv(0, Channel::kActivation, 1, mb).at(0)[1].item<float>(), mb);
    b.send(0, Channel::kGradient, 0, mb, {at::full({3}, static_cast<float>(-mb))});
    EXPECT_EQ(a.wait_recv(1, Channel::kGradient, 0, mb).at(0)[2].item<float>(), -mb);
  }
  a.flush();
  b.flush();
  // Each link's first message is a header, then one packed transfer per message.
  EXPECT_EQ(main_box->transfers, 1 + kMicrobatches);      // the activations only
  EXPECT_EQ(gradient_box->transfers, 1 + kMicrobatches);  // the gradients only
}

TEST(CommEngine, RefusesAGradientGroupOfOtherRanks) {
  auto box = std::make_shared<Mailbox>();
  EXPECT_THROW(CommEngine(c10::make_intrusive<LoopbackGroup>(box, 0, 2), 5.0,
                          CommEngine::kDefaultDepth, at::kCPU, 0.0, CommEngine::kDefaultRecvPool,
                          false, c10::make_intrusive<LoopbackGroup>(box, 0, 3)),
               std::invalid_argument);
  EXPECT_THROW(CommEngine(c10::make_intrusive<LoopbackGroup>(box, 0, 2), 5.0,
                          CommEngine::kDefaultDepth, at::kCPU, 0.0, CommEngine::kDefaultRecvPool,
                          false, c10::make_intrusive<LoopbackGroup>(box, 1, 2)),
               std::invalid_argument);
}
