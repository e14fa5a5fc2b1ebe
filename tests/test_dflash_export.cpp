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
  if (c.scalar_type() == at::kLong) type = H5T_NATIVE_INT64;
  else if (c.scalar_type() == at::kByte || c.scalar_type() == at::kBool) { c = c.to(at::kLong); type = H5T_NATIVE_INT64; }
  else if (c.scalar_type() == at::kDouble) type = H5T_NATIVE_DOUBLE;
  else c = c.to(at::kFloat);
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

TEST(DFlashExport, WritesOneStepForThePythonCrossCheck) {
  const char* env = std::getenv("FLASHDRAFT_DFLASH_EXPORT");
  const std::string path = env ? env : std::string(FLASHDRAFT_BINARY_DIR) + "/dflash_export.h5";
  const std::map<std::string, Value> cfg{
      {"layers", int64_t{2}},     {"hidden", int64_t{32}},   {"heads", int64_t{4}},  {"kv_heads", int64_t{2}},
      {"ffn", int64_t{48}},       {"block_size", int64_t{4}}, {"anchors", int64_t{3}}, {"mask_token", int64_t{39}},
      {"target_layer_ids", std::vector<int64_t>{2, 0}},       {"gamma", 3.0},          {"init_std", 0.2},
      {"rope_theta", 500.0},      {"rms_eps", 1e-5}};
  auto d = dflash_test::make_drafter(cfg);
  auto p = dflash_test::random_problem(40, 32, {0, 1, 2}, 2, 16, at::kFloat, 2024);
  p.batch.lengths[1] = 6;  // 2 anchor candidates (1, 2) for 3 anchors: one padding block
  RunContext ctx;
  ctx.seed = 17;
  d->bind(p.target, ctx, 2, 16);
  dflash_test::OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(5);
  StepResult r = d->step(p.batch, attn, rng, true);
  r.loss.backward();
  ASSERT_EQ(attn.input_.block_valid[1], (std::vector<uint8_t>{1, 1, 0}));

  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(file, 0) << path;
  write(file, "batch/tokens", p.batch.tokens);
  write(file, "batch/hidden", p.batch.hidden);
  write(file, "batch/loss_mask", p.batch.loss_mask);
  write(file, "batch/lengths", p.batch.lengths);
  write(file, "target/embedding", p.target.embedding);
  write(file, "target/lm_head", p.target.lm_head);
  write(file, "target/exported_layers", at::tensor(p.target.exported_layers));
  std::vector<int64_t> anchors, valid;
  for (size_t b = 0; b < attn.input_.anchors.size(); ++b)
    for (size_t n = 0; n < attn.input_.anchors[b].size(); ++n) {
      anchors.push_back(attn.input_.anchors[b][n]);
      valid.push_back(attn.input_.block_valid[b][n]);
    }
  write(file, "step/anchors", at::tensor(anchors).view({2, 3}));
  write(file, "step/block_valid", at::tensor(valid).view({2, 3}));
  write(file, "step/loss", r.loss.detach());
  write(file, "step/position_accuracy", at::tensor(r.position_accuracy, at::kDouble));
  write(file, "config/layers", at::scalar_tensor(int64_t{2}, at::kLong));
  write(file, "config/heads", at::scalar_tensor(int64_t{4}, at::kLong));
  write(file, "config/kv_heads", at::scalar_tensor(int64_t{2}, at::kLong));
  write(file, "config/head_dim", at::scalar_tensor(int64_t{8}, at::kLong));
  write(file, "config/block_size", at::scalar_tensor(int64_t{4}, at::kLong));
  write(file, "config/mask_token", at::scalar_tensor(int64_t{39}, at::kLong));
  write(file, "config/target_layer_ids", at::tensor(std::vector<int64_t>{2, 0}));
  write(file, "config/gamma", at::scalar_tensor(3.0, at::kDouble));
  write(file, "config/rope_theta", at::scalar_tensor(500.0, at::kDouble));
  write(file, "config/rms_eps", at::scalar_tensor(1e-5, at::kDouble));
  int64_t n = 0;
  for (auto& [name, w] : d->parameters()) {
    ASSERT_TRUE(w.grad().defined()) << name;
    write(file, "params/" + name, w);
    write(file, "grads/" + name, w.grad());
    ++n;
  }
  ASSERT_GE(H5Fclose(file), 0);
  EXPECT_EQ(n, 2 + 2 * 11 + 1);
  EXPECT_TRUE(std::isfinite(r.loss.item<double>()));
}

}  // namespace
