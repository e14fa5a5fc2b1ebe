// The flashdraft command line.
#include "config/experiment.hpp"
#include "export/hf_export.hpp"
#include "log/inspect.hpp"
#include "registry/registry.hpp"
#include "train/checkpoint.hpp"
#include "train/profile.hpp"
#include "train/trainer.hpp"

#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

using namespace flashdraft;

namespace {

const char* kUsage =
    "usage: flashdraft <command> [options]\n"
    "\n"
    "commands:\n"
    "  run EXP.toml [--out DIR] [--steps N] [--plugin-path DIRS]   train as the experiment says\n"
    "      [--resume [CHECKPOINT|latest]]                          ... continuing from a checkpoint\n"
    "  validate EXP.toml [--out DIR] [--plugin-path DIRS]          everything run checks before step 0, no training\n"
    "  plugins [--plugin-path DIRS]                                plugins found (and files rejected, with why)\n"
    "  schema [PLUGIN] [--plugin-path DIRS]                        every key of the experiment tables\n"
    "  inspect RUN.h5                                              text summary of a run log\n"
    "  export-weights CHECKPOINT [--out FILE]                      drafter weights of a checkpoint as HDF5\n"
    "  export RUN_OR_CHECKPOINT --format hf OUT_DIR [--plugin-path DIRS]  a drafter as the folder a server loads\n"
    "\n"
    "`flashdraft <command> --help` describes one command. Plugins are searched in --plugin-path,\n"
    "FLASHDRAFT_PLUGIN_PATH, the experiment's [plugins].paths, then the build's plugin folder.\n";

const char* help_for(const std::string& cmd) {
  if (cmd == "run")
    return "usage: flashdraft run EXP.toml [--out DIR] [--steps N] [--plugin-path DIRS] [--resume [CHECKPOINT|latest]] "
           "[--profile A:B]\n"
           "Trains as EXP.toml says and writes one HDF5 log per run, <out>/<name>.h5 (a new name if it exists).\n"
           "  --resume [CHECKPOINT|latest]  continue from a checkpoint folder (<out>/checkpoints/step_<n>) or\n"
           "                     from the newest usable one under <out>/checkpoints (latest, the default):\n"
           "                     weights, optimizer, schedule, generators and data position are restored and\n"
           "                     the run appends to the same log, cut back to the checkpoint's step\n"
           "  --out DIR          output folder (overrides [run].out); the data cache goes there too\n"
           "  --steps N          number of steps (overrides [run].steps)\n"
           "  --plugin-path DIRS extra plugin folders, ':'-separated, searched first\n"
           "  --profile A:B      profile steps A..B-1 (LibTorch's profiler): a Chrome trace <out>/<name>.trace.json\n"
           "                     and tables of device time per op family and per part of the step\n"
           "Progress: one line per step (loss, metrics, step time, peak memory, kernels that ran).\n"
           "Exit status: 0 finished, 1 failed (the log keeps every finished step), 2 bad experiment,\n"
           "130 interrupted (Ctrl-C finishes the step in flight, then stops).\n";
  if (cmd == "validate")
    return "usage: flashdraft validate EXP.toml [--out DIR] [--plugin-path DIRS]\n"
           "A dry run: everything `flashdraft run` does before step 0 that can refuse the experiment, without\n"
           "training or writing a log. Every table is checked against the engine's and the plugins' schemas,\n"
           "the plugins are created, the dataset is opened (the embedded data is generated into <out>/data\n"
           "if it is not cached there yet, and validate says so), the drafter is bound to the data's shapes\n"
           "and the attention kernel is chosen (the selection report is printed).\n"
           "Exit status and first error line are the ones `run` would give: 0 valid, 2 bad experiment,\n"
           "1 refused for another reason (e.g. no kernel accepts the problem under on_fallback = \"error\").\n";
  if (cmd == "plugins")
    return "usage: flashdraft plugins [--plugin-path DIRS]\n"
           "Lists the plugins found on the search path (kind, name, version, file) and every rejected file\n"
           "with the reason (API version, build fingerprint, not a plugin).\n";
  if (cmd == "schema")
    return "usage: flashdraft schema [PLUGIN] [--plugin-path DIRS]\n"
           "Prints every key of the engine's tables and of each plugin's table: type, default, accepted values\n"
           "and meaning. With PLUGIN, only that plugin's table.\n";
  if (cmd == "export-weights")
    return "usage: flashdraft export-weights CHECKPOINT [--out FILE]\n"
           "Writes the drafter weights of a checkpoint folder (<out>/checkpoints/step_<n>) as HDF5 (default\n"
           "CHECKPOINT/weights.h5): the [drafter] table as TOML and every tensor by name; the drafter plugins'\n"
           "READMEs show how to read it. A finished run writes <out>/<name>.weights.h5 itself.\n";
  if (cmd == "export")
    return "usage: flashdraft export RUN_OR_CHECKPOINT --format hf OUT_DIR [--plugin-path DIRS]\n"
           "Writes a trained drafter as the folder a serving engine loads, in the drafter plugin's own format\n"
           "(a Hugging Face folder: OUT_DIR/config.json and OUT_DIR/model.safetensors in the run's dtype; each\n"
           "drafter plugin's README lists its keys and tensors). What the weights do not carry was resolved when\n"
           "the run bound its drafter and kept next to its log (<out>/<name>.hf-layout.json, with the plugin's\n"
           "name, which is searched in --plugin-path as `run` does).\n"
           "  RUN_OR_CHECKPOINT  a run log RUN.h5 (the finished run's weights, else its newest checkpoint) or a\n"
           "                     checkpoint folder <out>/checkpoints/step_<n>\n"
           "  --format hf        the only format (required, so that scripts say what they expect)\n"
           "A finished run writes <out>/<name>.hf itself; [drafter] init = \"OUT_DIR\" loads one back.\n";
  if (cmd == "inspect")
    return "usage: flashdraft inspect RUN.h5 [--plot DIR]\n"
           "Prints a summary of a run log: steps, loss, metrics, memory peaks per phase, kernels that ran,\n"
           "events. Works on a log still being written and on one left by a crashed run.\n"
           "  --plot DIR  also write the figures (loss, per-position accuracy, tau_sim, memory per phase,\n"
           "              kernel timeline) as PNG files into DIR, through the Python module\n"
           "              analysis/flashdraft_logs.py (the project's .venv, or $FLASHDRAFT_PYTHON)\n";
  return nullptr;
}

struct Args {
  std::vector<std::string> positional;
  std::string out;
  std::string plot;
  std::string profile;
  int64_t steps = -1;
  std::vector<std::string> plugin_paths;
  std::string resume;
  std::string format;
  bool help = false;
};

Args parse(int argc, char** argv, int first) {
  Args a;
  for (int i = first; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(name) + " needs a value");
      return argv[++i];
    };
    if (s == "--help" || s == "-h")
      a.help = true;
    else if (s == "--out")
      a.out = value("--out");
    else if (s == "--plot")
      a.plot = value("--plot");
    else if (s == "--profile")
      a.profile = value("--profile");
    else if (s == "--format")
      a.format = value("--format");
    else if (s == "--plugin-path")
      a.plugin_paths.push_back(value("--plugin-path"));
    else if (s == "--resume") {
      // The value is optional: the next word, unless it is an option or the experiment file.
      const std::string next = i + 1 < argc ? argv[i + 1] : "";
      const bool toml = next.size() > 5 && next.compare(next.size() - 5, 5, ".toml") == 0;
      a.resume = !next.empty() && next.rfind("--", 0) != 0 && !toml ? argv[++i] : "latest";
    } else if (s == "--steps") {
      const std::string v = value("--steps");
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      if (!end || *end || n < 1) throw std::invalid_argument("--steps " + v + ": expected a positive integer");
      a.steps = n;
    } else if (s.rfind("--", 0) == 0)
      throw std::invalid_argument("unknown option " + s);
    else
      a.positional.push_back(s);
  }
  return a;
}

// The figures are drawn by the Python side (analysis/plot_run.py, matplotlib): one
// plotting code path for the notebook and the command line.
int plot_log(const std::string& log, const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path exe = fs::read_symlink("/proc/self/exe");
  std::vector<fs::path> scripts;
  if (const char* env = std::getenv("FLASHDRAFT_ANALYSIS_DIR")) scripts.push_back(fs::path(env) / "plot_run.py");
  scripts.push_back(exe.parent_path().parent_path() / "share" / "flashdraft" / "analysis" / "plot_run.py");
  scripts.push_back(fs::path(FLASHDRAFT_SOURCE_DIR) / "analysis" / "plot_run.py");
  fs::path script;
  for (const auto& p : scripts)
    if (fs::exists(p)) {
      script = p;
      break;
    }
  if (script.empty()) {
    std::cerr << "error: --plot needs analysis/plot_run.py; looked in:";
    for (const auto& p : scripts) std::cerr << " " << p.string();
    std::cerr << " (set FLASHDRAFT_ANALYSIS_DIR)\n";
    return 2;
  }
  std::string python = "python3";
  if (const char* env = std::getenv("FLASHDRAFT_PYTHON"))
    python = env;
  else if (fs::exists(fs::path(FLASHDRAFT_SOURCE_DIR) / ".venv" / "bin" / "python"))
    python = (fs::path(FLASHDRAFT_SOURCE_DIR) / ".venv" / "bin" / "python").string();
  auto quote = [](const std::string& x) {
    std::string q = "'";
    for (char c : x) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::cout << "figures (" << script.string() << "):" << std::endl;
  const int rc =
      std::system((quote(python) + " " + quote(script.string()) + " " + quote(log) + " " + quote(dir)).c_str());
  return rc == 0 ? 0 : (WIFEXITED(rc) ? WEXITSTATUS(rc) : 1);
}

Registry make_registry(const Args& a) { return Registry(Registry::search_path(a.plugin_paths, {}, "")); }

int cmd_plugins(const Args& a) {
  Registry reg = make_registry(a);
  std::cout << "search path:\n";
  for (const auto& d : reg.folders()) std::cout << "  " << d << "\n";
  std::cout << "plugins (" << reg.found().size() << "):\n";
  for (const auto& p : reg.found())
    std::cout << "  " << std::string(to_string(p.kind)) << std::string(9 - std::strlen(to_string(p.kind)), ' ')
              << p.name << std::string(p.name.size() < 16 ? 16 - p.name.size() : 1, ' ') << p.version << "  " << p.path
              << "\n"
              << "           " << p.summary << "\n";
  if (!reg.rejected().empty()) {
    std::cout << "rejected files (" << reg.rejected().size() << "):\n";
    for (const auto& r : reg.rejected()) std::cout << "  " << r.path << ": " << r.reason << "\n";
  }
  return 0;
}

int cmd_schema(const Args& a) {
  Registry reg = make_registry(a);
  const std::string only = a.positional.empty() ? "" : a.positional[0];
  bool any = false;
  if (only.empty()) {
    std::cout << "# engine tables\n";
    for (const auto& s : Experiment::engine_schemas()) std::cout << s.describe() << "\n";
    std::string one, listed;
    for (const auto& k : plugin_kinds()) {
      if (k.listed)
        listed += std::string(listed.empty() ? "" : ", ") + "[" + k.table + ".<name>]";
      else
        one += std::string(one.empty() ? "" : ", ") + "[" + k.table + "]";
    }
    std::cout << "# plugin tables: " << one << " take `plugin = \"<name>\"` and that plugin's keys;\n"
              << "# kernels take their keys in " << listed << ".\n\n";
  }
  for (const auto& p : reg.found()) {
    if (!only.empty() && p.name != only) continue;
    any = true;
    Schema s = reg.schema(p);
    const PluginKindInfo& kind = plugin_kind(p.kind);
    const bool kernel = kind.listed;
    s.set_table(kernel ? std::string(kind.table) + "." + p.name : std::string(kind.table));
    std::cout << "# " << to_string(p.kind) << " plugin '" << p.name << "' " << p.version << ": " << p.summary << "\n";
    std::string text = s.describe();
    if (!kernel) {  // the table names its plugin first
      const auto eol = text.find('\n');
      text = text.substr(0, eol + 1) + "  plugin = \"" + p.name + "\"\n" + text.substr(eol + 1);
    }
    std::cout << text << "\n";
  }
  if (!only.empty() && !any) {
    std::string names;
    for (const auto& p : reg.found()) names += (names.empty() ? "" : ", ") + p.name;
    std::cerr << "error: no plugin named '" << only << "' (plugins found: [" << names << "])\n";
    return 2;
  }
  return 0;
}

int cmd_export(const Args& a) {
  if (a.positional.size() != 2)
    throw std::invalid_argument("export takes a run log or checkpoint and an output folder");
  if (a.format != "hf")
    throw std::invalid_argument("export needs --format hf (a Hugging Face folder; found \"" + a.format + "\")");
  try {
    std::cout << hf_export::export_folder(a.positional[0], a.positional[1], make_registry(a)) << "\n";
  } catch (const std::runtime_error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (!help_for(cmd)) {
    std::cerr << "error: unknown command '" << cmd << "'\n\n" << kUsage;
    return 2;
  }
  try {
    Args a = parse(argc, argv, 2);
    if (a.help) {
      std::cout << help_for(cmd);
      return 0;
    }
    if (cmd == "plugins") return cmd_plugins(a);
    if (cmd == "schema") return cmd_schema(a);
    if (cmd == "inspect") {
      if (a.positional.size() != 1) throw std::invalid_argument("inspect takes one run log (RUN.h5)");
      inspect_log(a.positional[0], std::cout);
      return a.plot.empty() ? 0 : plot_log(a.positional[0], a.plot);
    }
    if (cmd == "export") return cmd_export(a);
    if (cmd == "export-weights") {
      if (a.positional.size() != 1) throw std::invalid_argument("export-weights takes one checkpoint folder");
      try {
        const std::string written = checkpoint::export_checkpoint(a.positional[0], a.out);
        std::cout << "weights: " << written << "\n";
      } catch (const checkpoint::Error& e) {
        std::cerr << "error: " << e.what() << "\n";
        return 1;
      }
      return 0;
    }
    if (a.positional.size() != 1) throw std::invalid_argument(cmd + " takes one experiment file (EXP.toml)");
    RunOptions o;
    o.experiment = a.positional[0];
    o.out = a.out;
    o.steps = a.steps;
    o.plugin_paths = a.plugin_paths;
    o.resume = a.resume;
    o.profile = a.profile;
    if (!o.profile.empty()) parse_profile_window(o.profile);  // a bad window is a usage error
    return cmd == "run" ? run_experiment(o) : validate_experiment(o);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    if (const char* h = help_for(cmd)) std::cerr << "\n" << h;
    return 2;
  }
}
