#include "intra/nvlink/nvlink_collectives.hpp"

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/deadline.hpp"
#include "common/logging.hpp"
#include "kernels/nvlink_collectives.hpp"

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
  throw std::invalid_argument(std::string("fastcomm: internal: NVLink reduction of ") +
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
  throw std::invalid_argument(std::string("fastcomm: internal: NVLink reduction with ") +
                              redOpName(op));
}

}  // namespace

NvlinkCollectives::NvlinkCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                     int size, std::chrono::milliseconds timeout,
                                     std::unique_ptr<SignalPads> pads)
    : store_(store), rank_(rank), size_(size), timeout_(timeout), pads_(std::move(pads)) {}

NvlinkCollectives::~NvlinkCollectives() { shutdown(true); }

void NvlinkCollectives::shutdown(bool failed) {
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

std::unique_ptr<NvlinkCollectives> NvlinkCollectives::create(
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
  std::unique_ptr<NvlinkCollectives> n(
      new NvlinkCollectives(store, rank, size, timeout, std::move(pads)));
  n->buffers_ = std::move(buffers);
  if (rank == 0) FASTCOMM_LOG(Info, n->describe());
  return n;
}

NvlinkAlgo NvlinkCollectives::choose(const at::Tensor& t, RedOp op) const {
  return chooseNvlinkAllreduce(t.scalar_type(), op,
                               t.numel() * static_cast<int64_t>(t.element_size()), size_);
}

nvlk::Args NvlinkCollectives::args(nvlk::Collective collective, const at::Tensor& in,
                                   const at::Tensor& out, int64_t n, RedOp op, uint64_t seq,
                                   bool captured) const {
  nvlk::Args a{};
  for (int r = 0; r < size_; ++r) a.bufs[r] = buffers_->base(r);
  a.in = in.data_ptr();
  a.out = out.data_ptr();
  a.n = n;
  a.slotBytes = nvlinkSlotBytes(size_);
  a.rank = rank_;
  a.world = size_;
  a.divisor = op == RedOp::Avg ? static_cast<float>(size_) : 0.f;
  a.ctl = pads_->deviceCtl();
  a.seq = seq;
  a.timeoutNs = static_cast<uint64_t>(timeout_.count()) * 1000000ULL;
  a.captured = captured ? 1 : 0;
  a.collective = static_cast<int>(collective);
  return a;
}

void NvlinkCollectives::allreduce(const at::Tensor& in, const at::Tensor& out, RedOp op,
                                  NvlinkAlgo algo, cudaStream_t stream, uint64_t seq,
                                  bool captured) {
  const int64_t slot = nvlinkSlotBytes(size_);
  const int64_t maxBytes = algo == NvlinkAlgo::OneShot ? nvlk::oneShotMaxBytes(slot)
                                                       : nvlk::twoShotMaxBytes(size_, slot);
  TORCH_CHECK(algo != NvlinkAlgo::None && in.numel() == out.numel() &&
                  in.scalar_type() == out.scalar_type() &&
                  in.numel() * static_cast<int64_t>(in.element_size()) <= maxBytes,
              "fastcomm: internal: NVLink all_reduce of ", in.numel(), " elements");
  try {
    nvlk::reduce(elemOf(in.scalar_type()), opOf(op),
                 algo == NvlinkAlgo::OneShot ? nvlk::Algo::OneShot : nvlk::Algo::TwoShot,
                 args(nvlk::Collective::AllReduce, in, out, in.numel(), op, seq, captured), stream);
  } catch (const std::runtime_error& e) {
    throwCommError(e.what());
  }
}

bool NvlinkCollectives::takesAllgather(const at::Tensor& input) const {
  return useNvlinkAllgather(input.numel() * static_cast<int64_t>(input.element_size()), size_);
}

bool NvlinkCollectives::takesReduceScatter(const at::Tensor& output, RedOp op) const {
  return useNvlinkReduceScatter(output.scalar_type(), op,
                                output.numel() * static_cast<int64_t>(output.element_size()),
                                size_);
}

void NvlinkCollectives::allgather(const at::Tensor& in, const at::Tensor& out, cudaStream_t stream,
                                  uint64_t seq, bool captured) {
  const int64_t bytes = in.numel() * static_cast<int64_t>(in.element_size());
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous() && out.numel() == size_ * in.numel() &&
                  in.scalar_type() == out.scalar_type() && bytes <= nvlinkSlotBytes(size_),
              "fastcomm: internal: NVLink all_gather of ", in.numel(), " elements");
  try {
    nvlk::allgather(args(nvlk::Collective::AllGather, in, out, bytes, RedOp::Sum, seq, captured),
                    stream);
  } catch (const std::runtime_error& e) {
    throwCommError(e.what());
  }
}

void NvlinkCollectives::reduceScatter(const at::Tensor& in, const at::Tensor& out, RedOp op,
                                      cudaStream_t stream, uint64_t seq, bool captured) {
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous() && in.numel() == size_ * out.numel() &&
                  in.scalar_type() == out.scalar_type() &&
                  out.numel() * static_cast<int64_t>(out.element_size()) <= nvlinkSlotBytes(size_),
              "fastcomm: internal: NVLink reduce_scatter of ", out.numel(), " elements");
  try {
    nvlk::reduce(elemOf(out.scalar_type()), opOf(op), nvlk::Algo::ReduceScatter,
                 args(nvlk::Collective::ReduceScatter, in, out, out.numel(), op, seq, captured),
                 stream);
  } catch (const std::runtime_error& e) {
    throwCommError(e.what());
  }
}

std::string NvlinkCollectives::describe() const {
  const NvlinkLimits l = nvlinkLimits(size_);
  std::ostringstream os;
  os << "CUDA collectives inside the node over NVLink peer memory (" << size_
     << " GPUs): all_reduce (float32/float16/bfloat16 SUM/AVG/MIN/MAX) one-shot up to "
     << l.oneShotBytes << " B, two-shot up to " << l.twoShotBytes
     << " B; all_gather (any dtype) up to " << l.gatherBytes << " B and reduce_scatter up to "
     << l.scatterBytes << " B per rank; NCCL above; " << (buffers_->bytes() >> 10)
     << " KiB registered per rank";
  return os.str();
}

}  // namespace fastcomm
