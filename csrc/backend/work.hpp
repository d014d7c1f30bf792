// Work objects returned by fastcomm collectives.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <vector>

namespace fastcomm {

// A collective run on a host lane (CPU tensors, or CUDA tensors staged
// through host memory). Completes from the lane.
class HostWork : public c10d::Work {
 public:
  HostWork(int rank, c10d::OpType type, const char* profilingTitle, uint64_t seq,
           const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs);

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  int sourceRank() const override;
  uint64_t getSequencenumber() const override { return seq_; }

  void complete();
  void fail(std::exception_ptr error);
  void setSourceRank(int rank) { sourceRank_ = rank; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  uint64_t seq_;
  std::atomic<int> sourceRank_{-1};
};

// Completes when every one of `parts` completed (coalesced host ops). Given a
// profiling title, the group is one profiler range over `inputs` that ends
// with its last part (one call of torch's API, one range, however many parts).
class GroupedWork : public c10d::Work {
 public:
  GroupedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> parts,
              std::vector<at::Tensor> outputs, const char* profilingTitle = nullptr,
              const std::vector<at::Tensor>& inputs = {});
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
  std::vector<at::Tensor> outputs_;
};

}  // namespace fastcomm
