// Mamba-2's state-space rule in chunks of 64 (the hf target's Mamba2 layers: Granite 4.0-H, Nemotron-H, Bamba,
// Nemotron 3), frozen, float32: per head h of row b, over positions t,
//   S_t = exp(g_t) S_{t-1} + k_t v_t^T,   out_t = S_t^T q_t          (S [128, P]; k, q a group's B and C)
// in the chunked form of the hf target's ATen path (datasets/targets/hf/mamba2.cpp), in two kernels instead of a few
// dozen launches a layer:
//   products (one CTA per row, group and chunk, every chunk at once): QK = Q K^T of the chunk's 64 positions, once
//        for all the heads of a group (they share B and C)
//   scan (one CTA per row, head and 32 value columns, over its chunks in order): c = cumsum(g) in the chunk;
//        out_i = exp(c_i) q_i.S + sum_{j <= i} QK_ij exp(c_i - c_j) v_j;  S = exp(c_last) S + sum_j exp(c_last - c_j)
//        k_j v_j^T
// Positions past T read as zeros (g = 0, nothing added), so T need not be a multiple of 64. The state slice and the
// chunk's operands live in shared memory; every product is float32 FMA (no TF32). Summation orders are the kernels'.
#include "engine_ops.cuh"
#include "ops_common.cuh"

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

constexpr int kC = 64;      // positions a chunk
constexpr int kN = 128;     // the state's rows (B's and C's width)
constexpr int kSlice = 32;  // value columns a scan CTA
constexpr int kThreads = 256;
constexpr int kNP = kN + 1;  // padded rows of the products' operands: column reads across a warp hit 32 banks
constexpr size_t kProductSmem = 2 * kC * kNP * sizeof(float);
constexpr size_t kScanSmem = (kN * kSlice + kC * kN + kC * kC + kC * kSlice + 3 * kC) * sizeof(float);

// QK [rows, groups, chunks, 64, 64] = each chunk's q_i.k_j (all i, j; the scan masks j > i).
__global__ void __launch_bounds__(kThreads)
    ssd_products_kernel(const float* __restrict__ q, const float* __restrict__ k, int64_t T, int G, int chunks,
                        float* __restrict__ qk) {
  extern __shared__ __align__(16) float sm[];
  float* Ks = sm;             // [kC][kNP]
  float* Qs = Ks + kC * kNP;  // [kC][kNP]
  const int bg = blockIdx.x, chunk = blockIdx.y, b = bg / G, grp = bg % G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t0 = int64_t(chunk) * kC;
  for (int e = tid; e < kC * kN; e += kThreads) {
    const int r = e / kN, c = e % kN;
    const int64_t t = t0 + r, at = ((int64_t(b) * T + t) * G + grp) * kN + c;
    Ks[r * kNP + c] = t < T ? k[at] : 0.f;
    Qs[r * kNP + c] = t < T ? q[at] : 0.f;
  }
  __syncthreads();
  // rows warp + 8 a, columns lane and lane + 32
  float acc[8][2];
#pragma unroll
  for (int a = 0; a < 8; ++a) acc[a][0] = acc[a][1] = 0.f;
#pragma unroll 4
  for (int c = 0; c < kN; ++c) {
    const float k0 = Ks[lane * kNP + c], k1 = Ks[(lane + 32) * kNP + c];
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      const float qi = Qs[(warp + 8 * a) * kNP + c];
      acc[a][0] = fmaf(qi, k0, acc[a][0]);
      acc[a][1] = fmaf(qi, k1, acc[a][1]);
    }
  }
  float* out = qk + (int64_t(bg) * chunks + chunk) * kC * kC;
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    out[(warp + 8 * a) * kC + lane] = acc[a][0];
    out[(warp + 8 * a) * kC + lane + 32] = acc[a][1];
  }
}

// A chunk's 64 rows of a group's q or k (width 128) into buf [kC][kN]; zeros past T.
__device__ __forceinline__ void load_rows(float* buf, const float* __restrict__ src, int64_t b, int64_t t0, int64_t T,
                                          int G, int grp, int tid) {
  for (int e = tid; e < kC * kN / 4; e += kThreads) {
    const int r = e / (kN / 4), c4 = e % (kN / 4);
    const int64_t t = t0 + r;
    reinterpret_cast<float4*>(buf)[e] =
        t < T ? __ldg(reinterpret_cast<const float4*>(src + ((b * T + t) * G + grp) * kN) + c4)
              : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__global__ void __launch_bounds__(kThreads)
    ssd_scan_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    const float* __restrict__ g, const float* __restrict__ qk, const float* __restrict__ initial,
                    int64_t T, int H, int G, int P, int chunks, float* __restrict__ out) {
  extern __shared__ __align__(16) float sm[];
  float* S = sm;                 // [kN][kSlice]: the state's columns c0 ..
  float* buf = S + kN * kSlice;  // [kC][kN]: q, then k, of the chunk
  float* it = buf + kC * kN;     // [kC][kC]: QK exp(c_i - c_j), zero past the diagonal
  float* vs = it + kC * kC;      // [kC][kSlice]: v's columns
  float* cs = vs + kC * kSlice;  // [kC]: the cumulative log decay from the chunk's start
  float* up = cs + kC;           // [kC]: exp(c_i)
  float* down = up + kC;         // [kC]: exp(c_last - c_j)
  const int64_t bh = blockIdx.x, b = bh / H;
  const int h = int(bh % H), grp = h / (H / G), c0 = blockIdx.y * kSlice;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < kN * kSlice; e += kThreads) {
    const int r = e / kSlice, c = e % kSlice;
    S[e] = initial ? initial[(bh * kN + r) * P + c0 + c] : 0.f;
  }
  for (int i = 0; i < chunks; ++i) {
    const int64_t t0 = int64_t(i) * kC;
    __syncthreads();  // the last chunk is done with every buffer
    load_rows(buf, q, b, t0, T, G, grp, tid);
    for (int e = tid; e < kC * kSlice / 4; e += kThreads) {
      const int r = e / (kSlice / 4), c4 = e % (kSlice / 4);
      const int64_t t = t0 + r;
      reinterpret_cast<float4*>(vs)[e] =
          t < T ? __ldg(reinterpret_cast<const float4*>(v + ((b * T + t) * H + h) * P + c0) + c4)
                : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float* qk_c = qk + ((b * G + grp) * chunks + i) * kC * kC;
    for (int e = tid; e < kC * kC / 4; e += kThreads)
      reinterpret_cast<float4*>(it)[e] = __ldg(reinterpret_cast<const float4*>(qk_c) + e);
    if (warp == 0) {  // c: an inclusive scan of g over the chunk, two halves of 32
      float lo = t0 + lane < T ? g[(b * T + t0 + lane) * H + h] : 0.f;
      float hi = t0 + lane + 32 < T ? g[(b * T + t0 + lane + 32) * H + h] : 0.f;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const float l = __shfl_up_sync(0xffffffffu, lo, d), u = __shfl_up_sync(0xffffffffu, hi, d);
        if (lane >= d) lo += l, hi += u;
      }
      hi += __shfl_sync(0xffffffffu, lo, 31);
      cs[lane] = lo, cs[lane + 32] = hi;
    }
    __syncthreads();
    if (tid < kC) {
      up[tid] = expf(cs[tid]);
      down[tid] = expf(cs[kC - 1] - cs[tid]);
    }
    for (int e = tid; e < kC * kC; e += kThreads) {
      const int r = e / kC, c = e % kC;
      it[e] = c <= r ? it[e] * expf(cs[r] - cs[c]) : 0.f;
    }
    __syncthreads();
    // out = diag(exp(c)) Q S + it v: rows warp * 8 + a, column lane (it is zero past each row's diagonal: v's first
    // warp * 8 + 8 rows)
    float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    rows_times<kSlice>(buf, kN, S, kN, warp * 8, lane, p);
    rows_times<kSlice>(it, kC, vs, warp * 8 + 8, warp * 8, lane, o);
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      const int r = warp * 8 + a;
      if (t0 + r < T) out[((b * T + t0 + r) * H + h) * P + c0 + lane] = fmaf(up[r], p[a], o[a]);
    }
    __syncthreads();  // buf free
    load_rows(buf, k, b, t0, T, G, grp, tid);
    __syncthreads();
    // S = exp(c_last) S + sum_j k_j (exp(c_last - c_j) v_j)^T: rows warp * 16 + r of the state, column lane
    float acc[16];
    cols_times<kSlice, true>(buf, kN, vs, down, kC, warp * 16, lane, acc);
    const float d = up[kC - 1];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float& s = S[(warp * 16 + r) * kSlice + lane];
      s = fmaf(s, d, acc[r]);
    }
  }
}

}  // namespace

bool ssd_supported(int64_t n, int64_t p) { return n == kN && p > 0 && p % kSlice == 0; }

size_t ssd_work_floats(int64_t rows, int64_t groups, int64_t T) {
  return size_t(rows) * size_t(groups) * size_t((T + kC - 1) / kC) * kC * kC;  // QK
}

void ssd_chunks(const float* q, const float* k, const float* v, const float* g, const float* initial, int64_t rows,
                int64_t T, int64_t heads, int64_t groups, int64_t P, float* work, float* out, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const int chunks = int((T + kC - 1) / kC);
  static const bool scan_smem =
      cudaFuncSetAttribute(ssd_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kScanSmem)) == cudaSuccess;
  static const bool product_smem =
      cudaFuncSetAttribute(ssd_products_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kProductSmem)) ==
      cudaSuccess;
  (void)scan_smem, (void)product_smem;
  ssd_products_kernel<<<dim3(unsigned(rows * groups), unsigned(chunks)), kThreads, kProductSmem, s>>>(
      q, k, T, int(groups), chunks, work);
  check_launch("ssd_chunks (products)");
  ssd_scan_kernel<<<dim3(unsigned(rows * heads), unsigned(P / kSlice)), kThreads, kScanSmem, s>>>(
      q, k, v, g, work, initial, T, int(heads), int(groups), int(P), chunks, out);
  check_launch("ssd_chunks (scan)");
}

}  // namespace flashdraft::cuda_ops
