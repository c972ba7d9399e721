// The bench-only extension `pipedream_fast_bench` (built on demand by bench/native_ext.py, not
// part of the installed library): the native ThreadedProducer of the hand-off benchmarks and
// the queue tests.
//
// It takes the `pipedream_fast._C.ActivationQueue` objects of the library: both modules are
// built with torch's pybind11 by the same compiler, so they share pybind11's type registry
// and exception translators (a closed queue raises `_C.QueueClosed` here too). The queue's
// code is compiled into this module as well (csrc/activation_queue.cpp), with the library's
// CUDA setting, so both agree on the layout of a Bundle.
#include <torch/extension.h>

#include "activation_queue.h"
#include "threaded_producer.h"

namespace py = pybind11;
using namespace pipedream_fast;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipedream_fast bench helpers: a native producer thread feeding an ActivationQueue";

  // Destructors that join threads run without the GIL: a thread may need it to drop the last
  // reference to a tensor that Python also holds.
  py::class_<ThreadedProducer>(m, "ThreadedProducer", py::release_gil_before_calling_cpp_dtor(),
                               "A native thread pushing `count` bundles into a queue.")
      .def(py::init<std::shared_ptr<ActivationQueue>, std::vector<at::Tensor>, int64_t,
                    int64_t>(),
           py::arg("queue"), py::arg("tensors"), py::arg("count"), py::arg("interval_us") = 0)
      .def("join", &ThreadedProducer::join, py::call_guard<py::gil_scoped_release>());
}
