// What the kernel tests share: every fast kernel is compared with the reference by the
// same error measures, on outputs allocated from NaN-poisoned memory.
#pragma once

#include <flashdraft/block_mask.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>

namespace test {

// The base seed of a test program's random inputs: fresh on every run (printed once), or
// FLASHDRAFT_TEST_SEED to repeat one. Each comparison adds its own offset and prints
// the seed it used when it fails.
inline uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FLASHDRAFT_TEST_SEED")) return uint64_t(std::strtoull(env, nullptr, 10));
    std::random_device rd;
    const uint64_t s = (uint64_t(rd()) << 20 ^ rd()) % 1000000000ull;
    std::printf("random inputs: base seed %llu (FLASHDRAFT_TEST_SEED=%llu repeats this run)\n", (unsigned long long)s,
                (unsigned long long)s);
    return s;
  }();
  return seed;
}

inline double max_abs(const at::Tensor& t) { return t.numel() ? t.abs().max().item<double>() : 0.0; }

// max|a - b| / max|b| (0 / 0 counts as 0; anything / 0 as infinite).
inline double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor af = a.to(at::kDouble), bf = b.to(at::kDouble);
  const double diff = max_abs(af - bf), ref = max_abs(bf);
  if (ref == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return diff / ref;
}

// lse: the -inf entries (rows that see no key) must coincide exactly; the finite ones
// are compared as above.
inline double lse_relative_error(const at::Tensor& a, const at::Tensor& b) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  const at::Tensor ai = at::isinf(a), bi = at::isinf(b);
  if (!at::equal(ai, bi)) return inf;
  if (ai.any().item<bool>() && !(a.masked_select(ai) < 0).all().item<bool>()) return inf;
  const at::Tensor finite = bi.logical_not();
  return relative_error(a.masked_select(finite), b.masked_select(finite));
}

// A BlockMask classified tile by tile from a plain predicate (the tests' own masks).
using Visible = std::function<bool(int64_t b, int64_t h, int64_t q, int64_t k)>;
inline flashdraft::BlockMask build_mask(int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len, int64_t block_q,
                                        int64_t block_kv, const Visible& visible) {
  flashdraft::BlockMaskBuilder builder(batch, heads, q_len, kv_len, block_q, block_kv);
  const int64_t nq = (q_len + block_q - 1) / block_q, nk = (kv_len + block_kv - 1) / block_kv;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        builder.begin_row();
        for (int64_t j = 0; j < nk; ++j)
          builder.add_tile(static_cast<int32_t>(j), [&](int64_t q, int64_t k) { return visible(b, h, q, k); });
      }
  flashdraft::BlockMask mask = builder.finish();
  mask.validate();
  return mask;
}

inline bool has_nan(const at::Tensor& t) { return at::isnan(t).any().item<bool>(); }

// Every at::empty in scope returns NaN-filled memory (integers: their max value), so an
// output element a kernel forgets to write shows up as NaN.
class PoisonedAllocations {
 public:
  PoisonedAllocations()
      : algorithms_(at::globalContext().deterministicAlgorithms()),
        warn_only_(at::globalContext().deterministicAlgorithmsWarnOnly()),
        fill_(at::globalContext().deterministicFillUninitializedMemory()) {
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
    at::globalContext().setDeterministicFillUninitializedMemory(true);
  }
  ~PoisonedAllocations() {
    at::globalContext().setDeterministicAlgorithms(algorithms_, warn_only_);
    at::globalContext().setDeterministicFillUninitializedMemory(fill_);
  }
  PoisonedAllocations(const PoisonedAllocations&) = delete;
  PoisonedAllocations& operator=(const PoisonedAllocations&) = delete;

 private:
  bool algorithms_, warn_only_, fill_;
};

}  // namespace test
