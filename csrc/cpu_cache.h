// CpuBlockCache: c10's CPU allocator with the freed large blocks kept for reuse.
//
// On the CPU a tensor comes from the C library's malloc. A block above malloc's mmap
// threshold (dynamic, at most 32 MiB with glibc) is mapped fresh and unmapped when freed,
// and the heap's free top is given back to the system; so a training step faults in and
// zeroes its activations and gradients page by page again every time (a weight gradient of
// 64 MiB is 16k page faults at each microbatch). On model A that was a third of a step
// (`bench/results/cpu_cache.md`). The CUDA caching allocator does not give a freed block
// back to the driver; this does the same for the CPU: freed blocks of at least
// `kMinBytes` are kept by size, up to a limit of bytes, and handed out again to a request
// of about their size. Smaller requests, and anything over the limit, go to the allocator
// that was installed before.
//
// Installed process-wide as c10's CPU allocator while at least one user holds it
// (`cpu_cache_acquire` / `cpu_cache_release`, counted); the last release puts the previous
// allocator back and frees what is cached. Blocks still in tensors then go back to the
// system when freed. Thread-safe: tensors are freed on any thread (a link's I/O thread).
#pragma once

#include <cstdint>

namespace pipedream_fast {

struct CpuCacheStats {
  bool installed = false;     // c10's CPU allocator is the cache now
  int64_t users = 0;          // acquisitions not released
  int64_t limit_bytes = 0;    // most bytes of free blocks kept
  int64_t cached_bytes = 0;   // bytes of free blocks kept now
  int64_t live_bytes = 0;     // bytes of the cache's blocks in use
  int64_t hits = 0;           // large requests served from the cache
  int64_t misses = 0;         // large requests that went to the previous allocator
  int64_t dropped = 0;        // freed blocks given back because the cache was full
};

// Requests below this many bytes go to the previous allocator (malloc serves them from its
// heap without faults).
constexpr int64_t kCpuCacheMinBytes = 256 * 1024;

// Installs the cache (the first user) or raises its limit to `limit_bytes` (a later one).
// Returns false, installing nothing, when c10 keeps another allocator installed with a
// higher priority (a profiler's, a user's).
bool cpu_cache_acquire(int64_t limit_bytes);

// One user less; the last one uninstalls the cache and frees its free blocks.
void cpu_cache_release();

// Frees the free blocks kept (the cache stays installed).
void cpu_cache_empty();

CpuCacheStats cpu_cache_stats();

}  // namespace pipedream_fast
