// RoPE in the rotate-half layout, forward and transpose (engine_ops.cuh: rope). One thread
// per 16-byte vector of the first half of a row: it reads that vector and its partner in
// the second half (x1, x2), the four table vectors (c1, c2, s1, s2) of the row's position,
// and writes both halves of the output. ATen's composite (x*cos, a cat of the negated
// halves, *sin, +) takes five passes forward and five backward, each over the whole
// [B, H, T, D] tensor; this is one read and one write of it (the tables, shared by the H
// heads, stay in L2).
#include "ops_common.cuh"

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                            T* __restrict__ out, int64_t rows, int64_t H, int64_t Tn, int64_t D, int64_t table_batch,
                            bool transpose) {
  constexpr int E = Vec16<T>::E;
  const int64_t half = D / 2, per_row = half / E;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * per_row; i += stride) {
    const int64_t r = i / per_row, j = (i % per_row) * E;
    const int64_t b = r / (H * Tn), t = r % Tn;
    const int64_t tr = (table_batch == 1 ? 0 : b) * Tn + t;
    const T* xr = x + r * D;
    const T* cr = cos + tr * D;
    const T* sr = sin + tr * D;
    const Vec16<T> x1 = load16(xr + j), x2 = load16(xr + half + j);
    const Vec16<T> c1 = load16(cr + j), c2 = load16(cr + half + j);
    const Vec16<T> s1 = load16(sr + j), s2 = load16(sr + half + j);
    Vec16<T> y1, y2;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float a = to_float(x1.v[k]), b2 = to_float(x2.v[k]);
      const float ca = to_float(c1.v[k]), cb = to_float(c2.v[k]), sa = to_float(s1.v[k]), sb = to_float(s2.v[k]);
      if (!transpose) {
        y1.v[k] = from_float<T>(a * ca - b2 * sa);
        y2.v[k] = from_float<T>(b2 * cb + a * sb);
      } else {
        y1.v[k] = from_float<T>(a * ca + b2 * sb);
        y2.v[k] = from_float<T>(b2 * cb - a * sa);
      }
    }
    store16(out + r * D + j, y1);
    store16(out + r * D + half + j, y2);
  }
}

int elements16(DType dtype) { return dtype == DType::f32 ? 4 : 8; }

}  // namespace

bool rope_supported(DType dtype, int64_t D, const void* x, const void* cos, const void* sin, const void* out) {
  return D > 0 && D % (2 * elements16(dtype)) == 0 && aligned16(x) && aligned16(cos) && aligned16(sin) &&
         aligned16(out);
}

void rope(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t B, int64_t H, int64_t T,
          int64_t D, int64_t table_batch, bool transpose, void* stream) {
  const int64_t rows = B * H * T;
  if (rows <= 0) return;
  if (!rope_supported(dtype, D, x, cos, sin, out))
    throw std::runtime_error("rope: head width " + std::to_string(D) +
                             " or an unaligned pointer is outside what the kernel takes (rope_supported)");
  with_type(dtype, [&](auto* tag) {
    using Tv = std::remove_pointer_t<decltype(tag)>;
    const int64_t items = rows * (D / 2 / Vec16<Tv>::E);
    rope_kernel<Tv><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const Tv*>(x), static_cast<const Tv*>(cos), static_cast<const Tv*>(sin), static_cast<Tv*>(out),
        rows, H, T, D, table_batch, transpose);
  });
  check_launch("rope");
}

}  // namespace flashdraft::cuda_ops
