#include "activation_queue.h"

#include "errors.h"

#ifdef PIPEDREAM_FAST_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace pipedream_fast {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

namespace {

// Waits on `cv` until `ready()` holds. Returns false on timeout. A negative timeout waits
// forever. Adds the time spent waiting to `*waited_ns`.
template <typename Pred>
bool wait_for(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, double timeout_s,
              int64_t* waited_ns, Pred ready) {
  if (ready()) return true;
  const int64_t start = now_ns();
  bool ok = true;
  if (timeout_s < 0) {
    cv.wait(lock, ready);
  } else {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    ok = cv.wait_until(lock, deadline, ready);
  }
  *waited_ns += now_ns() - start;
  return ok;
}

std::string seconds(double timeout_s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", timeout_s);
  return buf;
}

#ifdef PIPEDREAM_FAST_WITH_CUDA
// The CUDA device of the first CUDA tensor in the bundle, if any.
std::optional<c10::DeviceIndex> cuda_device(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) return t.device().index();
  }
  return std::nullopt;
}
#endif

// Spins (without the lock) until `ready()` or `spin_ns` pass; the caller then takes the lock
// and checks again, so a spin that gives up early only costs the normal blocking path.
template <typename Pred>
void spin_until(int64_t spin_ns, Pred ready) {
  if (spin_ns <= 0) return;
  const int64_t deadline = now_ns() + spin_ns;
  for (int i = 0;; ++i) {
    if (ready()) return;
    if ((i & 63) == 63 && now_ns() > deadline) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

// Orders the consumer's current stream after the producer's work on the bundle (CUDA only).
void make_consumer_wait(const Bundle& bundle) {
#ifdef PIPEDREAM_FAST_WITH_CUDA
  if (bundle.ready) {
    if (auto device = cuda_device(bundle.tensors)) {
      bundle.ready->block(at::cuda::getCurrentCUDAStream(*device));
    }
  }
#else
  (void)bundle;
#endif
}

}  // namespace

ActivationQueue::ActivationQueue(int64_t capacity, std::string name, double spin_us)
    : capacity_(capacity),
      name_(std::move(name)),
      spin_ns_(static_cast<int64_t>(spin_us * 1000.0)) {
  if (spin_us < 0) {
    throw std::invalid_argument("ActivationQueue '" + name_ + "': spin_us must be >= 0");
  }
  if (capacity < 1) {
    throw std::invalid_argument("ActivationQueue '" + name_ + "': capacity must be >= 1, got " +
                                std::to_string(capacity));
  }
  ring_.resize(static_cast<size_t>(capacity));
}

void ActivationQueue::push(Bundle bundle, double timeout_s) {
#ifdef PIPEDREAM_FAST_WITH_CUDA
  // Record before taking the lock: the event marks the producer's work so far on its stream.
  if (auto device = cuda_device(bundle.tensors)) {
    bundle.ready = std::make_shared<at::cuda::CUDAEvent>();
    bundle.ready->record(at::cuda::getCurrentCUDAStream(*device));
  }
#endif
  spin_until(spin_ns_, [this] {
    return closed_hint_.load(std::memory_order_acquire) ||
           count_hint_.load(std::memory_order_acquire) < capacity_;
  });
  std::unique_lock<std::mutex> lock(mutex_);
  const bool ok = wait_for(not_full_, lock, timeout_s, &stats_.push_wait_ns,
                           [this] { return closed_ || count_ < capacity_; });
  if (closed_) throw QueueClosed("push to closed queue '" + name_ + "'");
  if (!ok) {
    throw QueueTimeout("push to queue '" + name_ + "' timed out after " + seconds(timeout_s) +
                       " s: the queue stayed full (capacity " + std::to_string(capacity_) +
                       "); is its consumer alive?");
  }
  bundle.enqueued_ns = now_ns();
  ring_[static_cast<size_t>((head_ + count_) % capacity_)] = std::move(bundle);
  set_count_locked(count_ + 1);
  ++stats_.pushed;
  if (count_ > stats_.high_water) stats_.high_water = count_;
  lock.unlock();
  not_empty_.notify_one();
}

Bundle ActivationQueue::take_front_locked() {
  Bundle out = std::move(ring_[static_cast<size_t>(head_)]);
  ring_[static_cast<size_t>(head_)] = Bundle{};  // drop the moved-from slot's handles now
  head_ = (head_ + 1) % capacity_;
  set_count_locked(count_ - 1);
  ++stats_.popped;
  return out;
}

void ActivationQueue::set_count_locked(int64_t count) {
  count_ = count;
  count_hint_.store(count, std::memory_order_release);
}

Bundle ActivationQueue::pop(double timeout_s) {
  spin_until(spin_ns_, [this] {
    return closed_hint_.load(std::memory_order_acquire) ||
           count_hint_.load(std::memory_order_acquire) > 0;
  });
  std::unique_lock<std::mutex> lock(mutex_);
  const bool ok = wait_for(not_empty_, lock, timeout_s, &stats_.pop_wait_ns,
                           [this] { return closed_ || count_ > 0; });
  if (count_ == 0) {
    if (closed_) throw QueueClosed("pop from closed and drained queue '" + name_ + "'");
    (void)ok;
    throw QueueTimeout("pop from queue '" + name_ + "' timed out after " + seconds(timeout_s) +
                       " s: nothing arrived; is its producer alive?");
  }
  Bundle out = take_front_locked();
  lock.unlock();
  not_full_.notify_one();
  make_consumer_wait(out);
  return out;
}

std::optional<Bundle> ActivationQueue::try_pop() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (count_ == 0) return std::nullopt;
  Bundle out = take_front_locked();
  lock.unlock();
  not_full_.notify_one();
  make_consumer_wait(out);
  return out;
}

void ActivationQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    closed_hint_.store(true, std::memory_order_release);
  }
  not_empty_.notify_all();
  not_full_.notify_all();
}

bool ActivationQueue::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

int64_t ActivationQueue::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_;
}

QueueStats ActivationQueue::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace pipedream_fast
