// The generators a run draws from, captured into a checkpoint and restored from one:
// the trainer's anchor generator, LibTorch's default CPU generator and, on CUDA runs,
// the default generator of the run's GPU. Restoring them is what makes a resumed run
// draw exactly what the uninterrupted run would have drawn.
#pragma once

#include "train/checkpoint.hpp"

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

namespace flashdraft {

void capture_generators(checkpoint::State& state, const at::Generator& anchors, c10::Device device);
void restore_generators(const checkpoint::State& state, at::Generator& anchors, c10::Device device);

}  // namespace flashdraft
