// flashdraft::backward (model.hpp): a step's loss and its more roots in one backward pass.
#include <flashdraft/model.hpp>

#include <torch/csrc/autograd/autograd.h>

#include <vector>

namespace flashdraft {

void backward(const StepResult& r, double scale) {
  const at::Tensor loss = scale == 1.0 ? r.loss : r.loss * scale;
  if (r.more_roots.empty()) {
    loss.backward();
    return;
  }
  std::vector<at::Tensor> roots{loss}, grads{at::ones_like(loss)};
  for (const auto& [tensor, grad] : r.more_roots) {
    roots.push_back(tensor);
    grads.push_back(grad);
  }
  torch::autograd::backward(roots, grads);
}

}  // namespace flashdraft
