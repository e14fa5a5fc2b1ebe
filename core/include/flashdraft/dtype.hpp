// The dtype a `dtype` key names, as [run] dtype and the targets' dtype keys read it.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace flashdraft {

// "float32", "bfloat16", "float16"; "auto" (or any other name: the schemas accept only these): bfloat16 on CUDA,
// float32 elsewhere.
inline c10::ScalarType dtype_named(const std::string& name, c10::Device device) {
  if (name == "float32") return c10::kFloat;
  if (name == "bfloat16") return c10::kBFloat16;
  if (name == "float16") return c10::kHalf;
  return device.is_cuda() ? c10::kBFloat16 : c10::kFloat;
}

}  // namespace flashdraft
