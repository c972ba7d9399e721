#include "comm_engine.h"

#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
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

// Waits for a process-group transfer. One still unfinished after `timeout` raises QueueTimeout
// (its message made by `timed_out` from what the backend said), the type a timeout on the
// compute thread raises, whatever the backend throws for it (gloo: an IoException, NCCL: a
// DistBackendError, both plain RuntimeErrors in Python). Any other failure propagates as it
// was thrown.
template <typename TimedOut>
void wait_transfer(c10d::Work& work, std::chrono::milliseconds timeout, TimedOut timed_out) {
  const auto start = std::chrono::steady_clock::now();
  std::string detail = "the process group reported it unfinished";
  try {
    if (work.wait(timeout)) return;
  } catch (const std::exception& e) {
    if (std::chrono::steady_clock::now() - start < timeout) throw;
    detail = e.what();
  }
  throw QueueTimeout(timed_out(detail));
}

}  // namespace

const char* channel_name(Channel channel) {
  return channel == Channel::kActivation ? "activation" : "gradient";
}

// One (peer, channel, stage) link: its queues, its two threads' state and what failed them.
// The threads hold the link by shared ownership, so a thread that outlives a shutdown grace
// period (stuck in a transfer) never touches freed memory.
struct CommEngine::Link {
  Link(c10::intrusive_ptr<c10d::ProcessGroup> group, int rank, int peer, Channel channel,
       int stage, std::chrono::milliseconds timeout, at::Device device, int64_t depth,
       double spin_us, int64_t recv_pool, bool direct)
      : group(std::move(group)),
        rank(rank),
        peer(peer),
        channel(channel),
        stage(stage),
        timeout(timeout),
        device(device),
        recv_pool(recv_pool),
        depth(depth),
        direct(direct),
        what(std::string(channel_name(channel)) + " link of rank " + std::to_string(rank) +
             " with rank " + std::to_string(peer) + " for stage " + std::to_string(stage)),
        sends(depth, what + " (sends)", spin_us),
        requests(1 << 16, what + " (posted receives)", spin_us),
        done(depth, what + " (received)", spin_us) {}

  const c10::intrusive_ptr<c10d::ProcessGroup> group;
  const int rank;
  const int peer;
  const Channel channel;
  const int stage;  // the stage that receives this link's messages
  const std::chrono::milliseconds timeout;
  const at::Device device;  // where received tensors are allocated
  const int64_t recv_pool;  // most buffer sets kept in `pool`
  const int64_t depth;      // messages in flight per direction before a send waits
  const bool direct;        // transfers issued and awaited by the caller, no link threads
  const std::string what;   // "activation link of rank 0 with rank 1 for stage 3", for messages
  ActivationQueue sends;
  ActivationQueue requests;
  ActivationQueue done;

  // Compute-thread state.
  std::vector<TensorMeta> sent_metas;  // negotiated on the first send
  bool negotiated = false;

  // Send-thread state: whether the header went out, and the byte buffer packed messages go
  // out from (each send completes before the next is packed, so one is enough).
  bool sent_header = false;
  at::Tensor send_flat;

  // Receive-thread state.
  std::vector<TensorMeta> recv_metas;
  bool got_header = false;
  int64_t recv_packed = 0;  // packed_bytes(recv_metas)
  std::vector<std::vector<at::Tensor>> pool;  // per set: the tensors, or one packed buffer

  std::mutex mutex;
  std::condition_variable idle;
  int64_t sends_in_flight = 0;  // guarded by mutex
  // What stopped a thread, as thrown there (so a timeout stays a QueueTimeout when the
  // compute thread rethrows it); null while the thread runs or when it stopped on close.
  std::exception_ptr send_error;  // guarded by mutex
  std::exception_ptr recv_error;  // guarded by mutex
  int threads_running = 0;        // guarded by mutex
  std::vector<std::thread> threads;

  std::atomic<int64_t> messages_sent{0}, messages_received{0}, bytes_sent{0},
      bytes_received{0}, send_ns{0}, recv_ns{0};

  // Starts the send and the receive thread of `self`; each owns a reference to it.
  static void start_threads(const std::shared_ptr<Link>& self) {
    self->threads_running = 2;
    self->threads.emplace_back(
        [self] { self->run(&Link::send_loop, &Link::send_error, self->sends); });
    self->threads.emplace_back(
        [self] { self->run(&Link::recv_loop, &Link::recv_error, self->done); });
  }

  // Runs `loop` until its queue closes or it fails; a failure is kept in `error` for the
  // compute thread. Either way the thread then closes `out` so that nobody waits on it.
  void run(void (Link::*loop)(), std::exception_ptr Link::*error, ActivationQueue& out) {
    try {
      (this->*loop)();
    } catch (const QueueClosed&) {
      // shut down: not an error
    } catch (...) {
      std::lock_guard<std::mutex> guard(mutex);
      this->*error = std::current_exception();
    }
    out.close();
    std::lock_guard<std::mutex> guard(mutex);
    --threads_running;
    idle.notify_all();  // wakes flush (a failed send) and shutdown
  }

  // Send thread: hands each queued message to the process group, header first.
  void send_loop() {
    while (true) {
      Bundle bundle = sends.pop();
      const int64_t start = now_ns();
      send_message(bundle);
      send_ns += now_ns() - start;
      bytes_sent += nbytes(bundle.tensors);
      ++messages_sent;
      std::lock_guard<std::mutex> guard(mutex);
      --sends_in_flight;
      idle.notify_all();
    }
  }

  void send_message(const Bundle& bundle) {
    const auto metas = metas_of(bundle.tensors);  // the negotiated ones (checked in send)
    if (!sent_header) {
      std::vector<at::Tensor> header{encode_header(metas, what).to(device)};
      transfer(group->send(header, peer, header_tag(channel, stage)), "sending", bundle.microbatch,
               /*header=*/true);
      sent_header = true;
    }
    const int tag = message_tag(channel, stage, bundle.microbatch);
    if (const int64_t packed = packed_bytes(metas)) {
      if (!send_flat.defined()) {
        send_flat = at::empty(
            {packed}, at::TensorOptions().dtype(at::kByte).device(bundle.tensors[0].device()));
      }
      pack_into(send_flat, bundle.tensors, metas);
      std::vector<at::Tensor> one{send_flat};
      transfer(group->send(one, peer, tag), "sending", bundle.microbatch);
    } else {
      for (const auto& t : bundle.tensors) {
        std::vector<at::Tensor> one{t};
        transfer(group->send(one, peer, tag), "sending", bundle.microbatch);
      }
    }
  }

  // Receive thread: receives each posted message into pooled buffers, header first.
  void recv_loop() {
    while (true) {
      Bundle request = requests.pop();
      const int64_t start = now_ns();
      std::vector<at::Tensor> out = receive_message(request.microbatch);
      recv_ns += now_ns() - start;
      bytes_received += nbytes(out);
      ++messages_received;
      done.push(Bundle{std::move(out), request.microbatch, -1});
    }
  }

  std::vector<at::Tensor> receive_message(int64_t microbatch) {
    if (!got_header) {
      std::vector<at::Tensor> header{
          at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong).device(device))};
      transfer(group->recv(header, peer, header_tag(channel, stage)), "receiving", microbatch,
               /*header=*/true);
      recv_metas = decode_header(header[0].cpu());
      recv_packed = packed_bytes(recv_metas);
      got_header = true;
    }
    std::vector<at::Tensor> buffers = take_buffers();
    const int tag = message_tag(channel, stage, microbatch);
    std::vector<at::Tensor> out;
    for (auto& t : buffers) {
      std::vector<at::Tensor> one{t};
      transfer(group->recv(one, peer, tag), "receiving", microbatch);
      out.push_back(t.detach());  // a fresh handle; the pool keeps the buffer itself
    }
    if (recv_packed > 0) out = unpack(out[0], recv_metas);  // views, no copy
    return out;
  }

  // Waits for one transfer of `microbatch` (or for the link's header, sent before its first
  // message); a timeout raises a QueueTimeout naming the transfer and the likely cause.
  void transfer(const c10::intrusive_ptr<c10d::Work>& work, const char* doing,
                int64_t microbatch, bool header = false) {
    wait_transfer(*work, timeout, [&](const std::string& detail) {
      const bool sending = doing[0] == 's';
      std::ostringstream msg;
      msg << "rank " << rank << " timed out after " << static_cast<double>(timeout.count()) / 1e3
          << " s " << doing << " the " << channel_name(channel) << " of stage " << stage
          << ", microbatch " << microbatch << (sending ? " to rank " : " from rank ") << peer
          << (header ? " (the header before the link's first message)" : "") << "; is rank "
          << peer << " alive and running the same schedule? (" << detail << ")";
      return msg.str();
    });
  }


  // ---- direct mode: the caller's thread issues every transfer and waits for it ----------
  // A thread hop costs a wake-up (25-50 us on a loaded CPU) and each message took two (to the
  // send thread, from the receive thread); on gloo a send and a receive are asynchronous
  // already (the backend's own I/O thread moves the bytes), so on CPU the caller issues them
  // and waits on their Work where the schedule needs the result.
  struct Transfer {
    int64_t microbatch = 0;
    bool header = false;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;  // empty: posted before the header
    std::vector<at::Tensor> tensors;  // what is sent, or the buffers received into
    at::Tensor flat;                  // a packed send's buffer, reused once it is sent
  };
  // In flight, oldest first. Changed by the caller's thread only, under `mutex` so that a
  // shutdown from another thread can abort what they wait for.
  std::deque<Transfer> sending;
  std::deque<Transfer> receiving;
  std::vector<at::Tensor> free_flats;  // packed send buffers whose sends completed
  c10::intrusive_ptr<c10d::Work> header_work;  // the link's header, while it is awaited
  at::Tensor header_buffer;
  std::atomic<bool> closed{false};

  void check_open(const std::exception_ptr Link::*error) {
    std::lock_guard<std::mutex> guard(mutex);
    if (this->*error) std::rethrow_exception(this->*error);
    if (closed) throw QueueClosed(what + ": the engine was shut down");
  }

  // Waits for one transfer as `transfer` does; a wait the shutdown aborted is QueueClosed.
  void await(const c10::intrusive_ptr<c10d::Work>& work, const char* doing, int64_t microbatch,
             bool header) {
    try {
      transfer(work, doing, microbatch, header);
    } catch (...) {
      if (closed) throw QueueClosed(what + ": the engine was shut down");
      throw;
    }
  }

  void direct_send(std::vector<at::Tensor> tensors, int64_t microbatch) {
    check_open(&Link::send_error);
    while (static_cast<int64_t>(sending.size()) > depth) reap_send();
    const int64_t start = now_ns();
    const auto metas = metas_of(tensors);
    if (!sent_header) {
      Transfer header;
      header.microbatch = microbatch;
      header.header = true;
      header.tensors = {encode_header(metas, what).to(device)};
      header.works.push_back(group->send(header.tensors, peer, header_tag(channel, stage)));
      push(sending, std::move(header));
      sent_header = true;
    }
    Transfer t;
    t.microbatch = microbatch;
    const int tag = message_tag(channel, stage, microbatch);
    if (const int64_t packed = packed_bytes(metas)) {
      if (free_flats.empty()) {
        t.flat = at::empty({packed},
                           at::TensorOptions().dtype(at::kByte).device(tensors[0].device()));
      } else {
        t.flat = std::move(free_flats.back());
        free_flats.pop_back();
      }
      pack_into(t.flat, tensors, metas);
      std::vector<at::Tensor> one{t.flat};
      t.works.push_back(group->send(one, peer, tag));
    } else {
      for (const auto& tensor : tensors) {
        std::vector<at::Tensor> one{tensor};
        t.works.push_back(group->send(one, peer, tag));
      }
    }
    bytes_sent += nbytes(tensors);
    t.tensors = std::move(tensors);
    push(sending, std::move(t));
    send_ns += now_ns() - start;
  }

  // Waits for the oldest send in flight; its failure fails the link's later sends too.
  void reap_send() {
    Transfer& oldest = sending.front();
    try {
      for (const auto& work : oldest.works) await(work, "sending", oldest.microbatch, oldest.header);
    } catch (...) {
      std::lock_guard<std::mutex> guard(mutex);
      if (!send_error && !closed) send_error = std::current_exception();
      throw;
    }
    if (!oldest.header) ++messages_sent;
    if (oldest.flat.defined()) free_flats.push_back(oldest.flat);
    std::lock_guard<std::mutex> guard(mutex);
    sending.pop_front();
  }

  void direct_flush() {
    while (!sending.empty()) reap_send();
  }

  void direct_post(int64_t microbatch) {
    check_open(&Link::recv_error);
    Transfer t;
    t.microbatch = microbatch;
    if (!got_header && !header_work) {
      header_buffer = at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong).device(device));
      std::vector<at::Tensor> one{header_buffer};
      header_work = group->recv(one, peer, header_tag(channel, stage));
    }
    if (got_header) start_recv(t);  // else: started when the header has come
    push(receiving, std::move(t));
  }

  void start_recv(Transfer& t) {
    // Handles of their own: the pool tells a buffer free by its storage's use count, which
    // counts tensors (not copies of one handle), so the transfer must hold its own.
    for (const auto& buffer : take_buffers()) t.tensors.push_back(buffer.detach());
    const int tag = message_tag(channel, stage, t.microbatch);
    for (auto& buffer : t.tensors) {
      std::vector<at::Tensor> one{buffer};
      t.works.push_back(group->recv(one, peer, tag));
    }
  }

  std::vector<at::Tensor> direct_wait(int64_t microbatch) {
    check_open(&Link::recv_error);
    if (receiving.empty()) {
      throw std::logic_error(what + ": no receive was posted for microbatch " +
                             std::to_string(microbatch) + "; post_recv must come first");
    }
    if (receiving.front().microbatch != microbatch) {
      throw std::logic_error(what + ": expected microbatch " + std::to_string(microbatch) +
                             " but the next posted receive was for microbatch " +
                             std::to_string(receiving.front().microbatch) +
                             "; wait_recv must follow the order of post_recv on each link");
    }
    const int64_t start = now_ns();
    std::vector<at::Tensor> out;
    try {
      if (!got_header) {
        await(header_work, "receiving", microbatch, /*header=*/true);
        recv_metas = decode_header(header_buffer.cpu());
        recv_packed = packed_bytes(recv_metas);
        got_header = true;
        std::lock_guard<std::mutex> guard(mutex);
        header_work.reset();
        for (auto& t : receiving) start_recv(t);  // the receives posted before it came
      }
      Transfer& t = receiving.front();
      for (const auto& work : t.works) await(work, "receiving", microbatch, false);
      for (const auto& buffer : t.tensors) out.push_back(buffer.detach());  // fresh handles
    } catch (...) {
      std::lock_guard<std::mutex> guard(mutex);
      if (!recv_error && !closed) recv_error = std::current_exception();
      throw;
    }
    {
      std::lock_guard<std::mutex> guard(mutex);
      receiving.pop_front();
    }
    recv_ns += now_ns() - start;
    bytes_received += nbytes(out);
    ++messages_received;
    if (recv_packed > 0) out = unpack(out[0], recv_metas);  // views, no copy
    return out;
  }

  void push(std::deque<Transfer>& to, Transfer t) {
    std::lock_guard<std::mutex> guard(mutex);
    to.push_back(std::move(t));
  }

  // Shutdown: every transfer in flight is aborted (its waiter, if any, gets QueueClosed).
  void abort_direct() {
    closed = true;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      std::lock_guard<std::mutex> guard(mutex);
      for (auto* in : {&sending, &receiving}) {
        for (auto& t : *in) works.insert(works.end(), t.works.begin(), t.works.end());
      }
      if (header_work) works.push_back(header_work);
    }
    for (auto& work : works) {
      try {
        work->abort();
      } catch (...) {
        // a backend without abort: its waiter ends at the transfer's timeout
      }
    }
  }

  // Buffers for the next receive: a pooled set nobody else holds any more, or a new one.
  std::vector<at::Tensor> take_buffers() {
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
                       int64_t depth, at::Device device, double spin_us, int64_t recv_pool,
                       bool background)
    : group_(std::move(group)),
      rank_(group_->getRank()),
      timeout_s_(timeout_s),
      depth_(depth),
      device_(device),
      spin_us_(spin_us),
      recv_pool_(recv_pool),
      background_(background || !device.is_cpu()) {
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

void CommEngine::check_link(int peer, Channel channel, int stage) const {
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
}

CommEngine::Link& CommEngine::link(int peer, Channel channel, int stage) {
  std::lock_guard<std::mutex> lock(links_mutex_);
  if (shut_down_) throw QueueClosed("CommEngine of rank " + std::to_string(rank_) + " is shut down");
  check_link(peer, channel, stage);
  auto& slot = links_[{peer, static_cast<int>(channel), stage}];
  if (!slot) {
    slot = std::make_shared<Link>(group_, rank_, peer, channel, stage, millis(timeout_s_), device_,
                                  depth_, spin_us_, recv_pool_, !background_);
    if (background_) Link::start_threads(slot);
  }
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
    // Only the dtypes changed (a cast, autocast, a loader yielding another type): the size
    // advice would mislead.
    bool same_sizes = metas.size() == l.sent_metas.size();
    for (size_t i = 0; same_sizes && i < metas.size(); ++i) {
      same_sizes = metas[i].sizes == l.sent_metas[i].sizes;
    }
    const char* advice =
        same_sizes ? "; the dtypes crossing a stage boundary must stay fixed (give every batch "
                     "the same dtypes: cast the loader's tensors, or keep autocast on for every "
                     "microbatch)"
                   : "; shapes crossing a stage boundary must stay fixed (give every microbatch "
                     "the same size, e.g. drop_last=True in the DataLoader)";
    throw std::invalid_argument(l.what + ": microbatch " + std::to_string(microbatch) +
                                " sends tensors " + describe(metas) +
                                " but this boundary was negotiated as " +
                                describe(l.sent_metas) + advice);
  }
  l.sent_metas = metas;
  l.negotiated = true;
  if (l.direct) {
    l.direct_send(std::move(tensors), microbatch);
    return;
  }
  {
    std::lock_guard<std::mutex> guard(l.mutex);
    if (l.send_error) std::rethrow_exception(l.send_error);  // an earlier send failed
    ++l.sends_in_flight;
  }
  try {
    l.sends.push(Bundle{std::move(tensors), microbatch, -1}, timeout_s_);
  } catch (...) {
    std::lock_guard<std::mutex> guard(l.mutex);
    --l.sends_in_flight;
    // The send thread closes its queue when it fails: report why, not that it is closed.
    if (l.send_error) std::rethrow_exception(l.send_error);
    throw;
  }
}

void CommEngine::post_recv(int peer, Channel channel, int stage, int64_t microbatch) {
  Link& l = link(peer, channel, stage);
  if (l.direct) {
    l.direct_post(microbatch);
    return;
  }
  l.requests.push(Bundle{{}, microbatch, -1}, timeout_s_);
}

std::vector<at::Tensor> CommEngine::wait_recv(int peer, Channel channel, int stage,
                                              int64_t microbatch) {
  Link& l = link(peer, channel, stage);
  const int64_t start = now_ns();
  if (l.direct) {
    auto out = l.direct_wait(microbatch);
    wait_recv_ns_ += now_ns() - start;
    return out;
  }
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
    // The receive thread stopped: rethrow what stopped it as it was thrown there (a timeout
    // stays a QueueTimeout), or say the engine was shut down.
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> guard(l.mutex);
      error = l.recv_error;
    }
    if (error) std::rethrow_exception(error);
    throw QueueClosed("rank " + std::to_string(rank_) + " stopped waiting for the " +
                      channel_name(channel) + " of stage " + std::to_string(stage) +
                      ", microbatch " + std::to_string(microbatch) + " from rank " +
                      std::to_string(peer) + ": the engine was shut down");
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
    if (l->direct) {
      l->direct_flush();  // each transfer waited for at most the timeout
      continue;
    }
    std::unique_lock<std::mutex> guard(l->mutex);
    const bool drained = l->idle.wait_until(guard, deadline, [&] {
      return l->sends_in_flight == 0 || l->send_error;
    });
    if (l->send_error) std::rethrow_exception(l->send_error);
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
    if (l->direct) l->abort_direct();
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

std::vector<std::tuple<int, Channel, int, int64_t>> CommEngine::unfinished_sends() const {
  std::vector<std::tuple<int, Channel, int, int64_t>> out;
  std::lock_guard<std::mutex> lock(links_mutex_);
  for (const auto& [key, l] : links_) {
    std::lock_guard<std::mutex> guard(l->mutex);
    // A direct link learns that a send completed only when it waits for it (a c10d Work
    // says it is completed only once waited for), so it has none to report: a rank blocked
    // on one is inside send() or flush(), which the caller knows.
    if (!l->direct) {
      for (int64_t i = 0; i < l->sends_in_flight; ++i) {
        out.emplace_back(l->peer, l->channel, l->stage, -1);
      }
    }
  }
  return out;
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
