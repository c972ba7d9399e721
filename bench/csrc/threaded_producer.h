// ThreadedProducer: a native thread that pushes bundles into an ActivationQueue, as the
// communication engine's receive threads do. Bench-only (not in the library extension): the
// hand-off benchmarks and the queue tests use it, through bench/native.py, to measure
// C++-producer -> Python-consumer latency without any Python in the producer.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "activation_queue.h"

namespace pipedream_fast {

class ThreadedProducer {
 public:
  // Pushes `count` bundles of `tensors` (microbatch = 0..count-1), sleeping `interval_us`
  // between pushes so each hand-off meets a consumer that is already blocked in pop.
  ThreadedProducer(std::shared_ptr<ActivationQueue> queue, std::vector<at::Tensor> tensors,
                   int64_t count, int64_t interval_us);
  ~ThreadedProducer();

  // Waits for the thread; rethrows what stopped it early (a closed queue, say).
  void join();

 private:
  std::shared_ptr<ActivationQueue> queue_;
  std::exception_ptr error_;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

}  // namespace pipedream_fast
