// trace_cost: the flight recorder's own cost per op (benchmarks/bench_trace.py).
#include <pybind11/stl.h>
#include <torch/python.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "backend/flight_recorder.hpp"
#include "testing/bindings.hpp"

namespace py = pybind11;

namespace fastcomm {
namespace testing {

namespace {

// Nanoseconds per op of `iters` ops recorded in `ring` (none when null): on
// the calling thread, or as a collective runs, recorded here and started and
// completed by a second thread that takes each op in turn (then the hand-off
// itself is timed too, both threads spinning as lanes do under load; a run
// without a ring measures it alone).
double timeOps(TraceRing* ring, const std::vector<at::Tensor>& inputs,
               const std::vector<at::Tensor>& outputs, int64_t iters, bool crossThread) {
  TraceOp op{"all_reduce", false, 0, 0, -1, -1};
  const auto timeout = std::chrono::minutes(30);
  const auto t0 = std::chrono::steady_clock::now();
  if (!crossThread) {
    for (int64_t i = 0; i < iters; ++i) {
      op.seq = static_cast<uint64_t>(i + 1);
      if (ring == nullptr) continue;
      const uint64_t id = ring->record(op, inputs, outputs, timeout);
      ring->started(id);
      ring->completed(id);
    }
  } else {
    // posted: the op handed to the lane (its id, or 1 without a ring); 0 once done.
    std::atomic<uint64_t> posted{0};
    std::atomic<bool> stop{false};
    std::thread lane([&] {
      while (true) {
        uint64_t id;
        while ((id = posted.load(std::memory_order_acquire)) == 0) {
          if (stop.load(std::memory_order_relaxed)) return;
        }
        if (ring != nullptr) {
          ring->started(id);
          ring->completed(id);
        }
        posted.store(0, std::memory_order_release);
      }
    });
    for (int64_t i = 0; i < iters; ++i) {
      op.seq = static_cast<uint64_t>(i + 1);
      const uint64_t id = ring != nullptr ? ring->record(op, inputs, outputs, timeout) : 1;
      posted.store(id, std::memory_order_release);
      while (posted.load(std::memory_order_acquire) != 0) {
      }
    }
    stop.store(true);
    lane.join();
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(iters);
}

}  // namespace

void bindTrace(py::module_& m) {
  m.def(
      "trace_cost",
      [](int capacity, const std::vector<at::Tensor>& inputs,
         const std::vector<at::Tensor>& outputs, int64_t iters, bool pythonStack,
         bool crossThread) {
        Config cfg;
        cfg.traceBufferSize = capacity;
        cfg.traceDumpOnTimeout = false;
        cfg.tracePythonStack = pythonStack;
        auto ring = TraceRing::create(cfg, TraceGroup{"trace_cost", nullptr, {0}, 0, nullptr});
        // Every slot's buffers allocated once, as in a group that ran a while.
        timeOps(ring.get(), inputs, outputs, 2 * static_cast<int64_t>(capacity), false);
        // Interleaved with the bare loop (the hand-off alone), whose time is subtracted.
        double with = 0, without = 0;
        for (int k = 0; k < 4; ++k) {
          without += timeOps(nullptr, inputs, outputs, iters / 4, crossThread);
          with += timeOps(ring.get(), inputs, outputs, iters / 4, crossThread);
        }
        ring->unregister();
        return (with - without) / 4;
      },
      py::arg("capacity"), py::arg("inputs"), py::arg("outputs"), py::arg("iters"),
      py::arg("python_stack") = false, py::arg("cross_thread") = false,
      // As a collective is called: without the GIL (a Python stack takes it).
      py::call_guard<py::gil_scoped_release>(),
      "Nanoseconds per op that a flight recorder ring of `capacity` entries adds to recording "
      "(scheduled, started, completed) an op on `inputs` / `outputs`; with `cross_thread`, the "
      "op is started and completed by a second thread, as a lane does.");
}

}  // namespace testing
}  // namespace fastcomm
