#include "backend/work.hpp"

#include <ATen/core/jit_type.h>

namespace fastcomm {

HostWork::HostWork(int rank, c10d::OpType type, const char* profilingTitle, uint64_t seq,
                   const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs)
    : Work(rank, type, profilingTitle, std::optional<std::vector<at::Tensor>>(inputs)),
      outputs_(std::move(outputs)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
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
                         std::vector<at::Tensor> outputs)
    : Work(rank, c10d::OpType::COALESCED), parts_(std::move(parts)), outputs_(std::move(outputs)) {}

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
  for (auto& p : parts_) futures.push_back(p->getFuture());
  auto all = c10::collectAll(futures);
  auto outputs = outputs_;
  return all->then(
      [outputs](c10::ivalue::Future& f) {
        // Propagate the first part's error, if any.
        for (const auto& part : f.value().toList()) {
          auto fut = part.get().toFuture();
          if (fut->hasError()) fut->value();  // rethrows
        }
        return c10::IValue(outputs);
      },
      c10::ListType::create(c10::TensorType::get()));
}

}  // namespace fastcomm
