// The process group of a data-parallel run, its collectives and failure diagnosis.
#include "distributed/distributed.hpp"

#include "distributed/c10d_backends.hpp"

#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Logging.h>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

namespace flashdraft {

namespace {

constexpr auto kHeartbeat = std::chrono::milliseconds(500);

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int lo, int hi, const std::string& meaning) {
  const char* v = env(name);
  if (!v) throw std::runtime_error("environment variable " + std::string(name) + " is not set (" + meaning + ")");
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi)
    throw std::runtime_error("environment variable " + std::string(name) + " = \"" + v + "\" is not accepted (" +
                             meaning + ": an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "])");
  return static_cast<int>(x);
}

std::string first_line(const std::string& s) {
  const auto n = s.find('\n');
  return n == std::string::npos ? s : s.substr(0, n);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

Launch read_launch() {
  Launch l;
  const bool torchrun = env("WORLD_SIZE") != nullptr;
  const bool slurm = !torchrun && env("SLURM_NTASKS") && env("MASTER_ADDR");
  if (!torchrun && !slurm) return l;
  const char* world_var = torchrun ? "WORLD_SIZE" : "SLURM_NTASKS";
  l.world = env_int(world_var, 1, 1 << 20, "the number of processes");
  l.rank = env_int(torchrun ? "RANK" : "SLURM_PROCID", 0, l.world - 1,
                   "this process's rank, below " + std::string(world_var));
  l.local_rank = env(torchrun ? "LOCAL_RANK" : "SLURM_LOCALID")
                     ? env_int(torchrun ? "LOCAL_RANK" : "SLURM_LOCALID", 0, 1 << 16, "this process's GPU on its node")
                     : 0;
  l.source = torchrun ? "torchrun" : "slurm";
  if (l.world == 1) return l;
  const char* addr = env("MASTER_ADDR");
  if (!addr)
    throw std::runtime_error(
        "environment variable MASTER_ADDR is not set (the host of rank 0, where the processes "
        "meet; torchrun sets it, a Slurm script exports the first node's name)");
  l.master_addr = addr;
  l.port = env_int("MASTER_PORT", 1, 65535, "the port where the processes meet on MASTER_ADDR");
  return l;
}

c10::Device local_cuda_device(const Launch& launch) {
#ifdef FLASHDRAFT_ENGINE_CUDA
  const int count = static_cast<int>(torch::cuda::device_count());
  if (launch.local_rank >= count)
    throw std::runtime_error("LOCAL_RANK " + std::to_string(launch.local_rank) + " has no GPU: this node has " +
                             std::to_string(count) + " (start at most " + std::to_string(count) +
                             " processes per node: torchrun --nproc-per-node " + std::to_string(count) + ")");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(launch.local_rank));
#endif
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank));
}

// The store, the backend, and a heartbeat: every kHeartbeat this rank adds 1 to its
// counter in the store (through a connection of its own), so that a rank whose
// collective failed can tell the living from the dead.
struct Distributed::Impl {
  c10::intrusive_ptr<c10d::Store> store;  // the run's keys ("flashdraft/...")
  c10::intrusive_ptr<c10d::Backend> backend;
  c10::intrusive_ptr<c10d::Store> probe;  // heartbeats and failure messages
  c10::Device device = c10::kCPU;
  std::string where;  // "MASTER_ADDR:MASTER_PORT (hosted by ...)"
  bool rank0_hosts = false;
  std::mutex probe_mutex;
  std::mutex stop_mutex;
  std::condition_variable stop_cv;
  bool stopping = false;
  std::thread heartbeat;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(stop_mutex);
      stopping = true;
    }
    stop_cv.notify_all();
    if (heartbeat.joinable()) heartbeat.join();
    try {
      if (backend) backend->shutdown();  // NCCL: communicators released before exit
    } catch (const std::exception&) {
    }
  }

  void beat(int rank) {
    const std::string key = "alive/" + std::to_string(rank);
    std::unique_lock<std::mutex> lock(stop_mutex);
    while (!stopping) {
      try {
        std::lock_guard<std::mutex> p(probe_mutex);
        probe->add(key, 1);
      } catch (const std::exception&) {
        return;  // the store is gone; the next collective will say so
      }
      stop_cv.wait_for(lock, kHeartbeat, [this] { return stopping; });
    }
  }

  int64_t counter(int rank) {
    std::lock_guard<std::mutex> p(probe_mutex);
    return probe->add("alive/" + std::to_string(rank), 0);
  }

  at::Tensor on_backend(const at::Tensor& t) const { return t.to(device).contiguous(); }
};

std::unique_ptr<Distributed> Distributed::connect(const Launch& launch, const Config& table, c10::Device device) {
  auto d = std::make_unique<Distributed>();
  d->rank_ = launch.rank;
  d->world_ = launch.world;
  if (launch.world <= 1) return d;
  d->timeout_s_ = table.real("timeout");
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(d->timeout_s_ * 1000));
  std::string backend = table.string("backend");
  if (backend == "auto") backend = device.is_cuda() ? "nccl" : "gloo";
  if (backend == "nccl" && !device.is_cuda())
    table.fail("backend", "\"nccl\" runs on GPUs, but [run] device = \"cpu\"; use \"gloo\" (or \"auto\") on CPU");
  if (backend == "gloo" && device.is_cuda())
    table.fail("backend", "\"gloo\" is the CPU backend, but [run] device = \"cuda\"; use \"nccl\" (or \"auto\")");
  d->backend_ = backend;

  auto impl = std::make_unique<Impl>();
  impl->device = device;
  // torchrun's agent serves a store of its own at MASTER_ADDR:MASTER_PORT and says so;
  // otherwise rank 0 hosts it. Keys live under the prefix torch.distributed uses.
  const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent && std::string(agent) == "True";
  impl->rank0_hosts = !agent_store;
  impl->where = launch.master_addr + ":" + std::to_string(launch.port) +
                (agent_store ? " (torchrun's store)" : " (hosted by rank 0)");
  auto open_store = [&](bool server) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(launch.port);
    o.isServer = server;
    o.numWorkers = agent_store ? std::nullopt : std::optional<std::size_t>(launch.world);
    o.waitWorkers = false;
    o.timeout = timeout;
    return c10::make_intrusive<c10d::TCPStore>(launch.master_addr, o);
  };
  const char* attempt = env("TORCHELASTIC_RESTART_COUNT");
  const std::string prefix = "/worker/attempt_" + std::string(attempt ? attempt : "0") + "/flashdraft";
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    tcp = open_store(!agent_store && launch.rank == 0);
    impl->probe = c10::make_intrusive<c10d::PrefixStore>(prefix, open_store(false));
  } catch (const std::exception& e) {
    throw DistributedError("distributed: rank " + std::to_string(launch.rank) +
                           " cannot reach the rendezvous store at " + impl->where + " within " +
                           std::to_string(int(d->timeout_s_)) + " s: " + first_line(e.what()));
  }
  impl->store = c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
  try {
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg", impl->store);
    impl->backend = backend == "nccl" ? make_nccl_backend(pg_store, launch.rank, launch.world, timeout)
                                      : make_gloo_backend(pg_store, launch.rank, launch.world, timeout);
  } catch (const std::exception& e) {
    throw DistributedError("distributed: rank " + std::to_string(launch.rank) + " could not join the " + backend +
                           " process group of " + std::to_string(launch.world) + " ranks at " + impl->where +
                           " within " + std::to_string(int(d->timeout_s_)) + " s: " + first_line(e.what()));
  }
  Impl* raw = impl.get();
  impl->heartbeat = std::thread([raw, rank = launch.rank] { raw->beat(rank); });
  d->impl_ = std::move(impl);
  return d;
}

Distributed::Distributed() = default;
Distributed::~Distributed() = default;

namespace {
// While a failure is diagnosed the store may be gone with the rank that hosted it: c10d would
// log each failed probe as a warning with its C++ stack trace, before the sentence that says
// the same. Only errors are logged meanwhile.
class QuietC10Warnings {
 public:
  QuietC10Warnings() : level_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = std::max(level_, 2); }
  ~QuietC10Warnings() { FLAGS_caffe2_log_level = level_; }
  QuietC10Warnings(const QuietC10Warnings&) = delete;
  QuietC10Warnings& operator=(const QuietC10Warnings&) = delete;

 private:
  int level_;
};
}  // namespace

std::string Distributed::diagnose(const std::string& what, const std::string& cause) {
  const QuietC10Warnings quiet;
  std::ostringstream os;
  os << "distributed: " << what << " failed at rank " << rank_ << " of " << world_ << " (" << first_line(cause)
     << "); ";
  try {
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      std::lock_guard<std::mutex> p(impl_->probe_mutex);
      const std::string key = "failed/" + std::to_string(r);
      if (impl_->probe->check({key})) {
        const auto v = impl_->probe->get(key);
        os << "rank " << r << " stopped: " << std::string(v.begin(), v.end()) << "; every rank stops";
        return os.str();
      }
    }
    std::vector<int64_t> before(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) before[static_cast<size_t>(r)] = impl_->counter(r);
    std::this_thread::sleep_for(4 * kHeartbeat);
    std::vector<int> dead, alive;
    for (int r = 0; r < world_; ++r)
      if (r != rank_) (impl_->counter(r) == before[static_cast<size_t>(r)] ? dead : alive).push_back(r);
    if (!dead.empty())
      os << rank_list(dead) << " stopped answering (no heartbeat for " << 4 * kHeartbeat.count()
         << " ms: killed, crashed or hung); every rank stops";
    else
      os << "the other ranks are alive but " << rank_list(alive)
         << " did not complete it within [distributed] timeout = " << timeout_s_
         << " s (stuck, or in another collective); every rank stops";
  } catch (const std::exception& e) {
    os << "the rendezvous store at " << impl_->where << " does not answer (" << first_line(e.what()) << ")"
       << (impl_->rank0_hosts ? ": rank 0, which hosts it, is gone" : ": torchrun's agent is gone")
       << "; every rank stops";
  }
  return os.str();
}

void Distributed::announce_failure(const std::string& message) {
  if (!impl_) return;
  try {
    std::lock_guard<std::mutex> p(impl_->probe_mutex);
    const std::string text = message.substr(0, 1000);
    impl_->probe->set("failed/" + std::to_string(rank_), std::vector<uint8_t>(text.begin(), text.end()));
  } catch (const std::exception&) {
    return;  // the store is gone: the others find out by themselves
  }
  if (rank_ == 0 && impl_->rank0_hosts) std::this_thread::sleep_for(6 * kHeartbeat);
}

void Distributed::abandon() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lock(impl_->stop_mutex);
    impl_->stopping = true;
  }
  impl_->stop_cv.notify_all();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
  (void)impl_->backend.release();  // left to the process's exit
  (void)impl_->store.release();
  (void)impl_->probe.release();
  (void)impl_.release();
}

namespace {

// Waits for a collective; a failure becomes a DistributedError naming the rank responsible.
void wait_for(Distributed& d, const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw DistributedError(d.diagnose(what, e.what()));
  }
}

class Pending final : public PendingReduce {
 public:
  Pending(Distributed& d, c10::intrusive_ptr<c10d::Work> work, std::string what)
      : d_(d), work_(std::move(work)), what_(std::move(what)) {}
  void wait() override {
    if (work_) wait_for(d_, work_, what_);
  }

 private:
  Distributed& d_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
};

}  // namespace

void Distributed::broadcast(std::vector<at::Tensor>& tensors, const std::string& what) {
  if (!active()) return;
  at::NoGradGuard no_grad;  // the weights are leaves that require grad
  for (auto& t : tensors) {
    std::vector<at::Tensor> buf{impl_->on_backend(t)};
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    wait_for(*this, impl_->backend->broadcast(buf, o), what);
    t.copy_(buf[0]);
  }
}

void Distributed::all_reduce_sum(at::Tensor& t, const std::string& what) {
  if (!active()) return;
  all_reduce_async(t, what)->wait();
}

std::unique_ptr<PendingReduce> Distributed::all_reduce_async(at::Tensor t, const std::string& what) {
  if (!active()) return std::make_unique<Pending>(*this, nullptr, what);
  TORCH_CHECK(t.device() == impl_->device && t.is_contiguous(), "all_reduce_async: a contiguous tensor on ",
              impl_->device, " expected");
  std::vector<at::Tensor> buf{t};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = impl_->backend->allreduce(buf, c10d::AllreduceOptions());
  } catch (const std::exception& e) {
    throw DistributedError(diagnose(what, e.what()));
  }
  return std::make_unique<Pending>(*this, std::move(work), what);
}

std::vector<std::vector<double>> Distributed::all_gather(const std::vector<double>& mine, const std::string& what) {
  if (!active()) return {mine};
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  std::vector<at::Tensor> in{impl_->on_backend(at::tensor(mine, opts))};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_; ++r) out[0].push_back(at::empty_like(in[0]));
  wait_for(*this, impl_->backend->allgather(out, in), what);
  std::vector<std::vector<double>> rows;
  for (const auto& t : out[0]) {
    const at::Tensor c = t.to(at::kCPU).contiguous();
    rows.emplace_back(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return rows;
}

std::vector<std::string> Distributed::all_gather(const std::string& mine, const std::string& what) {
  if (!active()) return {mine};
  const auto lengths = all_gather(std::vector<double>{double(mine.size())}, what);
  size_t longest = 1;
  for (const auto& l : lengths) longest = std::max(longest, static_cast<size_t>(l[0]));
  std::vector<double> padded(longest, 0.0);
  for (size_t i = 0; i < mine.size(); ++i) padded[i] = static_cast<unsigned char>(mine[i]);
  std::vector<std::string> out;
  const auto rows = all_gather(padded, what);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::string s(static_cast<size_t>(lengths[r][0]), '\0');
    for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(static_cast<unsigned char>(rows[r][i]));
    out.push_back(std::move(s));
  }
  return out;
}

void Distributed::barrier(const std::string& what) {
  if (!active()) return;
  at::Tensor t = impl_->on_backend(at::zeros({1}, at::TensorOptions().dtype(at::kFloat)));
  all_reduce_sum(t, what);
}

}  // namespace flashdraft
