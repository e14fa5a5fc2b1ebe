// Data-parallel runs: the launch contract, the process group and the collectives the run
// uses.
//
// Launch: one process per GPU (or per CPU worker), started by torchrun
// (`torchrun --nproc-per-node N --no-python flashdraft run EXP.toml`), which sets RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Under Slurm (srun, one task per
// GPU) without torchrun, SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID stand for RANK,
// WORLD_SIZE and LOCAL_RANK; MASTER_ADDR (the first node's host name) and MASTER_PORT
// (any free port) must be exported by the batch script. Without any of these the run is
// a single process and nothing here does anything.
//
// Engine: LibTorch's c10d. Rendezvous through a TCPStore at MASTER_ADDR:MASTER_PORT
// (hosted by rank 0, or by torchrun's agent when it offers its own store); collectives
// through ProcessGroupNCCL on CUDA and ProcessGroupGloo on CPU ([distributed] backend).
//
// Failures: every collective waits at most [distributed] timeout seconds. When one fails,
// the rank finds out which rank is responsible before it stops: a rank that raised an
// error leaves its message in the store (announce_failure), a living rank's heartbeat
// counter in the store keeps moving, a dead one's stops; the DistributedError names it.
#pragma once

#include <flashdraft/config.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft {

struct Launch {
  int rank = 0, world = 1, local_rank = 0;
  std::string master_addr;
  int port = 0;
  std::string source = "single process";  // "torchrun", "slurm" or "single process"
};

// The launch from the environment; a malformed variable is a sentence naming it.
Launch read_launch();

// A collective that failed because of another rank (or the network): what() names it.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An all-reduce in flight.
class PendingReduce {
 public:
  virtual ~PendingReduce() = default;
  virtual void wait() = 0;
};

class FLASHDRAFT_API Distributed {
 public:
  // A single process: every collective is the identity.
  Distributed();
  // Joins the process group of `launch` (world > 1) on `device`; `table` is [distributed].
  static std::unique_ptr<Distributed> connect(const Launch& launch, const Config& table, c10::Device device);
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool root() const { return rank_ == 0; }
  bool active() const { return world_ > 1; }
  const std::string& backend() const { return backend_; }
  double timeout_s() const { return timeout_s_; }

  // Collectives (every rank calls them in the same order); `what` names the collective
  // in failure messages. Tensors may live on any device.
  void broadcast(std::vector<at::Tensor>& tensors, const std::string& what);  // from rank 0, in place
  void all_reduce_sum(at::Tensor& t, const std::string& what);                // in place
  // t stays referenced until wait(); the sum is written into t.
  std::unique_ptr<PendingReduce> all_reduce_async(at::Tensor t, const std::string& what);
  // Every rank's vector (same length on every rank), in rank order.
  std::vector<std::vector<double>> all_gather(const std::vector<double>& mine, const std::string& what);
  std::vector<std::string> all_gather(const std::string& mine, const std::string& what);
  void barrier(const std::string& what);

  // Leaves this rank's failure for the others to read before it stops (where rank 0
  // hosts the store, it stays up a moment so that they can).
  void announce_failure(const std::string& message);
  // After a failure: stops the heartbeat and leaves the process group as it is (its
  // destructor would wait for collectives that cannot complete).
  void abandon();
  // Why `what` failed at this rank: the rank responsible, as a sentence.
  std::string diagnose(const std::string& what, const std::string& cause);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, world_ = 1;
  std::string backend_ = "none";
  double timeout_s_ = 0;
};

// The CUDA device of this process: cuda:LOCAL_RANK (made current), checked against the
// devices present. Call before anything touches the GPU.
c10::Device local_cuda_device(const Launch& launch);

}  // namespace flashdraft
