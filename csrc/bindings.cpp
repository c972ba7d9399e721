// Python bindings of the core: pipedream_fast._C.
//
// Every call that can block or copy many bytes releases the GIL (py::call_guard): arguments
// are converted before the guard is taken and results after it is dropped, so no Python
// object is touched without the GIL.
#include <torch/extension.h>

#include <optional>

#include "activation_queue.h"
#include "comm_engine.h"
#include "cpu_cache.h"
#include "errors.h"
#include "transfer_loop.h"
#include "weight_ring.h"

namespace py = pybind11;
using namespace pipedream_fast;

namespace {

double timeout_or_forever(std::optional<double> timeout) {
  if (!timeout) return ActivationQueue::kForever;
  if (*timeout < 0) throw std::invalid_argument("timeout must be >= 0 seconds or None");
  return *timeout;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipedream_fast C++ core: activation queues, weight-version rings and the "
            "point-to-point comm engine";

#ifdef PIPEDREAM_FAST_WITH_CUDA
  m.attr("cuda_enabled") = true;
#else
  m.attr("cuda_enabled") = false;
#endif

  py::register_exception<QueueClosed>(m, "QueueClosed", PyExc_RuntimeError);
  py::register_exception<QueueTimeout>(m, "QueueTimeout", PyExc_TimeoutError);
  py::register_exception<VersionError>(m, "VersionError", PyExc_LookupError);

  m.def("now_ns", &now_ns, "Monotonic clock in ns (the clock that stamps Bundle.enqueued_ns).");

  m.attr("CPU_CACHE_MIN_BYTES") = kCpuCacheMinBytes;
  m.def("cpu_cache_acquire", &cpu_cache_acquire, py::arg("limit_bytes"),
        "Installs the CPU block cache as c10's CPU allocator (counted: one release each), "
        "keeping up to `limit_bytes` of freed blocks; False when another allocator has a "
        "higher priority (nothing installed).");
  m.def("cpu_cache_release", &cpu_cache_release,
        "One user of the CPU block cache less; the last one puts the previous allocator back "
        "and frees the cached blocks.");
  m.def("cpu_cache_empty", &cpu_cache_empty, "Frees the CPU block cache's free blocks.");
  m.def(
      "cpu_cache_stats",
      [] {
        const CpuCacheStats s = cpu_cache_stats();
        py::dict d;
        d["installed"] = s.installed;
        d["users"] = s.users;
        d["limit_bytes"] = s.limit_bytes;
        d["cached_bytes"] = s.cached_bytes;
        d["live_bytes"] = s.live_bytes;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["dropped"] = s.dropped;
        return d;
      },
      "The CPU block cache's state and counts (requests of at least CPU_CACHE_MIN_BYTES).");

  py::class_<Bundle>(m, "Bundle", "Tensors handed between pipeline stages, with their tags.")
      .def_readonly("tensors", &Bundle::tensors)
      .def_readonly("microbatch", &Bundle::microbatch)
      .def_readonly("version", &Bundle::version)
      .def_readonly("enqueued_ns", &Bundle::enqueued_ns)
      .def("__repr__", [](const Bundle& b) {
        return "Bundle(microbatch=" + std::to_string(b.microbatch) +
               ", version=" + std::to_string(b.version) +
               ", tensors=" + std::to_string(b.tensors.size()) + ")";
      });

  py::class_<ActivationQueue, std::shared_ptr<ActivationQueue>>(
      m, "ActivationQueue",
      "Bounded, blocking, closable FIFO of tensor bundles. push blocks while full, pop while "
      "empty; timeouts raise QueueTimeout, a closed queue QueueClosed (pop drains first).")
      .def(py::init<int64_t, std::string, double>(), py::arg("capacity"),
           py::arg("name") = "queue", py::arg("spin_us") = 0.0)
      .def(
          "push",
          [](ActivationQueue& q, std::vector<at::Tensor> tensors, int64_t microbatch,
             int64_t version, std::optional<double> timeout) {
            const double t = timeout_or_forever(timeout);
            py::gil_scoped_release no_gil;
            q.push(Bundle{std::move(tensors), microbatch, version}, t);
          },
          py::arg("tensors"), py::arg("microbatch") = -1, py::arg("version") = -1,
          py::arg("timeout") = py::none())
      .def(
          "pop",
          [](ActivationQueue& q, std::optional<double> timeout) {
            const double t = timeout_or_forever(timeout);
            py::gil_scoped_release no_gil;
            return q.pop(t);
          },
          py::arg("timeout") = py::none())
      .def("try_pop", &ActivationQueue::try_pop)
      .def("close", &ActivationQueue::close)
      .def_property_readonly("closed", &ActivationQueue::closed)
      .def_property_readonly("capacity", &ActivationQueue::capacity)
      .def_property_readonly("name", &ActivationQueue::name)
      .def("__len__", &ActivationQueue::size)
      .def("stats", [](const ActivationQueue& q) {
        const QueueStats s = q.stats();
        py::dict d;
        d["pushed"] = s.pushed;
        d["popped"] = s.popped;
        d["push_wait_s"] = static_cast<double>(s.push_wait_ns) * 1e-9;
        d["pop_wait_s"] = static_cast<double>(s.pop_wait_ns) * 1e-9;
        d["high_water"] = s.high_water;
        return d;
      });

  py::class_<WeightRing>(
      m, "WeightRing",
      "K preallocated weight-version slots of a stage. The parameters are rebound to views "
      "of one flat buffer per dtype; snapshot() copies them into a free slot in one bulk copy "
      "per dtype.")
      .def(py::init<std::vector<at::Tensor>, int64_t, bool>(), py::arg("params"),
           py::arg("slots"), py::arg("offload") = false)
      .def(
          "snapshot",
          [](WeightRing& r, std::optional<int64_t> version) {
            if (version && *version < 0) {
              throw std::invalid_argument("snapshot(version): version must be >= 0");
            }
            py::gil_scoped_release no_gil;
            return r.snapshot(version.value_or(-1));
          },
          py::arg("version") = py::none())
      .def("tensors", &WeightRing::tensors, py::arg("version"))
      .def("release", &WeightRing::release, py::arg("version"))
      .def("holds", &WeightRing::holds, py::arg("version"))
      .def("held_versions", &WeightRing::held_versions)
      .def("attach_grad_buffers", &WeightRing::attach_grad_buffers)
      .def("grad_buffers", &WeightRing::grad_buffers)
      .def("live_tensors", &WeightRing::live_tensors)
      .def("live_buffers", &WeightRing::live_buffers)
      .def_property_readonly("capacity", &WeightRing::capacity)
      .def_property_readonly("free_slots", &WeightRing::free_slots)
      .def_property_readonly("bytes_per_version", &WeightRing::bytes_per_version)
      .def_property_readonly("num_params", &WeightRing::num_params)
      .def_property_readonly("offloaded", &WeightRing::offloaded);

  py::enum_<Channel>(m, "Channel", "What a link carries: activations forward, gradients back.")
      .value("ACTIVATION", Channel::kActivation)
      .value("GRADIENT", Channel::kGradient);

  py::class_<CommEngine>(
      m, "CommEngine", py::release_gil_before_calling_cpp_dtor(),
      "Background send/receive threads of one rank over a c10d ProcessGroup, one link per "
      "(peer, channel, stage), where `stage` is the pipeline stage that receives the message "
      "(0 <= stage < 512). send() and post_recv() return at once; wait_recv() blocks (GIL "
      "released) until the tensors arrive or `timeout` seconds pass. `depth`: messages queued "
      "per link and direction; `spin_us`: how long the link queues spin before blocking; "
      "`recv_pool`: receive buffer sets pooled per link; `gradient_group`: a group of the same "
      "ranks for the gradient channel's links (its own NCCL streams).")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout,
                       int64_t depth, at::Device device, double spin_us, int64_t recv_pool,
                       bool background,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> gradient_group) {
             return std::make_unique<CommEngine>(std::move(group), timeout, depth, device,
                                                 spin_us, recv_pool, background,
                                                 gradient_group.value_or(nullptr));
           }),
           py::arg("group"), py::arg("timeout") = 300.0,
           py::arg("depth") = CommEngine::kDefaultDepth, py::arg("device") = at::Device(at::kCPU),
           py::arg("spin_us") = 0.0, py::arg("recv_pool") = CommEngine::kDefaultRecvPool,
           py::arg("background") = false, py::arg("gradient_group") = py::none())
      .def_readonly_static("DEFAULT_DEPTH", &CommEngine::kDefaultDepth)
      .def_readonly_static("DEFAULT_RECV_POOL", &CommEngine::kDefaultRecvPool)
      .def("send", &CommEngine::send, py::arg("peer"), py::arg("channel"), py::arg("stage"),
           py::arg("microbatch"), py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
           "Queue `tensors` of `microbatch` for the receiving `stage` on rank `peer`; returns "
           "at once unless the link's queue is full.")
      .def("post_recv", &CommEngine::post_recv, py::arg("peer"), py::arg("channel"),
           py::arg("stage"), py::arg("microbatch"), py::call_guard<py::gil_scoped_release>(),
           "Receive the message of `microbatch` for `stage` from rank `peer` in the background.")
      .def("wait_recv", &CommEngine::wait_recv, py::arg("peer"), py::arg("channel"),
           py::arg("stage"), py::arg("microbatch"), py::call_guard<py::gil_scoped_release>(),
           "Block until the posted receive of `microbatch` for `stage` from rank `peer` has "
           "arrived; receives are handed out in post order on each link.")
      .def("arrived", &CommEngine::arrived, py::arg("peer"), py::arg("channel"),
           py::arg("stage"), py::arg("microbatch"), py::call_guard<py::gil_scoped_release>(),
           "Whether the posted receive of `microbatch` for `stage` from rank `peer` has come, "
           "so that wait_recv would return at once (a hint; never blocks).")
      .def("flush", &CommEngine::flush, py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &CommEngine::shutdown, py::arg("grace") = 1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &CommEngine::rank)
      .def_property_readonly("timeout", &CommEngine::timeout_s)
      .def_property_readonly("depth", &CommEngine::depth)
      .def_property_readonly("spin_us", &CommEngine::spin_us)
      .def_property_readonly("recv_pool", &CommEngine::recv_pool)
      .def_property_readonly("background", &CommEngine::background)
      .def_property_readonly("split_channels", &CommEngine::split_channels)
      .def("unfinished_sends", &CommEngine::unfinished_sends,
           "The sends queued on link threads and not yet completed: (peer, channel, receiving "
           "stage, -1), one per send (only their number is known); none where the caller's "
           "thread issues transfers (a send's completion is known only once waited for).")
      .def("stats", [](const CommEngine& e) {
        const CommStats s = e.stats();
        py::dict d;
        d["messages_sent"] = s.messages_sent;
        d["messages_received"] = s.messages_received;
        d["bytes_sent"] = s.bytes_sent;
        d["bytes_received"] = s.bytes_received;
        d["send_s"] = static_cast<double>(s.send_ns) * 1e-9;
        d["recv_s"] = static_cast<double>(s.recv_ns) * 1e-9;
        d["wait_recv_s"] = static_cast<double>(s.wait_recv_ns) * 1e-9;
        return d;
      });

  py::class_<TransferLoop>(
      m, "TransferLoop",
      "Performs a run of transfer actions of a rank's program in one call, on `engine`.")
      .def(py::init<CommEngine&>(), py::arg("engine"), py::keep_alive<1, 2>())
      .def(
          "run",
          [](TransferLoop& loop, const py::list& actions) {
            // Each (kind, stage, microbatch, peer, tensors or None), kind 0..3 as
            // TransferKind: converted with the GIL, performed without it.
            std::vector<TransferAction> run;
            run.reserve(actions.size());
            for (const auto& item : actions) {
              const auto t = item.cast<py::tuple>();
              if (t.size() != 5) throw std::invalid_argument("a transfer action is 5 fields");
              TransferAction a{static_cast<TransferKind>(t[0].cast<int>()), t[1].cast<int>(),
                               t[2].cast<int64_t>(), t[3].cast<int>(), {}};
              if (!t[4].is_none()) a.tensors = t[4].cast<std::vector<at::Tensor>>();
              run.push_back(std::move(a));
            }
            py::gil_scoped_release no_gil;
            return loop.run(std::move(run));
          },
          py::arg("actions"),
          "Performs (kind, stage, microbatch, peer, tensors) in order: kind 0 sends the "
          "activation of `stage` to stage + 1 on `peer`, 1 the gradient to stage - 1, 2 and 3 "
          "post the receive of an activation or a gradient for `stage`. Returns each action's "
          "start and end on time.perf_counter's clock, 2 floats per action.")
      .def_property_readonly("position", &TransferLoop::position,
                             "The index in the run in progress of the action being performed "
                             "(-1: none).");
}
