#include "intra/nvlink/nvlink_allreduce.hpp"

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/deadline.hpp"
#include "common/logging.hpp"
#include "kernels/nvlink_allreduce.hpp"

namespace fastcomm {

namespace {

// How long a rank that destroys a healthy group waits for its peers to unmap
// its buffer before it gives the buffer up unfreed.
constexpr int64_t kReleaseWait = 5000;  // ms

nvlk::Elem elemOf(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return nvlk::Elem::F32;
    case at::kHalf:
      return nvlk::Elem::F16;
    case at::kBFloat16:
      return nvlk::Elem::BF16;
    default:
      break;
  }
  throw std::invalid_argument(std::string("fastcomm: internal: NVLink all_reduce of ") +
                              c10::toString(t));
}

nvlk::Op opOf(RedOp op) {
  switch (op) {
    case RedOp::Sum:
    case RedOp::Avg:
      return nvlk::Op::Sum;
    case RedOp::Min:
      return nvlk::Op::Min;
    case RedOp::Max:
      return nvlk::Op::Max;
    default:
      break;
  }
  throw std::invalid_argument(std::string("fastcomm: internal: NVLink all_reduce with ") +
                              redOpName(op));
}

}  // namespace

NvlinkAllreduce::NvlinkAllreduce(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout,
                                 std::unique_ptr<SignalPads> pads)
    : store_(store), rank_(rank), size_(size), timeout_(timeout), pads_(std::move(pads)) {}

NvlinkAllreduce::~NvlinkAllreduce() { shutdown(true); }

void NvlinkAllreduce::shutdown(bool failed) {
  if (!buffers_) return;
  if (failed) pads_->abort();
  buffers_->closePeers();
  // Ranks of a healthy group destroy it at about the same time; one that
  // lags past the bound costs this rank its buffer, unfreed, rather than a
  // longer wait. A failed group frees at once: a peer may be gone.
  bool peersClosed = failed;
  if (!failed) {
    const std::string prefix = "fastcomm/nvlink/closed/";
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back(prefix + std::to_string(r));
    try {
      store_->set(keys[static_cast<size_t>(rank_)], std::vector<uint8_t>{'1'});
      store_->wait(keys, std::min(timeout_, std::chrono::milliseconds(kReleaseWait)));
      peersClosed = true;
    } catch (const std::exception& e) {
      FASTCOMM_LOG(Debug, "NVLink all_reduce buffer left unfreed: not every peer unmapped it ("
                              << errorText(e) << ")");
    }
  }
  buffers_->releaseOwn(peersClosed);
  buffers_.reset();
}

std::unique_ptr<NvlinkAllreduce> NvlinkAllreduce::create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, at::Device device,
    std::chrono::milliseconds timeout) {
  c10::cuda::CUDAGuard guard(device);
  const auto ctx = OpContext::start("NVLink all_reduce setup", 0, timeout);
  std::unique_ptr<SignalPads> pads;
  std::string refusal;
  try {
    pads = std::make_unique<SignalPads>();
    nvlk::preload();
  } catch (const std::exception& e) {
    cudaGetLastError();
    refusal = e.what();
  }
  std::string why;
  auto buffers =
      PeerBuffers::exchange(store, rank, size, SignalPads::bufferBytes(size, nvlinkSlotBytes(size)),
                            device, ctx, refusal, &why);
  if (!buffers) {
    if (rank == 0) {
      FASTCOMM_LOG(Info,
                   "CUDA all_reduces inside the node stay on NCCL: the NVLink path is "
                   "unavailable on "
                       << why);
    }
    return nullptr;
  }
  std::unique_ptr<NvlinkAllreduce> n(
      new NvlinkAllreduce(store, rank, size, timeout, std::move(pads)));
  n->buffers_ = std::move(buffers);
  if (rank == 0) FASTCOMM_LOG(Info, n->describe());
  return n;
}

NvlinkAlgo NvlinkAllreduce::choose(const at::Tensor& t, RedOp op) const {
  return chooseNvlinkAllreduce(t.scalar_type(), op,
                               t.numel() * static_cast<int64_t>(t.element_size()), size_);
}

void NvlinkAllreduce::allreduce(const at::Tensor& in, const at::Tensor& out, RedOp op,
                                NvlinkAlgo algo, cudaStream_t stream, uint64_t seq, bool captured) {
  TORCH_CHECK(algo != NvlinkAlgo::None && in.numel() == out.numel() &&
                  in.scalar_type() == out.scalar_type() &&
                  in.numel() * static_cast<int64_t>(in.element_size()) <= nvlinkSlotBytes(size_),
              "fastcomm: internal: NVLink all_reduce of ", in.numel(), " elements");
  nvlk::Args a{};
  for (int r = 0; r < size_; ++r) a.bufs[r] = buffers_->base(r);
  a.in = in.data_ptr();
  a.out = out.data_ptr();
  a.n = in.numel();
  a.slotBytes = nvlinkSlotBytes(size_);
  a.rank = rank_;
  a.world = size_;
  a.divisor = op == RedOp::Avg ? static_cast<float>(size_) : 0.f;
  a.ctl = pads_->deviceCtl();
  a.seq = seq;
  a.timeoutNs = static_cast<uint64_t>(timeout_.count()) * 1000000ULL;
  a.captured = captured ? 1 : 0;
  try {
    nvlk::allreduce(elemOf(in.scalar_type()), opOf(op),
                    algo == NvlinkAlgo::OneShot ? nvlk::Algo::OneShot : nvlk::Algo::TwoShot, a,
                    stream);
  } catch (const std::runtime_error& e) {
    throwCommError(e.what());
  }
}

std::string NvlinkAllreduce::describe() const {
  const NvlinkLimits l = nvlinkLimits(size_);
  std::ostringstream os;
  os << "CUDA all_reduce inside the node over NVLink peer memory (" << size_
     << " GPUs, float32/float16/bfloat16 SUM/AVG/MIN/MAX): one-shot up to " << l.oneShotBytes
     << " B, two-shot up to " << l.twoShotBytes << " B, NCCL above; " << (buffers_->bytes() >> 10)
     << " KiB registered per rank";
  return os.str();
}

}  // namespace fastcomm
