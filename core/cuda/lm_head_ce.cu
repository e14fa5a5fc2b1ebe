// The LM-head cross-entropy's row pass (engine_ops.cuh: ce_rows).
//
// Per row of logits x (one CTA of 1024 threads at a time), base-2 arithmetic with
// y = x * log2(e):
//   pass 1  each thread walks its 16-byte vectors keeping a running max m and a sum
//           s = sum 2^(y - m) (rescaled when m grows, once per vector, not per value) and
//           the first index of the largest raw x; the block combines the (m, s) pairs
//           (M = max, S = s1 2^(m1 - M) + s2 2^(m2 - M)) and the argmax (larger value, then
//           smaller index);  lse = (M + log2 S) ln 2.
//   pass 2  (gradient) each thread rewrites its own values in place:
//           g = (2^(y - lse log2 e) - [v == label]) * w * grad_scale.
// The label's logit is read before pass 2 overwrites it. Every thread touches only its
// own values in pass 2, so the in-place update needs no barrier beyond the reduction's.
// Bytes: pass 1 reads the row, pass 2 reads it again and writes it: at V = 151936 bf16,
// 0.3 MB read twice + 0.3 MB written per row, against the plain ATen sequence (float32
// log-softmax, exp, scatter, scale, cast to bf16: about 7 passes over 4-byte values).
// The grid is persistent (one CTA per SM walks rows blockIdx.x, blockIdx.x + gridDim.x,
// ...), so that only (SMs) rows are in flight - 132 x 0.3 MB = 40 MB on an H200, under its
// 50 MB L2 - in the hope that pass 2 reads from L2. Measured on the H200 (7680 rows, the
// step profile): 1.72-1.93 ms with a CTA per row (4 rows per SM in flight), 1.97 ms
// persistent: no gain, so pass 2 still comes from memory (three passes at ~3.5 TB/s);
// what would gain is a row split over a cluster whose shared memory holds it (see the
// real-scale section of bench/RESULTS.md).
#include "ops_common.cuh"

#include <cfloat>
#include <cmath>

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct RowStat {
  float m, s;     // max of y and sum of 2^(y - m)
  float best;     // largest raw x
  int64_t index;  // its first index
};

__device__ __forceinline__ void merge(RowStat& a, const RowStat& b) {
  const float M = fmaxf(a.m, b.m);
  if (M == -INFINITY) {
    a.s = 0.f;
  } else {
    a.s = a.s * exp2f(a.m - M) + b.s * exp2f(b.m - M);
  }
  a.m = M;
  if (b.best > a.best || (b.best == a.best && b.index < a.index)) {
    a.best = b.best;
    a.index = b.index;
  }
}

__device__ __forceinline__ RowStat shuffle_down(const RowStat& x, int offset) {
  RowStat r;
  r.m = __shfl_down_sync(0xffffffffu, x.m, offset);
  r.s = __shfl_down_sync(0xffffffffu, x.s, offset);
  r.best = __shfl_down_sync(0xffffffffu, x.best, offset);
  r.index = __shfl_down_sync(0xffffffffu, x.index, offset);
  return r;
}

__device__ __forceinline__ RowStat no_stat() { return RowStat{-INFINITY, 0.f, -INFINITY, INT64_MAX}; }

template <class MergeB>
__device__ __forceinline__ void warp_reduce_pair(RowStat& a, RowStat& b, MergeB merge_b) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const RowStat oa = shuffle_down(a, off), ob = shuffle_down(b, off);
    merge(a, oa);
    merge_b(b, ob);
  }
}

// Each thread's a (merged with merge()) and b (with merge_b, identity ib) over the CTA: the
// totals are in thread 0 when it returns (the shared slots are free after the caller's next
// __syncthreads()).
template <class MergeB>
__device__ __forceinline__ void block_reduce_pair(RowStat& a, RowStat& b, MergeB merge_b, const RowStat& ib) {
  __shared__ RowStat warp_a[kWarps], warp_b[kWarps];
  warp_reduce_pair(a, b, merge_b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_a[warp] = a;
    warp_b[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kWarps ? warp_a[lane] : no_stat();
    b = lane < kWarps ? warp_b[lane] : ib;
    warp_reduce_pair(a, b, merge_b);
  }
}

// The CTA's sum of each thread's x, in thread 0 (ends with the CTA in step: the shared slots
// are free again).
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_x[kWarps];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_down_sync(0xffffffffu, x, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_x[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? warp_x[lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x += __shfl_down_sync(0xffffffffu, x, off);
  }
  __syncthreads();
  return x;
}

// Folds values a[0..n) (raw logits, as float) starting at vocabulary index `first` into st.
template <int N>
__device__ __forceinline__ void accumulate(RowStat& st, const float (&a)[N], int64_t first) {
  float local = -INFINITY;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (a[k] > st.best) {  // strictly greater: the first index wins within a thread
      st.best = a[k];
      st.index = first + k;
    }
    local = fmaxf(local, a[k]);
  }
  const float lm = local * kLog2e;
  if (lm > st.m) {
    st.s *= exp2f(st.m - lm);
    st.m = lm;
  }
  if (st.m == -INFINITY) return;  // every value so far is -inf: nothing to add
#pragma unroll
  for (int k = 0; k < N; ++k) st.s += exp2f(fmaf(a[k], kLog2e, -st.m));
}

// One row: statistics, outputs and (write_grad) the gradient in place. Every thread of the
// CTA calls it; it ends with the CTA's threads in step (the shared values are free again).
template <typename T>
__device__ __forceinline__ void ce_row(T* __restrict__ logits, int64_t r, int64_t vocab, int64_t ld,
                                       const int64_t* __restrict__ labels, const float* __restrict__ row_weight,
                                       float grad_scale, bool write_grad, float* __restrict__ nll,
                                       int64_t* __restrict__ argmax) {
  constexpr int E = Vec16<T>::E;
  T* row = logits + r * ld;
  const bool vec = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  const int64_t nvec = vec ? vocab / E : 0;
  const int tid = threadIdx.x;

  RowStat st{-INFINITY, 0.f, -INFINITY, INT64_MAX};
  // Four 16-byte loads in flight per thread per iteration (64 KB per SM).
  constexpr int kLoads = 4;
  int64_t i = tid;
  for (; i + (kLoads - 1) * kThreads < nvec; i += kLoads * kThreads) {
    Vec16<T> v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) v[u] = load16(row + (i + u * kThreads) * E);
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      float a[E];
#pragma unroll
      for (int k = 0; k < E; ++k) a[k] = to_float(v[u].v[k]);
      accumulate(st, a, (i + u * kThreads) * E);
    }
  }
  for (; i < nvec; i += kThreads) {
    const Vec16<T> v0 = load16(row + i * E);
    float a0[E];
#pragma unroll
    for (int k = 0; k < E; ++k) a0[k] = to_float(v0.v[k]);
    accumulate(st, a0, i * E);
  }
  for (int64_t v = nvec * E + tid; v < vocab; v += kThreads) {
    const float a0[1] = {to_float(row[v])};
    accumulate(st, a0, v);
  }

  // Block reduction: warps, then the warps' results in warp 0.
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const RowStat o = shuffle_down(st, off);
    merge(st, o);
  }
  __shared__ RowStat warp_stat[kWarps];
  __shared__ float row_lse2;
  __shared__ int64_t row_label;
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0) warp_stat[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kWarps ? warp_stat[lane] : RowStat{-INFINITY, 0.f, -INFINITY, INT64_MAX};
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      const RowStat o = shuffle_down(st, off);
      merge(st, o);
    }
    if (lane == 0) {
      const float lse2 = st.m + log2f(st.s);
      const float lse = lse2 * kLn2;
      const int64_t label = labels[r];
      const bool known = label >= 0 && label < vocab;
      nll[r] = known ? lse - to_float(row[label]) : NAN;
      argmax[r] = st.index == INT64_MAX ? 0 : st.index;
      row_lse2 = lse2;
      row_label = known ? label : -1;
    }
  }
  __syncthreads();
  if (!write_grad) return;  // (uniform across the CTA)

  const float lse2 = row_lse2;
  const int64_t label = row_label;
  __syncthreads();  // every thread has read the shared values: the next row may write them
  const float coef = row_weight[r] * grad_scale;
  for (int64_t j = tid; j < nvec; j += kThreads) {
    Vec16<T> v = load16(row + j * E);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float p = exp2f(fmaf(to_float(v.v[k]), kLog2e, -lse2));
      const float g = (j * E + k == label ? p - 1.f : p) * coef;
      v.v[k] = from_float<T>(g);
    }
    store16(row + j * E, v);
  }
  for (int64_t v = nvec * E + tid; v < vocab; v += kThreads) {
    const float p = exp2f(fmaf(to_float(row[v]), kLog2e, -lse2));
    row[v] = from_float<T>((v == label ? p - 1.f : p) * coef);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    ce_rows_kernel(T* __restrict__ logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* __restrict__ labels,
                   const float* __restrict__ row_weight, float grad_scale, bool write_grad, float* __restrict__ nll,
                   int64_t* __restrict__ argmax) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    ce_row(logits, r, vocab, ld, labels, row_weight, grad_scale, write_grad, nll, argmax);
}

// One row of the soft-label loss (kl_rows): the draft's statistics (lse, argmax) and the
// target's (over y = x_t / temperature: lse, argmax), then one pass computing
// sum_v p_v (log p_v - log q_v) and (write_grad) the gradient (q_v - p_v) * coef written over
// the draft's row in place. The target's row is read twice, the draft's twice and written once.
template <typename T>
__device__ __forceinline__ void kl_row(T* __restrict__ draft, const T* __restrict__ target,
                                       const int64_t* __restrict__ target_rows, int64_t r, int64_t vocab, int64_t ld,
                                       int64_t ld_target, float inv_temperature, const float* __restrict__ row_weight,
                                       float grad_scale, bool write_grad, float* __restrict__ kl,
                                       int64_t* __restrict__ argmax, int64_t* __restrict__ target_argmax) {
  constexpr int E = Vec16<T>::E;
  T* row = draft + r * ld;
  const T* trow = target + (target_rows ? target_rows[r] : r) * ld_target;
  const bool vec = reinterpret_cast<uintptr_t>(row) % 16 == 0 && reinterpret_cast<uintptr_t>(trow) % 16 == 0;
  const int64_t nvec = vec ? vocab / E : 0;
  const int tid = threadIdx.x;
  RowStat sd{-INFINITY, 0.f, -INFINITY, INT64_MAX}, st{-INFINITY, 0.f, -INFINITY, INT64_MAX};
  for (int64_t i = tid; i < nvec; i += kThreads) {
    const Vec16<T> vd = load16(row + i * E), vt = load16(trow + i * E);
    float a[E], b[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      a[k] = to_float(vd.v[k]);
      b[k] = to_float(vt.v[k]) * inv_temperature;
    }
    accumulate(sd, a, i * E);
    accumulate(st, b, i * E);
  }
  for (int64_t v = nvec * E + tid; v < vocab; v += kThreads) {
    const float a0[1] = {to_float(row[v])};
    const float b0[1] = {to_float(trow[v]) * inv_temperature};
    accumulate(sd, a0, v);
    accumulate(st, b0, v);
  }
  __shared__ float lse2_d, lse2_t;
  block_reduce_pair(sd, st, merge, no_stat());
  if (tid == 0) {
    lse2_d = sd.m + log2f(sd.s);
    lse2_t = st.m + log2f(st.s);
    argmax[r] = sd.index == INT64_MAX ? 0 : sd.index;
    target_argmax[r] = st.index == INT64_MAX ? 0 : st.index;
  }
  __syncthreads();
  const float ld2 = lse2_d, lt2 = lse2_t;
  const float coef = write_grad ? row_weight[r] * grad_scale : 0.f;
  float acc = 0.f;  // sum p (log2 p - log2 q), in bits
  for (int64_t i = tid; i < nvec; i += kThreads) {
    Vec16<T> vd = load16(row + i * E);
    const Vec16<T> vt = load16(trow + i * E);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float yq = fmaf(to_float(vd.v[k]), kLog2e, -ld2),
                  yp = fmaf(to_float(vt.v[k]) * inv_temperature, kLog2e, -lt2);
      const float p = exp2f(yp), q = exp2f(yq);
      acc += p > 0.f ? p * (yp - yq) : 0.f;
      if (write_grad) vd.v[k] = from_float<T>((q - p) * coef);
    }
    if (write_grad) store16(row + i * E, vd);
  }
  for (int64_t v = nvec * E + tid; v < vocab; v += kThreads) {
    const float yq = fmaf(to_float(row[v]), kLog2e, -ld2), yp = fmaf(to_float(trow[v]) * inv_temperature, kLog2e, -lt2);
    const float p = exp2f(yp), q = exp2f(yq);
    acc += p > 0.f ? p * (yp - yq) : 0.f;
    if (write_grad) row[v] = from_float<T>((q - p) * coef);
  }
  acc = block_sum(acc);
  if (tid == 0) kl[r] = acc * kLn2;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    kl_rows_kernel(T* __restrict__ draft, const T* __restrict__ target, const int64_t* __restrict__ target_rows,
                   int64_t rows, int64_t vocab, int64_t ld, int64_t ld_target, float inv_temperature,
                   const float* __restrict__ row_weight, float grad_scale, bool write_grad, float* __restrict__ kl,
                   int64_t* __restrict__ argmax, int64_t* __restrict__ target_argmax) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    kl_row(draft, target, target_rows, r, vocab, ld, ld_target, inv_temperature, row_weight, grad_scale, write_grad, kl,
           argmax, target_argmax);
}

// One row of the loss against a given distribution (prob_rows): pass 1 the draft's statistics
// (lse, argmax), sum(p) and the first largest p; pass 2 -sum_v p_v log q_v and (write_grad)
// (q_v sum(p) - p_v) * coef over the draft's row in place. The draft's row is read twice and
// written once, the distribution's (float32) read twice.
template <typename T>
__device__ __forceinline__ void prob_row(T* __restrict__ draft, const float* __restrict__ probs,
                                         const int64_t* __restrict__ prob_rows, int64_t r, int64_t vocab, int64_t ld,
                                         int64_t ld_probs, const float* __restrict__ row_weight, float grad_scale,
                                         bool write_grad, float* __restrict__ ce, int64_t* __restrict__ argmax,
                                         int64_t* __restrict__ target_argmax) {
  constexpr int E = Vec16<T>::E;
  T* row = draft + r * ld;
  const float* prow = probs + (prob_rows ? prob_rows[r] : r) * ld_probs;
  const bool vec = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  const int64_t nvec = vec ? vocab / E : 0;
  const int tid = threadIdx.x;
  RowStat sd{-INFINITY, 0.f, -INFINITY, INT64_MAX};
  float psum = 0.f, pbest = -INFINITY;
  int64_t pindex = INT64_MAX;
  auto see_p = [&](float p, int64_t v) {
    psum += p;
    if (p > pbest) {  // strictly greater: the first index wins within a thread
      pbest = p;
      pindex = v;
    }
  };
  for (int64_t i = tid; i < nvec; i += kThreads) {
    const Vec16<T> vd = load16(row + i * E);
    float a[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      a[k] = to_float(vd.v[k]);
      see_p(prow[i * E + k], i * E + k);
    }
    accumulate(sd, a, i * E);
  }
  for (int64_t v = nvec * E + tid; v < vocab; v += kThreads) {
    const float a0[1] = {to_float(row[v])};
    accumulate(sd, a0, v);
    see_p(prow[v], v);
  }
  // The distribution's (sum, best, index) ride in a RowStat's (s, best, index), m unused.
  RowStat sp{0.f, psum, pbest, pindex};
  auto merge_p = [](RowStat& a, const RowStat& b) {
    a.s += b.s;
    if (b.best > a.best || (b.best == a.best && b.index < a.index)) {
      a.best = b.best;
      a.index = b.index;
    }
  };
  __shared__ float lse2_d, row_psum;
  block_reduce_pair(sd, sp, merge_p, RowStat{0.f, 0.f, -INFINITY, INT64_MAX});
  if (tid == 0) {
    lse2_d = sd.m + log2f(sd.s);
    row_psum = sp.s;
    argmax[r] = sd.index == INT64_MAX ? 0 : sd.index;
    target_argmax[r] = sp.index == INT64_MAX ? 0 : sp.index;
  }
  __syncthreads();
  const float ld2 = lse2_d, total = row_psum;
  const float coef = write_grad ? row_weight[r] * grad_scale : 0.f;
  float acc = 0.f;  // sum p (lse - x) log2 e, in bits
  for (int64_t i = tid; i < nvec; i += kThreads) {
    Vec16<T> vd = load16(row + i * E);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float yq = fmaf(to_float(vd.v[k]), kLog2e, -ld2), p = prow[i * E + k];
      acc -= p * yq;
      if (write_grad) vd.v[k] = from_float<T>((exp2f(yq) * total - p) * coef);
    }
    if (write_grad) store16(row + i * E, vd);
  }
  for (int64_t v = nvec * E + tid; v < vocab; v += kThreads) {
    const float yq = fmaf(to_float(row[v]), kLog2e, -ld2), p = prow[v];
    acc -= p * yq;
    if (write_grad) row[v] = from_float<T>((exp2f(yq) * total - p) * coef);
  }
  acc = block_sum(acc);
  if (tid == 0) ce[r] = acc * kLn2;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prob_rows_kernel(T* __restrict__ draft, const float* __restrict__ probs, const int64_t* __restrict__ prob_rows,
                     int64_t rows, int64_t vocab, int64_t ld, int64_t ld_probs, const float* __restrict__ row_weight,
                     float grad_scale, bool write_grad, float* __restrict__ ce, int64_t* __restrict__ argmax,
                     int64_t* __restrict__ target_argmax) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    prob_row(draft, probs, prob_rows, r, vocab, ld, ld_probs, row_weight, grad_scale, write_grad, ce, argmax,
             target_argmax);
}

// Multiprocessors of the current device (asked once per device).
int sm_count() {
  static int counts[64] = {0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (counts[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 132;
    counts[device] = n;
  }
  return counts[device];
}

}  // namespace

void ce_rows(DType dtype, void* logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* labels,
             const float* row_weight, float grad_scale, bool write_grad, float* nll, int64_t* argmax, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || ld < vocab) throw std::runtime_error("ce_rows: vocabulary and row stride must satisfy 0 < V <= ld");
  if (write_grad && !row_weight) throw std::runtime_error("ce_rows: the gradient needs the row weights");
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t grid = rows < sm_count() ? rows : sm_count();
    ce_rows_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(logits), rows, vocab, ld, labels, row_weight, grad_scale, write_grad, nll, argmax);
  });
  check_launch("ce_rows");
}

void kl_rows(DType dtype, void* draft, const void* target, const int64_t* target_rows, int64_t rows, int64_t vocab,
             int64_t ld, int64_t ld_target, float temperature, const float* row_weight, float grad_scale,
             bool write_grad, float* kl, int64_t* argmax, int64_t* target_argmax, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || ld < vocab || ld_target < vocab)
    throw std::runtime_error("kl_rows: vocabulary and row strides must satisfy 0 < V <= ld");
  if (!(temperature > 0.f)) throw std::runtime_error("kl_rows: the temperature must be positive");
  if (write_grad && !row_weight) throw std::runtime_error("kl_rows: the gradient needs the row weights");
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t grid = rows < sm_count() ? rows : sm_count();
    kl_rows_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(draft), static_cast<const T*>(target), target_rows, rows, vocab, ld, ld_target,
        1.f / temperature, row_weight, grad_scale, write_grad, kl, argmax, target_argmax);
  });
  check_launch("kl_rows");
}

void prob_rows(DType dtype, void* draft, const float* probs, const int64_t* prob_rows, int64_t rows, int64_t vocab,
               int64_t ld, int64_t ld_probs, const float* row_weight, float grad_scale, bool write_grad, float* ce,
               int64_t* argmax, int64_t* target_argmax, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || ld < vocab || ld_probs < vocab)
    throw std::runtime_error("prob_rows: vocabulary and row strides must satisfy 0 < V <= ld");
  if (write_grad && !row_weight) throw std::runtime_error("prob_rows: the gradient needs the row weights");
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t grid = rows < sm_count() ? rows : sm_count();
    prob_rows_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(draft), probs, prob_rows, rows, vocab, ld, ld_probs, row_weight, grad_scale, write_grad, ce,
        argmax, target_argmax);
  });
  check_launch("prob_rows");
}

}  // namespace flashdraft::cuda_ops
