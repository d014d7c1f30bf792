// Python module torchext._C: the backend class and build facts.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/python.h>

#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "backend/process_group.hpp"
#include "common/affinity.hpp"
#include "common/timeline.hpp"
#include "kernels/staged_layout.hpp"
#include "python/staged_bindings.hpp"
#include "python/transport_bindings.hpp"

#ifdef FASTCOMM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <nccl.h>

#include "kernels/staged_kernels.hpp"
#endif

namespace py = pybind11;

#ifdef FASTCOMM_WITH_CUDA
namespace {

using namespace fastcomm;

hierk::Wire wireOf(const std::string& w) {
  if (w == "bf16") return hierk::Wire::BF16;
  if (w == "fp16") return hierk::Wire::FP16;
  TORCH_CHECK(w == "none", "fastcomm: wire must be none, bf16 or fp16, not ", w);
  return hierk::Wire::None;
}

hierk::Elem elemOf(at::ScalarType t) {
  static const std::pair<at::ScalarType, hierk::Elem> kinds[] = {
      {at::kFloat, hierk::Elem::F32}, {at::kDouble, hierk::Elem::F64},
      {at::kHalf, hierk::Elem::F16},  {at::kBFloat16, hierk::Elem::BF16},
      {at::kChar, hierk::Elem::I8},   {at::kByte, hierk::Elem::U8},
      {at::kInt, hierk::Elem::I32},   {at::kLong, hierk::Elem::I64}};
  for (const auto& [dt, e] : kinds)
    if (dt == t) return e;
  TORCH_CHECK(false, "fastcomm: no staged kernel for ", t);
}

hierk::Op opOf(const std::string& op) {
  if (op == "SUM" || op == "AVG") return hierk::Op::Sum;
  if (op == "PRODUCT") return hierk::Op::Prod;
  if (op == "MIN") return hierk::Op::Min;
  TORCH_CHECK(op == "MAX", "fastcomm: no staged kernel for op ", op);
  return hierk::Op::Max;
}

// Test-only: the fused staging kernels alone, on the current stream, with
// the tensors' own addresses (storage offsets included, so tests choose the
// alignment). Staging tensors are bytes in device or pinned host memory.
void bindStagedKernels(py::module_& m) {
  m.def(
      "_staged_pack",
      [](const at::Tensor& shard, int64_t k, int rails, int me, int64_t chunkBytes,
         const std::string& wire, const at::Tensor& slots, int64_t pitch) {
        const int64_t esize = shard.element_size();
        const HierLayout l = HierLayout::make(shard.numel(), rails, chunkBytes, esize);
        TORCH_CHECK(k >= 0 && k < l.chunks, "fastcomm: no chunk ", k);
        hierk::packToStaging(wireOf(wire), esize,
                             static_cast<const char*>(shard.data_ptr()) + l.chunkOff(k) * esize,
                             slots.data_ptr(), pitch, l, k, me, at::cuda::getCurrentCUDAStream());
      },
      "Test-only: hierk::packToStaging of chunk k of `shard` into `slots`.");
  m.def(
      "_staged_gather",
      [](const at::Tensor& slots, int64_t pitch, const at::Tensor& shard, int64_t k, int rails,
         int me, int64_t chunkBytes, const std::string& wire) {
        const int64_t esize = shard.element_size();
        const HierLayout l = HierLayout::make(shard.numel(), rails, chunkBytes, esize);
        TORCH_CHECK(k >= 0 && k < l.chunks, "fastcomm: no chunk ", k);
        hierk::gatherFromStaging(wireOf(wire), esize, slots.data_ptr(), pitch,
                                 static_cast<char*>(shard.data_ptr()) + l.chunkOff(k) * esize, l, k,
                                 me, at::cuda::getCurrentCUDAStream());
      },
      "Test-only: hierk::gatherFromStaging of `slots` into chunk k of `shard`.");
  m.def(
      "_staged_reduce",
      [](const at::Tensor& own, const at::Tensor& recv, int64_t pitch, int nPeers,
         const std::string& op, const std::string& wire, int64_t divisor, const at::Tensor& out) {
        hierk::reduceFromStaging(elemOf(own.scalar_type()), opOf(op), wireOf(wire), own.data_ptr(),
                                 recv.data_ptr(), pitch, nPeers, own.numel(), divisor,
                                 out.data_ptr(), at::cuda::getCurrentCUDAStream());
      },
      "Test-only: hierk::reduceFromStaging of `recv` (peer j at j * pitch bytes) into `own` "
      "and `out`.");
}

}  // namespace
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcomm: c10d backend and fused ops";
  // The base class must be registered with pybind before we derive from it.
  py::module_::import("torch.distributed");

  py::class_<fastcomm::ProcessGroupFastComm, c10d::Backend,
             c10::intrusive_ptr<fastcomm::ProcessGroupFastComm>>(m, "ProcessGroupFastComm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::vector<uint64_t> globalRanks,
                       std::string groupName) {
             return c10::make_intrusive<fastcomm::ProcessGroupFastComm>(
                 store, rank, size, timeout, std::move(globalRanks), std::move(groupName));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("global_ranks") = std::vector<uint64_t>{}, py::arg("group_name") = "",
           py::call_guard<py::gil_scoped_release>())
      .def(
          "stats",
          [](fastcomm::ProcessGroupFastComm& pg) {
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
      .def("perform_nocolor_split", [](fastcomm::ProcessGroupFastComm&, const py::object&) {})
      // A copy of this group's options (timeout, name, ranks): torch 2.11's
      // split_group deep-copies the parent's options, which its Options type
      // cannot do itself (see torchext/_registration.py).
      .def("_copy_options",
           [](fastcomm::ProcessGroupFastComm& pg) {
             return c10::make_intrusive<c10d::Backend::Options>(*pg.getBackendOptions());
           })
      .def("reset_stats", [](fastcomm::ProcessGroupFastComm& pg) { pg.stats().reset(); })
      .def("topology", [](fastcomm::ProcessGroupFastComm& pg) { return pg.topology().describe(); })
      .def("config", [](fastcomm::ProcessGroupFastComm& pg) { return pg.config().describe(); });

  m.def(
      "_timeline",
      [] {
        py::list out;
        for (const auto& e : fastcomm::Timeline::drain())
          out.append(py::make_tuple(e.name, e.thread, e.chunk, e.startUs, e.endUs));
        return out;
      },
      "Drains the recorded pipeline phases: (name, thread, chunk, start_us, end_us).");
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

  m.def(
      "_affinity_slice",
      [](const std::vector<int>& allowed, int localRank, int localSize,
         const std::optional<std::map<int, std::pair<int, int>>>& cores) {
        if (!cores) {
          return fastcomm::affinity::sliceOfCores(allowed, localRank, localSize,
                                                  fastcomm::affinity::sysfsCoreOf);
        }
        return fastcomm::affinity::sliceOfCores(allowed, localRank, localSize, [&](int cpu) {
          auto it = cores->find(cpu);
          TORCH_CHECK(it != cores->end(), "fastcomm: no core given for CPU ", cpu);
          return it->second;
        });
      },
      py::arg("allowed"), py::arg("local_rank"), py::arg("local_size"),
      py::arg("cores") = py::none(),
      "FASTCOMM_CPU_AFFINITY=local's slice of `allowed` for a local rank: whole cores (a map "
      "CPU -> (package, core), default: this host's sysfs), sorted.");

  m.def(
      "_hier_layout",
      [](int64_t shard, int rails, int64_t chunkBytes, int64_t esize, int me, bool packed) {
        using fastcomm::HierLayout;
        const HierLayout l = HierLayout::make(shard, rails, chunkBytes, esize);
        py::dict d;
        d["align"] = l.align;
        d["q_max"] = l.qMax;
        d["chunk_elems"] = l.chunkElems;
        d["piece_slot_bytes"] = HierLayout::pieceSlotBytes(rails, chunkBytes);
        py::list chunks;
        for (int64_t k = 0; k < l.chunks; ++k) {
          py::list pieces;
          for (int p = 0; p < rails; ++p)
            pieces.append(py::make_tuple(l.pieceOff(k, p), l.pieceLen(k, p)));
          py::dict c;
          c["off"] = l.chunkOff(k);
          c["len"] = l.chunkLen(k);
          c["q"] = l.q(k);
          c["pieces"] = pieces;
          if (packed) {
            py::list map;
            for (int64_t i = 0; i < (rails - 1) * l.qMax; ++i)
              map.append(fastcomm::packedToChunk(l, k, me, i));
            c["packed"] = map;
          }
          chunks.append(c);
        }
        d["chunks"] = chunks;
        return d;
      },
      "Test-only: the chunk/piece layout of the CUDA multi-node all_reduce.", py::arg("shard"),
      py::arg("rails"), py::arg("chunk_bytes"), py::arg("esize"), py::arg("me") = 0,
      py::arg("packed") = false);

  fastcomm::bindTransport(m);
  fastcomm::bindStagedRail(m);
#ifdef FASTCOMM_WITH_CUDA
  bindStagedKernels(m);
#endif
}
