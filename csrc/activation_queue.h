// ActivationQueue: a bounded, blocking, closable FIFO of tensor bundles.
//
//   producer (compute or comm thread)           consumer (compute or comm thread)
//        push(bundle) ──▶ [ slot | slot | ... | slot ] ──▶ pop()
//        blocks while full                      blocks while empty
//
// One mutex guards the ring; two condition variables wake the side that waits. The ring of
// `capacity` slots is allocated once in the constructor, and bundles are moved in and out, so
// a push or pop allocates nothing (the tensors themselves are reference-counted handles).
//
// CUDA builds: push records an event on the producer's current stream for the bundle's
// device, and pop makes the consumer's current stream wait on it. The hand-off is ordered on
// the GPU without the host ever synchronising.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#ifdef PIPEDREAM_FAST_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace pipedream_fast {

// Monotonic clock in nanoseconds, shared by C++ producers and Python consumers for latency.
int64_t now_ns();

struct Bundle {
  std::vector<at::Tensor> tensors;
  int64_t microbatch = -1;
  int64_t version = -1;
  int64_t enqueued_ns = 0;  // stamped by push: when the bundle entered the queue
#ifdef PIPEDREAM_FAST_WITH_CUDA
  // Recorded on the producer's stream at push; shared because CUDAEvent is move-only and a
  // Bundle must stay copyable for the Python side.
  std::shared_ptr<at::cuda::CUDAEvent> ready;
#endif
};

struct QueueStats {
  int64_t pushed = 0;
  int64_t popped = 0;
  int64_t push_wait_ns = 0;  // total time producers spent blocked on a full queue
  int64_t pop_wait_ns = 0;   // total time consumers spent blocked on an empty queue
  int64_t high_water = 0;    // most items ever held at once
};

class ActivationQueue {
 public:
  // A negative timeout waits forever.
  static constexpr double kForever = -1.0;

  // `spin_us` > 0: before blocking, a waiter spins that long (GIL released) watching for
  // its condition, which skips the OS wake-up (tens of µs) when the other side is quick.
  // Only for threads that each own a core: on a shared core spinning steals the other's time.
  ActivationQueue(int64_t capacity, std::string name, double spin_us = 0.0);
  ActivationQueue(const ActivationQueue&) = delete;
  ActivationQueue& operator=(const ActivationQueue&) = delete;

  // Blocks while the queue is full. Throws QueueClosed if the queue is (or becomes) closed,
  // QueueTimeout after `timeout_s` seconds.
  void push(Bundle bundle, double timeout_s = kForever);

  // Blocks while the queue is empty. Items pushed before close() are still handed out;
  // QueueClosed is thrown once the queue is closed and drained. QueueTimeout on timeout.
  Bundle pop(double timeout_s = kForever);

  // Non-blocking pop: nullopt when empty (also when closed and drained).
  std::optional<Bundle> try_pop();

  // Shuts the queue and wakes every waiter on both sides. Idempotent.
  void close();

  bool closed() const;
  int64_t size() const;
  int64_t capacity() const { return capacity_; }
  const std::string& name() const { return name_; }
  QueueStats stats() const;

 private:
  Bundle take_front_locked();
  void set_count_locked(int64_t count);

  const int64_t capacity_;
  const std::string name_;
  const int64_t spin_ns_;
  // Lock-free mirrors of count_ and closed_ for spinning waiters (written under mutex_).
  std::atomic<int64_t> count_hint_{0};
  std::atomic<bool> closed_hint_{false};

  mutable std::mutex mutex_;
  std::condition_variable not_empty_;
  std::condition_variable not_full_;
  std::vector<Bundle> ring_;  // guarded by mutex_; capacity_ slots, allocated once
  int64_t head_ = 0;          // guarded by mutex_; index of the oldest item
  int64_t count_ = 0;         // guarded by mutex_
  bool closed_ = false;       // guarded by mutex_
  QueueStats stats_;          // guarded by mutex_
};

}  // namespace pipedream_fast
