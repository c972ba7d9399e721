#include "weight_ring.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "errors.h"

#ifdef PIPEDREAM_FAST_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace pipedream_fast {

struct WeightRing::Group {
  at::Tensor live;  // flat buffer on the parameters' device, one dtype
};

struct WeightRing::Slot {
  int64_t version = -1;             // -1: free
  std::vector<at::Tensor> buffers;  // one per group (pinned host memory when offloaded)
  std::vector<at::Tensor> views;    // aligned with params; device tensors
#ifdef PIPEDREAM_FAST_WITH_CUDA
  std::vector<at::Tensor> device_buffers;  // offload: the fetched device copy, until release
  at::cuda::CUDAEvent copied;              // offload: device->host copy done
#endif
};

namespace {

// Parameter-shaped leaf views of flat `buffers`, with each parameter's requires_grad.
std::vector<at::Tensor> shaped_views(const std::vector<at::Tensor>& buffers,
                                     const std::vector<at::Tensor>& params,
                                     const std::vector<int64_t>& group_of,
                                     const std::vector<int64_t>& offset_of) {
  std::vector<at::Tensor> views(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& flat = buffers[static_cast<size_t>(group_of[i])];
    // detach(): a leaf that shares storage and the autograd version counter with the slot.
    views[i] = flat.narrow(0, offset_of[i], params[i].numel())
                   .view(params[i].sizes())
                   .detach()
                   .requires_grad_(params[i].requires_grad());
  }
  return views;
}

#ifdef PIPEDREAM_FAST_WITH_CUDA
at::cuda::CUDAStream side_stream(const at::Tensor& like) {
  // One pool stream per device, taken once: snapshots must stay ordered among themselves.
  static std::mutex mutex;
  static std::vector<std::optional<at::cuda::CUDAStream>> streams(
      static_cast<size_t>(at::cuda::device_count()));
  std::lock_guard<std::mutex> lock(mutex);
  auto& stream = streams.at(static_cast<size_t>(like.device().index()));
  if (!stream) stream = at::cuda::getStreamFromPool(false, like.device().index());
  return *stream;
}
#endif

}  // namespace

WeightRing::WeightRing(std::vector<at::Tensor> params, int64_t slots, bool offload)
    : offload_(offload), live_views_(params) {
  if (slots < 1) {
    throw std::invalid_argument("WeightRing: slots must be >= 1, got " + std::to_string(slots));
  }
  if (params.empty()) {
    throw std::invalid_argument("WeightRing: the stage has no parameters to version");
  }
#ifndef PIPEDREAM_FAST_WITH_CUDA
  if (offload) {
    throw std::invalid_argument(
        "WeightRing: offload=True needs a CUDA build of pipedream_fast and CUDA parameters");
  }
#endif
  // A tensor listed twice would be rebound twice and its first entry would go stale.
  std::unordered_map<const void*, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) continue;
    auto [it, fresh] = seen.emplace(params[i].unsafeGetTensorImpl(), i);
    if (!fresh) {
      throw std::invalid_argument("WeightRing: parameters " + std::to_string(it->second) + " and " +
                                  std::to_string(i) + " are the same tensor; pass each parameter "
                                  "once (model.parameters() already deduplicates shared weights)");
    }
  }
  // Group parameters by (device, dtype), in order of first appearance.
  group_of_.resize(params.size());
  offset_of_.resize(params.size());
  std::vector<int64_t> group_numel;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.defined()) {
      throw std::invalid_argument("WeightRing: parameter " + std::to_string(i) + " is undefined");
    }
    if (offload && !p.is_cuda()) {
      throw std::invalid_argument("WeightRing: offload=True needs CUDA parameters, parameter " +
                                  std::to_string(i) + " is on " + p.device().str());
    }
    auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) {
      return g.live.device() == p.device() && g.live.scalar_type() == p.scalar_type();
    });
    if (it == groups_.end()) {
      groups_.push_back(Group{at::empty({0}, p.options().requires_grad(false))});
      group_numel.push_back(0);
      it = groups_.end() - 1;
    }
    const size_t g = static_cast<size_t>(it - groups_.begin());
    group_of_[i] = static_cast<int64_t>(g);
    offset_of_[i] = group_numel[g];
    group_numel[g] += p.numel();
  }

  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> live_buffers(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    group.live = at::empty({group_numel[g]}, group.live.options());
    live_buffers[g] = group.live;
    bytes_per_version_ += group.live.numel() * static_cast<int64_t>(group.live.element_size());
  }
  // Rebind each parameter to its place in the live buffer (same Python object afterwards).
  std::vector<at::Tensor> live = shaped_views(live_buffers, params, group_of_, offset_of_);
  for (size_t i = 0; i < params.size(); ++i) {
    live[i].copy_(params[i]);
    params[i].set_data(live[i]);
  }

  for (int64_t k = 0; k < slots; ++k) {
    auto slot = std::make_unique<Slot>();
    for (const Group& group : groups_) {
      auto options = group.live.options();
      if (offload) options = options.device(at::kCPU).pinned_memory(true);
      slot->buffers.push_back(at::empty({group.live.numel()}, options));
    }
    if (!offload) slot->views = shaped_views(slot->buffers, params, group_of_, offset_of_);
    slots_.push_back(std::move(slot));
  }
}

WeightRing::~WeightRing() = default;

WeightRing::Slot& WeightRing::held_slot_locked(int64_t version, const char* action) {
  for (auto& slot : slots_) {
    if (slot->version == version && version >= 0) return *slot;
  }
  std::ostringstream msg;
  msg << "WeightRing." << action << "(" << version << "): version " << version
      << " is not held (held:";
  for (const auto& slot : slots_) {
    if (slot->version >= 0) msg << ' ' << slot->version;
  }
  msg << "); it was never snapshotted or has been released";
  throw VersionError(msg.str());
}

int64_t WeightRing::snapshot(int64_t version) {
  std::lock_guard<std::mutex> lock(mutex_);
  Slot* free = nullptr;
  for (auto& slot : slots_) {
    if (version >= 0 && slot->version == version) {
      throw VersionError("WeightRing.snapshot(" + std::to_string(version) + "): version " +
                         std::to_string(version) + " is already held; release it first");
    }
    if (!free && slot->version < 0) free = slot.get();
  }
  if (!free) {
    throw VersionError("WeightRing.snapshot(): all " + std::to_string(slots_.size()) +
                       " slots hold versions; release one first or build the ring with more "
                       "slots (the schedule declares how many versions a stage keeps)");
  }
  c10::NoGradGuard no_grad;
#ifdef PIPEDREAM_FAST_WITH_CUDA
  if (offload_) {
    // Side stream waits for the producer of the live weights, copies them to pinned host
    // memory, and the current stream waits for the copy before it may update them again.
    const at::Tensor& like = groups_.front().live;
    c10::cuda::CUDAGuard device_guard(like.device());
    auto current = at::cuda::getCurrentCUDAStream(like.device().index());
    auto side = side_stream(like);
    at::cuda::CUDAEvent produced;
    produced.record(current);
    produced.block(side);
    {
      c10::cuda::CUDAStreamGuard stream_guard(side);
      for (size_t g = 0; g < groups_.size(); ++g) {
        free->buffers[g].copy_(groups_[g].live, /*non_blocking=*/true);
      }
    }
    free->copied.record(side);
    free->copied.block(current);
  } else
#endif
  {
    for (size_t g = 0; g < groups_.size(); ++g) free->buffers[g].copy_(groups_[g].live);
  }
  free->version = version >= 0 ? version : next_version_;
  next_version_ = std::max(next_version_, free->version + 1);
  return free->version;
}

const std::vector<at::Tensor>& WeightRing::tensors(int64_t version) {
  std::lock_guard<std::mutex> lock(mutex_);
  Slot& slot = held_slot_locked(version, "tensors");
#ifdef PIPEDREAM_FAST_WITH_CUDA
  if (offload_ && slot.views.empty()) {
    // Fetch the version back to the device once; the copy stays until release.
    c10::NoGradGuard no_grad;
    const at::Tensor& like = groups_.front().live;
    c10::cuda::CUDAGuard device_guard(like.device());
    auto current = at::cuda::getCurrentCUDAStream(like.device().index());
    auto side = side_stream(like);
    slot.device_buffers.clear();
    for (const Group& group : groups_) {
      at::Tensor buf = at::empty({group.live.numel()}, group.live.options());
      c10::cuda::CUDACachingAllocator::recordStream(buf.storage().data_ptr(), side);
      slot.device_buffers.push_back(buf);
    }
    {
      c10::cuda::CUDAStreamGuard stream_guard(side);
      for (size_t g = 0; g < groups_.size(); ++g) {
        slot.device_buffers[g].copy_(slot.buffers[g], /*non_blocking=*/true);
      }
    }
    at::cuda::CUDAEvent fetched;
    fetched.record(side);
    fetched.block(current);
    slot.views = shaped_views(slot.device_buffers, live_views_, group_of_, offset_of_);
    bind_grads(slot.views);
  }
#endif
  return slot.views;
}

void WeightRing::release(int64_t version) {
  std::lock_guard<std::mutex> lock(mutex_);
  Slot& slot = held_slot_locked(version, "release");
  slot.version = -1;
  if (grads_.empty()) {
    // The slot's tensors are reused by the next version: it must not inherit these gradients.
    // (With attached buffers every version shares the stage's gradient buffer by design.)
    for (auto& t : slot.views) t.mutable_grad().reset();
  }
#ifdef PIPEDREAM_FAST_WITH_CUDA
  if (offload_) {
    slot.views.clear();
    slot.device_buffers.clear();
  }
#endif
}

void WeightRing::bind_grads(const std::vector<at::Tensor>& tensors) const {
  if (grads_.empty()) return;
  const std::vector<at::Tensor> grad_views = shaped_views(grads_, live_views_, group_of_, offset_of_);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].requires_grad()) tensors[i].mutable_grad() = grad_views[i].detach();
  }
}

std::vector<at::Tensor> WeightRing::attach_grad_buffers() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (grads_.empty()) {
    for (const Group& group : groups_) grads_.push_back(at::zeros_like(group.live));
    bind_grads(live_views_);
    for (auto& slot : slots_) bind_grads(slot->views);
  }
  return grads_;
}

std::vector<at::Tensor> WeightRing::live_buffers() const {
  std::vector<at::Tensor> out;
  out.reserve(groups_.size());
  for (const Group& group : groups_) out.push_back(group.live);
  return out;
}

std::vector<int64_t> WeightRing::held_versions() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> out;
  for (const auto& slot : slots_) {
    if (slot->version >= 0) out.push_back(slot->version);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool WeightRing::holds(int64_t version) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return version >= 0 && std::any_of(slots_.begin(), slots_.end(),
                                     [&](const auto& slot) { return slot->version == version; });
}

int64_t WeightRing::free_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::count_if(slots_.begin(), slots_.end(),
                       [](const auto& slot) { return slot->version < 0; });
}

}  // namespace pipedream_fast
