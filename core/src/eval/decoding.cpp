// Sampling for speculative decoding (decoding.hpp), as the reference loop does it.
#include <flashdraft/decoding.hpp>

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

namespace flashdraft {

DraftDecoder::~DraftDecoder() = default;
TargetDecoder::~TargetDecoder() = default;

at::Tensor sampling_probs(const at::Tensor& logits, double temperature, double top_p) {
  if (!(temperature > 0.0))
    throw std::invalid_argument("sampling_probs: temperature " + std::to_string(temperature) +
                                " must be positive (temperature 0 is greedy decoding)");
  if (!(top_p > 0.0 && top_p <= 1.0))
    throw std::invalid_argument("sampling_probs: top_p " + std::to_string(top_p) + " must lie in (0, 1]");
  at::Tensor probs = at::softmax(logits.to(at::kFloat) / temperature, -1);
  if (top_p < 1.0) {
    // Most probable first; a token stays while the mass before it is below top_p.
    auto [sorted, order] = probs.sort(-1, /*descending=*/true);
    const at::Tensor keep = (sorted.cumsum(-1) - sorted).lt(top_p);
    sorted = sorted * keep;
    probs = at::zeros_like(probs).scatter(-1, order, sorted);
    probs = probs / probs.sum(-1, /*keepdim=*/true);
  }
  return probs;
}

at::Tensor sample_tokens(const at::Tensor& probs, at::Generator* generator) {
  const int64_t V = probs.size(-1);
  std::vector<int64_t> shape(probs.sizes().begin(), probs.sizes().end() - 1);
  const at::Tensor flat = probs.reshape({-1, V});
  const at::Tensor drawn = generator ? at::multinomial(flat, 1, false, *generator) : at::multinomial(flat, 1, false);
  return drawn.view(shape);
}

at::Tensor served_logits(const at::Tensor& products, double scale, double softcap) {
  const at::Tensor scaled = scale == 1.0 ? products : products * scale;
  return softcap > 0 ? at::tanh(scaled / softcap) * softcap : scaled;
}

at::Tensor choose_tokens(const at::Tensor& logits, const Sampling& s) {
  if (s.greedy()) return logits.argmax(-1);
  return sample_tokens(sampling_probs(logits, s.temperature, s.top_p), s.generator);
}

}  // namespace flashdraft
