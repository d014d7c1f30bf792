#include "backend/cuda/host_staging.hpp"

#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <string>
#include <thread>

#include "backend/cuda/cuda_collectives.hpp"

namespace fastcomm {

HostStaging::HostStaging(at::Device device, c10::cuda::CUDAStream stream)
    : device_(device), stream_(stream) {}

HostStaging::Mirror& HostStaging::mirrorOf(const at::Tensor& device) {
  for (auto& m : mirrors_)
    if (m.device.is_same(device)) return m;
  Mirror m;
  m.device = device;
  m.host = at::empty(device.sizes(), device.options().device(at::kCPU).pinned_memory(true));
  mirrors_.push_back(std::move(m));
  return mirrors_.back();
}

std::shared_ptr<HostStaging> HostStaging::begin(const char* op,
                                                const std::vector<at::Tensor>& inputs,
                                                const std::vector<at::Tensor>& outputs) {
  at::Device device = inputs.empty() ? outputs.at(0).device() : inputs[0].device();
  // Before any CUDA call: an event record, a pinned allocation or a copy
  // would invalidate the capture, and the host plan cannot be replayed.
  TORCH_CHECK(!CudaCollectives::currentStreamCapturing(device), "fastcomm: ", op,
              " cannot be captured into a CUDA graph with FASTCOMM_CUDA_INTER=host: across "
              "nodes it is staged through host memory and run by the host plan, which a graph "
              "cannot replay (only all_reduce keeps a capturable path); capture it with "
              "FASTCOMM_CUDA_INTER=nccl or run it outside the graph");
  c10::cuda::CUDAGuard guard(device);
  auto s =
      std::make_shared<HostStaging>(device, c10::cuda::getStreamFromPool(false, device.index()));
  for (const auto& t : inputs) s->mirrorOf(t).in = true;
  for (const auto& t : outputs) s->mirrorOf(t).out = true;
  // The side stream starts after the work queued so far on the current
  // stream (which produced the inputs and last used the outputs); the copy
  // back of the outputs is queued behind this wait too.
  at::cuda::CUDAEvent queued;
  queued.record(c10::cuda::getCurrentCUDAStream(device.index()));
  queued.block(s->stream_);
  {
    c10::cuda::CUDAStreamGuard onSide(s->stream_);
    at::NoGradGuard noGrad;  // the mirrors are plain buffers, not part of a graph
    for (auto& m : s->mirrors_)
      if (m.in) m.host.copy_(m.device, /*non_blocking=*/true);
  }
  s->inputsCopied_.record(s->stream_);
  return s;
}

at::Tensor HostStaging::host(const at::Tensor& device) const {
  for (const auto& m : mirrors_)
    if (m.device.is_same(device)) return m.host;
  TORCH_CHECK(false, "fastcomm: internal error: a CUDA tensor without its host mirror");
}

void HostStaging::await(at::cuda::CUDAEvent& done, const OpContext& ctx, const char* what) {
  // Polled, not cudaEventSynchronize: a GPU that never gets there (a stuck
  // kernel ahead on the current stream) must end in a timeout error.
  auto sleep = std::chrono::microseconds(2);
  while (!done.query()) {
    if (ctx.expired()) {
      // The copies may still run: keep the CUDA memory they touch from being
      // reused while they do.
      for (auto& m : mirrors_) m.device.record_stream(at::Stream(stream_));
      throwCommError("fastcomm: " + ctx.describe() + ": " + what + " (FASTCOMM_CUDA_INTER=host) " +
                     "did not finish within the timeout of " + std::to_string(ctx.timeout.count()) +
                     " ms; is the GPU stuck in earlier work of the current stream?");
    }
    std::this_thread::sleep_for(sleep);
    if (sleep < std::chrono::microseconds(200)) sleep *= 2;
  }
}

void HostStaging::waitForInputs(const OpContext& ctx) {
  await(inputsCopied_, ctx, "copying the CUDA inputs to host memory");
}

void HostStaging::copyOutputsBack(const OpContext& ctx) {
  c10::cuda::CUDAGuard guard(device_);
  {
    c10::cuda::CUDAStreamGuard onSide(stream_);
    // Collectives write leaf tensors that require grad too (NCCL does so
    // behind autograd's back); an in-place copy_ there would be refused.
    at::NoGradGuard noGrad;
    for (auto& m : mirrors_)
      if (m.out) m.device.copy_(m.host, /*non_blocking=*/true);
  }
  outputsCopied_.record(stream_);
  await(outputsCopied_, ctx, "copying the outputs from host memory back to the GPU");
}

}  // namespace fastcomm
