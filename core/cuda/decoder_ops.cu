// A frozen decoder layer's memory-bound steps (engine_ops.cuh, "Frozen decoder layers"), each
// one pass with the rounding of transformers' Llama / Qwen modules, so that the online target
// computes what transformers computes:
//   add_rms_norm   s = x + delta (rounded), out = w * round(s * rsqrt(mean(s^2) + eps)) (rounded)
//   qkv_rope       the packed q|k|v projection -> q, k, v in [B, heads, T, D]; q and k per-head
//                  RMSNormed, then rotated as (x * cos) + (rotate_half(x) * sin), each product
//                  and the sum rounded as transformers' separate ops round them
//   swiglu_packed  the packed gate|up projection -> round(round(silu(g)) * u)
// Float32 math inside each value; the reductions in float32 (their summation order is the one
// place where the result may differ from transformers' by a rounding).
#include "ops_common.cuh"

#include <algorithm>

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One block of kNormThreads per row.
constexpr int kNormThreads = 256;

template <typename T>
__global__ void add_rms_norm_kernel(const T* x, const T* __restrict__ delta, T* sum,
                                    const T* __restrict__ w, T* __restrict__ out, int64_t H, float eps) {
  __shared__ float partial[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * H;
  const T* dr = delta ? delta + row * H : nullptr;
  T* sr = sum ? sum + row * H : nullptr;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    float v = to_float(xr[j]);
    if (dr) {
      v = round_to<T>(v + to_float(dr[j]));
      sr[j] = from_float<T>(v);
    }
    ss += v * v;
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += partial[i];
  const float inv = rsqrtf(total / float(H) + eps);
  T* orow = out + row * H;
  // Each thread reads back the values it wrote (or read): no other thread touched them.
  const T* src = dr ? sr : xr;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x)
    orow[j] = from_float<T>(to_float(w[j]) * round_to<T>(to_float(src[j]) * inv));
}

// One warp per (token, head slot); lanes take the pairs (j, j + D/2).
constexpr int kQkvWarps = 8;

template <typename T>
__global__ void qkv_rope_kernel(const T* __restrict__ qkv, const T* __restrict__ q_norm, const T* __restrict__ k_norm,
                                float eps, const T* __restrict__ cos, const T* __restrict__ sin, int64_t table_batch,
                                T* __restrict__ q, T* __restrict__ k, T* __restrict__ v, int64_t B, int64_t T_,
                                int64_t Hq, int64_t Hkv, int64_t D) {
  const int lane = threadIdx.x & 31;
  const int64_t slots = Hq + 2 * Hkv, items = B * T_ * slots, half = D / 2;
  for (int64_t item = int64_t(blockIdx.x) * kQkvWarps + (threadIdx.x >> 5); item < items;
       item += int64_t(gridDim.x) * kQkvWarps) {
    const int64_t slot = item % slots, token = item / slots, t = token % T_, b = token / T_;
    const T* in = qkv + token * slots * D + slot * D;
    if (slot >= Hq + Hkv) {  // v: moved to [B, Hkv, T, D]
      T* o = v + ((b * Hkv + (slot - Hq - Hkv)) * T_ + t) * D;
      for (int64_t j = lane; j < D; j += 32) o[j] = in[j];
      continue;
    }
    const bool is_q = slot < Hq;
    const T* norm = is_q ? q_norm : k_norm;
    float inv = 1.f;
    if (norm) {
      float ss = 0.f;
      for (int64_t j = lane; j < D; j += 32) {
        const float x = to_float(in[j]);
        ss += x * x;
      }
      inv = rsqrtf(warp_sum(ss) / float(D) + eps);
    }
    const int64_t tb = table_batch == 1 ? 0 : b;
    const T* c = cos + (tb * T_ + t) * D;
    const T* s = sin + (tb * T_ + t) * D;
    T* o = is_q ? q + ((b * Hq + slot) * T_ + t) * D : k + ((b * Hkv + (slot - Hq)) * T_ + t) * D;
    for (int64_t j = lane; j < half; j += 32) {
      float x1 = to_float(in[j]), x2 = to_float(in[j + half]);
      if (norm) {
        x1 = round_to<T>(to_float(norm[j]) * round_to<T>(x1 * inv));
        x2 = round_to<T>(to_float(norm[j + half]) * round_to<T>(x2 * inv));
      }
      // rotate_half(x) = (-x2, x1)
      o[j] = from_float<T>(round_to<T>(x1 * to_float(c[j])) + round_to<T>(-x2 * to_float(s[j])));
      o[j + half] = from_float<T>(round_to<T>(x2 * to_float(c[j + half])) + round_to<T>(x1 * to_float(s[j + half])));
    }
  }
}

constexpr int kSwigluThreads = 256;

template <typename T>
__global__ void swiglu_packed_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t I) {
  const int64_t n = rows * I, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / I, j = i % I;
    const float g = to_float(gate_up[r * 2 * I + j]), u = to_float(gate_up[r * 2 * I + I + j]);
    out[i] = from_float<T>(round_to<T>(g / (1.f + expf(-g))) * u);
  }
}

}  // namespace

void add_rms_norm(DType dtype, const void* x, const void* delta, void* sum, const void* w, void* out, int64_t rows,
                  int64_t H, float eps, void* stream) {
  if (rows <= 0) return;
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_rms_norm_kernel<T><<<static_cast<unsigned>(rows), kNormThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(delta), static_cast<T*>(sum), static_cast<const T*>(w),
        static_cast<T*>(out), H, eps);
  });
  check_launch("add_rms_norm");
}

void qkv_rope(DType dtype, const void* qkv, const void* q_norm, const void* k_norm, float eps, const void* cos,
              const void* sin, int64_t table_batch, void* q, void* k, void* v, int64_t B, int64_t T, int64_t Hq,
              int64_t Hkv, int64_t D, void* stream) {
  const int64_t items = B * T * (Hq + 2 * Hkv);
  if (items <= 0) return;
  const int64_t blocks = std::min<int64_t>((items + kQkvWarps - 1) / kQkvWarps, 65535 * 8);
  with_type(dtype, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    qkv_rope_kernel<E><<<static_cast<unsigned>(blocks), kQkvWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const E*>(qkv), static_cast<const E*>(q_norm), static_cast<const E*>(k_norm), eps,
        static_cast<const E*>(cos), static_cast<const E*>(sin), table_batch, static_cast<E*>(q), static_cast<E*>(k),
        static_cast<E*>(v), B, T, Hq, Hkv, D);
  });
  check_launch("qkv_rope");
}

void swiglu_packed(DType dtype, const void* gate_up, void* out, int64_t rows, int64_t I, void* stream) {
  if (rows <= 0 || I <= 0) return;
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_packed_kernel<T><<<grid_for(rows * I, kSwigluThreads), kSwigluThreads, 0,
                              static_cast<cudaStream_t>(stream)>>>(static_cast<const T*>(gate_up),
                                                                   static_cast<T*>(out), rows, I);
  });
  check_launch("swiglu_packed");
}

}  // namespace flashdraft::cuda_ops
