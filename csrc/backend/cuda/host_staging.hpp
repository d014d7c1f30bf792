// CUDA tensors of one collective staged through pinned host memory, so that
// the host plan (shared memory inside a node, fastcomm's transport across
// nodes) can run the collective on them (FASTCOMM_CUDA_INTER=host).
//
// On the caller's thread, begin() refuses a CUDA graph capture (nothing here
// can be captured), records an event on the current stream and copies the
// inputs into pinned host mirrors on a side stream that waits for it. On the
// host lane, waitForInputs() polls for those copies until the op's deadline,
// the host body runs on the mirrors, and copyOutputsBack() copies the output
// mirrors into the CUDA tensors and waits for that, so the work completes only
// once its outputs are on the GPU.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <utility>
#include <vector>

#include "backend/host_path.hpp"
#include "common/deadline.hpp"

namespace fastcomm {

class HostStaging : public HostMirrors {
 public:
  // `inputs` are read by the collective, `outputs` written by it; a tensor in
  // both lists gets one mirror, copied in and back.
  static std::shared_ptr<HostStaging> begin(const char* op, const std::vector<at::Tensor>& inputs,
                                            const std::vector<at::Tensor>& outputs);

  // The pinned, contiguous mirror of `device` (one of the staged tensors).
  at::Tensor host(const at::Tensor& device) const override;

  void waitForInputs(const OpContext& ctx) override;
  void copyOutputsBack(const OpContext& ctx) override;

  HostStaging(at::Device device, c10::cuda::CUDAStream stream);

 private:
  struct Mirror {
    at::Tensor device, host;
    bool in = false, out = false;
  };
  Mirror& mirrorOf(const at::Tensor& device);
  // Polls `done` until it completed or the op's deadline passed.
  void await(at::cuda::CUDAEvent& done, const OpContext& ctx, const char* what);

  at::Device device_;
  c10::cuda::CUDAStream stream_;
  std::vector<Mirror> mirrors_;
  at::cuda::CUDAEvent inputsCopied_, outputsCopied_;
};

}  // namespace fastcomm
