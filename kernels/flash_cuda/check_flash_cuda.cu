// check_flash_cuda: standalone correctness check and benchmark of flash_cuda (no LibTorch).
//
//   ./check_flash_cuda check   every mask kind x dtype x head dim x configuration, on fresh
//                              random inputs, against a plain fp32 GPU reference (one CUDA
//                              thread block per row / key, masks from a dense bool array);
//                              outputs poisoned (0xFF = NaN) before every call.
//   ./check_flash_cuda tail    the same two problems, sm90a and sm120, each CTA order
//                              (grid, longest-first): one traced call per kernel --
//                              span, SM idle fraction, tail, CTA times (NOTES.md v10);
//                              then a fit of each CTA's time to a fixed cost plus a cost
//                              per mask tile of its item (NOTES.md v13).
//   ./check_flash_cuda bench   DFlash mask (S=4096 context, 512 anchors x 16) and causal
//                              L=8192, bf16, B=1, H=32, D=128: median ms of forward and
//                              backward (cudaEvents) for the sm120, sm90 and sm90a
//                              configurations, effective TFLOP/s over visible pairs
//                              (4*pairs*D*H fwd, 2.5x bwd), then the mma.sync backward's
//                              phases timed one by one, with the dQ-pass shapes and the
//                              atomic dQ NOTES.md v2/v3 compare; the DFlash case is first
//                              checked against the reference at H=4.
//   ./check_flash_cuda sweep   the bench's DFlash problem (and causal 8192 with
//                              FLASHDRAFT_SWEEP_CAUSAL=1, the online target's causal S = 3072
//                              with 32 / 8 heads with FLASHDRAFT_SWEEP_TARGET=1), in the sm90a configuration or the
//                              one FLASHDRAFT_SWEEP_CONFIG names (sm120, sm90): variants given as
//                              environment settings, FLASHDRAFT_SWEEP="name|VAR=v VAR=v;name|..."
//                              (an empty list of settings is the default; the setting
//                              FLASHDRAFT_SWEEP_SCHEDULE=grid|longest-first sets the variant's
//                              CTA order), timed in
//                              alternating rounds (FLASHDRAFT_SWEEP_ROUNDS, default 4) in
//                              one process, on the same inputs.
//   ./check_flash_cuda profile the bench's DFlash problem, sm90a (or FLASHDRAFT_SWEEP_CONFIG),
//                              3 forward and 3 backward calls (for ncu: --launch-skip picks one).
// FLASHDRAFT_CHECK_SEED=<n> fixes the seed (printed on every run) instead of the clock's.
// FLASHDRAFT_CHECK_SCHEDULE=grid|longest-first sets the CTA order `bench` times (default:
// FlashParams' own, longest first); `tail` times both.
// The BlockMask is built here from the dense mask by a tiny builder (same format as
// flashdraft/block_mask.hpp, 128x64 tiles). Exit code 1 on any failure.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "flash_attention.cuh"
#include "flash_kernels.cuh"  // only for the per-phase backward timing in bench

using namespace flashdraft::flash_cuda;

#define CK(x)                                                                                               \
  do {                                                                                                      \
    cudaError_t e_ = (x);                                                                                   \
    if (e_ != cudaSuccess) {                                                                                \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                                         \
    }                                                                                                       \
  } while (0)

// ------------------------------------------------------------------ masks on the host
struct DenseMask {
  int batch = 1, heads = 1, Lq = 0, Lkv = 0;
  std::vector<uint8_t> m;  // [batch][heads][Lq][Lkv]
  uint8_t& at(int b, int h, int q, int k) { return m[(((size_t)b * heads + h) * Lq + q) * Lkv + k]; }
  uint8_t at(int b, int h, int q, int k) const { return m[(((size_t)b * heads + h) * Lq + q) * Lkv + k]; }
  void init(int b, int h, int lq, int lkv) {
    batch = b, heads = h, Lq = lq, Lkv = lkv;
    m.assign((size_t)b * h * lq * lkv, 0);
  }
  int64_t pairs() const {
    int64_t n = 0;
    for (uint8_t x : m) n += x;
    return n;
  }
};

struct HostBlockMask {
  int batch, heads, Lq, Lkv, qB, kB;
  std::vector<int32_t> fo, fi, po, pi, tfo, tfi, tpo, tpi, tpe;
  std::vector<uint32_t> bits;
};

HostBlockMask build_block_mask(const DenseMask& d) {
  const int BQ = kTileQ, BK = kTileKV, W = (BK + 31) / 32;
  HostBlockMask r;
  r.batch = d.batch, r.heads = d.heads, r.Lq = d.Lq, r.Lkv = d.Lkv;
  r.qB = (d.Lq + BQ - 1) / BQ, r.kB = (d.Lkv + BK - 1) / BK;
  const int ncols = d.batch * d.heads * r.kB;
  std::vector<std::vector<int32_t>> tf(ncols), tp(ncols), te(ncols);
  r.fo.push_back(0);
  r.po.push_back(0);
  for (int b = 0; b < d.batch; ++b)
    for (int h = 0; h < d.heads; ++h)
      for (int i = 0; i < r.qB; ++i) {
        for (int j = 0; j < r.kB; ++j) {
          const int q0 = i * BQ, q1 = std::min(q0 + BQ, d.Lq), k0 = j * BK, k1 = std::min(k0 + BK, d.Lkv);
          int64_t cnt = 0;
          for (int q = q0; q < q1; ++q)
            for (int k = k0; k < k1; ++k) cnt += d.at(b, h, q, k);
          if (cnt == 0) continue;
          const int col = (b * d.heads + h) * r.kB + j;
          if (cnt == int64_t(q1 - q0) * (k1 - k0)) {
            r.fi.push_back(j);
            tf[col].push_back(i);
          } else {
            const int e = (int)r.pi.size();
            r.pi.push_back(j);
            tp[col].push_back(i);
            te[col].push_back(e);
            const size_t base = r.bits.size();
            r.bits.resize(base + (size_t)BQ * W, 0u);
            for (int q = q0; q < q1; ++q)
              for (int k = k0; k < k1; ++k)
                if (d.at(b, h, q, k)) r.bits[base + (q - q0) * W + (k - k0) / 32] |= 1u << ((k - k0) % 32);
          }
        }
        r.fo.push_back((int32_t)r.fi.size());
        r.po.push_back((int32_t)r.pi.size());
      }
  r.tfo.push_back(0);
  r.tpo.push_back(0);
  for (int c = 0; c < ncols; ++c) {
    r.tfi.insert(r.tfi.end(), tf[c].begin(), tf[c].end());
    r.tpi.insert(r.tpi.end(), tp[c].begin(), tp[c].end());
    r.tpe.insert(r.tpe.end(), te[c].begin(), te[c].end());
    r.tfo.push_back((int32_t)r.tfi.size());
    r.tpo.push_back((int32_t)r.tpi.size());
  }
  if (r.bits.empty()) r.bits.push_back(0);  // keep device pointers non-null
  if (r.fi.empty()) r.fi.push_back(0);
  if (r.pi.empty()) r.pi.push_back(0);
  if (r.tfi.empty()) r.tfi.push_back(0);
  if (r.tpi.empty()) r.tpi.push_back(0), r.tpe.push_back(0);
  return r;
}

template <class V>
V* upload(const std::vector<V>& h) {
  V* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(16, h.size() * sizeof(V))));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(V), cudaMemcpyHostToDevice));
  return d;
}

struct DeviceMask {
  FlashMask fm;
  uint8_t* dense = nullptr;
  std::vector<void*> owned;
  int nfull = 0, npart = 0;
  void init(const DenseMask& d) {
    HostBlockMask h = build_block_mask(d);
    nfull = h.fo.back(), npart = h.po.back();
    auto up = [&](auto& v) {
      auto* p = upload(v);
      owned.push_back(p);
      return p;
    };
    fm.full_offset = up(h.fo), fm.full_index = up(h.fi), fm.part_offset = up(h.po), fm.part_index = up(h.pi);
    fm.bits = up(h.bits);
    fm.t_full_offset = up(h.tfo), fm.t_full_index = up(h.tfi), fm.t_part_offset = up(h.tpo);
    fm.t_part_index = up(h.tpi), fm.t_part_entry = up(h.tpe);
    fm.batch = d.batch, fm.heads = d.heads, fm.block_q = kTileQ, fm.block_kv = kTileKV;
    dense = upload(d.m);
    owned.push_back(dense);
  }
  ~DeviceMask() {
    for (void* p : owned) cudaFree(p);
  }
};

// ------------------------------------------------------------------ mask kinds
void mask_causal(DenseMask& d, int Lq, int Lkv) {  // bottom-right aligned
  d.init(1, 1, Lq, Lkv);
  for (int q = 0; q < Lq; ++q)
    for (int k = 0; k < Lkv; ++k) d.at(0, 0, q, k) = k <= q + (Lkv - Lq);
}
void mask_sliding(DenseMask& d, int Lq, int Lkv, int window) {
  d.init(1, 1, Lq, Lkv);
  for (int q = 0; q < Lq; ++q)
    for (int k = 0; k < Lkv; ++k) {
      const int qq = q + (Lkv - Lq);
      d.at(0, 0, q, k) = k <= qq && k > qq - window;
    }
}
// DFlash: queries = N blocks of BS tokens; keys = [context S | block tokens N*BS]. Block b
// sees context positions < anchor_b and its own block (bidirectional); invalid: nothing.
void mask_dflash(DenseMask& d, int batch, int S, int N, int BS, int invalid, std::mt19937& rng) {
  d.init(batch, 1, N * BS, S + N * BS);
  for (int b = 0; b < batch; ++b) {
    std::vector<int> pos(S - BS);
    for (int i = 0; i < S - BS; ++i) pos[i] = i + 1;
    std::shuffle(pos.begin(), pos.end(), rng);
    std::vector<int> anchors(pos.begin(), pos.begin() + N);
    std::sort(anchors.begin(), anchors.end());
    for (int blk = 0; blk < N; ++blk) {
      if (blk >= N - invalid) continue;  // padded blocks see nothing
      for (int j = 0; j < BS; ++j) {
        const int q = blk * BS + j;
        for (int k = 0; k < anchors[blk]; ++k) d.at(b, 0, q, k) = 1;
        for (int k = 0; k < BS; ++k) d.at(b, 0, q, S + blk * BS + k) = 1;
      }
    }
  }
}
// Random per-head mask: density p, some fully visible 64-key stripes, some empty rows.
void mask_random(DenseMask& d, int batch, int heads, int Lq, int Lkv, std::mt19937& rng) {
  d.init(batch, heads, Lq, Lkv);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h) {
      const float p = 0.1f + 0.5f * u(rng);
      for (int q = 0; q < Lq; ++q) {
        const bool empty = u(rng) < 0.05f;
        for (int k = 0; k < Lkv; ++k)
          d.at(b, h, q, k) = !empty && (u(rng) < p || (k / 64) % 3 == 1 || (q / 128 == 1 && k < 150));
      }
    }
}
void mask_dense(DenseMask& d, int Lq, int Lkv) {
  d.init(1, 1, Lq, Lkv);
  std::fill(d.m.begin(), d.m.end(), 1);
}

// ------------------------------------------------------------------ device helpers
template <class T>
struct TT;
template <>
struct TT<__nv_bfloat16> {
  static __host__ __device__ float f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __host__ __device__ __nv_bfloat16 t(float x) { return __float2bfloat16(x); }
};
template <>
struct TT<__half> {
  static __host__ __device__ float f(__half x) { return __half2float(x); }
  static __host__ __device__ __half t(float x) { return __float2half(x); }
};

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return (uint32_t)x;
}
template <class T>
__global__ void fill_random(T* p, size_t n, uint64_t seed, float amp) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    // sum of two uniforms: a triangular distribution in (-amp, amp)
    const float a = hash32(seed * 0x9E3779B97F4A7C15ULL + 2 * i) * (1.f / 4294967296.f);
    const float b = hash32(seed * 0x9E3779B97F4A7C15ULL + 2 * i + 1) * (1.f / 4294967296.f);
    p[i] = TT<T>::t(amp * (a + b - 1.f));
  }
}

struct RefArgs {
  const void *q, *k, *v, *dout;
  Strides qs, ks, vs, dos;
  int B, Hq, Hkv, Lq, Lkv, D;
  float scale;
  const uint8_t* mask;
  int mb, mh;
  float *out, *lse, *dq, *dk, *dv, *delta;  // contiguous fp32 [B,H,L,(D)]
};
__device__ bool ref_vis(const RefArgs& a, int b, int h, int q, int k) {
  const int mb = a.mb == 1 ? 0 : b, mh = a.mh == 1 ? 0 : h;
  return a.mask[(((size_t)mb * a.mh + mh) * a.Lq + q) * a.Lkv + k] != 0;
}
template <class T>
__device__ float ref_dot(const T* x, const T* y, int D, int lane) {
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += TT<T>::f(x[d]) * TT<T>::f(y[d]);
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}
__device__ float block_reduce(float v, bool is_max, float* red) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, u) : v + u;
  }
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < (int)blockDim.x / 32; ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
  return r;
}
// One block (128 threads) per (q, h, b): scores in shared memory.
template <class T>
__global__ void ref_forward(RefArgs a) {
  extern __shared__ float sm[];
  float* s = sm;  // [Lkv]
  __shared__ float red[32];
  const int q = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (a.Hq / a.Hkv);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const T* Q = (const T*)a.q + b * a.qs.batch + h * a.qs.head + q * a.qs.row;
  for (int k = w; k < a.Lkv; k += nw) {
    float v = -INFINITY;
    if (ref_vis(a, b, h, q, k))
      v = a.scale * ref_dot(Q, (const T*)a.k + b * a.ks.batch + hk * a.ks.head + k * a.ks.row, a.D, lane);
    if (lane == 0) s[k] = v;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int k = threadIdx.x; k < a.Lkv; k += blockDim.x) mx = fmaxf(mx, s[k]);
  mx = block_reduce(mx, true, red);
  float sum = 0.f;
  for (int k = threadIdx.x; k < a.Lkv; k += blockDim.x) sum += mx == -INFINITY ? 0.f : expf(s[k] - mx);
  sum = block_reduce(sum, false, red);
  const size_t row = ((size_t)b * a.Hq + h) * a.Lq + q;
  for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
    float o = 0.f;
    if (sum > 0.f)
      for (int k = 0; k < a.Lkv; ++k)
        if (s[k] != -INFINITY)
          o += expf(s[k] - mx) * TT<T>::f(((const T*)a.v)[b * a.vs.batch + hk * a.vs.head + k * a.vs.row + d]);
    a.out[row * a.D + d] = sum > 0.f ? o / sum : 0.f;
  }
  if (threadIdx.x == 0) a.lse[row] = sum > 0.f ? mx + logf(sum) : -INFINITY;
}
// dQ and delta: one block per (q, h, b).
template <class T>
__global__ void ref_dq(RefArgs a) {
  extern __shared__ float sm[];
  float* p = sm;           // [Lkv]
  float* dp = sm + a.Lkv;  // [Lkv]
  __shared__ float red[32];
  const int q = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (a.Hq / a.Hkv);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const size_t row = ((size_t)b * a.Hq + h) * a.Lq + q;
  const float lse = a.lse[row];
  const T* Q = (const T*)a.q + b * a.qs.batch + h * a.qs.head + q * a.qs.row;
  const T* dO = (const T*)a.dout + b * a.dos.batch + h * a.dos.head + q * a.dos.row;
  for (int k = w; k < a.Lkv; k += nw) {
    float pv = 0.f, dpv = 0.f;
    if (lse != -INFINITY && ref_vis(a, b, h, q, k)) {
      pv = expf(a.scale * ref_dot(Q, (const T*)a.k + b * a.ks.batch + hk * a.ks.head + k * a.ks.row, a.D, lane) - lse);
      dpv = ref_dot(dO, (const T*)a.v + b * a.vs.batch + hk * a.vs.head + k * a.vs.row, a.D, lane);
    }
    if (lane == 0) p[k] = pv, dp[k] = dpv;
  }
  __syncthreads();
  float de = 0.f;
  for (int k = threadIdx.x; k < a.Lkv; k += blockDim.x) de += p[k] * dp[k];
  de = block_reduce(de, false, red);
  for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < a.Lkv; ++k)
      if (p[k] != 0.f)
        acc += p[k] * (dp[k] - de) * TT<T>::f(((const T*)a.k)[b * a.ks.batch + hk * a.ks.head + k * a.ks.row + d]);
    a.dq[row * a.D + d] = a.scale * acc;
  }
  if (threadIdx.x == 0) a.delta[row] = de;
}
// dK, dV: one block per (key, kv head, b); walks every query of the GQA group in chunks.
template <class T>
__global__ void ref_dkdv(RefArgs a) {
  __shared__ float cp[128], cds[128];
  __shared__ int cq[128], ch[128];
  const int k = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, group = a.Hq / a.Hkv;
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const T* Kr = (const T*)a.k + b * a.ks.batch + hk * a.ks.head + k * a.ks.row;
  const T* Vr = (const T*)a.v + b * a.vs.batch + hk * a.vs.head + k * a.vs.row;
  float dk = 0.f, dv = 0.f;
  const int d = threadIdx.x;
  const int total = group * a.Lq;
  for (int c0 = 0; c0 < total; c0 += 128) {
    for (int i = w; i < 128; i += nw) {
      const int idx = c0 + i;
      float pv = 0.f, dsv = 0.f;
      int h = 0, q = 0;
      if (idx < total) {
        h = hk * group + idx / a.Lq, q = idx % a.Lq;
        const size_t row = ((size_t)b * a.Hq + h) * a.Lq + q;
        const float lse = a.lse[row];
        if (lse != -INFINITY && ref_vis(a, b, h, q, k)) {
          const T* Q = (const T*)a.q + b * a.qs.batch + h * a.qs.head + q * a.qs.row;
          const T* dO = (const T*)a.dout + b * a.dos.batch + h * a.dos.head + q * a.dos.row;
          pv = expf(a.scale * ref_dot(Q, Kr, a.D, lane) - lse);
          dsv = pv * (ref_dot(dO, Vr, a.D, lane) - a.delta[row]);
        }
      }
      if (lane == 0) cp[i] = pv, cds[i] = dsv, cq[i] = q, ch[i] = h;
    }
    __syncthreads();
    if (d < a.D)
      for (int i = 0; i < 128; ++i)
        if (cp[i] != 0.f) {
          const int h = ch[i], q = cq[i];
          dv += cp[i] * TT<T>::f(((const T*)a.dout)[b * a.dos.batch + h * a.dos.head + q * a.dos.row + d]);
          dk += cds[i] * TT<T>::f(((const T*)a.q)[b * a.qs.batch + h * a.qs.head + q * a.qs.row + d]);
        }
    __syncthreads();
  }
  if (d < a.D) {
    const size_t row = ((size_t)b * a.Hkv + hk) * a.Lkv + k;
    a.dk[row * a.D + d] = a.scale * dk;
    a.dv[row * a.D + d] = dv;
  }
}

// ------------------------------------------------------------------ one problem
struct Problem {
  std::string name;
  DenseMask mask;
  int B = 1, Hq = 1, Hkv = 1, D = 128;
  bool bshd = false;  // q/k/v/dout laid out [B, L, H, D] (strided views)
};

template <class T>
std::vector<float> to_host_f(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = TT<T>::f(h[i]);
  return r;
}
std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> r(n);
  CK(cudaMemcpy(r.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return r;
}
struct Cmp {
  double rel = 0;
  size_t nonfinite = 0;
};
Cmp compare(const std::vector<float>& a, const std::vector<float>& r) {
  Cmp c;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) {
      ++c.nonfinite;
      continue;
    }
    const double e = double(a[i]) - r[i];
    num += e * e;
    den += double(r[i]) * r[i];
  }
  c.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

struct Buffers {
  void *q, *k, *v, *dout, *out, *dq, *dk, *dv, *ws;
  float* lse;
  Strides qs, ks, vs, dos, os, dqs, dks, dvs;
};

template <class T>
void alloc_buffers(const Problem& pr, Buffers& bf, uint64_t seed, size_t ws_bytes) {
  const int Lq = pr.mask.Lq, Lkv = pr.mask.Lkv, D = pr.D;
  const size_t nq = (size_t)pr.B * pr.Hq * Lq * D, nk = (size_t)pr.B * pr.Hkv * Lkv * D;
  auto mk = [&](size_t n, uint64_t s, float amp) {
    T* p;
    CK(cudaMalloc(&p, n * sizeof(T)));
    fill_random<T><<<1024, 256>>>(p, n, s, amp);
    CK(cudaGetLastError());
    return (void*)p;
  };
  bf.q = mk(nq, seed + 1, 2.0f), bf.k = mk(nk, seed + 2, 2.0f), bf.v = mk(nk, seed + 3, 1.0f);
  bf.dout = mk(nq, seed + 4, 1.0f);
  auto st = [&](int H, int L) {
    return pr.bshd ? Strides{(int64_t)L * H * D, D, (int64_t)H * D} : Strides{(int64_t)H * L * D, (int64_t)L * D, D};
  };
  auto contig = [&](int H, int L) { return Strides{(int64_t)H * L * D, (int64_t)L * D, D}; };
  bf.qs = st(pr.Hq, Lq), bf.dos = st(pr.Hq, Lq), bf.ks = st(pr.Hkv, Lkv), bf.vs = st(pr.Hkv, Lkv);
  bf.os = contig(pr.Hq, Lq), bf.dqs = contig(pr.Hq, Lq), bf.dks = contig(pr.Hkv, Lkv), bf.dvs = contig(pr.Hkv, Lkv);
  CK(cudaMalloc(&bf.out, nq * sizeof(T)));
  CK(cudaMalloc(&bf.dq, nq * sizeof(T)));
  CK(cudaMalloc(&bf.dk, nk * sizeof(T)));
  CK(cudaMalloc(&bf.dv, nk * sizeof(T)));
  CK(cudaMalloc(&bf.lse, (size_t)pr.B * pr.Hq * Lq * sizeof(float)));
  CK(cudaMalloc(&bf.ws, std::max<size_t>(ws_bytes, 16)));
}
void free_buffers(Buffers& bf) {
  for (void* p : {bf.q, bf.k, bf.v, bf.dout, bf.out, bf.dq, bf.dk, bf.dv, bf.ws, (void*)bf.lse}) cudaFree(p);
}

// flash_backward_workspace_bytes() of the problem (it covers the forward's workspace too).
size_t workspace_bytes(const Problem& pr) {
  FlashParams p;
  p.B = pr.B, p.Hq = pr.Hq, p.Hkv = pr.Hkv, p.Lq = pr.mask.Lq, p.Lkv = pr.mask.Lkv, p.D = pr.D;
  return flash_backward_workspace_bytes(p);
}

FlashParams make_params(const Problem& pr, const Buffers& bf, const DeviceMask& dm, DType dt) {
  FlashParams p;
  p.dtype = dt;
  p.B = pr.B, p.Hq = pr.Hq, p.Hkv = pr.Hkv, p.Lq = pr.mask.Lq, p.Lkv = pr.mask.Lkv, p.D = pr.D;
  p.scale = 1.f / std::sqrt((float)pr.D);
  p.q = bf.q, p.k = bf.k, p.v = bf.v, p.q_strides = bf.qs, p.k_strides = bf.ks, p.v_strides = bf.vs;
  p.out = bf.out, p.out_strides = bf.os, p.lse = bf.lse;
  p.dout = bf.dout, p.dout_strides = bf.dos;
  p.dq = bf.dq, p.dk = bf.dk, p.dv = bf.dv, p.dq_strides = bf.dqs, p.dk_strides = bf.dks, p.dv_strides = bf.dvs;
  p.workspace = bf.ws;
  p.mask = dm.fm;
  return p;
}

// One bf16 problem set up on the device for timing: its mask, buffers (random inputs from
// `seed`, a workspace of ws_bytes) and the parameters of a call; freed on scope exit.
struct BenchSetup {
  DeviceMask dm;
  Buffers bf;
  FlashParams p;
  BenchSetup(const Problem& pr, uint64_t seed, size_t ws_bytes) {
    dm.init(pr.mask);
    alloc_buffers<__nv_bfloat16>(pr, bf, seed, ws_bytes);
    p = make_params(pr, bf, dm, DType::bf16);
  }
  ~BenchSetup() { free_buffers(bf); }
  BenchSetup(const BenchSetup&) = delete;
  BenchSetup& operator=(const BenchSetup&) = delete;
};

static int g_failures = 0;

// scale_error != 1: negative control -- the kernel runs with a wrong scale and the check
// must fail (counted as a failure when it does not). forward_only: the forward alone (heads of
// 192 and 256), its gradients reported as 0.
template <class T>
void run_check(const Problem& pr, Config cfg, uint64_t seed, float scale_error = 1.f, bool forward_only = false) {
  const DType dt = std::is_same<T, __nv_bfloat16>::value ? DType::bf16 : DType::fp16;
  const double tol = dt == DType::bf16 ? 2e-2 : 1e-2;
  DeviceMask dm;
  dm.init(pr.mask);
  Buffers bf;
  alloc_buffers<T>(pr, bf, seed, workspace_bytes(pr));
  FlashParams p = make_params(pr, bf, dm, dt);
  // both CTA orders are checked, alternately (the outputs must not depend on the order)
  p.schedule = seed % 2 ? Schedule::grid : Schedule::longest_first;
  const float true_scale = p.scale;
  p.scale *= scale_error;
  const int Lq = p.Lq, Lkv = p.Lkv, D = p.D;
  const size_t nq = (size_t)pr.B * pr.Hq * Lq * D, nk = (size_t)pr.B * pr.Hkv * Lkv * D, nl = (size_t)pr.B * pr.Hq * Lq;
  // poison every output: 0xFF bytes are NaN in bf16, fp16 and fp32
  CK(cudaMemset(bf.out, 0xFF, nq * sizeof(T)));
  CK(cudaMemset(bf.lse, 0xFF, nl * sizeof(float)));
  CK(cudaMemset(bf.dq, 0xFF, nq * sizeof(T)));
  CK(cudaMemset(bf.dk, 0xFF, nk * sizeof(T)));
  CK(cudaMemset(bf.dv, 0xFF, nk * sizeof(T)));
  CK(cudaMemset(bf.ws, 0xFF, flash_backward_workspace_bytes(p)));
  std::string vf, vb;
  try {
    vf = flash_forward(p, cfg);
    CK(cudaDeviceSynchronize());
    if (!forward_only) {
      vb = flash_backward(p, cfg);
      CK(cudaDeviceSynchronize());
    } else {  // no gradients: the comparisons below see the reference's zeros
      CK(cudaMemset(bf.dq, 0, nq * sizeof(T)));
      CK(cudaMemset(bf.dk, 0, nk * sizeof(T)));
      CK(cudaMemset(bf.dv, 0, nk * sizeof(T)));
    }
  } catch (const std::exception& e) {
    std::printf("FAIL %-28s exception: %s\n", pr.name.c_str(), e.what());
    ++g_failures;
    free_buffers(bf);
    return;
  }
  // reference
  RefArgs a;
  a.q = bf.q, a.k = bf.k, a.v = bf.v, a.dout = bf.dout;
  a.qs = bf.qs, a.ks = bf.ks, a.vs = bf.vs, a.dos = bf.dos;
  a.B = pr.B, a.Hq = pr.Hq, a.Hkv = pr.Hkv, a.Lq = Lq, a.Lkv = Lkv, a.D = D, a.scale = true_scale;
  a.mask = dm.dense, a.mb = pr.mask.batch, a.mh = pr.mask.heads;
  CK(cudaMalloc(&a.out, nq * 4));
  CK(cudaMalloc(&a.dq, nq * 4));
  CK(cudaMalloc(&a.dk, nk * 4));
  CK(cudaMalloc(&a.dv, nk * 4));
  CK(cudaMalloc(&a.lse, nl * 4));
  CK(cudaMalloc(&a.delta, nl * 4));
  const int smem_f = Lkv * 4, smem_q = 2 * Lkv * 4;
  CK(cudaFuncSetAttribute(ref_forward<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(ref_dq<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  ref_forward<T><<<dim3(Lq, pr.Hq, pr.B), 128, smem_f>>>(a);
  CK(cudaGetLastError());
  if (!forward_only) {
    ref_dq<T><<<dim3(Lq, pr.Hq, pr.B), 128, smem_q>>>(a);
    CK(cudaGetLastError());
    ref_dkdv<T><<<dim3(Lkv, pr.Hkv, pr.B), 128>>>(a);
    CK(cudaGetLastError());
  } else {
    CK(cudaMemset(a.dq, 0, nq * 4));
    CK(cudaMemset(a.dk, 0, nk * 4));
    CK(cudaMemset(a.dv, 0, nk * 4));
  }
  CK(cudaDeviceSynchronize());

  const auto out = to_host_f((const T*)bf.out, nq), dq = to_host_f((const T*)bf.dq, nq);
  const auto dk = to_host_f((const T*)bf.dk, nk), dv = to_host_f((const T*)bf.dv, nk);
  const auto lse = to_host(bf.lse, nl);
  const auto rout = to_host(a.out, nq), rdq = to_host(a.dq, nq), rdk = to_host(a.dk, nk), rdv = to_host(a.dv, nk);
  const auto rlse = to_host(a.lse, nl);
  const Cmp co = compare(out, rout), cq = compare(dq, rdq), ck = compare(dk, rdk), cv = compare(dv, rdv);
  // lse: -inf exactly where the reference has no visible key, else close
  double lse_err = 0;
  size_t lse_bad = 0, empty_rows = 0, empty_bad = 0;
  for (size_t i = 0; i < nl; ++i) {
    if (rlse[i] == -INFINITY) {
      ++empty_rows;
      if (lse[i] != -INFINITY) ++lse_bad;
      for (int d = 0; d < D; ++d)
        if (out[i * D + d] != 0.f || dq[i * D + d] != 0.f) {
          ++empty_bad;
          break;
        }
    } else if (!std::isfinite(lse[i])) {
      ++lse_bad;
    } else {
      lse_err = std::max(lse_err, (double)std::fabs(lse[i] - rlse[i]));
    }
  }
  const size_t nonfinite = co.nonfinite + cq.nonfinite + ck.nonfinite + cv.nonfinite;
  const bool ok = co.rel <= tol && cq.rel <= tol && ck.rel <= tol && cv.rel <= tol && nonfinite == 0 && lse_bad == 0 &&
                  empty_bad == 0 && lse_err < 1e-2;
  const bool control = scale_error != 1.f;
  if (ok == control) ++g_failures;
  std::printf(
      "%s%s %-30s %-5s d%-3d %-5s %-4s B%d Hq%d Hkv%d Lq%d Lkv%d tiles f%d p%d | out %.2e lse %.1e dq %.2e dk %.2e dv "
      "%.2e | nonfinite %zu empty_rows %zu bad %zu/%zu\n",
      control ? (ok ? "NEGATIVE CONTROL NOT CAUGHT " : "negative control caught: ") : "", ok ? "ok  " : "FAIL",
      pr.name.c_str(), dt == DType::bf16 ? "bf16" : "fp16", D, flash_config_name(cfg),
      p.schedule == Schedule::grid ? "grid" : "lpt", pr.B, pr.Hq, pr.Hkv, Lq, Lkv, dm.nfull, dm.npart, co.rel, lse_err,
      cq.rel, ck.rel, cv.rel, nonfinite, empty_rows, lse_bad, empty_bad);
  std::fflush(stdout);
  for (float* x : {a.out, a.dq, a.dk, a.dv, a.lse, a.delta}) cudaFree(x);
  free_buffers(bf);
}

// A forward the configuration cannot run must throw, saying `expected` (flash_forward_unfit()).
void check_refusal(const Problem& pr, Config cfg, const std::string& expected) {
  BenchSetup su(pr, 7, workspace_bytes(pr));
  std::string what;
  try {
    flash_forward(su.p, cfg);
    CK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    what = e.what();
  }
  const bool ok = what.find(expected) != std::string::npos;
  if (!ok) ++g_failures;
  std::printf("%s %-30s d%-3d %-5s %s%s\n", ok ? "ok  " : "FAIL", pr.name.c_str(), pr.D, flash_config_name(cfg),
              ok ? "refused as expected: " : ("expected a refusal saying \"" + expected + "\", got: ").c_str(),
              what.empty() ? "(it ran)" : what.c_str());
  std::fflush(stdout);
}

std::vector<Problem> check_problems(std::mt19937& rng, int D) {
  std::vector<Problem> v;
  auto add = [&](const char* n, int B, int Hq, int Hkv, bool bshd) {
    v.emplace_back();
    v.back().name = n, v.back().B = B, v.back().Hq = Hq, v.back().Hkv = Hkv, v.back().D = D, v.back().bshd = bshd;
    return &v.back().mask;
  };
  mask_causal(*add("causal 300", 2, 4, 2, false), 300, 300);
  mask_causal(*add("causal q200 kv457 bshd", 1, 6, 3, true), 200, 457);
  mask_sliding(*add("sliding w100 517", 2, 2, 2, false), 517, 517, 100);
  mask_dflash(*add("dflash S300 N13 (2 invalid)", 2, 4, 1, false), 2, 300, 13, 16, 2, rng);
  // Hq = Hkv, the context not a multiple of 64: noise key columns seen by one query tile and by two
  mask_dflash(*add("dflash S600 N40 mha", 2, 3, 3, false), 2, 600, 40, 16, 1, rng);
  mask_random(*add("random per-head 190x250", 2, 4, 2, false), 2, 4, 190, 250, rng);
  mask_dense(*add("dense 129x65 gqa4", 1, 8, 2, false), 129, 65);
  mask_dense(*add("dense 1x1", 1, 1, 1, false), 1, 1);
  return v;
}

// ------------------------------------------------------------------ benchmark

// Per-phase backward timing (bf16, d128): launches the backward kernels directly.
template <bool ATOMIC, int DQS, int MT>
void time_phases(const FlashParams& p, const char* label) {
  using namespace flashdraft::flash_cuda::detail;
  using T = __nv_bfloat16;
  constexpr int D = 128, KVS = 2;
  const int lq_pad = (p.Lq + BQ - 1) / BQ * BQ;
  const size_t rows = size_t(p.B) * p.Hq * lq_pad;
  float* l2 = static_cast<float*>(p.workspace);
  float* de = l2 + rows;
  float* acc = de + rows;
  // the CTA orders after the atomic-dQ buffer (bench_problem allocates room for all three)
  int* q_order = reinterpret_cast<int*>(acc + rows * D);
  int* kv_order = q_order + (query_items(p) + 3) / 4 * 4;
  launch_schedule(p, q_order, kv_order, 1, false);
  constexpr int skv = ATOMIC ? KvSmem<D, KVS>::bytes_atomic : KvSmem<D, KVS>::bytes, sdq = DqSmem<D, DQS>::bytes;
  CK(cudaFuncSetAttribute(flash_bwd_dkdv_kernel<T, D, KVS, ATOMIC>, cudaFuncAttributeMaxDynamicSharedMemorySize, skv));
  CK(cudaFuncSetAttribute(flash_bwd_dq_kernel<T, D, DQS, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, sdq));
  cudaEvent_t ev[4];
  for (auto& e : ev) CK(cudaEventCreate(&e));
  std::vector<float> t0, t1, t2;
  for (int r = 0; r < 30; ++r) {
    CK(cudaEventRecord(ev[0]));
    flash_bwd_pre_kernel<T, D><<<dim3(lq_pad / 16, p.B * p.Hq), 256>>>(p, l2, de, lq_pad);
    if (ATOMIC) CK(cudaMemsetAsync(acc, 0, rows * D * 4));
    CK(cudaEventRecord(ev[1]));
    flash_bwd_dkdv_kernel<T, D, KVS, ATOMIC><<<key_items(p, 1), 128, skv>>>(p, l2, de, lq_pad, kv_order, acc);
    CK(cudaEventRecord(ev[2]));
    if (ATOMIC)
      flash_bwd_dq_convert_kernel<T, D><<<dim3((lq_pad * (D / 8) + 255) / 256, p.B * p.Hq), 256>>>(p, acc, lq_pad);
    else
      flash_bwd_dq_kernel<T, D, DQS, MT><<<query_items(p), 256 / MT, sdq>>>(p, l2, de, lq_pad, q_order);
    CK(cudaEventRecord(ev[3]));
    CK(cudaEventSynchronize(ev[3]));
    CK(cudaGetLastError());
    float a, b, c;
    CK(cudaEventElapsedTime(&a, ev[0], ev[1]));
    CK(cudaEventElapsedTime(&b, ev[1], ev[2]));
    CK(cudaEventElapsedTime(&c, ev[2], ev[3]));
    if (r >= 5) t0.push_back(a), t1.push_back(b), t2.push_back(c);
  }
  auto med = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("PHASES %-8s %-7s dQ pass %2d rows/warp %d stage(s): preprocess%s %.3f ms  dK/dV%s %.3f ms  %s %.3f ms\n",
              label, ATOMIC ? "atomic" : "2-pass", ATOMIC ? 0 : MT * 16, ATOMIC ? 0 : DQS, ATOMIC ? "+memset" : "",
              med(t0), ATOMIC ? "+dQ atomics" : "", med(t1), ATOMIC ? "dQ convert" : "dQ pass", med(t2));
  for (auto& e : ev) cudaEventDestroy(e);
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median ms of the forward and of the backward calls (a cudaEvent pair around each), over
// `rounds` rounds of forward then backward after 10 unmeasured ones; the variants that ran.
struct Timing {
  float fwd = 0, bwd = 0;
  std::string vf, vb;
};
Timing time_calls(const FlashParams& p, Config cfg, int rounds) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  Timing t;
  std::vector<float> tf, tb;
  // runs call() between the two events; its time joins `times` after the warm-up rounds
  auto timed = [&](int round, std::vector<float>& times, auto&& call) {
    CK(cudaEventRecord(e0));
    call();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (round >= 10) times.push_back(ms);
  };
  for (int r = 0; r < rounds + 10; ++r) {
    timed(r, tf, [&] { t.vf = flash_forward(p, cfg); });
    timed(r, tb, [&] { t.vb = flash_backward(p, cfg); });
  }
  CK(cudaGetLastError());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  t.fwd = median(tf), t.bwd = median(tb);
  return t;
}

// The CTA orders' names as FLASHDRAFT_CHECK_SCHEDULE and FLASHDRAFT_SWEEP_SCHEDULE take them;
// false for anything else.
bool parse_schedule(const std::string& name, Schedule* out) {
  if (name != "grid" && name != "longest-first") return false;
  *out = name == "grid" ? Schedule::grid : Schedule::longest_first;
  return true;
}
bool g_bench_schedule_set = false;  // FLASHDRAFT_CHECK_SCHEDULE (main)
Schedule g_bench_schedule = Schedule::longest_first;

void bench_problem(const Problem& pr, const char* label) {
  BenchSetup su(pr, 1234 + std::random_device{}(),
                workspace_bytes(pr) + (size_t)pr.B * pr.Hq * ((pr.mask.Lq + 127) / 128 * 128) * pr.D *
                                          4);  // + room for the atomic-dQ phase timing
  FlashParams& p = su.p;
  const DeviceMask& dm = su.dm;
  if (g_bench_schedule_set) p.schedule = g_bench_schedule;
  const double pairs = (double)pr.mask.pairs() * (pr.mask.heads == 1 ? pr.Hq : 1) * (pr.mask.batch == 1 ? pr.B : 1);
  const double fl_f = 4.0 * pairs * pr.D, fl_b = 2.5 * fl_f;
  for (Config cfg : {Config::sm120, Config::sm90, Config::sm90a}) {
    const Timing tm = time_calls(p, cfg, 50);
    const float mf = tm.fwd, mb = tm.bwd;
    std::printf(
        "BENCH %-8s %-5s fwd %.3f ms (%.0f TFLOP/s)  bwd %.3f ms (%.0f TFLOP/s)  fwd+bwd %.3f ms | pairs/head %.4g "
        "tiles f%d p%d | %s %s\n",
        label, flash_config_name(cfg), mf, fl_f / mf * 1e-9, mb, fl_b / mb * 1e-9, mf + mb, pairs / pr.Hq, dm.nfull,
        dm.npart, tm.vf.c_str(), tm.vb.c_str());
    std::printf("      workspace %.2f MiB (flash_backward_workspace_bytes); no other allocation by the kernel\n",
                flash_backward_workspace_bytes(p) / 1048576.0);
    std::fflush(stdout);
  }
  time_phases<false, 1, 2>(p, label);
  time_phases<false, 1, 1>(p, label);
  time_phases<false, 2, 1>(p, label);
  time_phases<true, 1, 1>(p, label);
}

// ------------------------------------------------------------------ sweep
std::string fmt(const char* f, double v);
struct SweepVariant {
  std::string name;
  std::vector<std::pair<std::string, std::string>> env;
};
std::vector<SweepVariant> parse_sweep(const char* spec) {
  std::vector<SweepVariant> vs;
  std::string all = spec ? spec : "";
  size_t i = 0;
  while (i <= all.size()) {
    size_t j = all.find(';', i);
    if (j == std::string::npos) j = all.size();
    const std::string item = all.substr(i, j - i);
    i = j + 1;
    if (item.empty()) continue;
    SweepVariant v;
    const size_t bar = item.find('|');
    v.name = item.substr(0, bar);
    if (bar != std::string::npos) {
      std::string rest = item.substr(bar + 1);
      size_t a = 0;
      while (a < rest.size()) {
        size_t b2 = rest.find(' ', a);
        if (b2 == std::string::npos) b2 = rest.size();
        const std::string kv = rest.substr(a, b2 - a);
        a = b2 + 1;
        if (kv.empty()) continue;
        const size_t eq = kv.find('=');
        if (eq == std::string::npos) {
          std::fprintf(stderr, "FLASHDRAFT_SWEEP: \"%s\" in variant %s is not VAR=value\n", kv.c_str(), v.name.c_str());
          std::exit(2);
        }
        v.env.push_back({kv.substr(0, eq), kv.substr(eq + 1)});
      }
    }
    vs.push_back(v);
  }
  if (vs.empty()) vs.push_back({"default", {}});
  return vs;
}
void sweep_problem(const Problem& pr, const char* label, const std::vector<SweepVariant>& vs, int rounds, Config cfg) {
  BenchSetup su(pr, 1234 + std::random_device{}(), workspace_bytes(pr));
  FlashParams p = su.p;  // a variant may set its own schedule
  std::vector<std::string> vars;
  for (const auto& v : vs)
    for (const auto& e : v.env)
      if (std::find(vars.begin(), vars.end(), e.first) == vars.end()) vars.push_back(e.first);
  std::vector<std::vector<float>> f(vs.size()), b(vs.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < vs.size(); ++k) {
      for (const auto& n : vars) unsetenv(n.c_str());
      for (const auto& e : vs[k].env) setenv(e.first.c_str(), e.second.c_str(), 1);
      p.schedule = su.p.schedule;
      if (const char* sc = std::getenv("FLASHDRAFT_SWEEP_SCHEDULE"); sc && *sc && !parse_schedule(sc, &p.schedule)) {
        std::fprintf(stderr, "FLASHDRAFT_SWEEP_SCHEDULE=\"%s\" in variant %s: expected grid or longest-first\n", sc,
                     vs[k].name.c_str());
        std::exit(2);
      }
      const Timing tm = time_calls(p, cfg, 30);
      f[k].push_back(tm.fwd), b[k].push_back(tm.bwd);
      std::printf("SWEEP %s %s round %d %-14s fwd %.3f bwd %.3f ms\n", label, flash_config_name(cfg), r,
                  vs[k].name.c_str(), tm.fwd, tm.bwd);
      std::fflush(stdout);
    }
  for (const auto& n : vars) unsetenv(n.c_str());
  std::printf(
      "| %s %s | variant | fwd ms (rounds) | bwd ms (rounds) | median fwd+bwd |\n| --- | --- | --- | --- | --- |\n",
      label, flash_config_name(cfg));
  for (size_t k = 0; k < vs.size(); ++k) {
    std::string fs, bs;
    for (int r = 0; r < rounds; ++r)
      fs += fmt(r ? " / %.3f" : "%.3f", f[k][r]), bs += fmt(r ? " / %.3f" : "%.3f", b[k][r]);
    std::printf("| %s | %s | %s | %s | %.3f |\n", label, vs[k].name.c_str(), fs.c_str(), bs.c_str(),
                median(f[k]) + median(b[k]));
  }
}

// ------------------------------------------------------------------ tail (SM occupancy)
// One traced call (FlashParams::trace): per kernel, the span from its first CTA's start to
// its last CTA's end, the fraction of SM time in that span with no CTA of it resident
// ("idle": 1 - sum over SMs of the union of its CTAs' intervals / (SMs x span)), and the
// tail: the span's end minus the moment the first SM ran out of work for good. Checks that
// the CTAs took every work item exactly once.
struct Occupancy {
  int ctas = 0;
  double span_us = 0, idle = 0, tail_us = 0, head_us = 0, last_us = 0;  // head/last: mean CTA time, first/last 10%
  double gap_us = 0;  // SM time between one resident CTA's end and the next one's start, summed
  int gaps = 0;
  bool permutation = true;
};
Occupancy occupancy(const std::vector<unsigned long long>& tr, const std::vector<std::pair<size_t, size_t>>& ranges,
                    int nsm, size_t items_per_range) {
  Occupancy o;
  unsigned long long t0 = ~0ull, t1 = 0;
  std::vector<std::vector<std::pair<unsigned long long, unsigned long long>>> per_sm(nsm);
  for (const auto& r : ranges) {
    std::vector<int> seen(items_per_range ? items_per_range : 1, 0);
    std::vector<double> dur;
    for (size_t i = r.first; i < r.first + r.second; ++i) {
      const unsigned long long* e = &tr[4 * i];
      if (e[0] == 0) continue;
      ++o.ctas;
      t0 = std::min(t0, e[0]);
      t1 = std::max(t1, e[1]);
      if (e[2] < (unsigned long long)nsm) per_sm[e[2]].push_back({e[0], e[1]});
      if (e[3] < seen.size()) ++seen[e[3]];
      dur.push_back((e[1] - e[0]) * 1e-3);
    }
    if (items_per_range)
      for (int c : seen) o.permutation = o.permutation && c == 1;
    const size_t k = std::max<size_t>(1, dur.size() / 10);
    if (dur.size() >= k) {
      double a = 0, b = 0;
      for (size_t i = 0; i < k; ++i) a += dur[i], b += dur[dur.size() - 1 - i];
      o.head_us = a / k, o.last_us = b / k;
    }
  }
  if (o.ctas == 0) return o;
  double busy = 0;
  unsigned long long first_done = t1;
  for (auto& v : per_sm) {
    if (v.empty()) {
      first_done = t0;
      continue;
    }
    std::sort(v.begin(), v.end());
    unsigned long long a = v[0].first, b = v[0].second, last = 0;
    for (const auto& x : v) {
      if (x.first > b) {
        busy += double(b - a);
        o.gap_us += double(x.first - b) * 1e-3;
        ++o.gaps;
        a = x.first;
      }
      b = std::max(b, x.second);
      last = std::max(last, x.second);
    }
    busy += double(b - a);
    first_done = std::min(first_done, last);
  }
  const double span = double(t1 - t0);
  o.span_us = span * 1e-3;
  o.idle = 1.0 - busy / (double(nsm) * span);
  o.tail_us = double(t1 - first_done) * 1e-3;
  return o;
}

// Fixed cost per CTA (NOTES.md v13): a least-squares fit of each traced CTA's time to
// F + a x full tiles + b x partial tiles of its item (for the dK/dV kernels, the 128-row query
// tiles its column or pair of columns sees). A coefficient with no spread over the items (every
// causal item has the same partial tiles) is not fitted: F takes it, and the table prints "–".
// The gaps between CTAs on an SM come from occupancy().
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::vector<std::string> g_fits;  // rows of the fit table, printed after the tail table
struct CtaFit {
  double F = 0, a = 0, b = 0, r2 = 0;
  bool a_fit = false, b_fit = false;
  int n = 0;
};
CtaFit fit_ctas(const std::vector<unsigned long long>& tr, size_t first, size_t count,
                const std::function<void(int item, double& nf, double& np)>& tiles) {
  CtaFit r;
  double A[3][3] = {}, y[3] = {}, sy = 0, syy = 0;
  std::vector<std::array<double, 3>> rows;
  std::vector<double> ys;
  for (size_t i = first; i < first + count; ++i) {
    const unsigned long long* e = &tr[4 * i];
    if (e[0] == 0) continue;
    double nf = 0, np = 0;
    tiles((int)e[3], nf, np);
    const double d = (e[1] - e[0]) * 1e-3, x[3] = {1.0, nf, np};
    for (int u = 0; u < 3; ++u) {
      y[u] += x[u] * d;
      for (int v = 0; v < 3; ++v) A[u][v] += x[u] * x[v];
    }
    rows.push_back({1.0, nf, np});
    ys.push_back(d);
    sy += d, syy += d * d;
    ++r.n;
  }
  if (r.n < 3) return r;
  // Gauss-Jordan elimination with partial pivoting; a column with no spread is left at 0
  double M[3][4];
  for (int u = 0; u < 3; ++u) {
    for (int v = 0; v < 3; ++v) M[u][v] = A[u][v];
    M[u][3] = y[u];
  }
  int used[3] = {0, 0, 0};
  double sol[3] = {0, 0, 0};
  for (int c = 0; c < 3; ++c) {
    int piv = -1;
    double best = 1e-9 * (A[0][0] + 1.0);
    for (int u = 0; u < 3; ++u)
      if (!used[u] && std::fabs(M[u][c]) > best) best = std::fabs(M[u][c]), piv = u;
    if (piv < 0) continue;
    used[piv] = c + 1;
    for (int u = 0; u < 3; ++u)
      if (u != piv) {
        const double f = M[u][c] / M[piv][c];
        for (int v = 0; v < 4; ++v) M[u][v] -= f * M[piv][v];
      }
  }
  for (int u = 0; u < 3; ++u)
    if (used[u]) sol[used[u] - 1] = M[u][3] / M[u][used[u] - 1];
  r.F = sol[0], r.a = sol[1], r.b = sol[2];
  for (int u = 0; u < 3; ++u) {
    r.a_fit = r.a_fit || used[u] == 2;
    r.b_fit = r.b_fit || used[u] == 3;
  }
  double sse = 0;
  for (size_t i = 0; i < ys.size(); ++i) {
    const double pr = r.F + r.a * rows[i][1] + r.b * rows[i][2];
    sse += (ys[i] - pr) * (ys[i] - pr);
  }
  const double var = syy - sy * sy / r.n;
  r.r2 = var > 0 ? 1.0 - sse / var : 0;
  return r;
}

void tail_problem(const Problem& pr, const char* label, const std::vector<Config>& cfgs, int nsm) {
  BenchSetup su(pr, 4321 + std::random_device{}(), workspace_bytes(pr));
  FlashParams& p = su.p;
  const size_t slots = flash_trace_slots(p, true), dq_first = flash_trace_dq_first(p);
  unsigned long long* dtrace = nullptr;
  CK(cudaMalloc(&dtrace, slots * 4 * sizeof(unsigned long long)));
  std::vector<unsigned long long> tr(slots * 4);
  const size_t q_items = flash_trace_slots(p, false);
  const HostBlockMask hm = build_block_mask(pr.mask);
  for (Config cfg : cfgs) {
    const size_t kv_items = cfg == Config::sm90a ? (dq_first / pr.Hkv / pr.B + 1) / 2 * pr.Hkv * pr.B : dq_first;
    for (Schedule sch : {Schedule::grid, Schedule::longest_first}) {
      p.schedule = sch;
      p.trace = nullptr;
      const Timing tm = time_calls(p, cfg, 30);
      p.trace = dtrace;
      CK(cudaMemset(dtrace, 0, slots * 4 * sizeof(unsigned long long)));
      flash_forward(p, cfg);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(tr.data(), dtrace, slots * 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      const Occupancy f = occupancy(tr, {{0, q_items}}, nsm, q_items);
      const std::vector<unsigned long long> tr_f = tr;
      CK(cudaMemset(dtrace, 0, slots * 4 * sizeof(unsigned long long)));
      flash_backward(p, cfg);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(tr.data(), dtrace, slots * 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      p.trace = nullptr;
      const Occupancy kv = occupancy(tr, {{0, kv_items}}, nsm, kv_items);
      const Occupancy dq = occupancy(tr, {{dq_first, q_items}}, nsm, q_items);
      const Occupancy both = occupancy(tr, {{0, kv_items}, {dq_first, q_items}}, nsm, 0);
      const char* sn = sch == Schedule::grid ? "grid" : "longest-first";
      auto row = [&](const char* kernel, const Occupancy& o, double ms) {
        char t[32] = "";
        if (ms > 0) std::snprintf(t, sizeof t, "%.3f", ms);
        std::printf("| %s | %s | %s | %s | %d | %s | %.1f | %.1f%% | %.1f | %.1f / %.1f | %s |\n", label,
                    flash_config_name(cfg), sn, kernel, o.ctas, t, o.span_us, 100.0 * o.idle, o.tail_us, o.head_us,
                    o.last_us, o.permutation ? "yes" : "NO");
        if (!o.permutation) ++g_failures;
      };
      row("forward", f, tm.fwd);
      row("dK/dV", kv, 0);
      row("dQ", dq, 0);
      row("backward (both)", both, tm.bwd);
      if (sch == Schedule::longest_first) {
        const int qB = hm.qB;
        auto qtiles = [&](int item, double& nf, double& np) {
          const int qb = item % qB;  // one mask for every head and batch here
          nf = hm.fo[qb + 1] - hm.fo[qb];
          np = hm.po[qb + 1] - hm.po[qb];
        };
        const int per = cfg == Config::sm90a ? 2 : 1, ncol = (hm.kB + per - 1) / per;
        auto ktiles = [&](int item, double& nf, double& np) {
          // the 128-row query tiles the item's columns see (their union for a pair): full where
          // every column of the item that sees it sees all of it
          const int c0 = (item % ncol) * per;
          std::map<int, int> seen;  // query tile -> 1 full, 2 partial
          for (int c = c0; c < std::min(c0 + per, hm.kB); ++c) {
            for (int i = hm.tfo[c]; i < hm.tfo[c + 1]; ++i) seen[hm.tfi[i]] |= 1;
            for (int i = hm.tpo[c]; i < hm.tpo[c + 1]; ++i) seen[hm.tpi[i]] |= 2;
          }
          nf = np = 0;
          for (const auto& kv : seen) (kv.second & 2 ? np : nf) += 1;
        };
        auto frow = [&](const char* kernel, const CtaFit& c, const Occupancy& o) {
          const double share = o.span_us > 0 ? (c.n * std::max(0.0, c.F) + o.gap_us) / (nsm * o.span_us) : 0;
          g_fits.push_back(std::string("| ") + label + " | " + flash_config_name(cfg) + " | " + kernel + " | " +
                           std::to_string(c.n) + " | " + fmt("%.2f", c.F) + " | " + (c.a_fit ? fmt("%.3f", c.a) : "–") +
                           " | " + (c.b_fit ? fmt("%.3f", c.b) : "–") + " | " + fmt("%.3f", c.r2) + " | " +
                           fmt("%.2f", o.gaps ? o.gap_us / o.gaps : 0.0) + " | " + fmt("%.1f%%", 100.0 * share) + " |");
        };
        frow("forward", fit_ctas(tr_f, 0, q_items, qtiles), f);
        frow("dK/dV", fit_ctas(tr, 0, kv_items, ktiles), kv);
        frow("dQ", fit_ctas(tr, dq_first, q_items, qtiles), dq);
      }
      std::fflush(stdout);
    }
  }
  cudaFree(dtrace);
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s sm_%d%d, %d SMs, smem/block opt-in %zu KB\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.sharedMemPerBlockOptin / 1024);
  // FLASHDRAFT_CHECK_SEED fixes the seed (the random masks and inputs), so that variants timed
  // in separate processes (bench/flash_cuda_ab.sh) see the same DFlash mask
  const char* seed_env = std::getenv("FLASHDRAFT_CHECK_SEED");
  const uint64_t seed = seed_env != nullptr && *seed_env ? std::strtoull(seed_env, nullptr, 10)
                                                         : std::chrono::steady_clock::now().time_since_epoch().count();
  std::mt19937 rng((uint32_t)seed);
  std::printf("seed %llu\n", (unsigned long long)seed);
  if (const char* sch = std::getenv("FLASHDRAFT_CHECK_SCHEDULE"); sch != nullptr && *sch) {
    if (!parse_schedule(sch, &g_bench_schedule)) {
      std::fprintf(stderr, "FLASHDRAFT_CHECK_SCHEDULE=\"%s\": expected \"grid\" or \"longest-first\"\n", sch);
      return 2;
    }
    g_bench_schedule_set = true;
    std::printf("bench schedule %s (FLASHDRAFT_CHECK_SCHEDULE)\n", sch);
  }
  std::vector<Config> cfgs = {Config::sm120};
  if (prop.sharedMemPerBlockOptin >= 160 * 1024) cfgs.push_back(Config::sm90);
  if (prop.major == 9 && prop.minor == 0) cfgs.push_back(Config::sm90a);
  if (mode == "check" || mode == "all") {
    uint64_t s = seed;
    for (int D : {64, 128})
      for (const Problem& pr : check_problems(rng, D))
        for (Config c : cfgs) {
          run_check<__nv_bfloat16>(pr, c, s += 17);
          run_check<__half>(pr, c, s += 17);
        }
    {  // the check must be able to fail: a 25% scale error has to be reported
      const Problem pr = check_problems(rng, 128)[0];
      run_check<__nv_bfloat16>(pr, Config::sm120, s += 17, 1.25f);
    }
    // heads of 192 and 256: the forward alone, or the refusal where the configuration's shared
    // memory cannot hold it (256 under sm120)
    const DeviceLimits limits = flash_device_limits(0);
    for (int D : {192, 256})
      for (Config c : cfgs) {
        const std::string unfit = flash_forward_unfit(D, flash_forward_config(c, D), limits);
        if (!unfit.empty()) {
          check_refusal(check_problems(rng, D)[0], c, unfit);
          continue;
        }
        for (const Problem& pr : check_problems(rng, D)) {
          run_check<__nv_bfloat16>(pr, c, s += 17, 1.f, true);
          run_check<__half>(pr, c, s += 17, 1.f, true);
        }
      }
    {  // and the forward-only check must be able to fail too
      const Problem pr = check_problems(rng, 256)[0];
      run_check<__nv_bfloat16>(pr, Config::sm90, s += 17, 1.25f, true);
    }
  }
  if (mode == "tail") {
    std::printf(
        "| case | config | schedule | kernel | CTAs | ms (untraced median) | span us | SM idle | tail us | CTA us "
        "first / last 10%% | each item once |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    Problem big;
    big.B = 1, big.Hq = big.Hkv = 32, big.D = 128;
    mask_dflash(big.mask, 1, 4096, 512, 16, 0, rng);
    std::vector<Config> tc = {Config::sm120};
    if (prop.major == 9 && prop.minor == 0) tc.insert(tc.begin(), Config::sm90a);
    tail_problem(big, "DFlash S=4096 512x16", tc, prop.multiProcessorCount);
    Problem causal;
    causal.B = 1, causal.Hq = causal.Hkv = 32, causal.D = 128;
    mask_causal(causal.mask, 8192, 8192);
    tail_problem(causal, "causal 8192", tc, prop.multiProcessorCount);
    std::printf(
        "\nCTA time fit, longest-first (time = F + a x full tiles + b x partial tiles of the item; gap: an SM's "
        "idle time between two of the kernel's CTAs; fixed share: (CTAs x F + gaps) / (SMs x span))\n");
    std::printf(
        "| case | config | kernel | CTAs | F us | a us/full | b us/partial | R^2 | mean gap us | fixed share |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (const auto& l : g_fits) std::printf("%s\n", l.c_str());
    std::printf("\n");
  }
  if (mode == "sweep" || mode == "profile") {
    Problem big;
    big.B = 1, big.Hq = 32, big.Hkv = 32, big.D = 128;
    mask_dflash(big.mask, 1, 4096, 512, 16, 0, rng);  // the bench's first draw: the same mask
    Config cfg = Config::sm90a;
    if (const char* c = std::getenv("FLASHDRAFT_SWEEP_CONFIG"); c && *c) {
      if (!flash_parse_config(c, &cfg) || cfg == Config::automatic ||
          std::find(cfgs.begin(), cfgs.end(), cfg) == cfgs.end()) {
        std::fprintf(stderr, "FLASHDRAFT_SWEEP_CONFIG=\"%s\": expected one of the configurations this device runs:", c);
        for (Config k : cfgs) std::fprintf(stderr, " %s", flash_config_name(k));
        std::fprintf(stderr, "\n");
        return 2;
      }
    }
    if (mode == "profile") {
      BenchSetup su(big, 1234, workspace_bytes(big));
      for (int i = 0; i < 3; ++i) flash_forward(su.p, cfg);
      for (int i = 0; i < 3; ++i) flash_backward(su.p, cfg);
      CK(cudaDeviceSynchronize());
    } else {
      const char* rs = std::getenv("FLASHDRAFT_SWEEP_ROUNDS");
      const int rounds = rs && *rs ? std::max(1, std::atoi(rs)) : 4;
      const std::vector<SweepVariant> vs = parse_sweep(std::getenv("FLASHDRAFT_SWEEP"));
      sweep_problem(big, "dflash", vs, rounds, cfg);
      if (const char* c = std::getenv("FLASHDRAFT_SWEEP_CAUSAL"); c && *c == '1') {
        Problem causal;
        causal.B = 1, causal.Hq = causal.Hkv = 32, causal.D = 128;
        mask_causal(causal.mask, 8192, 8192);
        sweep_problem(causal, "causal", vs, rounds, cfg);
      }
      if (const char* c = std::getenv("FLASHDRAFT_SWEEP_TARGET"); c && *c == '1') {
        // the online target's attention: Qwen3-8B's 32 query / 8 key-value heads, causal, S = 3072
        Problem target;
        target.B = 1, target.Hq = 32, target.Hkv = 8, target.D = 128;
        mask_causal(target.mask, 3072, 3072);
        sweep_problem(target, "target", vs, rounds, cfg);
      }
    }
  }
  if (mode == "bench" || mode == "all") {
    Problem big;
    big.name = "dflash S4096 N512 H4 (bench mask)";
    big.B = 1, big.Hq = 4, big.Hkv = 4, big.D = 128;
    mask_dflash(big.mask, 1, 4096, 512, 16, 0, rng);
    for (Config c : cfgs) run_check<__nv_bfloat16>(big, c, seed + 999);
    big.Hq = big.Hkv = 32;
    bench_problem(big, "dflash");
    Problem causal;
    causal.B = 1, causal.Hq = causal.Hkv = 32, causal.D = 128;
    mask_causal(causal.mask, 8192, 8192);
    bench_problem(causal, "causal");
  }
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
