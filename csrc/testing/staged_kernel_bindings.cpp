// The staged rail's chunk/piece layout (kernels/staged_layout.hpp), the host
// wire codec (plans/wire_codec.hpp) and, in CUDA builds, the staging kernels
// alone (kernels/staged_kernels.hpp), for tests/test_hier_layout.py and
// tests/test_staged_kernels.py.
#include <pybind11/stl.h>
#include <torch/python.h>

#include "kernels/staged_layout.hpp"
#include "plans/wire_codec.hpp"
#include "testing/bindings.hpp"

#ifdef FASTCOMM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "kernels/staged_kernels.hpp"
#endif

namespace py = pybind11;

#ifdef FASTCOMM_WITH_CUDA
namespace {

using namespace fastcomm;

hierk::Wire wireOf(const std::string& w) {
  if (w == "bf16") return hierk::Wire::BF16;
  if (w == "fp16") return hierk::Wire::FP16;
  if (w == "int8") return hierk::Wire::INT8;
  TORCH_CHECK(w == "none", "fastcomm: wire must be none, bf16, fp16 or int8, not ", w);
  return hierk::Wire::None;
}

// A layout whose chunk 0, seen from node 1, has node 0's piece as the first
// n elements of the shard: P and B then code and decode exactly those.
HierLayout onePiece(int64_t n) {
  TORCH_CHECK(n >= 1, "fastcomm: no values to code");
  return HierLayout::wholeRange(n);
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

// The staging kernels alone, on the current stream, with
// the tensors' own addresses (storage offsets included, so tests choose the
// alignment). Staging tensors are bytes in device or pinned host memory.
void bindKernels(py::module_& m) {
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
      "hierk::packToStaging of chunk k of `shard` into `slots`.");
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
      "hierk::gatherFromStaging of `slots` into chunk k of `shard`.");
  m.def(
      "_staged_reduce",
      [](const at::Tensor& own, const at::Tensor& recv, int64_t pitch, int nPeers,
         const std::string& op, const std::string& wire, int64_t divisor, const at::Tensor& out) {
        hierk::reduceFromStaging(elemOf(own.scalar_type()), opOf(op), wireOf(wire), own.data_ptr(),
                                 recv.data_ptr(), pitch, nPeers, own.numel(), divisor,
                                 out.data_ptr(), at::cuda::getCurrentCUDAStream());
      },
      "hierk::reduceFromStaging of `recv` (peer j at j * pitch bytes) into `own` "
      "and `out`.");
  m.def(
      "_staged_encode",
      [](const at::Tensor& x, const std::string& wire, const at::Tensor& out) {
        TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "fastcomm: x must be contiguous float32 on the GPU");
        hierk::packToStaging(wireOf(wire), 4, x.data_ptr(), out.data_ptr(), 0, onePiece(x.numel()),
                             0, 1, at::cuda::getCurrentCUDAStream());
      },
      "x coded into `out` by the kernel of P, as one piece.");
  m.def(
      "_staged_decode",
      [](const at::Tensor& coded, const std::string& wire, const at::Tensor& x) {
        TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "fastcomm: x must be contiguous float32 on the GPU");
        hierk::gatherFromStaging(wireOf(wire), 4, coded.data_ptr(), 0, x.data_ptr(),
                                 onePiece(x.numel()), 0, 1, at::cuda::getCurrentCUDAStream());
      },
      "`coded` decoded into x by the kernel of B, as one piece.");
}

}  // namespace
#endif

namespace fastcomm {
namespace testing {
namespace {

WireDtype codecOf(const std::string& w) {
  const WireDtype d = parseWireDtype(w);
  TORCH_CHECK(d != WireDtype::None, "fastcomm: wire must be bf16, fp16 or int8, not ", w);
  return d;
}

void checkFloatsOnHost(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "fastcomm: values must be contiguous float32 on the CPU");
}

}  // namespace

void bindStagedKernels(py::module_& m) {
  m.def(
      "_wire_encode",
      [](const at::Tensor& x, const std::string& wire) {
        checkFloatsOnHost(x);
        const WireCodec codec(codecOf(wire));
        at::Tensor out = at::empty({codec.bytes(x.numel())}, at::kByte);
        if (x.numel() > 0) codec.encode(x.data_ptr<float>(), x.numel(), out.data_ptr());
        return out;
      },
      "x coded by the host wire codec (plans/wire_codec.hpp), as bytes.", py::arg("x"),
      py::arg("wire"));
  m.def(
      "_wire_decode",
      [](const at::Tensor& coded, int64_t n, const std::string& wire) {
        const WireCodec codec(codecOf(wire));
        TORCH_CHECK(coded.device().is_cpu() && coded.scalar_type() == at::kByte &&
                        coded.is_contiguous() && coded.numel() == codec.bytes(n),
                    "fastcomm: ", n, " coded values are ", codec.bytes(n), " contiguous bytes");
        at::Tensor x = at::empty({n}, at::kFloat);
        if (n > 0) codec.decode(coded.data_ptr(), n, x.data_ptr<float>());
        return x;
      },
      "n values decoded by the host wire codec from `coded`.", py::arg("coded"), py::arg("n"),
      py::arg("wire"));
  m.def(
      "_hier_layout",
      [](int64_t shard, int rails, int64_t chunkBytes, int64_t esize) {
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
          chunks.append(c);
        }
        d["chunks"] = chunks;
        return d;
      },
      "the chunk/piece layout of the CUDA multi-node all_reduce.", py::arg("shard"),
      py::arg("rails"), py::arg("chunk_bytes"), py::arg("esize"));
#ifdef FASTCOMM_WITH_CUDA
  bindKernels(m);
#endif
}

}  // namespace testing
}  // namespace fastcomm
