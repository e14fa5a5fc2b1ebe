// Experiment files: malformed input gives a precise message (file, line, column, key,
// value found, what is accepted, closest valid key) and never crashes.
#include "config/experiment.hpp"

#include <gtest/gtest.h>

#include <random>
#include <string>

using flashdraft::ConfigError;
using flashdraft::Experiment;

namespace {

const std::string kValid = R"([run]
name = "t"
steps = 10
[drafter]
plugin = "toy_drafter"
[dataset]
plugin = "toy_data"
[mask]
plugin = "causal"
)";

// Parses `text` and returns the error message ("" if it parsed).
std::string error_of(const std::string& text) {
  try {
    Experiment::parse(text, "bad.toml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_has(const std::string& msg, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(msg.empty()) << "expected an error";
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message lacks \"" << p << "\":\n" << msg;
}

}  // namespace

TEST(ExperimentFile, ValidFileParsesWithDefaults) {
  Experiment e = Experiment::parse(kValid, "ok.toml");
  EXPECT_EQ(e.run().integer("steps"), 10);
  EXPECT_EQ(e.run().string("device"), "cpu");  // default
  EXPECT_FALSE(e.run().given("device"));
  EXPECT_TRUE(e.run().given("steps"));
  EXPECT_EQ(e.attention().string("on_fallback"), "error");  // the strict default
  EXPECT_EQ(e.choice("drafter").plugin, "toy_drafter");
  EXPECT_EQ(e.choice("drafter").where.line, 5);
}

TEST(ExperimentFile, SyntaxError) { expect_has(error_of("[run\nsteps = 3\n"), {"bad.toml:1:", "TOML syntax error"}); }

TEST(ExperimentFile, UnknownKeySuggestsClosest) {
  expect_has(error_of("[run]\nstepz = 3\n" + kValid.substr(6)),
             {"bad.toml:2:1", "[run]", "unknown key 'stepz'", "did you mean 'steps'?", "accepted keys:"});
}

TEST(ExperimentFile, WrongType) {
  expect_has(
      error_of("[run]\nsteps = \"ten\"\n[drafter]\nplugin=\"a\"\n[dataset]\nplugin=\"b\"\n[mask]\nplugin=\"c\"\n"),
      {"bad.toml:2:9", "[run] steps", "expected an integer in [1, 1000000000]", "found string \"ten\""});
}

TEST(ExperimentFile, FloatForInteger) {
  expect_has(error_of("[run]\nsteps = 1.5\n[drafter]\nplugin=\"a\"\n[dataset]\nplugin=\"b\"\n[mask]\nplugin=\"c\"\n"),
             {"bad.toml:2:9", "[run] steps", "found float 1.5"});
}

TEST(ExperimentFile, OutOfRange) {
  expect_has(error_of("[run]\nsteps = 0\n[drafter]\nplugin=\"a\"\n[dataset]\nplugin=\"b\"\n[mask]\nplugin=\"c\"\n"),
             {"bad.toml:2:9", "[run] steps", "value 0 out of range", "in [1, 1000000000]"});
}

TEST(ExperimentFile, NegativeLearningRate) {
  expect_has(error_of(kValid + "[optimizer]\nlr = -0.1\n"), {"bad.toml:11:6", "[optimizer] lr", "-0.1", "in [0, 10]"});
}

TEST(ExperimentFile, EnumValueSuggestsClosest) {
  expect_has(error_of(kValid + "[attention]\non_fallback = \"warning\"\n"),
             {"bad.toml:11:15", "[attention] on_fallback", "\"warning\" is not accepted", "one of \"error\", \"warn\"",
              "did you mean \"warn\"?"});
}

TEST(ExperimentFile, BadDevice) {
  expect_has(error_of(kValid + "[run]\n"), {"bad.toml", "TOML syntax error"});  // [run] twice
  expect_has(error_of("[run]\ndevice = \"gpu\"\n" + kValid.substr(kValid.find("[drafter]"))),
             {"bad.toml:2:10", "[run] device", "one of \"cpu\", \"cuda\""});
}

TEST(ExperimentFile, MissingRequiredTable) {
  expect_has(error_of("[run]\nsteps = 3\n[dataset]\nplugin = \"x\"\n[mask]\nplugin = \"y\"\n"),
             {"bad.toml", "missing required table [drafter]", "plugin = \"...\""});
}

TEST(ExperimentFile, MissingPluginKey) {
  expect_has(error_of("[drafter]\nlayers = 2\n[dataset]\nplugin = \"x\"\n[mask]\nplugin = \"y\"\n"),
             {"bad.toml:1:1", "[drafter] missing required key 'plugin'"});
}

TEST(ExperimentFile, PluginNameNotAString) {
  expect_has(error_of("[drafter]\nplugin = 3\n[dataset]\nplugin = \"x\"\n[mask]\nplugin = \"y\"\n"),
             {"bad.toml:2:10", "[drafter] plugin: expected a string, found integer 3"});
}

TEST(ExperimentFile, MisspeltTable) {
  expect_has(error_of(kValid + "[optimiser]\nlr = 0.1\n"),
             {"bad.toml:10:2", "unknown table [optimiser]", "did you mean [optimizer]?"});
}

TEST(ExperimentFile, TableGivenAsValue) {
  expect_has(error_of("run = 3\n" + kValid.substr(kValid.find("[drafter]"))),
             {"bad.toml:1:7", "'run' must be a table", "integer 3"});
}

TEST(ExperimentFile, EmptyFile) {
  expect_has(error_of(""), {"bad.toml", "the experiment file is empty", "[drafter]"});
  expect_has(error_of("# only a comment\n\n"), {"bad.toml", "empty"});
}

TEST(ExperimentFile, BinaryGarbageWithNul) {
  std::string garbage(
      "\x7f"
      "ELF\x02\x01\x01\0\0\0\0",
      12);
  expect_has(error_of(garbage), {"bad.toml:1:", "not a TOML text file"});
}

TEST(ExperimentFile, BinaryGarbageInvalidUtf8) {
  std::string garbage = "\xff\xfe\xfa\x80\x81 = 3\n";
  expect_has(error_of(garbage), {"bad.toml:1:", "TOML syntax error"});
}

TEST(ExperimentFile, DuplicateKey) {
  expect_has(error_of("[run]\nsteps = 3\nsteps = 4\n" + kValid.substr(kValid.find("[drafter]"))),
             {"bad.toml:3:", "TOML syntax error", "steps"});
}

TEST(ExperimentFile, ListItemOfWrongType) {
  expect_has(error_of(kValid + "[attention]\nkernels = [\"dense_ref\", 3]\n"),
             {"bad.toml:11:", "[attention] kernels", "item 1 is integer 3"});
}

TEST(ExperimentFile, EmptyKernelList) {
  expect_has(error_of(kValid + "[attention]\nkernels = []\n"),
             {"bad.toml:11:11", "array has 0 items", "1 to 16 items"});
}

TEST(ExperimentFile, LossKernelsArePreferencesOfKnownVariants) {
  const Experiment e = Experiment::parse(kValid, "ok.toml");
  EXPECT_EQ(e.loss().strings("kernels"), std::vector<std::string>{"auto"});  // the default
  EXPECT_EQ(e.loss().string("on_fallback"), "error");
  const Experiment two = Experiment::parse(kValid + "[loss]\nkernels = [\"fused\", \"chunked\"]\n", "ok.toml");
  EXPECT_EQ(two.loss().strings("kernels"), (std::vector<std::string>{"fused", "chunked"}));
  // Refused when the file is read, before any data or model is touched.
  expect_has(error_of(kValid + "[loss]\nkernels = [\"fastest\"]\n"),
             {"bad.toml:11:12", "[loss] kernels", "\"fastest\" is not accepted", "\"auto\", \"fused\", \"chunked\""});
  expect_has(error_of(kValid + "[loss]\nkernel = \"fused\"\n"), {"unknown key 'kernel'", "did you mean 'kernels'"});
}

TEST(ExperimentFile, KernelTableNotATable) {
  expect_has(error_of(kValid + "[kernels]\nflash_cpu = 3\n"),
             {"bad.toml:11:13", "[kernels] flash_cpu", "expected a table"});
}

TEST(ExperimentFile, MissingFile) {
  try {
    Experiment::load("/nonexistent/x.toml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.toml: cannot open"), std::string::npos) << e.what();
  }
}

TEST(ExperimentFile, PluginTableCheckedAgainstPluginSchema) {
  Experiment e = Experiment::parse(kValid + "[drafter.extra]\n", "ok.toml");  // sub-table: unknown key 'extra'
  flashdraft::Schema s;
  s.integer("layers", "decoder layers").def(int64_t(2)).range(1, 64);
  try {
    e.plugin_config("drafter", s);
    FAIL() << "no error";
  } catch (const ConfigError& err) {
    expect_has(err.what(), {"ok.toml", "[drafter] unknown key 'extra'"});
  }
  Experiment e2 = Experiment::parse(R"([drafter]
plugin = "toy_drafter"
layrs = 4
[dataset]
plugin = "toy_data"
[mask]
plugin = "causal"
)",
                                    "ok.toml");
  try {
    e2.plugin_config("drafter", s);
    FAIL() << "no error";
  } catch (const ConfigError& err) {
    expect_has(err.what(), {"ok.toml:3:1", "[drafter] unknown key 'layrs'", "did you mean 'layers'?"});
  }
  Experiment e3 = Experiment::parse(R"([drafter]
plugin = "toy_drafter"
layers = 65
[dataset]
plugin = "toy_data"
[mask]
plugin = "causal"
)",
                                    "ok.toml");
  try {
    e3.plugin_config("drafter", s);
    FAIL() << "no error";
  } catch (const ConfigError& err) {
    expect_has(err.what(), {"ok.toml:3:10", "[drafter] layers", "value 65 out of range", "in [1, 64]"});
  }
}

TEST(ExperimentFile, RandomBytesNeverCrash) {
  // Random byte strings and random mutations of a valid file: every outcome is either
  // a parsed experiment or a ConfigError, never another exception or a crash.
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 400; ++trial) {
    std::string text = kValid;
    const int edits = 1 + static_cast<int>(rng() % 6);
    for (int k = 0; k < edits; ++k) {
      const size_t pos = rng() % (text.size() + 1);
      switch (rng() % 3) {
        case 0: text.insert(text.begin() + static_cast<long>(pos), static_cast<char>(rng() % 256)); break;
        case 1:
          if (pos < text.size()) text.erase(pos, 1);
          break;
        default:
          if (pos < text.size()) text[pos] = static_cast<char>(rng() % 256);
          break;
      }
    }
    try {
      Experiment::parse(text, "fuzz.toml");
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("fuzz.toml"), std::string::npos) << e.what();
    }
  }
}
