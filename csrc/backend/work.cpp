#include "backend/work.hpp"

#include <ATen/core/jit_type.h>

#include <algorithm>

namespace fastcomm {

namespace {

// The CUDA devices of `tensors`: a future whose value holds CUDA tensors must
// know them (CUDA tensors staged through host memory complete on the host).
std::vector<c10::Device> cudaDevices(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors)
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  return devices;
}

}  // namespace

HostWork::HostWork(int rank, c10d::OpType type, const char* profilingTitle, uint64_t seq,
                   const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs)
    : Work(rank, type, profilingTitle, std::optional<std::vector<at::Tensor>>(inputs)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), cudaDevices(outputs_))),
      seq_(seq) {}

int HostWork::sourceRank() const {
  const int src = sourceRank_.load();
  TORCH_CHECK(src >= 0,
              "fastcomm: sourceRank() is only valid for a completed recv from any source");
  return src;
}

void HostWork::complete() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void HostWork::fail(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
}

GroupedWork::GroupedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> parts,
                         std::vector<at::Tensor> outputs, const char* profilingTitle,
                         const std::vector<at::Tensor>& inputs)
    : Work(rank, c10d::OpType::COALESCED, profilingTitle,
           std::optional<std::vector<at::Tensor>>(inputs)),
      parts_(std::move(parts)),
      outputs_(std::move(outputs)) {
  if (recordFunctionEndCallback_) {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
        c10::FutureType::create(c10::ListType::create(c10::TensorType::get())));
    for (auto& p : parts_) futures.push_back(p->getFuture());
    c10::collectAll(futures)->addCallback(
        [end = std::move(recordFunctionEndCallback_)](c10::ivalue::Future&) { end(); });
    recordFunctionEndCallback_ = nullptr;
  }
}

bool GroupedWork::isCompleted() {
  for (auto& p : parts_)
    if (!p->isCompleted()) return false;
  return true;
}

bool GroupedWork::isSuccess() const {
  for (const auto& p : parts_)
    if (!p->isSuccess()) return false;
  return true;
}

std::exception_ptr GroupedWork::exception() const {
  for (const auto& p : parts_)
    if (auto e = p->exception()) return e;
  return nullptr;
}

bool GroupedWork::wait(std::chrono::milliseconds timeout) {
  for (auto& p : parts_) p->wait(timeout);
  return true;
}

void GroupedWork::synchronize() {
  for (auto& p : parts_) p->synchronize();
}

c10::intrusive_ptr<c10::ivalue::Future> GroupedWork::getFuture() {
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
      c10::FutureType::create(c10::ListType::create(c10::TensorType::get())));
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> parts;
  for (auto& p : parts_) {
    parts.push_back(p->getFuture());
    futures.push_back(parts.back());
  }
  // CUDA parts complete on their streams, not on the host: the group's future
  // must be CUDA-aware too, or a waiter (and a CUDA graph capture) would not
  // be ordered after them.
  std::vector<c10::Device> devices;
  for (const auto& t : outputs_)
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  auto result = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  auto outputs = outputs_;
  c10::collectAll(futures)->addCallback([result, parts, outputs](c10::ivalue::Future&) {
    for (const auto& f : parts) {
      if (f->hasError()) {  // the first part's error
        result->setError(f->exception_ptr());
        return;
      }
    }
    // Stream waits only (every part is complete on the host): the events
    // markCompleted records then follow all parts.
    for (const auto& f : parts) f->wait();
    result->markCompleted(c10::IValue(outputs));
  });
  return result;
}

}  // namespace fastcomm
