#include "cpu_cache.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>

#include <atomic>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pipedream_fast {

namespace {

constexpr size_t kPage = 4096;

class CpuBlockCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    // Every CPU tensor comes here, the small ones too: no lock on their way through.
    c10::Allocator* previous = previous_.load(std::memory_order_acquire);
    if (previous == nullptr) previous = c10::GetDefaultCPUAllocator();
    if (n < static_cast<size_t>(kCpuCacheMinBytes)) return previous->allocate(n);
    const size_t size = (n + kPage - 1) / kPage * kPage;
    Block block;
    {
      std::lock_guard<std::mutex> guard(mu_);
      // The smallest free block that fits, if it wastes at most a quarter of itself: a
      // microbatch of another size (the last of an epoch) need not take a much larger one.
      // Of equal ones the last freed, whose lines are likeliest still in the CPU's caches.
      auto it = free_.lower_bound(size);
      if (it != free_.end()) it = std::prev(free_.upper_bound(it->first));
      if (it != free_.end() && it->first - size <= it->first / 4) {
        block = std::move(it->second);
        cached_ -= static_cast<int64_t>(block.size);
        free_.erase(it);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (!block.data) {  // outside the lock: the system call and its page faults
      block.data = previous->allocate(size);
      block.size = size;
    }
    void* data = block.data.get();
    {
      std::lock_guard<std::mutex> guard(mu_);
      live_bytes_ += static_cast<int64_t>(block.size);
      live_.emplace(data, std::move(block));
    }
    return {data, data, &CpuBlockCache::free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CpuBlockCache::free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static CpuBlockCache& instance() {
    // Never destroyed: a tensor freed during the process's exit still finds it.
    static auto* cache = [] {
      auto* made = new CpuBlockCache();
      // A fork (a DataLoader's workers) while another thread holds the lock would leave the
      // child's copy locked for good: the lock is taken around the fork, as malloc's is.
      pthread_atfork([] { instance().mu_.lock(); }, [] { instance().mu_.unlock(); },
                     [] { instance().mu_.unlock(); });
      return made;
    }();
    return *cache;
  }

  bool acquire(int64_t limit) {
    std::lock_guard<std::mutex> guard(mu_);
    if (users_ == 0) {
      c10::Allocator* current = c10::GetCPUAllocator();
      if (current != this) previous_.store(current, std::memory_order_release);
      c10::SetCPUAllocator(this, /*priority=*/0);  // not over a higher priority one
      if (c10::GetCPUAllocator() != this) {
        previous_.store(nullptr, std::memory_order_release);
        return false;
      }
      limit_ = limit;
    } else if (limit > limit_) {
      limit_ = limit;
    }
    ++users_;
    return true;
  }

  void release() {
    std::vector<Block> freed;
    {
      std::lock_guard<std::mutex> guard(mu_);
      if (users_ == 0) return;
      if (--users_ > 0) return;
      c10::Allocator* previous = previous_.load(std::memory_order_acquire);
      if (c10::GetCPUAllocator() == this && previous != nullptr) {
        c10::SetCPUAllocator(previous, /*priority=*/0);
      }
      limit_ = 0;  // blocks freed from now on go back at once
      take_free(freed);
    }
    // `freed` goes here, outside the lock: each block's own deleter frees it.
  }

  void empty() {
    std::vector<Block> freed;
    std::lock_guard<std::mutex> guard(mu_);
    take_free(freed);
  }

  CpuCacheStats stats() {
    std::lock_guard<std::mutex> guard(mu_);
    CpuCacheStats s;
    s.installed = users_ > 0 && c10::GetCPUAllocator() == this;
    s.users = users_;
    s.limit_bytes = limit_;
    s.cached_bytes = cached_;
    s.live_bytes = live_bytes_;
    s.hits = hits_;
    s.misses = misses_;
    s.dropped = dropped_;
    return s;
  }

 private:
  struct Block {
    c10::DataPtr data;  // as the previous allocator made it: its deleter frees it
    size_t size = 0;
  };

  CpuBlockCache() = default;

  // Moves the free blocks into `out` (the caller lets them go outside the lock).
  void take_free(std::vector<Block>& out) {
    for (auto& entry : free_) out.push_back(std::move(entry.second));
    free_.clear();
    cached_ = 0;
  }

  static void free_block(void* data) { instance().give_back(data); }

  void give_back(void* data) {
    Block block;
    {
      std::lock_guard<std::mutex> guard(mu_);
      auto it = live_.find(data);
      if (it == live_.end()) {
        // Not one of ours: a small block that `raw_deallocate` hands to this deleter.
        c10::Allocator* previous = previous_.load(std::memory_order_acquire);
        if (previous == nullptr) previous = c10::GetDefaultCPUAllocator();
        c10::DeleterFnPtr deleter = previous->raw_deleter();
        if (deleter != nullptr) deleter(data);
        return;
      }
      block = std::move(it->second);
      live_.erase(it);
      live_bytes_ -= static_cast<int64_t>(block.size);
      if (cached_ + static_cast<int64_t>(block.size) <= limit_) {
        cached_ += static_cast<int64_t>(block.size);
        free_.emplace(block.size, std::move(block));
        return;
      }
      ++dropped_;
    }
    // `block` goes here, outside the lock.
  }

  std::mutex mu_;
  std::atomic<c10::Allocator*> previous_{nullptr};  // written under mu_
  int64_t users_ = 0;
  int64_t limit_ = 0;
  int64_t cached_ = 0;
  int64_t live_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  int64_t dropped_ = 0;
  std::multimap<size_t, Block> free_;            // free blocks by size
  std::unordered_map<void*, Block> live_;        // blocks in tensors, by address
};

}  // namespace

bool cpu_cache_acquire(int64_t limit_bytes) {
  return CpuBlockCache::instance().acquire(limit_bytes < 0 ? 0 : limit_bytes);
}

void cpu_cache_release() { CpuBlockCache::instance().release(); }

void cpu_cache_empty() { CpuBlockCache::instance().empty(); }

CpuCacheStats cpu_cache_stats() { return CpuBlockCache::instance().stats(); }

}  // namespace pipedream_fast
