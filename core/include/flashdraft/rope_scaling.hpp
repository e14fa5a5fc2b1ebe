// A RoPE's frequency scaling, as transformers' rope_parameters (rope_scaling) describe it: what the hf target reads
// from a checkpoint's config.json and a DFlash drafter from its [drafter] table or folder. The frequencies themselves:
// rope_inv_freq() (flashdraft/ops.hpp). Plain data: this header includes no LibTorch.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

struct RopeScaling {
  // default | linear (positions / factor) | llama3 (Llama 3.1: wavelengths longer than original_max_position /
  // low_freq_factor divided by factor, those shorter than original_max_position / high_freq_factor kept, a smooth blend
  // between) | yarn (interpolated below a ramp between the dimensions that turn beta_fast and beta_slow times over the
  // pretraining length, extrapolated above it; cos and sin times attention_factor) | longrope (the hf target's own)
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_max_position = 8192;                  // llama3, yarn, longrope: the pretraining length
  double beta_fast = 32, beta_slow = 1;                  // yarn: the ramp's bounds in rotations
  bool truncate = true;                                  // yarn: the ramp's bounds rounded outwards
  double attention_factor = 1.0;                         // yarn, longrope: cos and sin are scaled by it
  double mscale_all_dim = 0;                             // DeepSeek's YaRN: its softmax scale's mscale
  // longrope (Phi-3.5, Phi-4-mini): per rotated pair, the wavelength's factor for forwards that reach
  // no further than the pretraining length (short) and for longer ones (long).
  std::vector<double> short_factor, long_factor;

  // Whether cos and sin are scaled by attention_factor (yarn, longrope).
  bool scales_tables() const { return type == "yarn" || type == "longrope"; }
};

// YaRN's attention factor where a config gives none (transformers' _compute_yarn_parameters): mscale(factor, mscale) /
// mscale(factor, mscale_all_dim) where both are non-zero, else mscale(factor, 1), with mscale(s, m) = 0.1 m ln(s) + 1
// (1 for s <= 1).
inline double yarn_attention_factor(double factor, double mscale, double mscale_all_dim) {
  const auto of = [](double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; };
  return mscale != 0.0 && mscale_all_dim != 0.0 ? of(factor, mscale) / of(factor, mscale_all_dim) : of(factor, 1.0);
}

}  // namespace flashdraft
