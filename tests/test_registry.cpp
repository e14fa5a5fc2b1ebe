// The plugin registry: search path, descriptors, refusals with reasons.
#include "registry/registry.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/model.hpp>

#include "cli_runner.hpp"

#include <gtest/gtest.h>

#include <fstream>

using namespace flashdraft;

namespace {
bool has(const Registry& r, PluginKind kind, const std::string& name) {
  for (const auto* p : r.of_kind(kind))
    if (p->name == name) return true;
  return false;
}
}  // namespace

TEST(Registry, LoadsPluginsOfEveryKindFromTheSearchPath) {
  Registry reg({FLASHDRAFT_TEST_PLUGIN_DIR, FLASHDRAFT_PLUGIN_DIR});
  EXPECT_TRUE(has(reg, PluginKind::drafter, "toy_drafter"));
  EXPECT_TRUE(has(reg, PluginKind::dataset, "toy_data"));
  EXPECT_TRUE(has(reg, PluginKind::kernel, "toy_kernel"));
  EXPECT_TRUE(has(reg, PluginKind::mask, "causal"));
  EXPECT_TRUE(has(reg, PluginKind::kernel, "dense_ref"));
  EXPECT_TRUE(has(reg, PluginKind::drafter, "dflash"));
  for (const auto& p : reg.found()) {
    EXPECT_FALSE(p.version.empty()) << p.name;
    EXPECT_FALSE(p.path.empty()) << p.name;
  }
  // A created object implements its kind's interface, configured from its schema.
  const FoundPlugin& k = reg.get(PluginKind::kernel, "toy_kernel");
  Schema s = reg.schema(k);
  ASSERT_NE(s.find("sleep_ms"), nullptr);
  Config c("kernels.toy_kernel", {});
  for (const auto& key : s.keys()) c.set(key.name, *key.fallback, std::nullopt);
  std::unique_ptr<PluginObject> obj = reg.create(k, c);
  EXPECT_NE(dynamic_cast<AttentionKernel*>(obj.get()), nullptr);
}

TEST(Registry, RefusesAnotherApiVersionWithASentence) {
  const std::string dir = std::string(FLASHDRAFT_TEST_PLUGIN_DIR) + "/api_mismatch";
  Registry reg({dir});
  EXPECT_TRUE(reg.found().empty());
  ASSERT_EQ(reg.rejected().size(), 1u);
  const auto& r = reg.rejected()[0];
  EXPECT_NE(r.path.find("api_mismatch"), std::string::npos) << r.path;
  EXPECT_NE(r.reason.find("plugin API version 99, engine expects " + std::to_string(flashdraft::kPluginApiVersion)),
            std::string::npos)
      << r.reason;
}

TEST(Registry, RefusesFilesThatAreNotPlugins) {
  const std::string dir = test::temp_dir("registry-junk");
  test::write_file(dir + "/junk.so", "this is not an ELF file");
  Registry reg({dir});
  ASSERT_EQ(reg.rejected().size(), 1u);
  EXPECT_NE(reg.rejected()[0].reason.find("cannot be loaded"), std::string::npos) << reg.rejected()[0].reason;
}

TEST(Registry, UnknownNameListsWhatExistsAndWhereItLooked) {
  Registry reg({FLASHDRAFT_TEST_PLUGIN_DIR, FLASHDRAFT_PLUGIN_DIR});
  try {
    reg.get(PluginKind::kernel, "toy_kernal");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("no kernel plugin named 'toy_kernal'"), std::string::npos) << m;
    EXPECT_NE(m.find("toy_kernel"), std::string::npos) << m;
    EXPECT_NE(m.find("dense_ref"), std::string::npos) << m;
    EXPECT_NE(m.find("Did you mean 'toy_kernel'?"), std::string::npos) << m;
    EXPECT_NE(m.find(FLASHDRAFT_TEST_PLUGIN_DIR), std::string::npos) << m;
    EXPECT_NE(m.find(FLASHDRAFT_PLUGIN_DIR), std::string::npos) << m;
  }
}

TEST(Registry, SearchPathOrderAndFirstWins) {
  setenv("FLASHDRAFT_PLUGIN_PATH", "/env/a:/env/b", 1);
  const auto dirs = Registry::search_path({"/cli/x"}, {"rel", "/abs"}, "/exp/dir/e.toml");
  unsetenv("FLASHDRAFT_PLUGIN_PATH");
  ASSERT_GE(dirs.size(), 5u);
  EXPECT_EQ(dirs[0], "/cli/x");
  EXPECT_EQ(dirs[1], "/env/a");
  EXPECT_EQ(dirs[2], "/env/b");
  EXPECT_EQ(dirs[3], "/exp/dir/rel");
  EXPECT_EQ(dirs[4], "/abs");
  // The same plugin found twice: the first folder wins, the second file is rejected.
  Registry reg({FLASHDRAFT_TEST_PLUGIN_DIR, FLASHDRAFT_TEST_PLUGIN_DIR "/.."});
  EXPECT_TRUE(has(reg, PluginKind::kernel, "toy_kernel"));
}

TEST(Registry, PluginsCommandShowsFoundAndRejected) {
  std::string out;
  const int rc =
      test::run_cli({"plugins", "--plugin-path",
                     std::string(FLASHDRAFT_TEST_PLUGIN_DIR) + ":" + FLASHDRAFT_TEST_PLUGIN_DIR + "/api_mismatch"},
                    &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("toy_kernel"), std::string::npos) << out;
  EXPECT_NE(out.find("rejected files"), std::string::npos) << out;
  EXPECT_NE(out.find("plugin API version 99, engine expects " + std::to_string(flashdraft::kPluginApiVersion)),
            std::string::npos)
      << out;
}
