#include "backend/device_path.hpp"

#include <c10/util/Exception.h>

namespace fastcomm {

std::string NoCudaPath::describe() const { return "unsupported (CPU-only build)"; }

void NoCudaPath::refuse(at::Device device) {
  TORCH_CHECK(false, "fastcomm was built without CUDA support, so it cannot run collectives on ",
              device, " tensors; reinstall it where torch has CUDA and nvcc is found");
}

void NoCudaPath::connect(at::Device device) { refuse(device); }

DevicePath::WorkPtr NoCudaPath::broadcast(const OpCall&, const Tensors& tensors, int) {
  refuse(tensors.at(0).device());
}

DevicePath::WorkPtr NoCudaPath::allreduce(const OpCall&, const Tensors& tensors, RedOp) {
  refuse(tensors.at(0).device());
}

DevicePath::WorkPtr NoCudaPath::reduce(const OpCall&, const Tensors& tensors, RedOp, int) {
  refuse(tensors.at(0).device());
}

DevicePath::WorkPtr NoCudaPath::allgather(const OpCall&, const Tensors&, const at::Tensor& input) {
  refuse(input.device());
}

DevicePath::WorkPtr NoCudaPath::allgatherCoalesced(const OpCall&, const Tensors&,
                                                   const Tensors& inputs) {
  refuse(inputs.at(0).device());
}

DevicePath::WorkPtr NoCudaPath::gather(const OpCall&, const Tensors&, const at::Tensor& input,
                                       int) {
  refuse(input.device());
}

DevicePath::WorkPtr NoCudaPath::scatter(const OpCall&, const at::Tensor& output, const Tensors&,
                                        int) {
  refuse(output.device());
}

DevicePath::WorkPtr NoCudaPath::reduceScatter(const OpCall&, const at::Tensor& output,
                                              const Tensors&, RedOp) {
  refuse(output.device());
}

DevicePath::WorkPtr NoCudaPath::reduceScatterCoalesced(const OpCall&, const Tensors&,
                                                       const Tensors& inputs, RedOp) {
  refuse(inputs.at(0).device());
}

DevicePath::WorkPtr NoCudaPath::alltoall(const OpCall&, const Tensors&, const Tensors& inputs,
                                         const std::vector<int64_t>&, const std::vector<int64_t>&) {
  refuse(inputs.at(0).device());
}

DevicePath::WorkPtr NoCudaPath::send(const OpCall&, const at::Tensor& tensor, int, int) {
  refuse(tensor.device());
}

DevicePath::WorkPtr NoCudaPath::recv(const OpCall&, const at::Tensor& tensor, int, int) {
  refuse(tensor.device());
}

}  // namespace fastcomm
