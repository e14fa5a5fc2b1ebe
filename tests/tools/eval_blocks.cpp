// eval_blocks: one validation of an experiment's drafter, as `flashdraft run` does it
// before step 0 (the drafter bound, [drafter] init applied), with every held-out draft
// written out, for the tests that check the export, the import and target verification
// against plain PyTorch and transformers (tests/python/test_hf_export.py).
//
//   eval_blocks EXP.toml OUT.safetensors
// OUT (every held-out batch, batches concatenated along the first axis):
//   tokens [R, S], lengths [R], documents [R, 16] (each row's document lengths, 0-padded);
//   the drafts (model.hpp's Drafts) of every batch: draft_rows [D] (the row of tokens, over
//   all batches), draft_starts [D], draft_tokens [D, K], draft_labels [D, K] (the data's,
//   -1 = none), verified [D, K] (the labels of target verification; absent without an online
//   target); loss [batches] (float64), tau_anchor, tau_data, tau_served* (float64 scalars),
//   the served walks per response (served_*, served_data_*); metadata tau_anchor_method,
//   tau_served_method.
// Errors: one line on stderr, exit status 1.
#include "config/setup.hpp"
#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"
#include "eval/eval.hpp"
#include "registry/bind.hpp"
#include "train/batches.hpp"

#include <flashdraft/safetensors.hpp>

#include <ATen/ATen.h>

#include <iostream>
#include <map>
#include <stdexcept>

namespace fd = flashdraft;

namespace {

struct Blocks {
  std::map<std::string, std::vector<at::Tensor>> rows;
  std::vector<double> losses;
  int64_t rows_seen = 0;
  void add(const fd::Batch& batch, const fd::StepResult& r, const at::Tensor& verified) {
    if (!r.drafts.defined()) throw std::runtime_error("the drafter returned no drafts from validation");
    rows["tokens"].push_back(batch.tokens.to(at::kCPU, at::kLong));
    rows["lengths"].push_back(batch.lengths.to(at::kCPU, at::kLong));
    rows["draft_rows"].push_back(r.drafts.rows.to(at::kCPU, at::kLong) + rows_seen);
    rows["draft_starts"].push_back(r.drafts.starts.to(at::kCPU, at::kLong));
    rows["draft_tokens"].push_back(r.drafts.tokens.to(at::kCPU, at::kLong));
    rows["draft_labels"].push_back(r.drafts.labels.to(at::kCPU, at::kLong));
    rows_seen += batch.tokens.size(0);
    // [rows, 16]: each row's document lengths (packed rows), 0-padded; a row without
    // documents: its length.
    at::Tensor docs = at::zeros({batch.tokens.size(0), 16}, at::kLong);
    for (int64_t b = 0; b < batch.tokens.size(0); ++b) {
      const bool packed = static_cast<int64_t>(batch.documents.size()) > b && !batch.documents[size_t(b)].empty();
      const std::vector<int64_t> lens =
          packed ? batch.documents[size_t(b)] : std::vector<int64_t>{batch.lengths[b].item<int64_t>()};
      for (size_t i = 0; i < lens.size() && i < 16; ++i) docs[b][int64_t(i)] = lens[i];
    }
    rows["documents"].push_back(docs);
    if (verified.defined()) rows["verified"].push_back(verified.to(at::kCPU, at::kLong));
    losses.push_back(r.loss.item<double>());
  }
};

int run(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: eval_blocks EXP.toml OUT.safetensors\n";
    return 2;
  }
  fd::RunOptions options;
  options.experiment = argv[1];
  const fd::Setup setup = fd::load_setup(options);
  fd::BoundPlugins b = fd::bind_plugins(setup);
  const std::string& on_fallback = setup.experiment.attention().string("on_fallback");
  fd::KernelLedger ledger;
  fd::AttentionDispatcher dispatcher(b.choice, b.mask.get(), on_fallback, &ledger, nullptr);
  // The LM-head loss as the run computes it ([loss]), in the ledger's loss column.
  const fd::LedgerColumns columns{b.drafter->attention_layers(), b.target_calls};
  dispatcher.set_loss(b.loss_choice, columns.loss());
  std::unique_ptr<fd::AttentionDispatcher> target_dispatcher;
  std::unique_ptr<fd::OffsetAttention> target_attention;
  if (b.target) {
    target_dispatcher =
        std::make_unique<fd::AttentionDispatcher>(b.target_choice, b.target_mask.get(), on_fallback, &ledger, nullptr);
    target_attention = std::make_unique<fd::OffsetAttention>(*target_dispatcher, columns.target_begin());
  }
  fd::BatchSource batches(*b.dataset, b.target.get(), b.target_layers, target_attention.get(), b.ctx.device);
  std::unique_ptr<fd::ServedValidation> served;
  if (b.served)
    served = std::make_unique<fd::ServedValidation>(b, setup.experiment.eval(),
                                                    static_cast<uint64_t>(setup.experiment.run().integer("seed")),
                                                    on_fallback, nullptr);
  Blocks blocks;
  fd::EvalContext context{*b.drafter,
                          batches,
                          dispatcher,
                          ledger,
                          setup.experiment.eval(),
                          static_cast<uint64_t>(setup.experiment.run().integer("seed")),
                          columns.count(),
                          static_cast<int64_t>(b.drafter->position_names().size()),
                          b.target.get(),
                          [&](const fd::Batch& batch, const fd::StepResult& r, const at::Tensor& verified) {
                            blocks.add(batch, r, verified);
                          },
                          served.get(),
                          b.served_off};
  const std::optional<fd::EvalResult> result = fd::evaluate(context, 0);
  if (!result) throw std::runtime_error("the dataset has no held-out batch");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, parts] : blocks.rows) out.emplace_back(name, at::cat(parts, 0).contiguous());
  out.emplace_back("loss", at::tensor(blocks.losses, at::kDouble));
  out.emplace_back("tau_anchor", at::scalar_tensor(result->tau_anchor, at::kDouble));
  out.emplace_back("tau_data", at::scalar_tensor(result->tau_data, at::kDouble));
  out.emplace_back("tau_served", at::scalar_tensor(result->tau_served, at::kDouble));
  out.emplace_back("tau_served_se", at::scalar_tensor(result->tau_served_se, at::kDouble));
  out.emplace_back("tau_served_data", at::scalar_tensor(result->tau_served_data, at::kDouble));
  // Per response (in the order of the held-out set): its source row, prompt length, end, and
  // the tokens each verification step produced / the tokens decoded from the prompt on,
  // as flat lists with offsets.
  auto add_tally = [&](const std::string& prefix, const fd::ServedTally& t) {
    if (t.acceptance.empty()) return;
    std::vector<int64_t> acc, acc_off{0}, gen, gen_off{0};
    std::vector<size_t> at(t.order.size());
    for (size_t i = 0; i < t.order.size(); ++i) at[static_cast<size_t>(t.order[i])] = i;
    for (size_t k = 0; k < at.size(); ++k) {
      const auto& a = t.acceptance[at[k]];
      const auto& g = t.generated[at[k]];
      acc.insert(acc.end(), a.begin(), a.end());
      acc_off.push_back(static_cast<int64_t>(acc.size()));
      gen.insert(gen.end(), g.begin(), g.end());
      gen_off.push_back(static_cast<int64_t>(gen.size()));
    }
    out.emplace_back(prefix + "acceptance", at::tensor(acc, at::kLong));
    out.emplace_back(prefix + "acceptance_offsets", at::tensor(acc_off, at::kLong));
    out.emplace_back(prefix + "generated", at::tensor(gen, at::kLong));
    out.emplace_back(prefix + "generated_offsets", at::tensor(gen_off, at::kLong));
    std::vector<int64_t> spans;  // [responses, 3]: held-out row, prompt length, end
    for (size_t k = 0; k < at.size(); ++k)
      for (int64_t v : {t.source[at[k]], t.prompt[at[k]], t.end[at[k]]}) spans.push_back(v);
    out.emplace_back(prefix + "responses", at::tensor(spans, at::kLong).view({-1, 3}));
  };
  add_tally("served_", result->served);
  add_tally("served_data_", result->served_data);
  fd::safetensors::write(
      argv[2], out, {{"tau_anchor_method", result->tau_anchor_method}, {"tau_served_method", result->served_method}});
  std::cout << fd::eval_line(*result) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
