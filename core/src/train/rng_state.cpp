// Generator states in and out of checkpoints.
#include "train/rng_state.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace flashdraft {

void capture_generators(checkpoint::State& state, const at::Generator& anchors, c10::Device device) {
  state.anchor_rng = anchors.get_state();
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    state.cpu_default_rng = cpu.get_state();
  }
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) {
    at::Generator cuda = at::cuda::detail::getDefaultCUDAGenerator(device.index());
    std::lock_guard<std::mutex> lock(cuda.mutex());
    state.cuda_default_rng = cuda.get_state();
  }
#endif
}

void restore_generators(const checkpoint::State& state, at::Generator& anchors, c10::Device device) {
  anchors.set_state(state.anchor_rng);
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(state.cpu_default_rng);
  }
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda() && state.cuda_default_rng.defined()) {
    at::Generator cuda = at::cuda::detail::getDefaultCUDAGenerator(device.index());
    std::lock_guard<std::mutex> lock(cuda.mutex());
    cuda.set_state(state.cuda_default_rng);
  }
#endif
}

}  // namespace flashdraft
