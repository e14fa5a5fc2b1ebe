// A dtype as the experiment file and the log write it.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace flashdraft {

// "float32", "bfloat16", "float16", "float64"; other types as c10 names them.
inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kBFloat16: return "bfloat16";
    case c10::kHalf: return "float16";
    case c10::kDouble: return "float64";
    default: return c10::toString(t);
  }
}

}  // namespace flashdraft
