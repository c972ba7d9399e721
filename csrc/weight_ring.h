// WeightRing: K preallocated weight-version slots for one pipeline stage (weight stashing).
//
//   live parameters ──(rebound as views of)──▶ live[dtype]   one flat buffer per dtype
//   snapshot():   live[dtype] ──copy_──▶ slot[k][dtype]        one bulk copy per dtype
//   tensors(v):   views of slot[k], shaped like the parameters, for functional_call
//   release(v):   slot k is free again
//
// The constructor moves every parameter's data into a flat "live" buffer per (device, dtype)
// and rebinds the parameter to a view of it (the Python objects, and so the optimizer's
// references, stay the same). A snapshot is then one memcpy per dtype instead of a loop over
// tensors.
//
// Each slot owns its own buffers, so the tensors of one version share an autograd version
// counter with nothing but that slot: writing a new snapshot into slot k never trips the
// "modified by an inplace operation" check of a graph built on another slot, while reusing a
// slot whose version a graph still needs does (as it must).
//
// Offload (CUDA builds): slots live in pinned host memory; snapshot() copies device->host on
// a side stream ordered after the current stream; tensors(v) copies the version back to the
// device on that side stream once and keeps the device copy until release(v). The current
// stream waits on events, never the host.
//
// Not thread-safe for concurrent snapshot/release from several threads on one stage beyond
// the slot table itself, which is guarded by a mutex: a stage's compute thread owns its ring.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace pipedream_fast {

class WeightRing {
 public:
  // `params`: the stage's parameters (they are rebound to views of the live buffers).
  // `slots`: how many versions can be held at once (K >= 1).
  WeightRing(std::vector<at::Tensor> params, int64_t slots, bool offload = false);
  WeightRing(const WeightRing&) = delete;
  WeightRing& operator=(const WeightRing&) = delete;
  ~WeightRing();

  // Copies the live parameters into a free slot. Returns the version id: `version` when given
  // (>= 0, not currently held), else the next id of a counter that starts at 0. Throws
  // VersionError when every slot is held or the id is already live.
  int64_t snapshot(int64_t version = -1);

  // Tensors of a held version, aligned with the constructor's `params`. Leaf tensors with the
  // parameters' requires_grad, sharing storage with the slot; the same objects on every call.
  const std::vector<at::Tensor>& tensors(int64_t version);

  // Frees the version's slot. Throws VersionError for an unknown or released version.
  void release(int64_t version);

  // Gives every parameter and every version's tensors a `.grad` that is a view of one flat,
  // zeroed gradient buffer per group, and returns those buffers. Backward passes on any
  // version then accumulate in place into the same resident memory that the optimizer reads
  // through the parameters' `.grad` (and that an all-reduce sends as one bucket per dtype).
  // Idempotent.
  std::vector<at::Tensor> attach_grad_buffers();
  const std::vector<at::Tensor>& grad_buffers() const { return grads_; }

  // Tensors of the live parameters (views of the live buffers), aligned with `params`.
  const std::vector<at::Tensor>& live_tensors() const { return live_views_; }
  // The flat live buffers, one per (device, dtype) group.
  std::vector<at::Tensor> live_buffers() const;

  std::vector<int64_t> held_versions() const;
  bool holds(int64_t version) const;
  int64_t capacity() const { return static_cast<int64_t>(slots_.size()); }
  int64_t free_slots() const;
  int64_t bytes_per_version() const { return bytes_per_version_; }
  int64_t num_params() const { return static_cast<int64_t>(live_views_.size()); }
  bool offloaded() const { return offload_; }

 private:
  struct Group;  // the live flat buffer of one (device, dtype)
  struct Slot;   // one version's buffers, views and (offload) events

  Slot& held_slot_locked(int64_t version, const char* action);
  void bind_grads(const std::vector<at::Tensor>& tensors) const;

  const bool offload_;
  std::vector<Group> groups_;
  std::vector<at::Tensor> live_views_;
  std::vector<int64_t> group_of_;   // per parameter: index of its group
  std::vector<int64_t> offset_of_;  // per parameter: element offset in its group's buffers
  std::vector<at::Tensor> grads_;   // flat gradient buffer per group, once attached
  std::vector<std::unique_ptr<Slot>> slots_;
  int64_t bytes_per_version_ = 0;
  int64_t next_version_ = 0;
  mutable std::mutex mutex_;  // guards slot ownership (version ids) and next_version_
};

}  // namespace pipedream_fast
