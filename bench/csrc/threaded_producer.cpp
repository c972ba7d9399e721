#include "threaded_producer.h"

#include <chrono>

namespace pipedream_fast {

ThreadedProducer::ThreadedProducer(std::shared_ptr<ActivationQueue> queue,
                                   std::vector<at::Tensor> tensors, int64_t count,
                                   int64_t interval_us)
    : queue_(std::move(queue)) {
  thread_ = std::thread([this, tensors = std::move(tensors), count, interval_us] {
    try {
      for (int64_t i = 0; i < count; ++i) {
        if (interval_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(interval_us));
        queue_->push(Bundle{tensors, i, -1});
      }
    } catch (...) {
      error_ = std::current_exception();
    }
    finished_ = true;
  });
}

ThreadedProducer::~ThreadedProducer() {
  if (thread_.joinable()) {
    // Never leave the thread blocked on a queue nobody reads; a finished thread leaves a
    // shared queue open for its other users.
    if (!finished_) queue_->close();
    thread_.join();
  }
}

void ThreadedProducer::join() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

}  // namespace pipedream_fast
