// Python module torchext._C: the backend class and build facts.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/python.h>

#include <vector>

#include "backend/flight_recorder.hpp"
#include "backend/process_group.hpp"
#include "common/timeline.hpp"

#ifdef FASTCOMM_WITH_CUDA
#include <nccl.h>
#endif

namespace py = pybind11;

namespace {

// Python's reference to a group. The last one may go while the GIL is held (a
// `del`, the end of a frame), and the group then joins its threads, which may
// be waiting for the GIL themselves: to free a tensor's Python object, or to
// run a Python callback of a future. So the reference is dropped without it,
// as torch drops its own backends'.
template <typename T>
class GilFreeRelease {
 public:
  GilFreeRelease() = default;
  /* implicit */ GilFreeRelease(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}
  // pybind adopts an object it made itself through this one.
  explicit GilFreeRelease(T* fresh) : ptr_(c10::intrusive_ptr<T>::unsafe_steal_from_new(fresh)) {}
  GilFreeRelease(const GilFreeRelease&) = default;
  GilFreeRelease(GilFreeRelease&&) noexcept = default;
  GilFreeRelease& operator=(const GilFreeRelease&) = default;
  GilFreeRelease& operator=(GilFreeRelease&&) noexcept = default;
  ~GilFreeRelease() {
    if (ptr_ && PyGILState_Check()) {
      py::gil_scoped_release unlocked;
      ptr_.reset();
    }
  }

  T* get() const noexcept { return ptr_.get(); }
  T& operator*() const noexcept { return *ptr_; }
  T* operator->() const noexcept { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, GilFreeRelease<T>, true)

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcomm: c10d backend and fused ops";
  // The base class must be registered with pybind before we derive from it.
  py::module_::import("torch.distributed");

  using Group = fastcomm::ProcessGroupFastComm;
  py::class_<Group, c10d::Backend, GilFreeRelease<Group>>(m, "ProcessGroupFastComm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::vector<uint64_t> globalRanks,
                       std::string groupName) {
             return GilFreeRelease<Group>(c10::make_intrusive<Group>(
                 store, rank, size, timeout, std::move(globalRanks), std::move(groupName)));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("global_ranks") = std::vector<uint64_t>{}, py::arg("group_name") = "",
           py::call_guard<py::gil_scoped_release>())
      .def(
          "stats",
          [](Group& pg) {
            py::dict out;
            for (const auto& [name, s] : pg.stats().snapshot()) {
              py::dict d;
              d["count"] = s.count;
              d["bytes"] = s.bytes;
              d["time_us"] = s.timeUs;
              out[py::str(name)] = d;
            }
            return out;
          },
          "Per-collective {count, bytes, time_us} of this group.")
      // torch calls this on non-members of a new group when the parent is
      // bound to a device (ProcessGroupNCCL splits its communicator there).
      // fastcomm creates each group's communicator from its own store
      // rendezvous, so a non-member has nothing to do.
      .def("perform_nocolor_split", [](Group&, const py::object&) {})
      // A copy of this group's options (timeout, name, ranks): torch 2.11's
      // split_group deep-copies the parent's options, which its Options type
      // cannot do itself (see torchext/_registration.py).
      .def("_copy_options",
           [](Group& pg) {
             return c10::make_intrusive<c10d::Backend::Options>(*pg.getBackendOptions());
           })
      .def("reset_stats", [](Group& pg) { pg.stats().reset(); })
      .def("topology", [](Group& pg) { return pg.topology().describe(); })
      .def("config", [](Group& pg) { return pg.config().describe(); });

  m.def(
      "_timeline",
      [] {
        py::list out;
        for (const auto& e : fastcomm::Timeline::drain())
          out.append(py::make_tuple(e.name, e.thread, e.chunk, e.startUs, e.endUs));
        return out;
      },
      "Drains the recorded pipeline phases: (name, thread, chunk, start_us, end_us).");
  m.def(
      "_dump_trace",
      [](const std::string& path, const std::string& reason) {
        return fastcomm::dumpTrace(path, reason);
      },
      py::arg("path") = "", py::arg("reason") = "on demand",
      // Symbolizing recorded Python stacks takes the GIL.
      py::call_guard<py::gil_scoped_release>(),
      "Writes this process's flight recorder dump; returns its path, \"\" when no group records.");
  m.def("has_cuda", [] {
#ifdef FASTCOMM_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("nccl_version", []() -> py::object {
#ifdef FASTCOMM_WITH_CUDA
    return py::make_tuple(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
#else
    return py::none();
#endif
  });
}
