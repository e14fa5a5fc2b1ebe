// The c10d backends a run can use, each built in its own file: Gloo (CPU tensors, always
// built) and NCCL (CUDA tensors; built where the engine has CUDA and NCCL's header was
// found, FLASHDRAFT_WITH_NCCL).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace flashdraft {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                    std::chrono::milliseconds timeout);
// Throws when this build has no NCCL (a sentence saying so).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                    std::chrono::milliseconds timeout);
bool nccl_built();

}  // namespace flashdraft
