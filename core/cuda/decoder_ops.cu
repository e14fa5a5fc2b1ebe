// A frozen decoder layer's memory-bound steps (engine_ops.cuh, "Frozen decoder layers"), each
// one pass with the rounding of transformers' Llama / Qwen modules, so that the online target
// computes what transformers computes:
//   add_rms_norm   s = x + delta (rounded), out = w * round(s * rsqrt(mean(s^2) + eps)) (rounded); a
//                  float32 w with a narrower x (gpt-oss's norms): out = round(w * s * rsqrt(...))
//   qkv_rope       the packed q|k|v projection -> q, k, v in [B, heads, T, D]; q and k per-head
//                  RMSNormed, then rotated as (x * cos) + (rotate_half(x) * sin), each product
//                  and the sum rounded as transformers' separate ops round them (the first R
//                  dimensions of a head with a partial rotary factor, the rest passed on)
//   swiglu_packed  the packed gate|up projection -> round(round(silu(g)) * u)
//   clamped_glu    gpt-oss's: each row's expert's bias added (rounded), g clamped above at limit, u to
//                  +-limit, round(round(u + 1) * round(g * round(sigmoid(round(g alpha)))))
//   combine_experts  a mixture of experts' output rows back to their tokens: per token, the sum
//                  in float32 of its k rows each times its router weight (each product rounded
//                  to the dtype, unless the weights are float32), rounded once
// Float32 math inside each value; the reductions in float32 (their summation order is the one
// place where the result may differ from transformers' by a rounding).
#include "ops_common.cuh"

#include <algorithm>
#include <type_traits>

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Products and sums rounded one by one (never contracted into a fused multiply-add), as
// ATen's separate elementwise ops round them; in float32 the dtype's rounding is a no-op.
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One block of kNormThreads per row.
constexpr int kNormThreads = 256;

// 1 / sqrt(mean(x^2) + eps) of a row from each thread's sum of squares `ss` (the CTA's
// kNormThreads threads, `partial` their shared slots).
__device__ __forceinline__ float inverse_rms(float ss, float* partial, int64_t H, float eps) {
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += partial[i];
  return rsqrtf(total / float(H) + eps);
}

// A normed value times its weight: w of the dtype multiplies the value rounded to it (Llama's
// RMSNorm); a float32 w with a narrower T multiplies it in float32, rounded once (gpt-oss's).
template <typename T, typename W>
__device__ __forceinline__ T weighted(float w, float normed) {
  if constexpr (std::is_same<W, float>::value && !std::is_same<T, float>::value)
    return from_float<T>(mul(w, normed));
  else
    return from_float<T>(mul(w, round_to<T>(normed)));
}

template <typename T, typename W>
__global__ void add_rms_norm_kernel(const T* x, int64_t x_ld, const T* __restrict__ delta, T* sum, int64_t sum_ld,
                                    const W* __restrict__ w, T* __restrict__ out, int64_t H, float eps) {
  __shared__ float partial[kNormThreads / 32];
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_ld;
  const T* dr = delta ? delta + row * H : nullptr;
  T* sr = sum ? sum + row * sum_ld : nullptr;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    float v = to_float(xr[j]);
    if (dr) {
      v = round_to<T>(add(v, to_float(dr[j])));
      sr[j] = from_float<T>(v);
    }
    ss += v * v;
  }
  const float inv = inverse_rms(ss, partial, H, eps);
  T* orow = out + row * H;
  // Each thread reads back the values it wrote (or read): no other thread touched them.
  const T* src = dr ? sr : xr;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x)
    orow[j] = weighted<T, W>(to_float(w[j]), mul(to_float(src[j]), inv));
}

// The same with 16-byte vectors, each thread's (at most kNormVecs) vectors kept in registers
// between the two passes (rows of at most kNormThreads * kNormVecs vectors).
constexpr int kNormVecs = 4;

template <typename T, typename W>
__global__ void add_rms_norm_vec_kernel(const T* x, int64_t x_ld, const T* __restrict__ delta, T* sum, int64_t sum_ld,
                                        const W* __restrict__ w, T* __restrict__ out, int64_t H, float eps) {
  constexpr int E = Vec16<T>::E;
  __shared__ float partial[kNormThreads / 32];
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x, nv = H / E;
  const T* xr = x + row * x_ld;
  const T* dr = delta ? delta + row * H : nullptr;
  T* sr = sum ? sum + row * sum_ld : nullptr;
  Vec16<T> cache[kNormVecs];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int64_t vi = threadIdx.x + int64_t(i) * kNormThreads;
    if (vi < nv) {
      Vec16<T> a = load16(xr + vi * E);
      if (dr) {
        const Vec16<T> d = load16(dr + vi * E);
#pragma unroll
        for (int k = 0; k < E; ++k) a.v[k] = from_float<T>(add(to_float(a.v[k]), to_float(d.v[k])));
        store16(sr + vi * E, a);
      }
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const float v = to_float(a.v[k]);
        ss += v * v;
      }
      cache[i] = a;
    }
  }
  const float inv = inverse_rms(ss, partial, H, eps);
  T* orow = out + row * H;
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int64_t vi = threadIdx.x + int64_t(i) * kNormThreads;
    if (vi < nv) {
      float wf[E];
      if constexpr (std::is_same<W, T>::value) {
        const Vec16<T> wv = load16(w + vi * E);
#pragma unroll
        for (int k = 0; k < E; ++k) wf[k] = to_float(wv.v[k]);
      } else {
#pragma unroll
        for (int k = 0; k < E; ++k) wf[k] = w[vi * E + k];
      }
      Vec16<T> o;
#pragma unroll
      for (int k = 0; k < E; ++k) o.v[k] = weighted<T, W>(wf[k], mul(to_float(cache[i].v[k]), inv));
      store16(orow + vi * E, o);
    }
  }
}

// q|k|v RoPE for D = 64, 128, 256 with 16-byte vectors (every row 16-byte aligned): each thread
// takes E = 16 / sizeof(T) values of a head's first half and the E values D/2 further (the
// rotate_half pairs), TPH = D / (2 E) threads per head (a power of two, at most 32: adjacent
// lanes, which sum the norm's squares with shuffles among themselves); a token's head slots x
// TPH threads in x, tokens in y (grid-stride). (Two or four tokens per thread, their loads
// issued together, ran slower on an H200: 36.8 us against 29.4 at Qwen3-8B's shapes, bench
// bench/decoder_ops.cpp.) Each value is rounded as in qkv_rope_kernel (below); only the order
// of the norm's sum of squares differs (float32). A partial rotary factor (R < D rotated, R a
// multiple of 2 E): the first R / (2 E) threads of a head take the rotated pairs (j, R/2 + j),
// the others the passed-on columns in two vectors (R + j', R + (D - R)/2 + j').
template <typename T, int D>
constexpr int kRopeThreadsPerHead = D / 2 / Vec16<T>::E;

template <typename T, int D>
__global__ void qkv_rope_vec_kernel(const T* __restrict__ qkv, const T* __restrict__ q_norm,
                                    const T* __restrict__ k_norm, float eps, const T* __restrict__ cos,
                                    const T* __restrict__ sin, int64_t table_batch, T* __restrict__ q,
                                    T* __restrict__ k, T* __restrict__ v, int64_t B, int64_t T_, int64_t Hq,
                                    int64_t Hkv, int R) {
  constexpr int E = Vec16<T>::E, TPH = kRopeThreadsPerHead<T, D>;
  static_assert(TPH >= 1 && TPH <= 32 && (TPH & (TPH - 1)) == 0, "threads per head: a power of two up to 32");
  const int64_t slots = Hq + 2 * Hkv, tokens = B * T_;
  const int64_t th = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, slot = th / TPH;
  const bool is_v = slot >= Hq + Hkv, is_q = slot < Hq;
  const T* norm = is_v ? nullptr : is_q ? q_norm : k_norm;
  const int lane = threadIdx.x & 31, j = int(th % TPH) * E, rh = R / 2;
  // this thread's two vectors of a head: a rotated pair, or two passed-on pieces
  const bool rotates = j < rh;
  const int p1 = rotates ? j : R + (j - rh), p2 = rotates ? rh + j : R + (D - R) / 2 + (j - rh);
  pdl_wait();  // (first: even the norm weights may come from the kernel before)
  pdl_trigger();
  if (slot >= slots) return;  // whole heads leave together (blockDim is a multiple of TPH)
  Vec16<T> w1, w2;
  if (norm) w1 = load16(norm + p1), w2 = load16(norm + p2);
  const unsigned group = TPH == 32 ? 0xffffffffu : ((1u << TPH) - 1u) << (lane & ~(TPH - 1));
  for (int64_t token = blockIdx.y; token < tokens; token += gridDim.y) {
    const int64_t t = token % T_, b = token / T_;
    const T* in = qkv + (token * slots + slot) * D;
    const Vec16<T> a1 = load16(in + p1), a2 = load16(in + p2);
    if (is_v) {  // moved to [B, Hkv, T, D]
      T* o = v + ((b * Hkv + (slot - Hq - Hkv)) * T_ + t) * D;
      store16(o + p1, a1);
      store16(o + p2, a2);
      continue;
    }
    float x1[E], x2[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x1[e] = to_float(a1.v[e]), x2[e] = to_float(a2.v[e]);
    if (norm) {
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) ss += x1[e] * x1[e] + x2[e] * x2[e];
#pragma unroll
      for (int o = TPH / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(group, ss, o);
      const float inv = rsqrtf(ss / float(D) + eps);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        x1[e] = round_to<T>(mul(to_float(w1.v[e]), round_to<T>(mul(x1[e], inv))));
        x2[e] = round_to<T>(mul(to_float(w2.v[e]), round_to<T>(mul(x2[e], inv))));
      }
    }
    Vec16<T> o1, o2;
    if (rotates) {
      const int64_t tb = table_batch == 1 ? 0 : b;
      const T* ct = cos + (tb * T_ + t) * R;
      const T* st = sin + (tb * T_ + t) * R;
      const Vec16<T> c1 = load16(ct + p1), c2 = load16(ct + p2), s1 = load16(st + p1), s2 = load16(st + p2);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        // rotate_half(x) = (-x2, x1)
        o1.v[e] =
            from_float<T>(add(round_to<T>(mul(x1[e], to_float(c1.v[e]))), round_to<T>(mul(-x2[e], to_float(s1.v[e])))));
        o2.v[e] =
            from_float<T>(add(round_to<T>(mul(x2[e], to_float(c2.v[e]))), round_to<T>(mul(x1[e], to_float(s2.v[e])))));
      }
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) o1.v[e] = from_float<T>(x1[e]), o2.v[e] = from_float<T>(x2[e]);
    }
    T* o = is_q ? q + ((b * Hq + slot) * T_ + t) * D : k + ((b * Hkv + (slot - Hq)) * T_ + t) * D;
    store16(o + p1, o1);
    store16(o + p2, o2);
  }
}

// Any even D and R (the general case): one warp per (token, head slot); lanes take the rotated
// pairs (j, j + R/2) and the passed-on columns R..D-1.
constexpr int kQkvWarps = 8;

template <typename T>
__global__ void qkv_rope_kernel(const T* __restrict__ qkv, const T* __restrict__ q_norm, const T* __restrict__ k_norm,
                                float eps, const T* __restrict__ cos, const T* __restrict__ sin, int64_t table_batch,
                                T* __restrict__ q, T* __restrict__ k, T* __restrict__ v, int64_t B, int64_t T_,
                                int64_t Hq, int64_t Hkv, int64_t D, int64_t R) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t slots = Hq + 2 * Hkv, items = B * T_ * slots, half = R / 2;
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
    const T* c = cos + (tb * T_ + t) * R;
    const T* s = sin + (tb * T_ + t) * R;
    T* o = is_q ? q + ((b * Hq + slot) * T_ + t) * D : k + ((b * Hkv + (slot - Hq)) * T_ + t) * D;
    for (int64_t j = lane; j < half; j += 32) {
      float x1 = to_float(in[j]), x2 = to_float(in[j + half]);
      if (norm) {
        x1 = round_to<T>(mul(to_float(norm[j]), round_to<T>(mul(x1, inv))));
        x2 = round_to<T>(mul(to_float(norm[j + half]), round_to<T>(mul(x2, inv))));
      }
      // rotate_half(x) = (-x2, x1)
      o[j] = from_float<T>(add(round_to<T>(mul(x1, to_float(c[j]))), round_to<T>(mul(-x2, to_float(s[j])))));
      o[j + half] =
          from_float<T>(add(round_to<T>(mul(x2, to_float(c[j + half]))), round_to<T>(mul(x1, to_float(s[j + half])))));
    }
    for (int64_t j = R + lane; j < D; j += 32) {
      const float x = to_float(in[j]);
      o[j] = norm ? from_float<T>(mul(to_float(norm[j]), round_to<T>(mul(x, inv)))) : in[j];
    }
  }
}

constexpr int kSwigluThreads = 256;

// The gate's activation of a packed GLU, in float32 (rounded to the dtype by the caller, as ATen's op rounds it):
// SiLU x / (1 + e^-x), or GELU's tanh approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in ATen's order
// of operations (Gemma 3's gelu_pytorch_tanh).
struct Silu {
  static __device__ __forceinline__ float apply(float x) { return x / (1.f + expf(-x)); }
};
struct GeluTanh {
  static __device__ __forceinline__ float apply(float x) {
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // (sqrt(2) * 2 / sqrt(pi) * 0.5)
    const float cube = x * x * x;
    return 0.5f * x * (1.f + tanhf(kBeta * (x + kKappa * cube)));
  }
};

// Rows in blockIdx.y (grid-stride), 16-byte vectors of a row in x: no division per value.
template <typename T, typename Act = Silu>
__global__ void swiglu_packed_vec_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t I) {
  constexpr int E = Vec16<T>::E;
  pdl_wait();
  pdl_trigger();
  const int64_t nv = I / E;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t vi = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; vi < nv; vi += int64_t(gridDim.x) * blockDim.x) {
      const Vec16<T> g = load16(gate_up + r * 2 * I + vi * E), u = load16(gate_up + r * 2 * I + I + vi * E);
      Vec16<T> o;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        o.v[k] = from_float<T>(mul(round_to<T>(Act::apply(to_float(g.v[k]))), to_float(u.v[k])));
      }
      store16(out + r * I + vi * E, o);
    }
}

template <typename T, typename Act = Silu>
__global__ void swiglu_packed_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t I) {
  pdl_wait();
  pdl_trigger();
  const int64_t n = rows * I, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / I, j = i % I;
    const float g = to_float(gate_up[r * 2 * I + j]), u = to_float(gate_up[r * 2 * I + I + j]);
    out[i] = from_float<T>(mul(round_to<T>(Act::apply(g)), u));
  }
}

// gpt-oss's GLU of one (gate, up) pair, the bias already added, as transformers' ops round it.
template <typename T>
__device__ __forceinline__ T clamped_glu_value(float g, float u, float alpha, float limit) {
  g = round_to<T>(fminf(g, limit));
  u = round_to<T>(fminf(fmaxf(u, -limit), limit));
  const float s = round_to<T>(1.f / (1.f + expf(-round_to<T>(mul(g, alpha)))));
  return from_float<T>(mul(round_to<T>(add(u, 1.f)), round_to<T>(mul(g, s))));
}

// Rows of gate_up [rows, 2 I] (gate first) with each row's expert's bias [2 I] (bias [E, 2 I], expert
// [rows]; bias null: none) -> out [rows, I]; 16-byte vectors, rows over blockIdx.y.
template <typename T>
__global__ void clamped_glu_vec_kernel(const T* __restrict__ gate_up, const T* __restrict__ bias,
                                       const int64_t* __restrict__ expert, T* __restrict__ out, int64_t rows, int64_t I,
                                       float alpha, float limit) {
  constexpr int E = Vec16<T>::E;
  pdl_wait();
  pdl_trigger();
  const int64_t nv = I / E;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* b = bias ? bias + expert[r] * 2 * I : nullptr;
    for (int64_t vi = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; vi < nv; vi += int64_t(gridDim.x) * blockDim.x) {
      const Vec16<T> g = load16(gate_up + r * 2 * I + vi * E), u = load16(gate_up + r * 2 * I + I + vi * E);
      Vec16<T> bg, bu;
      if (b) bg = load16(b + vi * E), bu = load16(b + I + vi * E);
      Vec16<T> o;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        float gv = to_float(g.v[k]), uv = to_float(u.v[k]);
        if (b) gv = round_to<T>(add(gv, to_float(bg.v[k]))), uv = round_to<T>(add(uv, to_float(bu.v[k])));
        o.v[k] = clamped_glu_value<T>(gv, uv, alpha, limit);
      }
      store16(out + r * I + vi * E, o);
    }
  }
}

template <typename T>
__global__ void clamped_glu_kernel(const T* __restrict__ gate_up, const T* __restrict__ bias,
                                   const int64_t* __restrict__ expert, T* __restrict__ out, int64_t rows, int64_t I,
                                   float alpha, float limit) {
  pdl_wait();
  pdl_trigger();
  const int64_t n = rows * I, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / I, j = i % I;
    float g = to_float(gate_up[r * 2 * I + j]), u = to_float(gate_up[r * 2 * I + I + j]);
    if (bias) {
      const T* b = bias + expert[r] * 2 * I;
      g = round_to<T>(add(g, to_float(b[j]))), u = round_to<T>(add(u, to_float(b[I + j])));
    }
    out[i] = clamped_glu_value<T>(g, u, alpha, limit);
  }
}

// The product of a row's value and its weight as ATen rounds it: to T where the weight is in T,
// not at all where the weight is float32 (the product is then float32).
template <typename T, typename W>
__device__ __forceinline__ float weighted(float x, W w) {
  const float p = mul(x, to_float(w));
  if constexpr (std::is_same_v<T, W>)
    return round_to<T>(p);
  else
    return p;
}

// One block per token (grid-stride), 16-byte vectors of the row in the threads; the k rows added
// in order j = 0 .. k - 1.
template <typename T, typename W>
__global__ void combine_experts_vec_kernel(const T* __restrict__ rows, const W* __restrict__ weights,
                                           const int64_t* __restrict__ slot, T* __restrict__ out, int64_t tokens,
                                           int64_t k, int64_t H) {
  constexpr int E = Vec16<T>::E;
  pdl_wait();
  pdl_trigger();
  const int64_t nv = H / E;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x)
    for (int64_t vi = threadIdx.x; vi < nv; vi += blockDim.x) {
      float acc[E];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const W w = weights[t * k + j];
        const Vec16<T> v = load16(rows + slot[t * k + j] * H + vi * E);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = add(acc[e], weighted<T>(to_float(v.v[e]), w));
      }
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < E; ++e) o.v[e] = from_float<T>(acc[e]);
      store16(out + t * H + vi * E, o);
    }
}

template <typename T, typename W>
__global__ void combine_experts_kernel(const T* __restrict__ rows, const W* __restrict__ weights,
                                       const int64_t* __restrict__ slot, T* __restrict__ out, int64_t tokens, int64_t k,
                                       int64_t H) {
  pdl_wait();
  pdl_trigger();
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x)
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j)
        acc = add(acc, weighted<T>(to_float(rows[slot[t * k + j] * H + i]), weights[t * k + j]));
      out[t * H + i] = from_float<T>(acc);
    }
}

}  // namespace

bool programmatic_launch(int device) { return pdl_on(device); }
int compute_capability(int device) { return launch::compute_capability(device); }

void add_rms_norm(DType dtype, const void* x, int64_t x_ld, const void* delta, void* sum, int64_t sum_ld, const void* w,
                  bool w_float, void* out, int64_t rows, int64_t H, float eps, void* stream) {
  if (rows <= 0) return;
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int E = Vec16<T>::E;
    const bool aligned = aligned16(x) && x_ld % E == 0 && aligned16(w) && aligned16(out) &&
                         (!delta || (aligned16(delta) && aligned16(sum) && sum_ld % E == 0));
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const T *xt = static_cast<const T*>(x), *dt = static_cast<const T*>(delta);
    T *st = static_cast<T*>(sum), *ot = static_cast<T*>(out);
    const dim3 grid(static_cast<unsigned>(rows)), block(kNormThreads);
    const bool vec = aligned && H % E == 0 && H / E <= int64_t(kNormThreads) * kNormVecs;
    const auto go = [&](auto* weights) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(weights)>>;
      if (vec)
        launch_dependent(add_rms_norm_vec_kernel<T, W>, grid, block, 0, s, xt, x_ld, dt, st, sum_ld, weights, ot, H,
                         eps);
      else
        launch_dependent(add_rms_norm_kernel<T, W>, grid, block, 0, s, xt, x_ld, dt, st, sum_ld, weights, ot, H, eps);
    };
    if (w_float)
      go(static_cast<const float*>(w));
    else
      go(static_cast<const T*>(w));
  });
  check_launch("add_rms_norm");
}

void qkv_rope(DType dtype, const void* qkv, const void* q_norm, const void* k_norm, float eps, const void* cos,
              const void* sin, int64_t table_batch, void* q, void* k, void* v, int64_t B, int64_t T, int64_t Hq,
              int64_t Hkv, int64_t D, int64_t R, void* stream) {
  const int64_t items = B * T * (Hq + 2 * Hkv);
  if (items <= 0) return;
  with_type(dtype, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    const E *in = static_cast<const E*>(qkv), *qn = static_cast<const E*>(q_norm), *kn = static_cast<const E*>(k_norm);
    const E *c = static_cast<const E*>(cos), *s = static_cast<const E*>(sin);
    E *qo = static_cast<E*>(q), *ko = static_cast<E*>(k), *vo = static_cast<E*>(v);
    const bool vec = aligned16(in) && aligned16(c) && aligned16(s) && aligned16(qo) && aligned16(ko) && aligned16(vo) &&
                     (!qn || aligned16(qn)) && (!kn || aligned16(kn)) && R % (2 * Vec16<E>::E) == 0;
    auto launch_vec = [&](auto d) {
      constexpr int threads = 128;  // a multiple of every TPH
      const dim3 g(
          static_cast<unsigned>(((Hq + 2 * Hkv) * kRopeThreadsPerHead<E, decltype(d)::value> + threads - 1) / threads),
          static_cast<unsigned>(std::min<int64_t>(B * T, 65535)));
      launch_dependent(qkv_rope_vec_kernel<E, decltype(d)::value>, g, dim3(threads), 0, st, in, qn, kn, eps, c, s,
                       table_batch, qo, ko, vo, B, T, Hq, Hkv, static_cast<int>(R));
    };
    if (vec && D == 64) return launch_vec(std::integral_constant<int, 64>());
    if (vec && D == 128) return launch_vec(std::integral_constant<int, 128>());
    if (vec && D == 256) return launch_vec(std::integral_constant<int, 256>());
    const int64_t blocks = std::min<int64_t>((items + kQkvWarps - 1) / kQkvWarps, 65535 * 8);
    launch_dependent(qkv_rope_kernel<E>, dim3(static_cast<unsigned>(blocks)), dim3(kQkvWarps * 32), 0, st, in, qn, kn,
                     eps, c, s, table_batch, qo, ko, vo, B, T, Hq, Hkv, D, R);
  });
  check_launch("qkv_rope");
}

namespace {
template <typename Act>
void glu_packed(DType dtype, const void* gate_up, void* out, int64_t rows, int64_t I, void* stream) {
  if (rows <= 0 || I <= 0) return;
  const bool aligned = aligned16(gate_up) && aligned16(out);
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int E = Vec16<T>::E;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const T* in = static_cast<const T*>(gate_up);
    T* o = static_cast<T*>(out);
    if (aligned && I % E == 0) {
      const int64_t nv = I / E;
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>((nv + kSwigluThreads - 1) / kSwigluThreads, 64)),
                      static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
      launch_dependent(swiglu_packed_vec_kernel<T, Act>, grid, dim3(kSwigluThreads), 0, s, in, o, rows, I);
    } else {
      launch_dependent(swiglu_packed_kernel<T, Act>, dim3(grid_for(rows * I, kSwigluThreads)), dim3(kSwigluThreads), 0,
                       s, in, o, rows, I);
    }
  });
}
}  // namespace

void swiglu_packed(DType dtype, const void* gate_up, void* out, int64_t rows, int64_t I, void* stream) {
  glu_packed<Silu>(dtype, gate_up, out, rows, I, stream);
  check_launch("swiglu_packed");
}

void gelu_tanh_packed(DType dtype, const void* gate_up, void* out, int64_t rows, int64_t I, void* stream) {
  glu_packed<GeluTanh>(dtype, gate_up, out, rows, I, stream);
  check_launch("gelu_tanh_packed");
}

void clamped_glu(DType dtype, const void* gate_up, const void* bias, const int64_t* expert, void* out, int64_t rows,
                 int64_t I, float alpha, float limit, void* stream) {
  if (rows <= 0 || I <= 0) return;
  const bool aligned = aligned16(gate_up) && aligned16(out) && (!bias || aligned16(bias));
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int E = Vec16<T>::E;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const T *in = static_cast<const T*>(gate_up), *b = static_cast<const T*>(bias);
    T* o = static_cast<T*>(out);
    if (aligned && I % E == 0) {
      const int64_t nv = I / E;
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>((nv + kSwigluThreads - 1) / kSwigluThreads, 64)),
                      static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
      launch_dependent(clamped_glu_vec_kernel<T>, grid, dim3(kSwigluThreads), 0, s, in, b, expert, o, rows, I, alpha,
                       limit);
    } else {
      launch_dependent(clamped_glu_kernel<T>, dim3(grid_for(rows * I, kSwigluThreads)), dim3(kSwigluThreads), 0, s, in,
                       b, expert, o, rows, I, alpha, limit);
    }
  });
  check_launch("clamped_glu");
}

void combine_experts(DType dtype, const void* rows, const void* weights, bool float_weights, const int64_t* slot,
                     void* out, int64_t tokens, int64_t k, int64_t H, void* stream) {
  if (tokens <= 0 || H <= 0) return;
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tokens, 65535)));
    const T* r = static_cast<const T*>(rows);
    T* o = static_cast<T*>(out);
    const bool vec = aligned16(rows) && aligned16(out) && H % Vec16<T>::E == 0;
    const auto launch = [&](const auto* w) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
      if (vec)
        launch_dependent(combine_experts_vec_kernel<T, W>, grid, dim3(kSwigluThreads), 0, s, r, w, slot, o, tokens, k,
                         H);
      else
        launch_dependent(combine_experts_kernel<T, W>, grid, dim3(kSwigluThreads), 0, s, r, w, slot, o, tokens, k, H);
    };
    if (float_weights)
      launch(static_cast<const float*>(weights));
    else
      launch(static_cast<const T*>(weights));
  });
  check_launch("combine_experts");
}

namespace {

// One thread a group of 32 values: its 16 bytes in one load (blocks 16-byte aligned), its 64 (bf16)
// bytes out in 16-byte stores where out is aligned.
template <typename T>
__global__ void dequantize_mxfp4_kernel(const uint8_t* __restrict__ blocks, const uint8_t* __restrict__ scales,
                                        T* __restrict__ out, int64_t groups, bool aligned) {
  constexpr float kE2M1[16] = {0.f,  .5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  pdl_wait();
  pdl_trigger();
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const uint4 raw = *reinterpret_cast<const uint4*>(blocks + 16 * g);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    const int exponent = int(scales[g]) - 127;
    T values[32];
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      const uint32_t byte = (words[b / 4] >> (8 * (b % 4))) & 0xffu;
      values[2 * b] = from_float<T>(ldexpf(kE2M1[byte & 15u], exponent));
      values[2 * b + 1] = from_float<T>(ldexpf(kE2M1[byte >> 4], exponent));
    }
    T* o = out + 32 * g;
    if (aligned) {  // (out 16-byte aligned: every group's 32 values are whole vectors)
      constexpr int E = Vec16<T>::E;
#pragma unroll
      for (int v = 0; v < 32 / E; ++v) {
        Vec16<T> vec;
#pragma unroll
        for (int k = 0; k < E; ++k) vec.v[k] = values[v * E + k];
        store16(o + v * E, vec);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 32; ++j) o[j] = values[j];
    }
  }
}

}  // namespace

void dequantize_mxfp4(DType dtype, const uint8_t* blocks, const uint8_t* scales, void* out, int64_t groups,
                      void* stream) {
  if (groups <= 0) return;
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t ctas = std::min<int64_t>((groups + 255) / 256, 65535 * 8);
    launch_dependent(dequantize_mxfp4_kernel<T>, dim3(static_cast<unsigned>(ctas)), dim3(256), 0,
                     static_cast<cudaStream_t>(stream), blocks, scales, static_cast<T*>(out), groups, aligned16(out));
  });
  check_launch("dequantize_mxfp4");
}

}  // namespace flashdraft::cuda_ops
