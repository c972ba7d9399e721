#include "comm_engine.h"

#include <chrono>
#include <cmath>
#include <sstream>
#include <thread>

#include "errors.h"

namespace pipedream_fast {

namespace {

constexpr int64_t kHeaderLen = 128;  // int64 words: [count, (dtype, ndim, dims...)...]

// Message tags. The process group matches a receive to a send by (peer, tag) across every link
// of a rank pair, so the tag names the link (channel, stage) and the microbatch:
//   bit 30 header | bits 21..29 stage | bits 1..20 microbatch mod 2^20 | bit 0 channel
// All 31 bits stay non-negative in an int. Wrapping the microbatch is safe because a link
// receives in post order and never has 2^20 microbatches in flight.
constexpr int kChannelBits = 1;
constexpr int kMicrobatchBits = 20;
constexpr int kStageBits = 9;
constexpr int kStageShift = kChannelBits + kMicrobatchBits;
constexpr int kHeaderBit = kStageShift + kStageBits;
static_assert(kHeaderBit == 30, "tags must fit in 31 bits");
static_assert(CommEngine::kMaxStages == 1 << kStageBits, "kMaxStages must match the tag layout");

int message_tag(Channel channel, int stage, int64_t microbatch) {
  // Masking (not %) keeps the field non-negative even for a negative microbatch.
  const int64_t mb_bits = microbatch & ((int64_t{1} << kMicrobatchBits) - 1);
  return (stage << kStageShift) | static_cast<int>(mb_bits << kChannelBits) |
         static_cast<int>(channel);
}
// One header per link: microbatch bits zero, told apart from messages by the header bit.
int header_tag(Channel channel, int stage) {
  return (1 << kHeaderBit) | (stage << kStageShift) | static_cast<int>(channel);
}

struct TensorMeta {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  bool operator==(const TensorMeta& other) const {
    return dtype == other.dtype && sizes == other.sizes;
  }
};

std::string describe(const std::vector<TensorMeta>& metas) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < metas.size(); ++i) {
    if (i) out << ", ";
    out << c10::toString(metas[i].dtype) << at::IntArrayRef(metas[i].sizes);
  }
  out << ']';
  return out.str();
}

std::vector<TensorMeta> metas_of(const std::vector<at::Tensor>& tensors) {
  std::vector<TensorMeta> metas;
  for (const auto& t : tensors) metas.push_back({t.scalar_type(), t.sizes().vec()});
  return metas;
}

at::Tensor encode_header(const std::vector<TensorMeta>& metas, const std::string& what) {
  at::Tensor header = at::zeros({kHeaderLen}, at::kLong);
  auto* words = header.data_ptr<int64_t>();
  int64_t pos = 0;
  words[pos++] = static_cast<int64_t>(metas.size());
  for (const auto& meta : metas) {
    if (pos + 2 + static_cast<int64_t>(meta.sizes.size()) > kHeaderLen) {
      throw std::invalid_argument(what + ": too many tensors or dimensions to describe in one "
                                  "message header: " + describe(metas));
    }
    words[pos++] = static_cast<int64_t>(meta.dtype);
    words[pos++] = static_cast<int64_t>(meta.sizes.size());
    for (int64_t size : meta.sizes) words[pos++] = size;
  }
  return header;
}

std::vector<TensorMeta> decode_header(const at::Tensor& header) {
  const auto* words = header.data_ptr<int64_t>();
  std::vector<TensorMeta> metas(static_cast<size_t>(words[0]));
  int64_t pos = 1;
  for (auto& meta : metas) {
    meta.dtype = static_cast<at::ScalarType>(words[pos++]);
    meta.sizes.assign(words + pos + 1, words + pos + 1 + words[pos]);
    pos += 1 + words[pos];
  }
  return metas;
}

// Packing. A message of several tensors (an activation and the target riding with it, a
// gradient and its loss) costs one process-group transfer per tensor, and every transfer is a
// round of latency: on gloo, two tiny tensors per message made a round trip 4x slower than
// one. So a message of several tensors totalling at most kPackMaxBytes travels as one byte
// buffer: the sender copies its tensors in (a memcpy, small next to a round of latency at
// these sizes), the receiver hands out views of the buffer, no copy. Both ends decide from
// the negotiated metas, so they always agree. Larger messages go tensor by tensor, where the
// copy would cost more than the latency it saves.
constexpr int64_t kPackMaxBytes = 4 << 20;
constexpr int64_t kPackAlign = 64;  // every tensor starts at a multiple: any dtype can view it

int64_t meta_bytes(const TensorMeta& meta) {
  int64_t numel = 1;
  for (int64_t size : meta.sizes) numel *= size;
  return numel * static_cast<int64_t>(c10::elementSize(meta.dtype));
}

int64_t aligned(int64_t bytes) { return (bytes + kPackAlign - 1) / kPackAlign * kPackAlign; }

// The packed size of a message, or 0 when it travels tensor by tensor.
int64_t packed_bytes(const std::vector<TensorMeta>& metas) {
  if (metas.size() < 2) return 0;
  int64_t total = 0;
  for (const auto& meta : metas) total += aligned(meta_bytes(meta));
  return total <= kPackMaxBytes ? total : 0;
}

// Views of `flat` laid out as `metas` (the layout `pack_into` writes).
std::vector<at::Tensor> unpack(const at::Tensor& flat, const std::vector<TensorMeta>& metas) {
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& meta : metas) {
    const int64_t bytes = meta_bytes(meta);
    out.push_back(flat.narrow(0, offset, bytes).view(meta.dtype).view(meta.sizes));
    offset += aligned(bytes);
  }
  return out;
}

void pack_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
               const std::vector<TensorMeta>& metas) {
  auto views = unpack(flat, metas);
  for (size_t i = 0; i < tensors.size(); ++i) views[i].copy_(tensors[i]);
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

int64_t nbytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel() * static_cast<int64_t>(t.element_size());
  return total;
}

}  // namespace

const char* channel_name(Channel channel) {
  return channel == Channel::kActivation ? "activation" : "gradient";
}

struct CommEngine::Link {
  Link(int peer, Channel channel, int stage, int64_t depth, double spin_us, int64_t recv_pool,
       std::string what)
      : peer(peer),
        channel(channel),
        stage(stage),
        recv_pool(recv_pool),
        what(std::move(what)),
        sends(depth, this->what + " (sends)", spin_us),
        requests(1 << 16, this->what + " (posted receives)", spin_us),
        done(depth, this->what + " (received)", spin_us) {}

  const int peer;
  const Channel channel;
  const int stage;          // the stage that receives this link's messages
  const int64_t recv_pool;  // most buffer sets kept in `pool`
  const std::string what;   // "activation link of rank 0 with rank 1 for stage 3", for messages
  ActivationQueue sends;
  ActivationQueue requests;
  ActivationQueue done;

  // Compute-thread state.
  std::vector<TensorMeta> sent_metas;  // negotiated on the first send
  bool negotiated = false;

  // Send-thread state.
  bool sent_header = false;

  // Send-thread state: the byte buffer packed messages go out from (each send completes
  // before the next is packed, so one is enough).
  at::Tensor send_flat;

  // Receive-thread state.
  std::vector<TensorMeta> recv_metas;
  bool got_header = false;
  int64_t recv_packed = 0;  // packed_bytes(recv_metas)
  std::vector<std::vector<at::Tensor>> pool;  // per set: the tensors, or one packed buffer

  std::mutex mutex;
  std::condition_variable idle;
  int64_t sends_in_flight = 0;  // guarded by mutex
  std::string send_error;       // guarded by mutex
  std::string recv_error;       // guarded by mutex
  int threads_running = 0;      // guarded by mutex
  std::vector<std::thread> threads;

  std::atomic<int64_t> messages_sent{0}, messages_received{0}, bytes_sent{0},
      bytes_received{0}, send_ns{0}, recv_ns{0};

  // Buffers for the next receive: a pooled set nobody else holds any more, or a new one.
  std::vector<at::Tensor> take_buffers(const at::Device& device) {
    for (auto& set : pool) {
      bool free = true;
      for (const auto& t : set) free = free && t.storage().use_count() == 1;
      if (free) return set;
    }
    std::vector<at::Tensor> set;
    if (recv_packed > 0) {
      set.push_back(at::empty({recv_packed}, at::TensorOptions().dtype(at::kByte).device(device)));
    } else {
      for (const auto& meta : recv_metas) {
        set.push_back(
            at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device)));
      }
    }
    if (static_cast<int64_t>(pool.size()) < recv_pool) pool.push_back(set);
    return set;
  }
};

CommEngine::CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout_s,
                       int64_t depth, at::Device device, double spin_us, int64_t recv_pool)
    : group_(std::move(group)),
      rank_(group_->getRank()),
      timeout_s_(timeout_s),
      depth_(depth),
      device_(device),
      spin_us_(spin_us),
      recv_pool_(recv_pool) {
  if (timeout_s <= 0) throw std::invalid_argument("CommEngine: timeout must be > 0 seconds");
  if (depth < 1) throw std::invalid_argument("CommEngine: depth must be >= 1");
  if (!std::isfinite(spin_us) || spin_us < 0) {
    throw std::invalid_argument("CommEngine: spin_us must be a finite number >= 0");
  }
  if (recv_pool < 1) {
    throw std::invalid_argument("CommEngine: recv_pool must be >= 1 (buffer sets per link), got " +
                                std::to_string(recv_pool));
  }
}

CommEngine::~CommEngine() { shutdown(); }

CommEngine::Link& CommEngine::link(int peer, Channel channel, int stage) {
  std::lock_guard<std::mutex> lock(links_mutex_);
  if (shut_down_) throw QueueClosed("CommEngine of rank " + std::to_string(rank_) + " is shut down");
  if (peer < 0 || peer >= group_->getSize() || peer == rank_) {
    throw std::invalid_argument("CommEngine of rank " + std::to_string(rank_) + ": peer " +
                                std::to_string(peer) + " is not another rank of the group (size " +
                                std::to_string(group_->getSize()) + ")");
  }
  if (stage < 0 || stage >= kMaxStages) {
    throw std::invalid_argument("CommEngine of rank " + std::to_string(rank_) + ": stage " +
                                std::to_string(stage) + " of the " + channel_name(channel) +
                                " link with rank " + std::to_string(peer) +
                                " is out of range: message tags have room for stages 0.." +
                                std::to_string(kMaxStages - 1));
  }
  auto& slot = links_[{peer, static_cast<int>(channel), stage}];
  if (slot) return *slot;
  auto link = std::make_shared<Link>(peer, channel, stage, depth_, spin_us_, recv_pool_,
                                     std::string(channel_name(channel)) + " link of rank " +
                                         std::to_string(rank_) + " with rank " +
                                         std::to_string(peer) + " for stage " +
                                         std::to_string(stage));
  const auto timeout = millis(timeout_s_);
  auto group = group_;
  // The threads hold the link and the group by shared ownership, so a thread that outlives a
  // shutdown grace period (stuck in a transfer) never touches freed memory.
  auto finish = [](Link& l) {
    std::lock_guard<std::mutex> guard(l.mutex);
    --l.threads_running;
    l.idle.notify_all();
  };
  link->threads_running = 2;
  const at::Device device = device_;
  link->threads.emplace_back([link, group, timeout, finish, device] {
    try {
      while (true) {
        Bundle bundle = link->sends.pop();
        const int64_t start = now_ns();
        const auto metas = metas_of(bundle.tensors);  // the negotiated ones (checked in send)
        if (!link->sent_header) {
          std::vector<at::Tensor> header{encode_header(metas, link->what).to(device)};
          group->send(header, link->peer, header_tag(link->channel, link->stage))->wait(timeout);
          link->sent_header = true;
        }
        const int tag = message_tag(link->channel, link->stage, bundle.microbatch);
        if (const int64_t packed = packed_bytes(metas)) {
          if (!link->send_flat.defined()) {
            link->send_flat = at::empty(
                {packed}, at::TensorOptions().dtype(at::kByte).device(bundle.tensors[0].device()));
          }
          pack_into(link->send_flat, bundle.tensors, metas);
          std::vector<at::Tensor> one{link->send_flat};
          group->send(one, link->peer, tag)->wait(timeout);
        } else {
          for (auto& t : bundle.tensors) {
            std::vector<at::Tensor> one{t};
            group->send(one, link->peer, tag)->wait(timeout);
          }
        }
        link->send_ns += now_ns() - start;
        link->bytes_sent += nbytes(bundle.tensors);
        ++link->messages_sent;
        std::lock_guard<std::mutex> guard(link->mutex);
        --link->sends_in_flight;
        link->idle.notify_all();
      }
    } catch (const QueueClosed&) {
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> guard(link->mutex);
      link->send_error = e.what();
      link->idle.notify_all();
    }
    link->sends.close();
    finish(*link);
  });
  link->threads.emplace_back([link, group, timeout, finish, device] {
    try {
      while (true) {
        Bundle request = link->requests.pop();
        const int64_t start = now_ns();
        if (!link->got_header) {
          std::vector<at::Tensor> header{
              at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong).device(device))};
          group->recv(header, link->peer, header_tag(link->channel, link->stage))->wait(timeout);
          link->recv_metas = decode_header(header[0].cpu());
          link->recv_packed = packed_bytes(link->recv_metas);
          link->got_header = true;
        }
        std::vector<at::Tensor> buffers = link->take_buffers(device);
        const int tag = message_tag(link->channel, link->stage, request.microbatch);
        std::vector<at::Tensor> out;
        for (auto& t : buffers) {
          std::vector<at::Tensor> one{t};
          group->recv(one, link->peer, tag)->wait(timeout);
          out.push_back(t.detach());  // a fresh handle; the pool keeps the buffer itself
        }
        if (link->recv_packed > 0) out = unpack(out[0], link->recv_metas);  // views, no copy
        link->recv_ns += now_ns() - start;
        link->bytes_received += nbytes(out);
        ++link->messages_received;
        link->done.push(Bundle{std::move(out), request.microbatch, -1});
      }
    } catch (const QueueClosed&) {
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> guard(link->mutex);
      link->recv_error = e.what();
    }
    link->done.close();
    finish(*link);
  });
  slot = link;
  return *slot;
}

void CommEngine::send(int peer, Channel channel, int stage, int64_t microbatch,
                      std::vector<at::Tensor> tensors) {
  Link& l = link(peer, channel, stage);
  for (auto& t : tensors) {
    if (!t.defined()) throw std::invalid_argument(l.what + ": cannot send an undefined tensor");
    t = t.detach().contiguous();
  }
  const auto metas = metas_of(tensors);
  if (l.negotiated && metas != l.sent_metas) {
    throw std::invalid_argument(
        l.what + ": microbatch " + std::to_string(microbatch) + " sends tensors " +
        describe(metas) + " but this boundary was negotiated as " + describe(l.sent_metas) +
        "; shapes crossing a stage boundary must stay fixed (give every microbatch the same "
        "size, e.g. drop_last=True in the DataLoader)");
  }
  l.sent_metas = metas;
  l.negotiated = true;
  {
    std::lock_guard<std::mutex> guard(l.mutex);
    if (!l.send_error.empty()) {
      throw std::runtime_error(l.what + ": an earlier send failed: " + l.send_error);
    }
    ++l.sends_in_flight;
  }
  try {
    l.sends.push(Bundle{std::move(tensors), microbatch, -1}, timeout_s_);
  } catch (...) {
    std::lock_guard<std::mutex> guard(l.mutex);
    --l.sends_in_flight;
    throw;
  }
}

void CommEngine::post_recv(int peer, Channel channel, int stage, int64_t microbatch) {
  link(peer, channel, stage).requests.push(Bundle{{}, microbatch, -1}, timeout_s_);
}

std::vector<at::Tensor> CommEngine::wait_recv(int peer, Channel channel, int stage,
                                              int64_t microbatch) {
  Link& l = link(peer, channel, stage);
  const int64_t start = now_ns();
  Bundle bundle;
  try {
    bundle = l.done.pop(timeout_s_);
  } catch (const QueueTimeout&) {
    wait_recv_ns_ += now_ns() - start;
    std::ostringstream msg;
    msg << "rank " << rank_ << " waited " << timeout_s_ << " s for the " << channel_name(channel)
        << " of stage " << stage << ", microbatch " << microbatch << " from rank " << peer
        << "; is rank " << peer << " alive and running the same schedule?";
    throw QueueTimeout(msg.str());
  } catch (const QueueClosed&) {
    std::lock_guard<std::mutex> guard(l.mutex);
    throw std::runtime_error("rank " + std::to_string(rank_) + " receiving the " +
                             channel_name(channel) + " of stage " + std::to_string(stage) +
                             ", microbatch " + std::to_string(microbatch) + " from rank " +
                             std::to_string(peer) +
                             " failed: " +
                             (l.recv_error.empty() ? "the engine was shut down" : l.recv_error));
  }
  wait_recv_ns_ += now_ns() - start;
  if (bundle.microbatch != microbatch) {
    throw std::logic_error(l.what + ": expected microbatch " + std::to_string(microbatch) +
                           " but the next posted receive was for microbatch " +
                           std::to_string(bundle.microbatch) +
                           "; wait_recv must follow the order of post_recv on each link");
  }
  return std::move(bundle.tensors);
}

void CommEngine::flush() {
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(links_mutex_);
    for (auto& [key, l] : links_) links.push_back(l);
  }
  const auto deadline = std::chrono::steady_clock::now() + millis(timeout_s_);
  for (auto& l : links) {
    std::unique_lock<std::mutex> guard(l->mutex);
    const bool drained = l->idle.wait_until(guard, deadline, [&] {
      return l->sends_in_flight == 0 || !l->send_error.empty();
    });
    if (!l->send_error.empty()) throw std::runtime_error(l->what + ": send failed: " + l->send_error);
    if (!drained) {
      throw QueueTimeout(l->what + ": " + std::to_string(l->sends_in_flight) +
                         " sends still pending after " + std::to_string(timeout_s_) +
                         " s; is the peer alive and receiving?");
    }
  }
}

void CommEngine::shutdown(double grace_s) {
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(links_mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [key, l] : links_) links.push_back(l);
  }
  for (auto& l : links) {
    l->sends.close();
    l->requests.close();
    l->done.close();
  }
  const auto deadline = std::chrono::steady_clock::now() + millis(grace_s);
  for (auto& l : links) {
    std::unique_lock<std::mutex> guard(l->mutex);
    const bool stopped = l->idle.wait_until(guard, deadline, [&] { return l->threads_running == 0; });
    guard.unlock();
    for (auto& t : l->threads) {
      // A thread still inside a transfer ends when the transfer times out; it owns what it uses.
      if (stopped) t.join(); else t.detach();
    }
    l->threads.clear();
  }
}

CommStats CommEngine::stats() const {
  CommStats s;
  std::lock_guard<std::mutex> lock(links_mutex_);
  for (const auto& [key, l] : links_) {
    s.messages_sent += l->messages_sent;
    s.messages_received += l->messages_received;
    s.bytes_sent += l->bytes_sent;
    s.bytes_received += l->bytes_received;
    s.send_ns += l->send_ns;
    s.recv_ns += l->recv_ns;
  }
  s.wait_recv_ns = wait_recv_ns_;
  return s;
}

}  // namespace pipedream_fast
