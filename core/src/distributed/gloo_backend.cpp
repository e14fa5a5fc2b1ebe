// ProcessGroupGloo, compiled against the declarations in c10d_gloo/ (the wheel has no
// Gloo headers; see c10d_gloo/README.md).
#ifndef USE_C10D_GLOO  // LibTorch's CMake target defines it
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "distributed/c10d_backends.hpp"

namespace flashdraft {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                    std::chrono::milliseconds timeout) {
  // create_default: one device bound to this host's address (loopback when the host name
  // does not resolve), as torch.distributed does.
  auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
}

}  // namespace flashdraft
