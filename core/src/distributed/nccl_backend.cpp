// ProcessGroupNCCL, where the engine has CUDA and NCCL's header was found.
#include "distributed/c10d_backends.hpp"

#include <cstdlib>
#include <stdexcept>

#ifdef FLASHDRAFT_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace flashdraft {

bool nccl_built() {
#ifdef FLASHDRAFT_WITH_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                    std::chrono::milliseconds timeout) {
#ifdef FLASHDRAFT_WITH_NCCL
  // Blocking waits: a collective that does not complete within the timeout raises in
  // Work::wait() on the calling thread (which names the rank responsible), instead of the
  // watchdog tearing the process down. A value the user exported is kept.
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
#else
  (void)store, (void)rank, (void)world, (void)timeout;
  throw std::runtime_error(
      "[distributed] backend \"nccl\": this flashdraft was built without NCCL (no CUDA in the LibTorch it was built "
      "against, or nccl.h not found); use backend = \"gloo\" with [run] device = \"cpu\"");
#endif
}

}  // namespace flashdraft
