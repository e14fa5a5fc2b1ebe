// The frozen target's matrix products with the fastest cuBLASLt algorithm per shape.
//
// torch's at::mm takes cuBLAS's first choice for a shape. cuBLASLt's heuristic offers several
// (tile shapes, clusters); at the hf target's Qwen3-8B shapes one of the others is 1-3% faster
// (bench/gemm_algos.cpp). The first product of a shape here times each candidate that needs no
// workspace and gives torch's result bit for bit on the call's own operands, with torch's own
// choice among them, and keeps the fastest for every later product of that shape: the values
// are torch's, only the time changes. FLASHDRAFT_TUNE_PRODUCTS=0 keeps torch's choice always.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace flashdraft::tuned {

// Whether products can be tuned here (built with cuBLASLt, FLASHDRAFT_TUNE_PRODUCTS not 0).
bool enabled();
// out = a w^T (accumulate: out += a w^T, the product adding out in its epilogue, beta = 1), for
// a [.., K], w [N, K], out [.., N], all contiguous, one dtype (bfloat16 or float16), one CUDA
// device, a and out with the same rows. Returns false, touching nothing, where it does not
// apply (the caller then runs torch's op); throws a sentence if cuBLASLt fails.
bool product(const at::Tensor& out, const at::Tensor& a, const at::Tensor& w, bool accumulate);
// One line per shape tuned since the last call ("[M x K] x [K x N]: ..."), for progress output.
std::vector<std::string> take_reports();

}  // namespace flashdraft::tuned
