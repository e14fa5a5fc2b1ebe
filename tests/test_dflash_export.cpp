// Writes one fp32 DFlash drafter step for tests/python/test_dflash_crosscheck.py: the
// weights, the target's frozen parts, the batch, the anchors the step drew, the loss and
// every parameter gradient, as HDF5 (path from FLASHDRAFT_DFLASH_EXPORT, default
// <build>/dflash_export.h5). As a plain ctest it checks the file was written whole.
#include "dflash_oracle.hpp"

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdlib>

using namespace flashdraft;

namespace {

void write(hid_t file, const std::string& name, const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  hid_t type = H5T_NATIVE_FLOAT;
  if (c.scalar_type() == at::kLong)
    type = H5T_NATIVE_INT64;
  else if (c.scalar_type() == at::kByte || c.scalar_type() == at::kBool) {
    c = c.to(at::kLong);
    type = H5T_NATIVE_INT64;
  } else if (c.scalar_type() == at::kDouble)
    type = H5T_NATIVE_DOUBLE;
  else
    c = c.to(at::kFloat);
  std::vector<hsize_t> dims(c.sizes().begin(), c.sizes().end());
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  hid_t space = dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  hid_t set = H5Dcreate2(file, name.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(set, 0) << name;
  ASSERT_GE(H5Dwrite(set, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, c.data_ptr()), 0) << name;
  H5Dclose(set);
  H5Sclose(space);
  H5Pclose(lcpl);
}

// One step of a configuration, written under "<name>/": the batch, the anchors the step
// drew, the loss, every parameter and gradient, and the keys the reference needs.
// target_scale / target_cap: the target's logit scale and cap (TargetModel::logit_scale / logit_softcap).
void write_case(hid_t file, const std::string& name, const std::map<std::string, Value>& extra, bool packed,
                double target_scale = 1.0, double target_cap = 0.0) {
  std::map<std::string, Value> cfg{
      {"layers", int64_t{2}},   {"hidden", int64_t{32}},     {"heads", int64_t{4}},
      {"kv_heads", int64_t{2}}, {"ffn", int64_t{48}},        {"block_size", int64_t{4}},
      {"anchors", int64_t{3}},  {"mask_token", int64_t{39}}, {"target_layer_ids", std::vector<int64_t>{2, 0}},
      {"gamma", 3.0},           {"init_std", 0.2},           {"rope_theta", 500.0},
      {"rms_eps", 1e-5}};
  for (const auto& [k, v] : extra) cfg[k] = v;
  auto d = dflash_test::make_drafter(cfg);
  auto p = dflash_test::random_problem(40, 32, {0, 1, 2}, 2, 16, at::kFloat, 2024);
  p.batch.lengths[1] = 6;  // row 1: few anchor candidates for 3 anchors (padding blocks)
  // Responses after short prompts; packed: row 0 holds documents of 7 and 9 positions (the
  // first with unlabelled positions at its end).
  p.batch.loss_mask.fill_(true);
  for (int64_t t : {0, 1, 5, 6}) p.batch.loss_mask[0][t] = false;
  for (int64_t t : {0, 1}) p.batch.loss_mask[1][t] = false;
  if (packed) p.batch.documents = {{7, 9}, {}};
  p.target.logit_scale = target_scale;
  p.target.logit_softcap = target_cap;
  RunContext ctx;
  ctx.seed = 17;
  d->bind(p.target, ctx, 2, 16);
  dflash_test::OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(5);
  StepResult r = d->step(p.batch, attn, rng, true);
  r.loss.backward();
  const std::string g = name + "/";
  write(file, g + "batch/tokens", p.batch.tokens);
  write(file, g + "batch/hidden", p.batch.hidden);
  write(file, g + "batch/loss_mask", p.batch.loss_mask);
  write(file, g + "batch/lengths", p.batch.lengths);
  // [B, 2] document lengths per row (0: none): a row without documents is one of its length.
  write(file, g + "batch/documents",
        packed ? at::tensor(std::vector<int64_t>{7, 9, 6, 0}).view({2, 2})
               : at::tensor(std::vector<int64_t>{16, 0, 6, 0}).view({2, 2}));
  write(file, g + "target/embedding", p.target.embedding);
  write(file, g + "target/lm_head", p.target.lm_head);
  write(file, g + "target/exported_layers", at::tensor(p.target.exported_layers));
  std::vector<int64_t> anchors, valid;
  for (size_t b = 0; b < attn.input_.blocks.anchors.size(); ++b)
    for (size_t n = 0; n < attn.input_.blocks.anchors[b].size(); ++n) {
      anchors.push_back(attn.input_.blocks.anchors[b][n]);
      valid.push_back(attn.input_.blocks.valid[b][n]);
    }
  write(file, g + "step/anchors", at::tensor(anchors).view({2, 3}));
  write(file, g + "step/block_valid", at::tensor(valid).view({2, 3}));
  write(file, g + "step/loss", r.loss.detach());
  write(file, g + "step/position_accuracy", at::tensor(r.position_accuracy, at::kDouble));
  for (const char* k : {"layers", "heads", "kv_heads", "block_size", "mask_token"})
    write(file, g + "config/" + k, at::scalar_tensor(std::get<int64_t>(cfg.at(k)), at::kLong));
  write(file, g + "config/head_dim", at::scalar_tensor(int64_t{8}, at::kLong));
  write(file, g + "config/target_layer_ids", at::tensor(std::vector<int64_t>{2, 0}));
  for (const char* k : {"gamma", "rope_theta", "rms_eps"})
    write(file, g + "config/" + k, at::scalar_tensor(std::get<double>(cfg.at(k)), at::kDouble));
  auto real = [&](const char* key, double fallback) {
    return at::scalar_tensor(cfg.count(key) ? std::get<double>(cfg.at(key)) : fallback, at::kDouble);
  };
  write(file, g + "config/input_embedding_scale", real("input_embedding_scale", 1.0));
  write(file, g + "config/output_multiplier", real("output_multiplier", 1.0));
  write(file, g + "config/final_logit_softcapping", real("final_logit_softcapping", 0.0));
  write(file, g + "config/target_logit_scale", at::scalar_tensor(target_scale, at::kDouble));
  write(file, g + "config/target_logit_softcap", at::scalar_tensor(target_cap, at::kDouble));
  auto text = [&](const char* key, const char* fallback) {
    return cfg.count(key) ? std::get<std::string>(cfg.at(key)) : std::string(fallback);
  };
  const std::string labels = text("labels", "data"), norm = text("normalisation", "positions"),
                    rule = text("anchor_rule", "response");
  write(file, g + "config/labels",
        at::scalar_tensor(int64_t(labels == "data"            ? 0
                                  : labels == "target_argmax" ? 1
                                                              : 2)));
  write(file, g + "config/by_positions", at::scalar_tensor(int64_t(norm == "positions")));
  write(file, g + "config/response_anchors", at::scalar_tensor(int64_t(rule == "response")));
  write(file, g + "config/label_temperature",
        at::scalar_tensor(cfg.count("label_temperature") ? std::get<double>(cfg.at("label_temperature")) : 1.0,
                          at::kDouble));
  int64_t n = 0;
  for (auto& [pname, w] : d->parameters()) {
    ASSERT_TRUE(w.grad().defined()) << name << " " << pname;
    write(file, g + "params/" + pname, w);
    write(file, g + "grads/" + pname, w.grad());
    ++n;
  }
  EXPECT_EQ(n, 2 + 2 * 11 + 1) << name;
  EXPECT_TRUE(std::isfinite(r.loss.item<double>())) << name;
}

TEST(DFlashExport, WritesOneStepForThePythonCrossCheck) {
  const char* env = std::getenv("FLASHDRAFT_DFLASH_EXPORT");
  const std::string path = env ? env : std::string(FLASHDRAFT_BINARY_DIR) + "/dflash_export.h5";
  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(file, 0) << path;
  // flashdraft before 2026-12 (data labels, sum-of-weights normalisation, anchors before a
  // response token), today's defaults with data labels, packed rows, the two target label
  // modes ("auto" picks target_argmax here: the problem exports the target's last layer), and
  // scaled and capped logits.
  const Value data = std::string("data");
  write_case(file, "old",
             {{"normalisation", std::string("weights")}, {"anchor_rule", std::string("next_token")}, {"labels", data}},
             false);
  write_case(file, "defaults", {{"labels", data}}, false);
  write_case(file, "packed", {{"labels", data}}, true);
  write_case(file, "target_argmax", {{"labels", std::string("target_argmax")}}, true);
  write_case(file, "target_kl", {{"labels", std::string("target_kl")}, {"label_temperature", 0.7}}, true);
  // z-lab's scaled and capped drafter (input_embedding_scale, output_multiplier, final_logit_softcapping) against
  // a target that scales and caps its own logits (the soft labels are its served distribution).
  write_case(file, "scaled",
             {{"labels", std::string("target_kl")},
              {"label_temperature", 0.7},
              {"input_embedding_scale", 2.5},
              {"output_multiplier", 1.7},
              {"final_logit_softcapping", 1.5}},
             true, 1.3, 2.0);
  ASSERT_GE(H5Fclose(file), 0);
}

}  // namespace
