// CommEngine: point-to-point activation and gradient traffic of one rank, off the compute
// thread, over a c10d ProcessGroup (gloo on CPU, NCCL on GPU, same calls).
//
//   compute thread                        link (peer, channel, stage)              peer rank
//   send(peer, ch, st, mb, ts) ──▶ [send queue] ──send thread──▶ pg->send ───────────▶
//   post_recv(peer, ch, st, mb) ─▶ [request queue] ─recv thread─ pg->recv ◀───────────
//   wait_recv(peer, ch, st, mb) ◀─ [done queue] ◀──────────────┘  (pooled buffers)
//
// One link per (peer, channel, stage), each with its own send and receive thread, started on
// first use. `stage` is the pipeline stage that receives the message (the consumer s+1 of an
// activation, s-1 of a gradient); the engine treats it as an opaque id. A rank that holds
// several stages (interleaved schedules) has several stage boundaries with the same peer, and
// each must be its own link: one shared link would hand stage 3 the activation meant for
// stage 1 whenever the two boundaries run the same microbatches in a different order.
//
// The first message of a link is preceded by a small header with the tensors' dtypes and
// shapes; it fixes how the link's messages travel (packed into one transfer, or split into a
// prefix and one transfer per tensor) and the size of the receive buffers posted ahead. After
// that every message is a frame whose 64-byte prefix says how long it is and, only when they
// changed, carries the new dtypes and shapes: sizes and dtypes may change from microbatch to
// microbatch (a batch padded to its own longest sequence, a short last batch) at no cost while
// they stay; a message larger than the posted buffer sends its rest on an overflow tag. What
// may not change is what the boundary is made of: the number of tensors and their dimensions
// (a send that changes them is rejected with an error naming both). See "Frames" in
// comm_engine.cpp.
//
// The process group matches a receive to a send by (peer, tag) over the whole rank pair, so
// tags are unique across links: bit 30 marks the header, bit 29 an overflow, bits 20..28 hold
// the stage (so stage < 512), bits 1..19 the microbatch modulo 2^19 (the messages in flight on
// one link never span 2^19 microbatches) and bit 0 the channel. A receive thus matches exactly
// the send of the same stage, channel and microbatch; a schedule that disagrees between two
// ranks times out with a message naming the peer, the channel, the stage and the microbatch
// instead of mixing data.
//
// Two ways to move a message. On a GPU (NCCL) each link has a send and a receive thread, as
// drawn above: a transfer there is waited for off the compute thread. On CPU (gloo), where a
// send and a receive are asynchronous already (gloo's own I/O thread moves the bytes), the
// caller issues them directly: send() starts the transfer and returns (it waits only when
// more than `depth` sends of the link are unfinished, for the oldest), post_recv() starts the
// receive into pooled buffers (the first waits for the link's header first, in wait_recv),
// and wait_recv() waits on the receive's Work. No thread hop per message: each hop is a
// wake-up, and two per message were most of the runtime's cost per action on CPU. A shutdown
// aborts what is in flight. `background=true` keeps the threads on CPU too.
//
// Receive buffers come from a per-link pool of at most `recv_pool` sets. A buffer is handed
// out again only when nobody else holds its storage (the compute thread and autograd have
// dropped it), so steady-state receives allocate nothing as long as the pool covers the
// messages a stage holds at once; past that, and for a message larger than the link's first
// (its overflow), receives allocate fresh buffers.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "activation_queue.h"

namespace pipedream_fast {

enum class Channel : int { kActivation = 0, kGradient = 1 };

const char* channel_name(Channel channel);

struct CommStats {
  int64_t messages_sent = 0;
  int64_t messages_received = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t send_ns = 0;       // time the send threads spent in the process group
  int64_t recv_ns = 0;       // time the receive threads spent in the process group
  int64_t wait_recv_ns = 0;  // time the compute thread waited in wait_recv
};

class CommEngine {
 public:
  static constexpr int64_t kDefaultDepth = 8;
  static constexpr int64_t kDefaultRecvPool = 64;

  // `timeout_s`: how long any one transfer or wait may take before it raises (a dead or stuck
  // peer never hangs this rank forever). `depth`: messages queued per link and direction.
  // `device`: where received tensors are allocated (CPU for gloo, the rank's GPU for NCCL).
  // `spin_us`: how long a link's queues spin before blocking (see ActivationQueue).
  // `recv_pool`: receive buffer sets pooled per link. `background`: transfers on link threads
  // even on CPU (on a GPU they always are; see "Two ways to move a message" above).
  // `gradient_group`: where given, the gradient channel's links run on it instead of `group`
  // (the same ranks in the same order; invalid_argument otherwise): under NCCL a group is a
  // communicator with a stream of its own per peer, so a gradient received never queues
  // behind an activation sent to the same peer, nor the other way. Speed only: none changes
  // what arrives.
  CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout_s,
             int64_t depth = kDefaultDepth, at::Device device = at::kCPU, double spin_us = 0.0,
             int64_t recv_pool = kDefaultRecvPool, bool background = false,
             c10::intrusive_ptr<c10d::ProcessGroup> gradient_group = {});
  CommEngine(const CommEngine&) = delete;
  CommEngine& operator=(const CommEngine&) = delete;
  ~CommEngine();

  // Every transfer names its link: the `peer` rank, the `channel` and the `stage` that receives
  // the message (0 <= stage < kMaxStages; invalid_argument otherwise).
  static constexpr int kMaxStages = 512;

  // Queues `tensors` of `microbatch` for `stage` on `peer`; returns at once unless the link's
  // queue is full. Raises the error of an earlier failed send on this link, as the send
  // thread caught it (a transfer that timed out there: QueueTimeout).
  void send(int peer, Channel channel, int stage, int64_t microbatch,
            std::vector<at::Tensor> tensors);

  // Asks for the message of `microbatch` for `stage` from `peer` to be received in the
  // background.
  void post_recv(int peer, Channel channel, int stage, int64_t microbatch);

  // Blocks until the posted receive of `microbatch` for `stage` from `peer` has arrived;
  // receives are handed out in the order they were posted on the link. Raises QueueTimeout
  // on timeout, whether this wait or the receive thread's transfer ran out of time; other
  // failures of the receive thread are rethrown as they were thrown there (their type kept);
  // QueueClosed once the engine is shut down.
  std::vector<at::Tensor> wait_recv(int peer, Channel channel, int stage, int64_t microbatch);

  // Whether the posted receive of `microbatch` for `stage` from `peer` has arrived, so that
  // wait_recv would return at once (a hint: false where unknown). Never blocks.
  bool arrived(int peer, Channel channel, int stage, int64_t microbatch);

  // Blocks until every queued send has been handed to the process group and completed.
  // Raises QueueTimeout after the timeout, or a send thread's error as it was thrown.
  void flush();

  // Stops every thread (waits at most `grace_s` for transfers in progress), then drops the
  // links (their transfers and buffers) and the process groups; stats() keeps the counts.
  // Idempotent.
  void shutdown(double grace_s = 1.0);

  CommStats stats() const;

  // The sends queued on link threads and not yet completed, as (peer, channel, receiving
  // stage, microbatch = -1: only their number per link is known), for a report of where a
  // stuck rank stands. None from direct links (see "Two ways to move a message"): there a
  // send's completion is known only when the caller waits for it. Safe from any thread.
  std::vector<std::tuple<int, Channel, int, int64_t>> unfinished_sends() const;

  int rank() const { return rank_; }
  double timeout_s() const { return timeout_s_; }
  int64_t depth() const { return depth_; }
  double spin_us() const { return spin_us_; }
  int64_t recv_pool() const { return recv_pool_; }
  bool background() const { return background_; }
  bool split_channels() const { return split_channels_; }

 private:
  struct Link;  // a link's queues, its send and receive loops and their state
  // The link of (peer, channel, stage), created and its threads started on first use; the
  // caller holds it for the length of its call, so a shutdown may drop it meanwhile.
  std::shared_ptr<Link> link(int peer, Channel channel, int stage);
  static void add_counters(CommStats& into, const Link& l);
  // invalid_argument unless `peer` is another rank of the group and `stage` fits in a tag.
  void check_link(int peer, Channel channel, int stage) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  // Both guarded by links_mutex_ and released at shutdown.
  c10::intrusive_ptr<c10d::ProcessGroup> gradient_group_;  // null: `group_` carries both
  const bool split_channels_;
  const int rank_;
  const double timeout_s_;
  const int64_t depth_;
  const at::Device device_;
  const double spin_us_;
  const int64_t recv_pool_;
  const bool background_;
  mutable std::mutex links_mutex_;
  // (peer, channel, stage) -> link; guarded by links_mutex_
  std::map<std::tuple<int, int, int>, std::shared_ptr<Link>> links_;
  std::atomic<int64_t> wait_recv_ns_{0};
  bool shut_down_ = false;  // guarded by links_mutex_
  CommStats retired_;       // the counters of the links a shutdown dropped; links_mutex_
};

}  // namespace pipedream_fast
