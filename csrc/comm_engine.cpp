#include "comm_engine.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <exception>
#include <sstream>
#include <thread>

#include "errors.h"

namespace pipedream_fast {

namespace {

// Message tags. The process group matches a receive to a send by (peer, tag) across every link
// of a rank pair, so the tag names the link (channel, stage), the microbatch and the part:
//   bit 30 header | bit 29 overflow | bits 20..28 stage | bits 1..19 microbatch mod 2^19 |
//   bit 0 channel
// All 31 bits stay non-negative in an int. Wrapping the microbatch is safe because a link
// receives in post order and never has 2^19 microbatches in flight.
constexpr int kChannelBits = 1;
constexpr int kMicrobatchBits = 19;
constexpr int kStageBits = 9;
constexpr int kStageShift = kChannelBits + kMicrobatchBits;
constexpr int kOverflowBit = kStageShift + kStageBits;
constexpr int kHeaderBit = kOverflowBit + 1;
static_assert(kHeaderBit == 30, "tags must fit in 31 bits");
static_assert(CommEngine::kMaxStages == 1 << kStageBits, "kMaxStages must match the tag layout");

int message_tag(Channel channel, int stage, int64_t microbatch) {
  // Masking (not %) keeps the field non-negative even for a negative microbatch.
  const int64_t mb_bits = microbatch & ((int64_t{1} << kMicrobatchBits) - 1);
  return (stage << kStageShift) | static_cast<int>(mb_bits << kChannelBits) |
         static_cast<int>(channel);
}
// The rest of a message that outgrew the first transfer (see "Frames" below).
int overflow_tag(Channel channel, int stage, int64_t microbatch) {
  return (1 << kOverflowBit) | message_tag(channel, stage, microbatch);
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
  bool operator!=(const TensorMeta& other) const { return !(*this == other); }
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
  metas.reserve(tensors.size());
  for (const auto& t : tensors) metas.push_back({t.scalar_type(), t.sizes().vec()});
  return metas;
}

// A message's dtypes and shapes as int64 words: [count, (dtype, ndim, dims...)...], at most
// kMetaWords of them (the link header, and a frame whose shapes changed, carry these).
constexpr int64_t kMetaWords = 128;

int64_t encode_metas(const std::vector<TensorMeta>& metas, int64_t* words,
                     const std::string& what) {
  int64_t pos = 0;
  words[pos++] = static_cast<int64_t>(metas.size());
  for (const auto& meta : metas) {
    if (pos + 2 + static_cast<int64_t>(meta.sizes.size()) > kMetaWords) {
      throw std::invalid_argument(what + ": too many tensors or dimensions to describe in one "
                                  "message header: " + describe(metas));
    }
    words[pos++] = static_cast<int64_t>(meta.dtype);
    words[pos++] = static_cast<int64_t>(meta.sizes.size());
    for (int64_t size : meta.sizes) words[pos++] = size;
  }
  return pos;
}

std::vector<TensorMeta> decode_metas(const int64_t* words, const std::string& what) {
  auto corrupt = [&] {
    return std::runtime_error(what + ": a message arrived with a corrupt shape description "
                              "(is the peer running the same version of pipedream_fast?)");
  };
  if (words[0] < 0 || words[0] > kMetaWords / 2) throw corrupt();
  std::vector<TensorMeta> metas(static_cast<size_t>(words[0]));
  int64_t pos = 1;
  for (auto& meta : metas) {
    if (pos + 2 > kMetaWords) throw corrupt();
    meta.dtype = static_cast<at::ScalarType>(words[pos++]);
    const int64_t ndim = words[pos++];
    if (ndim < 0 || pos + ndim > kMetaWords) throw corrupt();
    meta.sizes.assign(words + pos, words + pos + ndim);
    pos += ndim;
  }
  return metas;
}

at::Tensor encode_header(const std::vector<TensorMeta>& metas, const std::string& what) {
  at::Tensor header = at::zeros({kMetaWords}, at::kLong);
  encode_metas(metas, header.data_ptr<int64_t>(), what);
  return header;
}

// Frames. Shapes may change from message to message (a batch padded to its own longest
// sequence, a short last batch), so the receiver cannot know a message's size before it
// arrives; yet it must post a buffer for it early, or the transfer waits for the receiver.
// Each link therefore fixes, from its first message (described by the link header), a
// *capacity*, and every message travels as a frame:
//
//   packed link:  one transfer  [prefix 64 B][shape words, only when they changed][tensors]
//   split link:   one transfer  [prefix 64 B][shape words]  then one per tensor
//
// The receiver posts buffers of the capacity ahead, as before; a frame that is smaller fills
// part of one (gloo accepts a send shorter than the posted receive; a GPU send is padded to
// the capacity, as NCCL needs equal sizes), and the rest of one that is larger follows on the
// overflow tag into a buffer allocated then. The prefix says how long the frame is and whether
// shape words follow; shapes that stay as they were cost no header and no extra transfer.
//
// A message of several small tensors (an activation and the target riding with it, a
// gradient and its loss), or of one small tensor, is *packed*: the sender copies its tensors
// into the frame (a memcpy, small next to a round of latency at these sizes), the receiver
// hands out views of the buffer, no copy. A larger message is *split*: a small prefix
// transfer, then each tensor from its own memory, no copy (a prefix's latency is small next
// to such a transfer). Both ends decide from the link header, so they always agree.
constexpr int64_t kPackMaxBytes = 4 << 20;       // several tensors up to this: packed
constexpr int64_t kPackOneMaxBytes = 256 << 10;  // one tensor up to this: packed
constexpr int64_t kPackAlign = 64;  // every tensor starts at a multiple: any dtype can view it
constexpr int64_t kPrefixWords = 8;  // [frame bytes, shape words, unused...]
constexpr int64_t kPrefixBytes = kPrefixWords * 8;
constexpr int64_t kMetaBytes = kMetaWords * 8;
constexpr int64_t kSplitPrefixBytes = kPrefixBytes + kMetaBytes;  // a split frame's first part

int64_t meta_bytes(const TensorMeta& meta) {
  int64_t numel = 1;
  for (int64_t size : meta.sizes) numel *= size;
  return numel * static_cast<int64_t>(c10::elementSize(meta.dtype));
}

int64_t aligned(int64_t bytes) { return (bytes + kPackAlign - 1) / kPackAlign * kPackAlign; }

int64_t payload_bytes(const std::vector<TensorMeta>& metas) {
  int64_t total = 0;
  for (const auto& meta : metas) total += aligned(meta_bytes(meta));
  return total;
}

// How a link's messages travel, fixed by its first message.
struct Layout {
  bool packed = true;
  int64_t capacity = 0;            // packed: the bytes of the first transfer
  std::vector<int64_t> part_caps;  // split: the bytes of each tensor's first transfer
};

Layout layout_for(const std::vector<TensorMeta>& metas) {
  Layout layout;
  const int64_t payload = payload_bytes(metas);
  if (payload <= (metas.size() >= 2 ? kPackMaxBytes : kPackOneMaxBytes)) {
    // Room for shape words too: a change of shape that keeps the size needs no overflow.
    layout.capacity = kPrefixBytes + kMetaBytes + payload;
  } else {
    layout.packed = false;
    for (const auto& meta : metas) layout.part_caps.push_back(meta_bytes(meta));
  }
  return layout;
}

// A tensor laid out as `meta` over `flat`'s memory from byte `offset` on. On the CPU it is made
// directly over the buffer's storage: a narrow and two views go through the dispatcher (a
// microsecond or more each), and with a copy they were most of the engine's own cost per
// message. `offset` is a multiple of kPackAlign, so of every element size.
at::Tensor tensor_at(const at::Tensor& flat, int64_t offset, const TensorMeta& meta) {
  const int64_t bytes = meta_bytes(meta);
  const int64_t item = static_cast<int64_t>(c10::elementSize(meta.dtype));
  if (!flat.is_cpu() || (flat.storage_offset() + offset) % item != 0) {
    return flat.narrow(0, offset, bytes).view(meta.dtype).view(meta.sizes);
  }
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(flat.storage()), flat.key_set(), c10::scalarTypeToTypeMeta(meta.dtype));
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(meta.sizes);
  impl->set_storage_offset((flat.storage_offset() + offset) / item);
  return t;
}

// Tensors over `flat` from byte `offset` on, laid out as `metas` (the layout `pack_into` writes).
std::vector<at::Tensor> unpack(const at::Tensor& flat, int64_t offset,
                               const std::vector<TensorMeta>& metas) {
  std::vector<at::Tensor> out;
  out.reserve(metas.size());
  for (const auto& meta : metas) {
    out.push_back(tensor_at(flat, offset, meta));
    offset += aligned(meta_bytes(meta));
  }
  return out;
}

// Copies `tensors` into `flat` from byte `offset` on: a memcpy per tensor where both are CPU
// memory and the tensor is contiguous, a copy through the dispatcher otherwise.
void pack_into(const at::Tensor& flat, int64_t offset, const std::vector<at::Tensor>& tensors,
               const std::vector<TensorMeta>& metas) {
  auto* base = static_cast<char*>(flat.data_ptr());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t bytes = meta_bytes(metas[i]);
    if (flat.is_cpu() && t.is_cpu() && t.is_contiguous()) {
      if (bytes > 0) std::memcpy(base + offset, t.const_data_ptr(), static_cast<size_t>(bytes));
    } else {
      tensor_at(flat, offset, metas[i]).copy_(t);
    }
    offset += aligned(bytes);
  }
}

// A contiguous tensor's bytes, as a 1-d byte tensor over the same memory.
at::Tensor as_bytes(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// A handle of its own on a pooled byte buffer (another tensor over its storage, which the pool
// counts as a user).
at::Tensor own_handle(const at::Tensor& buffer) {
  return tensor_at(buffer, 0, TensorMeta{buffer.scalar_type(), {buffer.numel()}});
}

// The first `words` int64 words of a byte buffer, readable on the CPU (a GPU one is copied).
at::Tensor host_words(const at::Tensor& flat, int64_t words) {
  if (flat.is_cpu()) return tensor_at(flat, 0, TensorMeta{at::kLong, {words}});
  return flat.narrow(0, 0, words * 8).cpu().contiguous().view(at::kLong);
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
        exact_sizes(!device.is_cpu()),
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
  const bool exact_sizes;   // a receive takes exactly the posted size (NCCL), not less (gloo)
  const std::string what;   // "activation link of rank 0 with rank 1 for stage 3", for messages
  ActivationQueue sends;
  ActivationQueue requests;
  ActivationQueue done;

  // Compute-thread state: the first message's metas (what may not change is checked
  // against them).
  std::vector<TensorMeta> first_metas;
  bool negotiated = false;

  // Sending side (the send thread, or the caller in direct mode): whether the header went
  // out, the layout it fixed, the metas of the last frame, and packed buffers free for reuse.
  bool sent_header = false;
  Layout send_layout;
  std::vector<TensorMeta> framed_metas;
  std::vector<at::Tensor> free_flats;

  // Receiving side (the receive thread, or the caller in direct mode).
  std::vector<TensorMeta> recv_metas;  // the last frame's
  bool got_header = false;
  Layout recv_layout;
  std::vector<std::vector<at::Tensor>> pool;  // per set: the buffers of one message's first parts

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

  // ---- frames (see "Frames" above) -----------------------------------------------------
  // What one message puts on the wire, in order, and what must live until it is sent.
  struct Frame {
    std::vector<at::Tensor> parts;
    std::vector<int> tags;
    at::Tensor flat;  // a packed frame's buffer, returned to free_flats once sent
    std::vector<at::Tensor> keep;  // the tensors a split frame sends from, and its prefix
  };

  // The link header, before the first frame: it fixes the layout on both ends.
  at::Tensor header_for(const std::vector<TensorMeta>& metas) {
    send_layout = layout_for(metas);
    framed_metas = metas;
    sent_header = true;
    return encode_header(metas, what).to(device);
  }

  // A packed buffer of at least `bytes` on `dev`: a free one, or a new one.
  at::Tensor spare_flat(int64_t bytes, at::Device dev) {
    for (auto it = free_flats.begin(); it != free_flats.end(); ++it) {
      if (it->numel() >= bytes && it->device() == dev) {
        at::Tensor flat = std::move(*it);
        free_flats.erase(it);
        return flat;
      }
    }
    return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(dev));
  }

  void recycle(at::Tensor flat) {
    if (flat.defined() && static_cast<int64_t>(free_flats.size()) <= depth) {
      free_flats.push_back(std::move(flat));
    }
  }

  Frame frame(std::vector<at::Tensor> tensors, int64_t microbatch) {
    const auto metas = metas_of(tensors);
    const bool changed = metas != framed_metas;
    if (changed) framed_metas = metas;
    const int tag = message_tag(channel, stage, microbatch);
    const int rest_tag = overflow_tag(channel, stage, microbatch);
    Frame f;
    std::array<int64_t, kPrefixWords + kMetaWords> head{};  // on the stack: no allocation
    const int64_t meta_words = changed || !send_layout.packed
                                   ? encode_metas(metas, head.data() + kPrefixWords, what)
                                   : 0;
    head[1] = meta_words;
    if (send_layout.packed) {
      const int64_t offset = kPrefixBytes + aligned(meta_words * 8);
      const int64_t bytes = offset + payload_bytes(metas);
      head[0] = bytes;
      const int64_t cap = send_layout.capacity;
      const at::Device dev = tensors.empty() ? device : tensors[0].device();
      f.flat = spare_flat(exact_sizes ? std::max(bytes, cap) : bytes, dev);
      write_words(f.flat, head.data(), offset / 8);
      pack_into(f.flat, offset, tensors, metas);
      f.parts.push_back(f.flat.narrow(0, 0, exact_sizes ? cap : std::min(bytes, cap)));
      f.tags.push_back(tag);
      if (bytes > cap) {
        f.parts.push_back(f.flat.narrow(0, cap, bytes - cap));
        f.tags.push_back(rest_tag);
      }
      return f;
    }
    at::Tensor prefix = at::from_blob(head.data(), {kSplitPrefixBytes}, at::kByte).clone();
    if (!device.is_cpu()) prefix = prefix.to(device);
    f.keep.push_back(prefix);
    f.parts.push_back(prefix);
    f.tags.push_back(tag);
    std::vector<at::Tensor> rests;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor bytes = as_bytes(tensors[i]);
      const int64_t n = bytes.numel();
      const int64_t cap = send_layout.part_caps[i];
      if (cap > 0) {
        if (exact_sizes && n < cap) {  // NCCL: pad to the posted size
          at::Tensor padded = at::empty({cap}, bytes.options());
          padded.narrow(0, 0, n).copy_(bytes);
          f.keep.push_back(padded);
          f.parts.push_back(padded);
        } else {
          f.parts.push_back(bytes.narrow(0, 0, std::min(n, cap)));
        }
        f.tags.push_back(tag);
      }
      if (n > cap) rests.push_back(bytes.narrow(0, cap, n - cap));
    }
    for (auto& rest : rests) {
      f.parts.push_back(rest);
      f.tags.push_back(rest_tag);
    }
    f.keep.insert(f.keep.end(), tensors.begin(), tensors.end());
    return f;
  }

  // Writes `count` int64 words at the start of a byte buffer (a GPU one through the host).
  static void write_words(const at::Tensor& flat, const int64_t* words, int64_t count) {
    if (flat.is_cpu()) {
      std::memcpy(flat.data_ptr(), words, static_cast<size_t>(count * 8));
    } else {
      flat.narrow(0, 0, count * 8)
          .copy_(at::from_blob(const_cast<int64_t*>(words), {count * 8}, at::kByte));
    }
  }

  // A new receive's buffers: a pooled set nobody else holds any more, or a new one. Packed:
  // one buffer of the capacity; split: the prefix, then one per tensor.
  std::vector<at::Tensor> take_buffers() {
    for (auto& set : pool) {
      bool free = true;
      for (const auto& t : set) free = free && t.storage().use_count() == 1;
      if (free) return set;
    }
    const auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
    std::vector<at::Tensor> set;
    if (recv_layout.packed) {
      set.push_back(at::empty({recv_layout.capacity}, bytes));
    } else {
      set.push_back(at::empty({kSplitPrefixBytes}, bytes));
      for (int64_t cap : recv_layout.part_caps) set.push_back(at::empty({cap}, bytes));
    }
    if (static_cast<int64_t>(pool.size()) < recv_pool) pool.push_back(set);
    return set;
  }

  // Starts the first parts of a message into `buffers` (those of size zero have none).
  std::vector<c10::intrusive_ptr<c10d::Work>> post_first_parts(std::vector<at::Tensor>& buffers,
                                                               int64_t microbatch) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    const int tag = message_tag(channel, stage, microbatch);
    for (auto& buffer : buffers) {
      if (buffer.numel() == 0) continue;
      std::vector<at::Tensor> one{buffer};
      works.push_back(group->recv(one, peer, tag));
    }
    return works;
  }

  // The message in `buffers`, whose first parts have arrived: reads the prefix, receives an
  // overflow (posting its works through `started`, so that a shutdown can abort them), and
  // returns views of the tensors.
  template <typename Started>
  std::vector<at::Tensor> open_frame(const std::vector<at::Tensor>& buffers, int64_t microbatch,
                                     Started started) {
    const int rest_tag = overflow_tag(channel, stage, microbatch);
    auto receive_rest = [&](std::vector<at::Tensor> into) {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (auto& t : into) {
        std::vector<at::Tensor> one{t};
        works.push_back(group->recv(one, peer, rest_tag));
      }
      started(works);
      for (auto& w : works) await(w, "receiving", microbatch, false);
    };
    if (recv_layout.packed) {
      at::Tensor flat = buffers[0];
      const at::Tensor prefix = host_words(flat, kPrefixWords);
      const int64_t bytes = prefix.data_ptr<int64_t>()[0];
      const int64_t meta_words = prefix.data_ptr<int64_t>()[1];
      if (bytes < kPrefixBytes || meta_words < 0 || meta_words > kMetaWords) {
        throw std::runtime_error(what + ": microbatch " + std::to_string(microbatch) +
                                 " arrived with a corrupt frame prefix (is the peer running "
                                 "the same version of pipedream_fast?)");
      }
      const int64_t cap = recv_layout.capacity;
      if (bytes > cap) {  // the rest follows on the overflow tag
        at::Tensor whole = at::empty({bytes}, flat.options());
        whole.narrow(0, 0, cap).copy_(flat);
        receive_rest({whole.narrow(0, cap, bytes - cap)});
        flat = whole;
      }
      if (meta_words > 0) {
        const at::Tensor words = host_words(flat, kPrefixWords + meta_words);
        recv_metas = decode_metas(words.data_ptr<int64_t>() + kPrefixWords, what);
      }
      return unpack(flat, kPrefixBytes + aligned(meta_words * 8), recv_metas);
    }
    const at::Tensor words = host_words(buffers[0], kPrefixWords + kMetaWords);
    recv_metas = decode_metas(words.data_ptr<int64_t>() + kPrefixWords, what);
    if (recv_metas.size() != recv_layout.part_caps.size()) {
      throw std::runtime_error(what + ": microbatch " + std::to_string(microbatch) + " holds " +
                               std::to_string(recv_metas.size()) + " tensors, the link " +
                               std::to_string(recv_layout.part_caps.size()));
    }
    std::vector<at::Tensor> out;
    std::vector<at::Tensor> rests;
    for (size_t i = 0; i < recv_metas.size(); ++i) {
      const TensorMeta& meta = recv_metas[i];
      const int64_t n = meta_bytes(meta);
      const int64_t cap = recv_layout.part_caps[i];
      at::Tensor bytes = buffers[1 + i];
      if (n > cap) {
        at::Tensor whole = at::empty({n}, bytes.options());
        if (cap > 0) whole.narrow(0, 0, cap).copy_(bytes);
        rests.push_back(whole.narrow(0, cap, n - cap));
        bytes = whole;
      }
      out.push_back(bytes.narrow(0, 0, n).view(meta.dtype).view(meta.sizes));
    }
    if (!rests.empty()) receive_rest(rests);
    return out;
  }

  // Sends every part of `f` and waits for each (the link threads' way).
  void send_frame_and_wait(const Frame& f, int64_t microbatch) {
    for (size_t i = 0; i < f.parts.size(); ++i) {
      std::vector<at::Tensor> one{f.parts[i]};
      transfer(group->send(one, peer, f.tags[i]), "sending", microbatch);
    }
  }

  // Send thread: hands each queued message to the process group, header first.
  void send_loop() {
    while (true) {
      Bundle bundle = sends.pop();
      const int64_t start = now_ns();
      const int64_t size = nbytes(bundle.tensors);
      if (!sent_header) {
        std::vector<at::Tensor> header{header_for(metas_of(bundle.tensors))};
        transfer(group->send(header, peer, header_tag(channel, stage)), "sending",
                 bundle.microbatch, /*header=*/true);
      }
      Frame f = frame(std::move(bundle.tensors), bundle.microbatch);
      send_frame_and_wait(f, bundle.microbatch);
      recycle(std::move(f.flat));
      send_ns += now_ns() - start;
      bytes_sent += size;
      ++messages_sent;
      std::lock_guard<std::mutex> guard(mutex);
      --sends_in_flight;
      idle.notify_all();
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

  void learn_header(const at::Tensor& header) {
    const at::Tensor words = header.is_cpu() ? header : header.cpu();
    recv_metas = decode_metas(words.data_ptr<int64_t>(), what);
    recv_layout = layout_for(recv_metas);
    got_header = true;
  }

  std::vector<at::Tensor> receive_message(int64_t microbatch) {
    if (!got_header) {
      std::vector<at::Tensor> header{
          at::empty({kMetaWords}, at::TensorOptions().dtype(at::kLong).device(device))};
      transfer(group->recv(header, peer, header_tag(channel, stage)), "receiving", microbatch,
               /*header=*/true);
      learn_header(header[0]);
    }
    std::vector<at::Tensor> buffers;
    for (const auto& b : take_buffers()) buffers.push_back(own_handle(b));  // handles of our own
    for (auto& work : post_first_parts(buffers, microbatch)) {
      transfer(work, "receiving", microbatch);
    }
    return open_frame(buffers, microbatch, [](const auto&) {});
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
    std::vector<at::Tensor> tensors;  // what is sent from, or the buffers received into
    at::Tensor flat;                  // a packed send's buffer, reused once it is sent
  };
  // In flight, oldest first. Changed by the caller's thread only, under `mutex` so that a
  // shutdown from another thread can abort what they wait for.
  std::deque<Transfer> sending;
  std::deque<Transfer> receiving;
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
    if (!sent_header) {
      Transfer header;
      header.microbatch = microbatch;
      header.header = true;
      header.tensors = {header_for(metas_of(tensors))};
      header.works.push_back(group->send(header.tensors, peer, header_tag(channel, stage)));
      push(sending, std::move(header));
    }
    const int64_t size = nbytes(tensors);
    Frame f = frame(std::move(tensors), microbatch);
    Transfer t;
    t.microbatch = microbatch;
    for (size_t i = 0; i < f.parts.size(); ++i) {
      std::vector<at::Tensor> one{f.parts[i]};
      t.works.push_back(group->send(one, peer, f.tags[i]));
    }
    bytes_sent += size;
    t.tensors = std::move(f.keep);
    t.flat = std::move(f.flat);
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
    recycle(std::move(oldest.flat));
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
      header_buffer = at::empty({kMetaWords}, at::TensorOptions().dtype(at::kLong).device(device));
      std::vector<at::Tensor> one{header_buffer};
      header_work = group->recv(one, peer, header_tag(channel, stage));
    }
    if (got_header) start_recv(t);  // else: started when the header has come
    push(receiving, std::move(t));
  }

  void start_recv(Transfer& t) {
    // Handles of their own: the pool tells a buffer free by its storage's use count, which
    // counts tensors (not copies of one handle), so the transfer must hold its own.
    for (const auto& buffer : take_buffers()) t.tensors.push_back(own_handle(buffer));
    t.works = post_first_parts(t.tensors, t.microbatch);
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
        learn_header(header_buffer);
        std::lock_guard<std::mutex> guard(mutex);
        header_work.reset();
        for (auto& t : receiving) start_recv(t);  // the receives posted before it came
      }
      Transfer& t = receiving.front();
      for (const auto& work : t.works) await(work, "receiving", microbatch, false);
      out = open_frame(t.tensors, microbatch, [&](const auto& works) {
        std::lock_guard<std::mutex> guard(mutex);  // so that a shutdown aborts them too
        t.works.insert(t.works.end(), works.begin(), works.end());
      });
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
    return out;
  }

  // Whether the posted receive of `microbatch` has come in full (its header too): a wait for
  // it would return at once. A frame with an overflow part says yes before that part.
  bool direct_arrived(int64_t microbatch) {
    std::lock_guard<std::mutex> guard(mutex);
    if (!got_header || receiving.empty() || receiving.front().microbatch != microbatch) {
      return false;
    }
    for (const auto& work : receiving.front().works) {
      if (!work->isCompleted()) return false;
    }
    return true;
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
};

CommEngine::CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout_s,
                       int64_t depth, at::Device device, double spin_us, int64_t recv_pool,
                       bool background, c10::intrusive_ptr<c10d::ProcessGroup> gradient_group)
    : group_(std::move(group)),
      gradient_group_(std::move(gradient_group)),
      split_channels_(static_cast<bool>(gradient_group_)),
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
  if (gradient_group_ && (gradient_group_->getSize() != group_->getSize() ||
                          gradient_group_->getRank() != rank_)) {
    throw std::invalid_argument(
        "CommEngine: the gradient group must hold the ranks of the group in the same order "
        "(this rank is " + std::to_string(rank_) + " of " + std::to_string(group_->getSize()) +
        " there, but " + std::to_string(gradient_group_->getRank()) + " of " +
        std::to_string(gradient_group_->getSize()) + " in the gradient group)");
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

std::shared_ptr<CommEngine::Link> CommEngine::link(int peer, Channel channel, int stage) {
  std::lock_guard<std::mutex> lock(links_mutex_);
  if (shut_down_) throw QueueClosed("CommEngine of rank " + std::to_string(rank_) + " is shut down");
  check_link(peer, channel, stage);
  auto& slot = links_[{peer, static_cast<int>(channel), stage}];
  if (!slot) {
    const auto& group =
        channel == Channel::kGradient && gradient_group_ ? gradient_group_ : group_;
    slot = std::make_shared<Link>(group, rank_, peer, channel, stage, millis(timeout_s_), device_,
                                  depth_, spin_us_, recv_pool_, !background_);
    if (background_) Link::start_threads(slot);
  }
  return slot;
}

void CommEngine::send(int peer, Channel channel, int stage, int64_t microbatch,
                      std::vector<at::Tensor> tensors) {
  const auto held = link(peer, channel, stage);  // alive through this call, even past a shutdown
  Link& l = *held;
  for (auto& t : tensors) {
    if (!t.defined()) throw std::invalid_argument(l.what + ": cannot send an undefined tensor");
    // Each a dispatcher call: only where needed (a graph kept alive by a send in flight; a
    // strided tensor, which travels as its contiguous copy).
    if (t.requires_grad()) t = t.detach();
    if (!t.is_contiguous()) t = t.contiguous();
  }
  // Sizes and dtypes may change from message to message (see "Frames"); what a stage boundary
  // is made of may not: the number of tensors crossing it and their dimensions.
  auto metas = metas_of(tensors);
  if (!l.negotiated) {
    l.first_metas = std::move(metas);
    l.negotiated = true;
  } else {
    bool same_kind = metas.size() == l.first_metas.size();
    for (size_t i = 0; same_kind && i < metas.size(); ++i) {
      same_kind = metas[i].sizes.size() == l.first_metas[i].sizes.size();
    }
    if (!same_kind) {
      throw std::invalid_argument(
          l.what + ": microbatch " + std::to_string(microbatch) + " sends tensors " +
          describe(metas) + " but this boundary's first message sent " +
          describe(l.first_metas) +
          "; sizes and dtypes may change between microbatches, but the number of tensors "
          "crossing a stage boundary and their dimensions must stay fixed (return the same "
          "structure from the stage for every batch)");
    }
  }
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
  const auto held = link(peer, channel, stage);  // alive through this call, even past a shutdown
  Link& l = *held;
  if (l.direct) {
    l.direct_post(microbatch);
    return;
  }
  l.requests.push(Bundle{{}, microbatch, -1}, timeout_s_);
}

bool CommEngine::arrived(int peer, Channel channel, int stage, int64_t microbatch) {
  const auto held = link(peer, channel, stage);  // alive through this call, even past a shutdown
  Link& l = *held;
  if (l.direct) return l.direct_arrived(microbatch);
  return l.done.size() > 0;
}

std::vector<at::Tensor> CommEngine::wait_recv(int peer, Channel channel, int stage,
                                              int64_t microbatch) {
  const auto held = link(peer, channel, stage);  // alive through this call, even past a shutdown
  Link& l = *held;
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

void CommEngine::add_counters(CommStats& into, const Link& l) {
  into.messages_sent += l.messages_sent;
  into.messages_received += l.messages_received;
  into.bytes_sent += l.bytes_sent;
  into.bytes_received += l.bytes_received;
  into.send_ns += l.send_ns;
  into.recv_ns += l.recv_ns;
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
  // Release what the links hold (the transfers' works and buffers, the process groups) now,
  // not whenever the engine object is collected: a Python cycle can keep a closed engine
  // until interpreter teardown, and gloo's threads left running into exit() take the process
  // down with them (an abort at exit). A call still inside a link keeps it alive till it
  // returns; a thread detached above owns its link.
  std::map<std::tuple<int, int, int>, std::shared_ptr<Link>> retired;
  {
    std::lock_guard<std::mutex> lock(links_mutex_);
    for (const auto& [key, l] : links_) add_counters(retired_, *l);
    retired.swap(links_);
    group_.reset();
    gradient_group_.reset();
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
  s = retired_;
  for (const auto& [key, l] : links_) add_counters(s, *l);
  s.wait_recv_ns = wait_recv_ns_;
  return s;
}

}  // namespace pipedream_fast
