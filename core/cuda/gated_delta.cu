// The gated delta rule in chunks of 64 (Qwen3.5's / Qwen3-Next's Gated DeltaNet), frozen: the
// arithmetic of transformers' torch_chunk_gated_delta_rule (and of the hf target's ATen path,
// datasets/targets/hf/gated_delta.cpp) in float32, in two kernels instead of a few dozen launches
// a chunk:
//   prep (one CTA per chunk, every chunk at once): c = cumsum(g) in the chunk; the unit lower
//        triangular system L = I + strictly_lower(beta_i k_i.k_j exp(c_i - c_j)); U = L^-1 (v beta)
//        and W = L^-1 (k beta exp(c)) by forward substitution, one column a thread (the column in
//        registers); intra = (q_i.k_j exp(c_i - c_j))_{j <= i}; Qd = q exp(c), Kd = k exp(c_last - c),
//        decay = exp(c_last)
//   scan (one CTA per sequence and 32 value columns, over its chunks in order): from S (zero, or the
//        initial state) u = U - W S; out = Qd S + intra u; S = decay S + Kd^T u
// The state slice, the chunk's operands and u live in shared memory; every product is float32
// FMA (no TF32: transformers' products are float32). Summation orders are the kernels' own.
#include "engine_ops.cuh"
#include "ops_common.cuh"

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

constexpr int kC = 64;      // positions a chunk
constexpr int kSlice = 32;  // value columns a scan CTA
constexpr int kDk = 128, kDv = 128;

constexpr int kPrepThreads = kDk + kDv;  // one column of [U | W] each in the substitution
constexpr int kKP = kDk + 1;             // padded rows: column reads across a warp hit 32 banks
constexpr size_t kPrepSmem = (2 * kC * kKP + kC * kC + 2 * kC) * sizeof(float);
constexpr int kScanThreads = 256;
constexpr size_t kScanSmem = (kDk * kSlice + kC * kDk + kC * kC + kC * kSlice) * sizeof(float);

__global__ void __launch_bounds__(kPrepThreads)
    gdn_prep_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ W,
                    float* __restrict__ U, float* __restrict__ intra, float* __restrict__ qd, float* __restrict__ kd,
                    float* __restrict__ decay) {
  extern __shared__ __align__(16) float sm[];
  float* Ks = sm;             // [kC][kKP]
  float* Qs = Ks + kC * kKP;  // [kC][kKP]
  float* A = Qs + kC * kKP;   // [kC][kC]: L's strictly lower part (zeros elsewhere)
  float* cs = A + kC * kC;    // [kC]: the cumulative log decay
  float* bs = cs + kC;        // [kC]: beta
  const int64_t chunk = blockIdx.x, row0 = chunk * kC;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < kC * kDk; e += kPrepThreads) {
    const int r = e / kDk, c = e % kDk;
    Ks[r * kKP + c] = k[(row0 + r) * kDk + c];
    Qs[r * kKP + c] = q[(row0 + r) * kDk + c];
  }
  if (tid < kC) {
    bs[tid] = beta[row0 + tid];
    cs[tid] = g[row0 + tid];
  }
  __syncthreads();
  if (tid == 0)
    for (int r = 1; r < kC; ++r) cs[r] += cs[r - 1];
  __syncthreads();

  // k_i.k_j and q_i.k_j: warp w rows w + 8 a, lanes columns lane and lane + 32
  float kk[8][2], qk[8][2];
#pragma unroll
  for (int a = 0; a < 8; ++a) kk[a][0] = kk[a][1] = qk[a][0] = qk[a][1] = 0.f;
#pragma unroll 4
  for (int c = 0; c < kDk; ++c) {
    const float k0 = Ks[lane * kKP + c], k1 = Ks[(lane + 32) * kKP + c];
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      const float ki = Ks[(warp + 8 * a) * kKP + c], qi = Qs[(warp + 8 * a) * kKP + c];
      kk[a][0] = fmaf(ki, k0, kk[a][0]);
      kk[a][1] = fmaf(ki, k1, kk[a][1]);
      qk[a][0] = fmaf(qi, k0, qk[a][0]);
      qk[a][1] = fmaf(qi, k1, qk[a][1]);
    }
  }
  float* intra_c = intra + chunk * kC * kC;
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    const int i = warp + 8 * a;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = lane + 32 * h;
      const float dec = j <= i ? expf(cs[i] - cs[j]) : 0.f;
      A[i * kC + j] = j < i ? bs[i] * kk[a][h] * dec : 0.f;
      intra_c[i * kC + j] = qk[a][h] * dec;
    }
  }
  __syncthreads();

  // forward substitution, one column of [v beta | k beta exp(c)] a thread: x_i = rhs_i - sum_{j < i} A_ij x_j
  const bool is_u = tid < kDv;
  const int col = is_u ? tid : tid - kDv;
  float x[kC];
#pragma unroll
  for (int i = 0; i < kC; ++i) {
    float acc = is_u ? v[(row0 + i) * kDv + col] * bs[i] : Ks[i * kKP + col] * bs[i] * expf(cs[i]);
    float sub = 0.f;
#pragma unroll
    for (int j = 0; j < i; ++j) sub = fmaf(A[i * kC + j], x[j], sub);
    x[i] = acc - sub;
  }
  float* dst = is_u ? U + row0 * kDv : W + row0 * kDk;
#pragma unroll
  for (int i = 0; i < kC; ++i) dst[i * (is_u ? kDv : kDk) + col] = x[i];

  const float last = cs[kC - 1];
  for (int e = tid; e < kC * kDk; e += kPrepThreads) {
    const int r = e / kDk, c = e % kDk;
    qd[(row0 + r) * kDk + c] = Qs[r * kKP + c] * expf(cs[r]);
    kd[(row0 + r) * kDk + c] = Ks[r * kKP + c] * expf(last - cs[r]);
  }
  if (tid == 0) decay[chunk] = expf(last);
}

// Copies n16 16-byte pieces from global to shared memory, the CTA's threads together.
__device__ __forceinline__ void copy16(float* dst, const float* __restrict__ src, int n16, int tid, int nt) {
  for (int e = tid; e < n16; e += nt)
    reinterpret_cast<float4*>(dst)[e] = __ldg(reinterpret_cast<const float4*>(src) + e);
}

__global__ void __launch_bounds__(kScanThreads)
    gdn_scan_kernel(const float* __restrict__ W, const float* __restrict__ U, const float* __restrict__ intra,
                    const float* __restrict__ qd, const float* __restrict__ kd, const float* __restrict__ decay,
                    const float* __restrict__ initial, int n, float* __restrict__ out,
                    float* __restrict__ final_state) {
  extern __shared__ __align__(16) float sm[];
  float* S = sm;                  // [kDk][kSlice]: the state's columns c0 ..
  float* buf = S + kDk * kSlice;  // [kC][kDk]: W, then Qd, then Kd of the chunk
  float* it = buf + kC * kDk;     // [kC][kC]: intra
  float* u = it + kC * kC;        // [kC][kSlice]: U's columns, then the new values
  const int64_t bh = blockIdx.x;
  const int c0 = blockIdx.y * kSlice;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < kDk * kSlice; e += kScanThreads) {
    const int r = e / kSlice, c = e % kSlice;
    S[e] = initial ? initial[(bh * kDk + r) * kDv + c0 + c] : 0.f;
  }
  for (int i = 0; i < n; ++i) {
    const int64_t ch = bh * n + i;
    __syncthreads();  // the last chunk is done with buf, it, u and S
    copy16(buf, W + ch * kC * kDk, kC * kDk / 4, tid, kScanThreads);
    copy16(it, intra + ch * kC * kC, kC * kC / 4, tid, kScanThreads);
    for (int e = tid; e < kC * kSlice / 4; e += kScanThreads) {
      const int r = e / (kSlice / 4), c4 = e % (kSlice / 4);
      reinterpret_cast<float4*>(u)[e] = __ldg(reinterpret_cast<const float4*>(U + (ch * kC + r) * kDv + c0) + c4);
    }
    __syncthreads();
    // u = U - W S: rows warp * 8 + a, column lane
    float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    rows_times<kSlice>(buf, kDk, S, kDk, warp * 8, lane, p);
#pragma unroll
    for (int a = 0; a < 8; ++a) u[(warp * 8 + a) * kSlice + lane] -= p[a];
    __syncthreads();  // buf free, u final
    copy16(buf, qd + ch * kC * kDk, kC * kDk / 4, tid, kScanThreads);
    __syncthreads();
    // out = Qd S + intra u (intra is zero past each row's diagonal: u's first warp * 8 + 8 rows)
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int a = 0; a < 8; ++a) p[a] = 0.f;
    rows_times<kSlice>(buf, kDk, S, kDk, warp * 8, lane, p);
    rows_times<kSlice>(it, kC, u, warp * 8 + 8, warp * 8, lane, o);
#pragma unroll
    for (int a = 0; a < 8; ++a) out[(ch * kC + warp * 8 + a) * kDv + c0 + lane] = p[a] + o[a];
    __syncthreads();  // buf free
    copy16(buf, kd + ch * kC * kDk, kC * kDk / 4, tid, kScanThreads);
    __syncthreads();
    // S = decay S + Kd^T u: rows warp * 16 + r of the state, column lane
    float acc[16];
    cols_times<kSlice, false>(buf, kDk, u, nullptr, kC, warp * 16, lane, acc);
    const float d = decay[ch];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float& s = S[(warp * 16 + r) * kSlice + lane];
      s = s * d + acc[r];
    }
  }
  if (final_state) {
    __syncthreads();
    for (int e = tid; e < kDk * kSlice; e += kScanThreads) {
      const int r = e / kSlice, c = e % kSlice;
      final_state[(bh * kDk + r) * kDv + c0 + c] = S[e];
    }
  }
}

}  // namespace

bool gated_delta_supported(int64_t dk, int64_t dv) { return dk == kDk && dv == kDv; }

size_t gated_delta_work_floats(int64_t sequences, int64_t chunks) {
  const size_t n = size_t(sequences) * size_t(chunks);
  return n * kC * (3 * kDk + kDv + kC) + n;  // W, Qd, Kd, U, intra, decay
}

void gated_delta_chunks(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        const float* initial, int64_t sequences, int64_t chunks, float* work, float* out,
                        float* final_state, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const size_t n = size_t(sequences) * size_t(chunks);
  float* W = work;
  float* qd = W + n * kC * kDk;
  float* kd = qd + n * kC * kDk;
  float* U = kd + n * kC * kDk;
  float* intra = U + n * kC * kDv;
  float* decay = intra + n * kC * kC;
  static const bool prep_smem =
      cudaFuncSetAttribute(gdn_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kPrepSmem)) == cudaSuccess;
  static const bool scan_smem =
      cudaFuncSetAttribute(gdn_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kScanSmem)) == cudaSuccess;
  (void)prep_smem, (void)scan_smem;
  gdn_prep_kernel<<<unsigned(n), kPrepThreads, kPrepSmem, s>>>(q, k, v, g, beta, W, U, intra, qd, kd, decay);
  check_launch("gated_delta_chunks (prep)");
  gdn_scan_kernel<<<dim3(unsigned(sequences), kDv / kSlice), kScanThreads, kScanSmem, s>>>(
      W, U, intra, qd, kd, decay, initial, int(chunks), out, final_state);
  check_launch("gated_delta_chunks (scan)");
}

}  // namespace flashdraft::cuda_ops
