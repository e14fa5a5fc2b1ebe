// Building a BlockMask from per-row visible intervals, shared by the mask generators.
//
// Every generator in masks/ can say, for one query row q, which KV positions it sees as
// the union of K half-open intervals [lo_k(q), hi_k(q)) (K = 1 for causal, sliding
// window, prefix LM and documents; K = 2 for DFlash: context and own block). From the
// rows of one query block the tile decisions follow without looking at elements:
//
//   - family k touches KV blocks  floor(min lo_k / BKV) .. floor((max hi_k - 1) / BKV)
//     (over the rows where interval k is not empty); nothing outside the union of these
//     ranges can be visible, so only these blocks are candidates;
//   - if interval k is non-empty on every row of the block, a KV block [k0, k1) (k1
//     clipped to Lkv) is full when k0 >= max lo_k and k1 <= min hi_k: every row's
//     interval contains it. Such blocks are listed as full at once, with no bitmap.
//   - every other candidate is classified by counting, per row, the length of its
//     intervals clipped to the tile: zero (empty, skipped), all in-range elements
//     (full) or partial; only partial tiles get a bitmap, filled row by row with
//     word-level bit-range writes (one or two masked words plus whole words).
//
// Cost per query block: O(BQ * K) to evaluate the rows, O(1) per full tile, and
// O(BQ * (K + words per row)) per tile that needs a bitmap. Nothing scans Lq x Lkv.
#pragma once

#include <flashdraft/block_mask.hpp>
#include <flashdraft/mask_generator.hpp>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft::masks {

// MaskInput::window, checked (0 = no window): the generators that honour it call this.
inline int64_t window(const MaskInput& in, const char* generator) {
  if (in.window < 0)
    throw std::invalid_argument(std::string(generator) + ": window " + std::to_string(in.window) +
                                " is negative (0 = none)");
  return in.window;
}

// Sets bits [a, b) (0 <= a < b <= 32 * words) of one bitmap row.
inline void set_bit_range(uint32_t* row, int64_t a, int64_t b) {
  const int64_t wa = a >> 5, wb = (b - 1) >> 5;
  const uint32_t head = ~0u << (a & 31);               // bits a%32 .. 31 of word wa
  const uint32_t tail = ~0u >> (31 - ((b - 1) & 31));  // bits 0 .. (b-1)%32 of word wb
  if (wa == wb) {
    row[wa] |= head & tail;
    return;
  }
  row[wa] |= head;
  for (int64_t w = wa + 1; w < wb; ++w) row[w] = ~0u;
  row[wb] |= tail;
}

// Number of positions of [k0, k1) covered by the union of n (<= 2) intervals.
inline int64_t clipped_union(const int64_t* lo, const int64_t* hi, int n, int64_t k0, int64_t k1) {
  const int64_t a0 = std::max(lo[0], k0), b0 = std::min(hi[0], k1);
  const int64_t len0 = a0 < b0 ? b0 - a0 : 0;
  if (n == 1) return len0;
  const int64_t a1 = std::max(lo[1], k0), b1 = std::min(hi[1], k1);
  const int64_t len1 = a1 < b1 ? b1 - a1 : 0;
  const int64_t ao = std::max(a0, a1), bo = std::min(b0, b1);  // overlap of the two
  return len0 + len1 - (len0 > 0 && len1 > 0 && ao < bo ? bo - ao : 0);
}

// Reusable buffers of one build (the intervals of the rows of one query block).
struct RowScratch {
  std::vector<int64_t> lo, hi;
};

// Per family k of one query block's rows: whether any / all rows have a non-empty
// interval k, and the range of lo and hi over the non-empty ones.
template <int K>
struct BlockRows {
  bool any[K], all[K];
  int64_t min_lo[K], max_lo[K], min_hi[K], max_hi[K];
};

// Evaluates the qn rows from q0 into s.lo / s.hi (clipped to [0, kv_len), empty ones as
// [0, 0)) and gathers their per-family ranges into br.
template <int K, class RowFn>
inline void read_block_rows(RowFn& row_fn, RowScratch& s, int64_t q0, int64_t qn, int64_t kv_len, BlockRows<K>& br) {
  for (int k = 0; k < K; ++k) {
    br.any[k] = false;
    br.all[k] = true;
    br.min_lo[k] = br.min_hi[k] = kv_len;
    br.max_lo[k] = br.max_hi[k] = 0;
  }
  for (int64_t r = 0; r < qn; ++r) {
    int64_t* lo = &s.lo[static_cast<size_t>(r * K)];
    int64_t* hi = &s.hi[static_cast<size_t>(r * K)];
    row_fn(q0 + r, lo, hi);
    for (int k = 0; k < K; ++k) {
      lo[k] = std::max<int64_t>(lo[k], 0);
      hi[k] = std::min<int64_t>(hi[k], kv_len);
      if (lo[k] >= hi[k]) {
        lo[k] = hi[k] = 0;
        br.all[k] = false;
        continue;
      }
      br.any[k] = true;
      br.min_lo[k] = std::min(br.min_lo[k], lo[k]);
      br.max_lo[k] = std::max(br.max_lo[k], lo[k]);
      br.min_hi[k] = std::min(br.min_hi[k], hi[k]);
      br.max_hi[k] = std::max(br.max_hi[k], hi[k]);
    }
  }
}

// Adds KV block j of the query block whose qn clipped rows are in s, classified by
// counting: the union length of each row's intervals clipped to [k0, k1). Skips an empty
// tile, lists a full one, and fills the bitmap of a real partial one only.
template <int K>
inline void add_counted_tile(BlockMaskBuilder& builder, const RowScratch& s, int64_t qn, int64_t kv_len, int64_t bkv,
                             int64_t wpr, int64_t j) {
  const int64_t k0 = j * bkv, k1 = std::min(k0 + bkv, kv_len);
  int64_t set = 0;
  for (int64_t r = 0; r < qn; ++r)
    set += clipped_union(&s.lo[static_cast<size_t>(r * K)], &s.hi[static_cast<size_t>(r * K)], K, k0, k1);
  if (set == 0) return;
  if (set == qn * (k1 - k0)) {
    builder.add_full(static_cast<int32_t>(j));
    return;
  }
  uint32_t* t = builder.add_partial(static_cast<int32_t>(j));  // zeroed
  for (int64_t r = 0; r < qn; ++r) {
    const int64_t* lo = &s.lo[static_cast<size_t>(r * K)];
    const int64_t* hi = &s.hi[static_cast<size_t>(r * K)];
    for (int k = 0; k < K; ++k) {
      const int64_t a = std::max(lo[k], k0), b = std::min(hi[k], k1);
      if (a < b) set_bit_range(t + r * wpr, a - k0, b - k0);
    }
  }
}

// Appends the rows of one (batch, head) slice to `builder`: begin_row() for every query
// block in order, then its tiles in ascending KV block order.
//   row_fn(q, lo, hi) writes K intervals for query row q (empty ones as lo >= hi; values
//   may lie outside [0, kv_len), they are clipped here).
template <int K, class RowFn>
void add_slice(BlockMaskBuilder& builder, int64_t q_len, int64_t kv_len, int64_t bq, int64_t bkv, RowFn&& row_fn,
               RowScratch& s) {
  static_assert(K == 1 || K == 2, "rows are unions of one or two intervals");
  const int64_t nq = (q_len + bq - 1) / bq, nk = (kv_len + bkv - 1) / bkv;
  const int64_t wpr = (bkv + 31) / 32;
  s.lo.resize(static_cast<size_t>(bq * K));
  s.hi.resize(static_cast<size_t>(bq * K));

  for (int64_t i = 0; i < nq; ++i) {
    builder.begin_row();
    const int64_t q0 = i * bq, qn = std::min(bq, q_len - q0);
    // Rows of this block, clipped; per family: range of lo/hi over non-empty rows.
    BlockRows<K> br;
    read_block_rows<K>(row_fn, s, q0, qn, kv_len, br);
    // Candidate KV block ranges (inclusive) and certainly-full ranges (half-open).
    int64_t c0[2], c1[2], f0[K], f1[K];
    int nc = 0;
    for (int k = 0; k < K; ++k) {
      f0[k] = f1[k] = 0;
      if (!br.any[k]) continue;
      c0[nc] = br.min_lo[k] / bkv;
      c1[nc] = (br.max_hi[k] - 1) / bkv;
      ++nc;
      if (br.all[k]) {
        f0[k] = (br.max_lo[k] + bkv - 1) / bkv;                    // first block with k0 >= max lo
        f1[k] = br.min_hi[k] == kv_len ? nk : br.min_hi[k] / bkv;  // blocks with k1 <= min hi
      }
    }
    // Visit candidates once each, ascending (K <= 2: order the two ranges by start).
    if (K == 2 && nc == 2 && c0[1] < c0[0]) {
      std::swap(c0[0], c0[1]);
      std::swap(c1[0], c1[1]);
    }
    int64_t next = 0;
    for (int c = 0; c < nc; ++c) {
      for (int64_t j = std::max(c0[c], next); j <= c1[c]; ++j) {
        bool full = false;
        for (int k = 0; k < K && !full; ++k) full = j >= f0[k] && j < f1[k];
        if (full) {
          builder.add_full(static_cast<int32_t>(j));
          continue;
        }
        // Otherwise count the tile's visible elements; only real partial tiles get a bitmap.
        add_counted_tile<K>(builder, s, qn, kv_len, bkv, wpr, j);
      }
      next = std::max(next, c1[c] + 1);
    }
  }
}

}  // namespace flashdraft::masks
