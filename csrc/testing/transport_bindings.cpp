// torchext._testing._TransportEndpoint: one transport connected to every other rank,
// so that tests/test_transport.py can drive any transport (tcp, ib)
// directly, below the process group. Private: not part of the public API.
#include "testing/bindings.hpp"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/python.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <utility>

#include "inter/transport.hpp"

namespace py = pybind11;

namespace fastcomm {
namespace {

using transport::Connection;
using transport::Request;
using transport::Transport;
using transport::TransportError;

// CUDA tensors only where a registration goes with them (GPUDirect RDMA);
// the caller synchronizes the producing stream first.
char* bufferOf(const at::Tensor& t, const char* what, bool allowCuda = false) {
  TORCH_CHECK(t.device().is_cpu() || (allowCuda && t.device().is_cuda()), "_TransportEndpoint.",
              what,
              allowCuda ? ": the tensor must be on the CPU or a CUDA device"
                        : ": the tensor must be on the CPU (CUDA tensors need a registration)");
  TORCH_CHECK(t.is_contiguous(), "_TransportEndpoint.", what, ": the tensor must be contiguous");
  return static_cast<char*>(t.data_ptr());
}

class Endpoint {
 public:
  Endpoint(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
           const std::string& name, std::chrono::milliseconds timeout, std::string prefix)
      : rank_(rank), size_(size), timeout_(timeout) {
    static std::atomic<int> counter{0};
    // Endpoints are created in the same order on every rank, so a counter
    // gives each one its own keys in a shared store.
    if (prefix.empty()) prefix = "fastcomm_transport_endpoint/" + std::to_string(counter++);
    transport_ = transport::createTransport(name, Config::fromEnv());
    std::vector<int> peers;
    for (int r = 0; r < size; ++r) {
      if (r != rank) peers.push_back(r);
    }
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    auto conns = transport_->connect(prefixed, rank, size, peers,
                                     OpContext::start("transport connect", 0, timeout));
    for (auto& c : conns) conns_[c->peer()] = std::move(c);
  }

  Transport& transport() {
    TORCH_CHECK(transport_, "_TransportEndpoint: closed");
    return *transport_;
  }

  Connection& conn(int peer) {
    auto it = conns_.find(peer);
    TORCH_CHECK(it != conns_.end(), "_TransportEndpoint: rank ", peer, " is not a peer of rank ",
                rank_);
    return *it->second;
  }

  std::unique_ptr<Request> post(int peer, const at::Tensor& t, bool send,
                                const transport::MemoryRegion* mr = nullptr) {
    char* p = bufferOf(t, send ? "isend" : "irecv", mr != nullptr);
    auto nbytes = static_cast<int64_t>(t.nbytes());
    return send ? conn(peer).isend(p, nbytes, mr) : conn(peer).irecv(p, nbytes, mr);
  }

  // Posts (retrying while the connection is full) and waits.
  void blocking(int peer, const at::Tensor& t, bool send) {
    auto ctx = OpContext::start(send ? "send" : "recv", seq_++, timeout_);
    std::unique_ptr<Request> r;
    while (!(r = post(peer, t, send))) {
      if (ctx.expired()) throwCommError("fastcomm: " + ctx.describe() + ": connection stays full");
      transport().waitForProgress(std::chrono::milliseconds(10));
    }
    transport::waitAll(transport(), {r.get()}, {peer}, ctx);
  }

  // Posts all receives and sends, each connection and direction in list
  // order, keeping at most kMaxRequestsInFlight outstanding ("retry later"
  // answers are retried after earlier requests completed). Returns how many
  // times a post was answered "retry later".
  int64_t exchange(const std::vector<std::pair<int, at::Tensor>>& sends,
                   const std::vector<std::pair<int, at::Tensor>>& recvs) {
    auto ctx = OpContext::start("exchange", seq_++, timeout_);
    struct Item {
      Item(int p, at::Tensor t, bool s) : peer(p), tensor(std::move(t)), send(s) {}
      int peer;
      at::Tensor tensor;
      bool send;
      std::unique_ptr<Request> req;
      bool done = false;
    };
    std::vector<Item> items;
    for (auto& [p, t] : recvs) items.emplace_back(p, t, false);
    for (auto& [p, t] : sends) items.emplace_back(p, t, true);
    std::map<std::pair<int, bool>, std::vector<size_t>> queues;  // (peer, send) -> items
    for (size_t i = 0; i < items.size(); ++i) {
      conn(items[i].peer);  // validates the peer before anything is posted
      queues[{items[i].peer, items[i].send}].push_back(i);
    }
    std::map<std::pair<int, bool>, size_t> cursor;
    int64_t retries = 0;
    for (;;) {
      bool allPosted = true;
      for (auto& [key, q] : queues) {
        size_t& c = cursor[key];
        while (c < q.size()) {
          Item& it = items[q[c]];
          it.req = post(it.peer, it.tensor, it.send);
          if (!it.req) {
            ++retries;
            break;
          }
          ++c;
        }
        allPosted = allPosted && c == q.size();
      }
      std::vector<Request*> reqs;
      std::vector<int> peers;
      bool allDone = true;
      for (auto& it : items) {
        if (!it.req || it.done) continue;
        try {
          it.done = it.req->test();
        } catch (const TransportError& e) {
          throwCommError("fastcomm: " + ctx.describe() + " failed: " + e.what());
        }
        allDone = allDone && it.done;
        if (!it.done) peers.push_back(it.peer);
      }
      if (allPosted && allDone) return retries;
      if (ctx.expired()) {
        std::sort(peers.begin(), peers.end());
        peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
        throwCommError("fastcomm: " + ctx.describe() + " timed out after " +
                       std::to_string(timeout_.count()) + " ms waiting for rank(s) " +
                       formatRanks(peers));
      }
      transport().waitForProgress(std::chrono::milliseconds(50));
    }
  }

  void close() {
    if (transport_) transport_->close();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  uint64_t nextSeq() { return seq_++; }

 private:
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  uint64_t seq_ = 1;
  std::unique_ptr<Transport> transport_;
  std::map<int, std::unique_ptr<Connection>> conns_;
};

// A registered tensor (Transport::registerMemory); keeps the tensor alive.
struct Memory {
  std::shared_ptr<Endpoint> ep;
  std::unique_ptr<transport::MemoryRegion> mr;
  at::Tensor tensor;
};

// A request from isend/irecv; keeps its tensor, its registration and the
// endpoint alive.
struct Handle {
  std::shared_ptr<Endpoint> ep;
  std::unique_ptr<Request> req;
  at::Tensor tensor;
  int peer;
  std::shared_ptr<Memory> mem;
};

}  // namespace

namespace testing {

void bindTransport(py::module_& m) {
  py::register_exception<TransportError>(m, "_TransportError", PyExc_RuntimeError);
  m.attr("_TRANSPORT_MAX_IN_FLIGHT") = transport::kMaxRequestsInFlight;
  m.def(
      "_transport_usable",
      [](const std::string& name) {
        std::string why;
        bool ok = transport::transportUsable(name, Config::fromEnv(), &why);
        return std::make_pair(ok, why);
      },
      "(usable, why): whether this process could run transport `name` under its environment.");

  py::class_<Handle, std::shared_ptr<Handle>>(m, "_TransportHandle")
      .def(
          "test", [](Handle& h) { return h.req->test(); },
          "True once complete; raises _TransportError when the connection broke.")
      .def("wait", torch::wrap_pybind_function_no_gil([](Handle& h) {
             auto ctx = OpContext::start("wait", h.ep->nextSeq(), h.ep->timeout());
             transport::waitAll(h.ep->transport(), {h.req.get()}, {h.peer}, ctx);
           }))
      .def_readonly("peer", &Handle::peer);

  py::class_<Memory, std::shared_ptr<Memory>>(m, "_TransportMemory")
      .def_property_readonly("nbytes", [](Memory& mem) { return mem.mr->bytes(); });

  auto post = [](bool send) {
    return [send](std::shared_ptr<Endpoint> ep, int peer, at::Tensor t,
                  std::shared_ptr<Memory> mem) -> py::object {
      auto req = ep->post(peer, t, send, mem ? mem->mr.get() : nullptr);
      if (!req) return py::none();  // retry later: kMaxRequestsInFlight outstanding
      return py::cast(
          std::make_shared<Handle>(Handle{std::move(ep), std::move(req), t, peer, std::move(mem)}));
    };
  };

  py::class_<Endpoint, std::shared_ptr<Endpoint>>(m, "_TransportEndpoint")
      .def(py::init(torch::wrap_pybind_function_no_gil(
               [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  const std::string& name, std::chrono::milliseconds timeout,
                  const std::string& prefix) {
                 try {
                   return std::make_shared<Endpoint>(store, rank, size, name, timeout, prefix);
                 } catch (const std::invalid_argument& e) {
                   C10_THROW_ERROR(ValueError, e.what());  // ValueError in Python
                 }
               })),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("name") = "tcp",
           py::arg("timeout") = std::chrono::milliseconds(60000), py::arg("prefix") = "")
      .def("send", torch::wrap_pybind_function_no_gil(
                       [](Endpoint& ep, int peer, at::Tensor t) { ep.blocking(peer, t, true); }))
      .def("recv", torch::wrap_pybind_function_no_gil(
                       [](Endpoint& ep, int peer, at::Tensor t) { ep.blocking(peer, t, false); }))
      .def("isend", post(true), py::arg("peer"), py::arg("tensor"), py::arg("mr") = nullptr,
           "A handle, or None when the connection is full (retry later). `mr`: a registration "
           "(register_memory) covering the tensor.")
      .def("irecv", post(false), py::arg("peer"), py::arg("tensor"), py::arg("mr") = nullptr,
           "A handle, or None when the connection is full (retry later).")
      .def(
          "register_memory",
          [](std::shared_ptr<Endpoint> ep, at::Tensor t, bool device) {
            char* p = bufferOf(t, "register_memory", true);
            const auto n = static_cast<int64_t>(t.nbytes());
            auto mr = device ? ep->transport().registerDeviceMemory(p, n)
                             : ep->transport().registerMemory(p, n);
            return std::make_shared<Memory>(Memory{std::move(ep), std::move(mr), t});
          },
          py::arg("tensor"), py::arg("device") = false,
          "Registers the tensor's memory with the transport (ib: the registration cache; CUDA "
          "tensors as device memory). device=True: Transport::registerDeviceMemory, whatever "
          "the tensor is.")
      .def("counters", [](Endpoint& ep) { return ep.transport().counters(); })
      .def_property_readonly("supports_device_memory",
                             [](Endpoint& ep) { return ep.transport().supportsDeviceMemory(); })
      .def("exchange",
           torch::wrap_pybind_function_no_gil(
               [](Endpoint& ep, const std::vector<std::pair<int, at::Tensor>>& sends,
                  const std::vector<std::pair<int, at::Tensor>>& recvs) {
                 return ep.exchange(sends, recvs);
               }),
           py::arg("sends"), py::arg("recvs"),
           "Sends and receives lists of (peer, tensor); returns the number of 'retry later' "
           "answers.")
      .def("close", torch::wrap_pybind_function_no_gil([](Endpoint& ep) { ep.close(); }))
      .def_property_readonly("rank", &Endpoint::rank)
      .def_property_readonly("size", &Endpoint::size)
      .def_property_readonly("name", [](Endpoint& ep) { return ep.transport().name(); });
}

}  // namespace testing
}  // namespace fastcomm
