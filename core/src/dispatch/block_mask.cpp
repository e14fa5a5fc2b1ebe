// BlockMask: assembly, element lookup, and the validity check.
#include <flashdraft/block_mask.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace flashdraft {

namespace {
[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("invalid BlockMask: " + what); }
std::string tile(int64_t b, int64_t h, int64_t i, int64_t j) {
  return "tile (batch " + std::to_string(b) + ", head " + std::to_string(h) + ", q block " + std::to_string(i) +
         ", kv block " + std::to_string(j) + ")";
}

// Checks the extents: batch and heads >= 1, lengths >= 0, block sizes at least 1x1.
void check_extents(const BlockMask& m) {
  if (m.batch < 1 || m.heads < 1)
    bad("batch " + std::to_string(m.batch) + " and heads " + std::to_string(m.heads) + " must be >= 1");
  if (m.q_len < 0 || m.kv_len < 0)
    bad("negative length (q_len " + std::to_string(m.q_len) + ", kv_len " + std::to_string(m.kv_len) + ")");
  if (m.block_q < 1 || m.block_kv < 1)
    bad("block size " + std::to_string(m.block_q) + "x" + std::to_string(m.block_kv) + " must be at least 1x1");
}

// Checks one CSR list of nrows rows: offsets sized right, from 0 to the index count and
// never decreasing; each row's indices in [0, limit) and strictly increasing.
void check_csr(const std::vector<int32_t>& off, const std::vector<int32_t>& idx, int64_t nrows, int64_t limit,
               const char* name) {
  if (static_cast<int64_t>(off.size()) != nrows + 1)
    bad(std::string(name) + " offsets have " + std::to_string(off.size()) + " entries, expected " +
        std::to_string(nrows + 1));
  if (off[0] != 0) bad(std::string(name) + " offsets start at " + std::to_string(off[0]) + ", expected 0");
  if (static_cast<int64_t>(idx.size()) != off[nrows])
    bad(std::string(name) + " has " + std::to_string(idx.size()) + " indices but offsets end at " +
        std::to_string(off[nrows]));
  for (int64_t r = 0; r < nrows; ++r)
    if (off[r + 1] < off[r]) bad(std::string(name) + " offsets decrease at row " + std::to_string(r));
  for (int64_t r = 0; r < nrows; ++r) {
    for (int32_t e = off[r]; e < off[r + 1]; ++e) {
      if (idx[e] < 0 || idx[e] >= limit)
        bad(std::string(name) + " index " + std::to_string(idx[e]) + " at row " + std::to_string(r) +
            " out of range [0, " + std::to_string(limit) + ")");
      if (e > off[r] && idx[e] <= idx[e - 1])
        bad(std::string(name) + " indices of row " + std::to_string(r) + " not strictly increasing (" +
            std::to_string(idx[e - 1]) + " then " + std::to_string(idx[e]) + ")");
    }
  }
}

// Checks the bitmap of partial entry e, tile (b, h, i, j) with qn in-range query rows:
// no bit outside the sequence or in the padding, and neither empty nor full.
void check_partial_bits(const BlockMask& m, int32_t e, int64_t b, int64_t h, int64_t i, int64_t qn) {
  const int64_t wpr = m.words_per_row();
  const int64_t j = m.part_index[e], kn = std::min(m.block_kv, m.kv_len - j * m.block_kv);
  const uint32_t* w = &m.bits[static_cast<size_t>(e * m.words_per_tile())];
  int64_t set = 0;
  for (int64_t r = 0; r < m.block_q; ++r)
    for (int64_t c = 0; c < m.block_kv; ++c) {
      const bool on = (w[r * wpr + c / 32] >> (c % 32)) & 1u;
      if (on && (r >= qn || c >= kn))
        bad(tile(b, h, i, j) + " has bit (" + std::to_string(r) + ", " + std::to_string(c) +
            ") set outside the sequence");
      set += on;
    }
  // bits past block_kv in the last word of a row must be zero too
  for (int64_t r = 0; r < m.block_q; ++r)
    for (int64_t c = m.block_kv; c < wpr * 32; ++c)
      if ((w[r * wpr + c / 32] >> (c % 32)) & 1u) bad(tile(b, h, i, j) + " has padding bits set");
  if (set == 0) bad(tile(b, h, i, j) + " is listed as partial but has no visible element (empty tiles are not listed)");
  if (set == qn * kn) bad(tile(b, h, i, j) + " is listed as partial but all its elements are visible (it is full)");
}

// Walks the rows: no tile both full and partial, every partial bitmap consistent; counts
// the tiles of each column into transposed_full / transposed_part (at column + 1).
void check_rows(const BlockMask& m, std::vector<int32_t>& transposed_full, std::vector<int32_t>& transposed_part) {
  const int64_t nq = m.q_blocks(), nk = m.kv_blocks(), rows = m.batch * m.heads * nq;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t bh = row / nq, i = row % nq, b = bh / m.heads, h = bh % m.heads;
    const int64_t qn = std::min(m.block_q, m.q_len - i * m.block_q);
    for (int32_t e = m.full_offset[row]; e < m.full_offset[row + 1]; ++e) {
      for (int32_t p = m.part_offset[row]; p < m.part_offset[row + 1]; ++p)
        if (m.part_index[p] == m.full_index[e])
          bad(tile(b, h, i, m.full_index[e]) + " listed as both full and partial");
      ++transposed_full[bh * nk + m.full_index[e] + 1];
    }
    for (int32_t e = m.part_offset[row]; e < m.part_offset[row + 1]; ++e) {
      check_partial_bits(m, e, b, h, i, qn);
      ++transposed_part[bh * nk + m.part_index[e] + 1];
    }
  }
}

// Checks that every transposed entry names a tile of the same class in the row lists
// (and, for partial tiles, points at that tile's partial entry).
void check_transposed_entries(const BlockMask& m) {
  const int64_t nq = m.q_blocks(), nk = m.kv_blocks(), cols = m.batch * m.heads * nk;
  for (int64_t col = 0; col < cols; ++col) {
    const int64_t bh = col / nk, j = col % nk;
    for (int32_t e = m.t_full_offset[col]; e < m.t_full_offset[col + 1]; ++e) {
      const int64_t row = bh * nq + m.t_full_index[e];
      bool found = false;
      for (int32_t f = m.full_offset[row]; f < m.full_offset[row + 1] && !found; ++f) found = m.full_index[f] == j;
      if (!found)
        bad("transposed full list of kv block " + std::to_string(j) + " names q block " +
            std::to_string(m.t_full_index[e]) + ", which does not list it as full");
    }
    for (int32_t e = m.t_part_offset[col]; e < m.t_part_offset[col + 1]; ++e) {
      const int64_t row = bh * nq + m.t_part_index[e];
      const int32_t entry = m.t_part_entry[e];
      if (entry < m.part_offset[row] || entry >= m.part_offset[row + 1] || m.part_index[entry] != j)
        bad("transposed partial entry of kv block " + std::to_string(j) + ", q block " +
            std::to_string(m.t_part_index[e]) + " points at partial entry " + std::to_string(entry) +
            ", which is not that tile");
    }
  }
}
}  // namespace

int64_t BlockMask::bytes() const {
  const auto n = [](const auto& v) { return static_cast<int64_t>(v.size() * sizeof(v[0])); };
  return n(full_offset) + n(full_index) + n(part_offset) + n(part_index) + n(bits) + n(t_full_offset) +
         n(t_full_index) + n(t_part_offset) + n(t_part_index) + n(t_part_entry);
}

bool BlockMask::visible(int64_t b, int64_t h, int64_t q, int64_t kv) const {
  if (q < 0 || q >= q_len || kv < 0 || kv >= kv_len) return false;
  const int64_t mb = batch == 1 ? 0 : b, mh = heads == 1 ? 0 : h;
  const int64_t i = q / block_q, j = kv / block_kv;
  const int64_t row = (mb * heads + mh) * q_blocks() + i;
  for (int32_t e = full_offset[row]; e < full_offset[row + 1]; ++e)
    if (full_index[e] == j) return true;
  for (int32_t e = part_offset[row]; e < part_offset[row + 1]; ++e)
    if (part_index[e] == j) {
      const int64_t r = q - i * block_q, c = kv - j * block_kv;
      return (bits[e * words_per_tile() + r * words_per_row() + c / 32] >> (c % 32)) & 1u;
    }
  return false;
}

int64_t BlockMask::visible_pairs() const {
  int64_t total = 0;
  const int64_t rows = batch * heads * q_blocks();
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row % q_blocks();
    const int64_t qn = std::min(block_q, q_len - i * block_q);
    for (int32_t e = full_offset[row]; e < full_offset[row + 1]; ++e)
      total += qn * std::min(block_kv, kv_len - int64_t(full_index[e]) * block_kv);
  }
  for (uint32_t w : bits) total += __builtin_popcount(w);
  return total;
}

void BlockMask::validate() const {
  check_extents(*this);
  const int64_t nq = q_blocks(), nk = kv_blocks(), rows = batch * heads * nq, cols = batch * heads * nk;
  check_csr(full_offset, full_index, rows, nk, "full");
  check_csr(part_offset, part_index, rows, nk, "partial");
  check_csr(t_full_offset, t_full_index, cols, nq, "transposed full");
  check_csr(t_part_offset, t_part_index, cols, nq, "transposed partial");
  if (t_part_entry.size() != t_part_index.size())
    bad("transposed partial entries (" + std::to_string(t_part_entry.size()) + ") and indices (" +
        std::to_string(t_part_index.size()) + ") differ in length");
  if (static_cast<int64_t>(bits.size()) != partial_count() * words_per_tile())
    bad("bitmaps hold " + std::to_string(bits.size()) + " words, expected " + std::to_string(partial_count()) +
        " partial tiles x " + std::to_string(words_per_tile()));

  std::vector<int32_t> transposed_full(cols + 1, 0), transposed_part(cols + 1, 0);
  check_rows(*this, transposed_full, transposed_part);
  // The transpose must list exactly the same tiles, with the right partial entries.
  for (int64_t c = 0; c < cols; ++c) {
    transposed_full[c + 1] += transposed_full[c];
    transposed_part[c + 1] += transposed_part[c];
  }
  if (transposed_full != t_full_offset) bad("transposed full lists do not match the full lists (counts differ)");
  if (transposed_part != t_part_offset) bad("transposed partial lists do not match the partial lists (counts differ)");
  check_transposed_entries(*this);
}

BlockMaskBuilder::BlockMaskBuilder(int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len, int64_t block_q,
                                   int64_t block_kv) {
  if (block_q < 1 || block_kv < 1)
    throw std::invalid_argument("block size " + std::to_string(block_q) + "x" + std::to_string(block_kv) +
                                " is not accepted; both must be at least 1");
  if (batch < 1 || heads < 1 || q_len < 0 || kv_len < 0)
    throw std::invalid_argument("mask extents batch " + std::to_string(batch) + ", heads " + std::to_string(heads) +
                                ", q_len " + std::to_string(q_len) + ", kv_len " + std::to_string(kv_len) +
                                " are not accepted (batch, heads >= 1; lengths >= 0)");
  mask_.batch = batch;
  mask_.heads = heads;
  mask_.q_len = q_len;
  mask_.kv_len = kv_len;
  mask_.block_q = block_q;
  mask_.block_kv = block_kv;
  const int64_t rows = batch * heads * mask_.q_blocks();
  mask_.full_offset.reserve(rows + 1);
  mask_.part_offset.reserve(rows + 1);
  mask_.full_offset.push_back(0);
  mask_.part_offset.push_back(0);
}

void BlockMaskBuilder::begin_row() {
  if (rows_begun_ > 0) {
    mask_.full_offset.push_back(static_cast<int32_t>(mask_.full_index.size()));
    mask_.part_offset.push_back(static_cast<int32_t>(mask_.part_index.size()));
  }
  ++rows_begun_;
}

void BlockMaskBuilder::add_full(int32_t kv_block) { mask_.full_index.push_back(kv_block); }

uint32_t* BlockMaskBuilder::add_partial(int32_t kv_block) {
  mask_.part_index.push_back(kv_block);
  mask_.bits.resize(mask_.bits.size() + static_cast<size_t>(mask_.words_per_tile()), 0u);
  return mask_.bits.data() + mask_.bits.size() - mask_.words_per_tile();
}

BlockMask BlockMaskBuilder::finish() {
  const int64_t nq = mask_.q_blocks(), nk = mask_.kv_blocks();
  const int64_t rows = mask_.batch * mask_.heads * nq, cols = mask_.batch * mask_.heads * nk;
  if (rows_begun_ != rows)
    throw std::logic_error("BlockMaskBuilder: " + std::to_string(rows_begun_) + " rows begun, expected " +
                           std::to_string(rows));
  if (rows_begun_ > 0) {
    mask_.full_offset.push_back(static_cast<int32_t>(mask_.full_index.size()));
    mask_.part_offset.push_back(static_cast<int32_t>(mask_.part_index.size()));
  }
  // Transpose by counting sort: rows are visited in order, so each column's query
  // blocks come out sorted.
  BlockMask& m = mask_;
  m.t_full_offset.assign(cols + 1, 0);
  m.t_part_offset.assign(cols + 1, 0);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t bh = row / std::max<int64_t>(nq, 1);
    for (int32_t e = m.full_offset[row]; e < m.full_offset[row + 1]; ++e)
      ++m.t_full_offset[bh * nk + m.full_index[e] + 1];
    for (int32_t e = m.part_offset[row]; e < m.part_offset[row + 1]; ++e)
      ++m.t_part_offset[bh * nk + m.part_index[e] + 1];
  }
  for (int64_t c = 0; c < cols; ++c) {
    m.t_full_offset[c + 1] += m.t_full_offset[c];
    m.t_part_offset[c + 1] += m.t_part_offset[c];
  }
  m.t_full_index.resize(m.full_index.size());
  m.t_part_index.resize(m.part_index.size());
  m.t_part_entry.resize(m.part_index.size());
  std::vector<int32_t> fill_f(m.t_full_offset.begin(), m.t_full_offset.end() - (cols >= 0 ? 1 : 0));
  std::vector<int32_t> fill_p(m.t_part_offset.begin(), m.t_part_offset.end() - (cols >= 0 ? 1 : 0));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t bh = row / nq, i = row % nq;
    for (int32_t e = m.full_offset[row]; e < m.full_offset[row + 1]; ++e)
      m.t_full_index[fill_f[bh * nk + m.full_index[e]]++] = static_cast<int32_t>(i);
    for (int32_t e = m.part_offset[row]; e < m.part_offset[row + 1]; ++e) {
      const int32_t slot = fill_p[bh * nk + m.part_index[e]]++;
      m.t_part_index[slot] = static_cast<int32_t>(i);
      m.t_part_entry[slot] = e;
    }
  }
  return std::move(mask_);
}

}  // namespace flashdraft
