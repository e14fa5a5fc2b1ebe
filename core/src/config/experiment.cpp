// Experiment files: TOML++ parsing and schema checking with precise messages.
#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

#include "config/experiment.hpp"

#include <flashdraft/plugin.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

namespace flashdraft {

struct Experiment::Parsed {
  toml::table root;
};

namespace {

// Tables that name one plugin, and the table of per-plugin options of listed kinds
// ([kernels.<name>]), from plugin_kinds.def.
std::vector<std::string> plugin_sections(bool with_optional = true) {
  std::vector<std::string> out;
  for (const auto& k : plugin_kinds())
    if (!k.listed && (with_optional || !k.optional)) out.push_back(k.table);
  return out;
}
bool optional_section(const std::string& table) {
  for (const auto& k : plugin_kinds())
    if (k.table == table) return k.optional;
  return false;
}
std::vector<std::string> listed_sections() {
  std::vector<std::string> out;
  for (const auto& k : plugin_kinds())
    if (k.listed) out.push_back(k.table);
  return out;
}

SourcePosition position(const std::string& file, const toml::source_region& src) {
  return SourcePosition{file, static_cast<int64_t>(src.begin.line), static_cast<int64_t>(src.begin.column)};
}

std::string describe(const toml::node& node) {
  std::ostringstream os;
  switch (node.type()) {
    case toml::node_type::string: os << "string \"" << *node.value<std::string>() << "\""; break;
    case toml::node_type::integer: os << "integer " << *node.value<int64_t>(); break;
    case toml::node_type::floating_point: os << "float " << *node.value<double>(); break;
    case toml::node_type::boolean: os << "boolean " << (*node.value<bool>() ? "true" : "false"); break;
    case toml::node_type::table: os << "a table"; break;
    case toml::node_type::array: os << "an array"; break;
    default: os << "a date/time"; break;
  }
  return os.str();
}

[[noreturn]] void fail_at(const SourcePosition& where, const std::string& table, const std::string& key,
                          const std::string& message) {
  throw ConfigError(where.str() + ": [" + table + "] " + key + ": " + message);
}

// One scalar element against the spec; returns the converted value.
template <class T>
T scalar(const toml::node& node, const KeySpec& spec, const SourcePosition& where, const std::string& table,
         const std::string& what);

template <>
int64_t scalar<int64_t>(const toml::node& node, const KeySpec& spec, const SourcePosition& where,
                        const std::string& table, const std::string& what) {
  if (!node.is_integer())
    fail_at(where, table, spec.name, "expected " + spec.accepted() + ", found " + what + describe(node));
  const int64_t v = *node.value<int64_t>();
  if ((spec.min && double(v) < *spec.min) || (spec.max && double(v) > *spec.max))
    fail_at(where, table, spec.name, "value " + std::to_string(v) + " out of range; expected " + spec.accepted());
  return v;
}

template <>
double scalar<double>(const toml::node& node, const KeySpec& spec, const SourcePosition& where,
                      const std::string& table, const std::string& what) {
  if (!node.is_number())
    fail_at(where, table, spec.name, "expected " + spec.accepted() + ", found " + what + describe(node));
  const double v = node.is_integer() ? double(*node.value<int64_t>()) : *node.value<double>();
  if (!std::isfinite(v))
    fail_at(where, table, spec.name, "value " + to_string(Value(v)) + " is not finite; expected " + spec.accepted());
  if ((spec.min && v < *spec.min) || (spec.max && v > *spec.max))
    fail_at(where, table, spec.name, "value " + to_string(Value(v)) + " out of range; expected " + spec.accepted());
  return v;
}

template <>
std::string scalar<std::string>(const toml::node& node, const KeySpec& spec, const SourcePosition& where,
                                const std::string& table, const std::string& what) {
  if (!node.is_string())
    fail_at(where, table, spec.name, "expected " + spec.accepted() + ", found " + what + describe(node));
  std::string v = *node.value<std::string>();
  if (!spec.choices.empty() && std::find(spec.choices.begin(), spec.choices.end(), v) == spec.choices.end()) {
    std::string msg = "value \"" + v + "\" is not accepted; expected " + spec.accepted();
    Schema tmp;
    for (const auto& c : spec.choices) tmp.string(c, "");
    const std::string near = tmp.closest(v);
    if (!near.empty()) msg += " (did you mean \"" + near + "\"?)";
    fail_at(where, table, spec.name, msg);
  }
  return v;
}

template <class T>
std::vector<T> list(const toml::node& node, const KeySpec& spec, const SourcePosition& where,
                    const std::string& table) {
  const toml::array* arr = node.as_array();
  if (!arr) fail_at(where, table, spec.name, "expected " + spec.accepted() + ", found " + describe(node));
  const int64_t n = static_cast<int64_t>(arr->size());
  if ((spec.min_items && n < *spec.min_items) || (spec.max_items && n > *spec.max_items))
    fail_at(where, table, spec.name,
            "array has " + std::to_string(n) + " item" + (n == 1 ? "" : "s") + "; expected " + spec.accepted());
  std::vector<T> out;
  for (int64_t i = 0; i < n; ++i) {
    const toml::node& el = *arr->get(static_cast<size_t>(i));
    const SourcePosition ew = position(where.file, el.source());
    out.push_back(scalar<T>(el, spec, ew.line ? ew : where, table, "item " + std::to_string(i) + " is "));
  }
  return out;
}

Config check(const toml::table* tbl, const Schema& schema, const std::string& file, SourcePosition table_where,
             const std::set<std::string>& skip) {
  Config cfg(schema.table(), table_where);
  if (tbl) {
    for (const auto& [k, node] : *tbl) {
      const std::string key(k.str());
      if (skip.count(key)) continue;
      if (!schema.find(key)) {
        std::string msg = "unknown key '" + key + "'";
        const std::string near = schema.closest(key);
        if (!near.empty()) msg += "; did you mean '" + near + "'?";
        std::string names;
        for (const auto& s : schema.keys()) names += (names.empty() ? "" : ", ") + s.name;
        msg += names.empty() ? " (this table takes no keys)" : " (accepted keys: " + names + ")";
        throw ConfigError(position(file, k.source()).str() + ": [" + schema.table() + "] " + msg);
      }
    }
  }
  for (const auto& spec : schema.keys()) {
    const toml::node* node = tbl ? tbl->get(spec.name) : nullptr;
    if (!node) {
      if (!spec.fallback)
        throw ConfigError(table_where.str() + ": [" + schema.table() + "] missing required key '" + spec.name + "' (" +
                          spec.doc + "; " + spec.accepted() + ")");
      cfg.set(spec.name, *spec.fallback, std::nullopt);
      continue;
    }
    const SourcePosition where = position(file, node->source());
    const std::string& t = schema.table();
    switch (spec.type) {
      case ValueType::integer: cfg.set(spec.name, scalar<int64_t>(*node, spec, where, t, ""), where); break;
      case ValueType::real: cfg.set(spec.name, scalar<double>(*node, spec, where, t, ""), where); break;
      case ValueType::string: cfg.set(spec.name, scalar<std::string>(*node, spec, where, t, ""), where); break;
      case ValueType::boolean:
        if (!node->is_boolean())
          fail_at(where, t, spec.name, "expected a boolean (true or false), found " + describe(*node));
        cfg.set(spec.name, *node->value<bool>(), where);
        break;
      case ValueType::integer_list: cfg.set(spec.name, list<int64_t>(*node, spec, where, t), where); break;
      case ValueType::real_list: cfg.set(spec.name, list<double>(*node, spec, where, t), where); break;
      case ValueType::string_list: cfg.set(spec.name, list<std::string>(*node, spec, where, t), where); break;
    }
  }
  return cfg;
}

const toml::table* section(const toml::table& root, const std::string& name, const std::string& file) {
  const toml::node* n = root.get(name);
  if (!n) return nullptr;
  if (!n->is_table())
    throw ConfigError(position(file, n->source()).str() + ": '" + name + "' must be a table ([" + name + "]), found " +
                      describe(*n));
  return n->as_table();
}

}  // namespace

namespace {

// [eval]: when validation runs and how served validation decodes.
Schema eval_schema() {
  Schema eval("eval");
  eval.integer("every",
               "validate before step 0, every N steps and at the end (0 = before and at the end); "
               "rows in /eval of the log")
      .def(int64_t(0))
      .at_least(0);
  eval.boolean("enabled", "run validation on the held-out sequences").def(false);
  eval.integer("batches", "held-out batches per validation (0 = all the dataset has)").def(int64_t(0)).at_least(0);
  eval.boolean("served",
               "decode the held-out responses speculatively as a server does and report the served acceptance "
               "length eval/tau_served (the headline); off: only the anchor and simulated figures")
      .def(true);
  eval.integer("served_batch", "responses decoded at once in served validation (rows of the decoders' caches)")
      .def(int64_t(64))
      .range(1, 1 << 16);
  eval.integer("served_responses",
               "held-out responses decoded per served validation (0 = every assistant turn of "
               "the held-out batches)")
      .def(int64_t(0))
      .at_least(0);
  eval.real("temperature",
            "served validation's sampling temperature (0 = greedy; > 0: rejection sampling as the "
            "reference loop does it, needs an online target)")
      .def(0.0)
      .range(0.0, 100.0);
  eval.real("top_p", "served validation's nucleus cut at temperature > 0").def(1.0).range(1e-6, 1.0);
  return eval;
}

// [run]: what to train, where, and how the process runs.
Schema run_schema() {
  Schema run("run");
  run.string("name", "name of the run; the log is <out>/<name>.h5").def(std::string("run"));
  run.integer("seed", "seed of every random draw (data order, anchors, initial weights)").def(int64_t(0)).at_least(0);
  run.integer("steps", "optimizer steps to train").def(int64_t(100)).range(1, 1e9);
  run.string("device", "where training runs").def(std::string("cpu")).one_of({"cpu", "cuda"});
  run.string("dtype", "compute dtype of the drafter (auto: bfloat16 on CUDA, float32 on CPU)")
      .def(std::string("auto"))
      .one_of({"auto", "float32", "bfloat16", "float16"});
  run.string("master_weights",
             "dtype of the weights the optimizer updates and of its moments (auto: float32; "
             "compute: the compute dtype, i.e. pure 16-bit training)")
      .def(std::string("auto"))
      .one_of({"auto", "float32", "compute"});
  run.string("out", "output folder (log, data cache, checkpoints)").def(std::string("runs"));
  run.integer("print_every", "print a progress line every N steps").def(int64_t(1)).range(1, 1e9);
  run.integer("threads", "CPU threads for LibTorch (0 = LibTorch's default)").def(int64_t(0)).range(0, 1024);
  run.boolean("queue_ahead",
              "on CUDA (one process, one micro-batch, fused AdamW): queue each step before reading "
              "the previous one's loss and metrics, so the device never waits for the host between steps (the "
              "same results; false reads every step before the next starts)")
      .def(true);
  return run;
}

// [attention]: the attention kernels in order of preference, and what a fallback does.
Schema attention_schema() {
  Schema attention("attention");
  attention.strings("kernels", "attention kernels in order of preference; the first that supports the problem runs")
      .def(std::vector<std::string>{"dense_ref"})
      .items(1, 16);
  attention.string("on_fallback", "what a fallback does: stop the run (error) or continue and record it (warn)")
      .def(std::string("error"))
      .one_of({"error", "warn"});
  return attention;
}

// [optimizer]: AdamW, its schedule, clipping and gradient accumulation.
Schema optimizer_schema() {
  Schema opt("optimizer");
  opt.real("lr", "peak learning rate (AdamW)").def(1e-3).range(0, 10);
  opt.real("min_lr_ratio", "final learning rate of the cosine schedule, as a fraction of lr").def(0.1).range(0, 1);
  opt.integer("warmup_steps", "linear warm-up steps before the cosine decay").def(int64_t(10)).at_least(0);
  opt.real("weight_decay", "AdamW decoupled weight decay").def(0.0).range(0, 10);
  opt.real("beta1", "AdamW beta1").def(0.9).range(0, 0.999999);
  opt.real("beta2", "AdamW beta2").def(0.95).range(0, 0.999999);
  opt.real("eps", "AdamW epsilon").def(1e-8).range(1e-30, 1);
  opt.real("grad_clip", "clip the global gradient norm to this (0 = no clipping)").def(1.0).at_least(0);
  opt.integer("accumulate",
              "micro-batches per optimizer step (gradient accumulation); the gradient is that of "
              "the union of the micro-batches (of every rank), each loss weighted by its loss-carrying positions")
      .def(int64_t(1))
      .range(1, 1e6);
  opt.string("implementation",
             "AdamW implementation: fused (ATen's multi-tensor fused AdamW, float32 master "
             "weights for 16-bit compute, no host sync), torch (torch::optim::AdamW; compute-dtype weights only), "
             "auto (fused on CUDA or with 16-bit compute, torch otherwise)")
      .def(std::string("auto"))
      .one_of({"auto", "fused", "torch"});
  return opt;
}

// [loss]: the LM-head cross-entropy kernel and its chunking.
Schema loss_schema() {
  Schema loss("loss");
  loss.strings("kernels",
               "LM-head loss variants in order of preference; the first that supports the run's device and dtype "
               "runs. fused (CUDA: rows in chunks, one kernel per chunk for the softmax statistics, argmax and the "
               "gradient written over the 16-bit logits in place), chunked (rows in chunks in plain ATen, gradient "
               "computed in the forward, never [rows, vocab] float32 logits at once), reference (full logits, plain "
               "autograd), auto (fused on CUDA, chunked elsewhere)")
      .def(std::vector<std::string>{"auto"})
      .items(1, 4)
      .one_of({"auto", "fused", "chunked", "reference"});
  loss.string("on_fallback",
              "what running a later preference than the first does: stop the run (error) or continue and "
              "record it (warn)")
      .def(std::string("error"))
      .one_of({"error", "warn"});
  loss.integer("chunk_rows",
               "rows per chunk of the chunked and fused losses (0 = auto: about 512 MiB of logits, "
               "float32 for chunked, the compute dtype for fused)")
      .def(int64_t(0))
      .range(0, 1 << 24);
  return loss;
}

// [plugins]: extra folders searched for plugins.
Schema plugins_schema() {
  Schema plugins("plugins");
  plugins.strings("paths", "extra folders searched for plugins (after --plugin-path and FLASHDRAFT_PLUGIN_PATH)")
      .def(std::vector<std::string>{});
  return plugins;
}

// [checkpoint]: when checkpoints are written and how many are kept.
Schema checkpoint_schema() {
  Schema ckpt("checkpoint");
  ckpt.integer("every", "write a checkpoint to <out>/checkpoints/step_<n> every N steps (0 = only at the end)")
      .def(int64_t(0))
      .at_least(0);
  ckpt.integer("keep", "checkpoints kept (older ones are deleted)").def(int64_t(2)).range(1, 1000);
  ckpt.boolean("enabled", "write checkpoints at all").def(false);
  return ckpt;
}

// [distributed]: collectives, timeouts and gradient buckets of a torchrun launch.
Schema distributed_schema() {
  Schema dist("distributed");
  dist.string("backend",
              "collectives of a run launched by torchrun (WORLD_SIZE > 1): nccl on CUDA, gloo on CPU "
              "(auto: by [run] device)")
      .def(std::string("auto"))
      .one_of({"auto", "nccl", "gloo"});
  dist.real("timeout",
            "seconds a rank waits for the others (rendezvous and every collective) before the run stops "
            "naming the rank that did not answer")
      .def(300.0)
      .range(1, 86400);
  dist.real("bucket_mb",
            "gradient all-reduce bucket size, MiB: a bucket is sent as soon as its gradients are "
            "ready, overlapped with the rest of the backward")
      .def(25.0)
      .range(0.001, 65536);
  return dist;
}

}  // namespace

std::vector<Schema> Experiment::engine_schemas() {
  std::vector<Schema> out;
  out.push_back(run_schema());
  out.push_back(attention_schema());
  out.push_back(optimizer_schema());
  out.push_back(loss_schema());
  out.push_back(plugins_schema());
  out.push_back(checkpoint_schema());
  out.push_back(eval_schema());
  out.push_back(distributed_schema());
  return out;
}

Experiment Experiment::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the experiment file (does it exist, is it readable?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

namespace {

// An experiment file with a NUL byte is not text: fails at the first one's line and column.
void check_no_nul(const std::string& text, const std::string& path) {
  if (text.find('\0') == std::string::npos) return;
  size_t line = 1, col = 1;
  for (size_t i = 0; i < text.size() && text[i] != '\0'; ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else
      ++col;
  }
  throw ConfigError(path + ":" + std::to_string(line) + ":" + std::to_string(col) +
                    ": not a TOML text file (a NUL byte); an experiment file is UTF-8 TOML");
}

// Every top-level table must be one the engine or a plugin kind knows; fails at the first
// other one, naming the closest known table and all of them.
void check_table_names(const toml::table& root, const std::string& path, const std::vector<Schema>& schemas) {
  std::set<std::string> known;
  for (const auto& s : listed_sections()) known.insert(s);
  for (const auto& s : plugin_sections()) known.insert(s);
  for (const auto& s : schemas) known.insert(s.table());
  Schema table_names;
  for (const auto& k : known) table_names.boolean(k, "");
  for (const auto& [k, node] : root) {
    const std::string key(k.str());
    if (!known.count(key)) {
      std::string msg = "unknown table [" + key + "]";
      const std::string near = table_names.closest(key);
      if (!near.empty()) msg += "; did you mean [" + near + "]?";
      std::string names;
      for (const auto& n : known) names += (names.empty() ? "" : ", ") + n;
      throw ConfigError(position(path, k.source()).str() + ": " + msg + " (tables: " + names + ")");
    }
  }
}

// An empty experiment file: fails naming the plugin tables it needs at least.
void check_not_empty(const toml::table& root, const std::string& path) {
  if (!root.empty()) return;
  std::string needed;
  const auto sections = plugin_sections(/*with_optional=*/false);
  for (size_t i = 0; i < sections.size(); ++i)
    needed += (i ? (i + 1 == sections.size() ? " and " : ", ") : "") + ("[" + sections[i] + "]");
  throw ConfigError(path + ": the experiment file is empty; it needs at least " + needed +
                    " tables (see experiments/quickstart.toml, or `flashdraft schema`)");
}

// Where a table starts; the file itself for an absent table.
SourcePosition table_position(const std::string& path, const toml::table* t) {
  return t ? position(path, t->source()) : SourcePosition{path, 0, 0};
}

// The plugin a plugin table names (its `plugin` key); none for an absent optional table.
std::optional<PluginChoice> plugin_choice(const toml::table& root, const std::string& name, const std::string& path) {
  const toml::table* t = section(root, name, path);
  if (!t && optional_section(name)) return std::nullopt;
  if (!t)
    throw ConfigError(path + ": missing required table [" + name + "] (it names the " + name +
                      " plugin: plugin = \"...\"; `flashdraft plugins` lists them)");
  const toml::node* p = t->get("plugin");
  if (!p)
    throw ConfigError(table_position(path, t).str() + ": [" + name + "] missing required key 'plugin' (the name of a " +
                      name + " plugin; `flashdraft plugins` lists them)");
  if (!p->is_string())
    throw ConfigError(position(path, p->source()).str() + ": [" + name + "] plugin: expected a string, found " +
                      describe(*p));
  return PluginChoice{name, *p->value<std::string>(), position(path, p->source())};
}

// Every entry of a listed table ([kernels]) must itself be a table ([kernels.<name>]).
void check_listed_tables(const toml::table& root, const std::string& path) {
  for (const auto& listed : listed_sections())
    if (const toml::table* k = section(root, listed, path)) {
      for (const auto& [kname, node] : *k)
        if (!node.is_table())
          throw ConfigError(position(path, node.source()).str() + ": [" + listed + "] " + std::string(kname.str()) +
                            ": expected a table [" + listed + "." + std::string(kname.str()) + "], found " +
                            describe(node));
    }
}

}  // namespace

Experiment Experiment::parse(const std::string& text, const std::string& path) {
  Experiment e;
  e.path_ = path;
  e.text_ = text;
  check_no_nul(text, path);
  auto parsed = std::make_shared<Parsed>();
  try {
    parsed->root = toml::parse(text, path);
  } catch (const toml::parse_error& err) {
    throw ConfigError(position(path, err.source()).str() + ": TOML syntax error: " + std::string(err.description()));
  }
  const toml::table& root = parsed->root;

  const std::vector<Schema> schemas = engine_schemas();
  check_table_names(root, path, schemas);
  check_not_empty(root, path);

  for (const auto& s : schemas) {
    const toml::table* t = section(root, s.table(), path);
    Config c = check(t, s, path, table_position(path, t), {});
    if (s.table() == "run")
      e.run_ = c;
    else if (s.table() == "attention")
      e.attention_ = c;
    else if (s.table() == "optimizer")
      e.optimizer_ = c;
    else if (s.table() == "plugins")
      e.plugins_ = c;
    else if (s.table() == "checkpoint")
      e.checkpoint_ = c;
    else if (s.table() == "eval")
      e.eval_ = c;
    else if (s.table() == "distributed")
      e.distributed_ = c;
    else if (s.table() == "loss")
      e.loss_ = c;
  }
  for (const auto& name : plugin_sections())
    if (auto chosen = plugin_choice(root, name, path)) e.choices_[name] = std::move(*chosen);
  check_listed_tables(root, path);
  e.parsed_ = parsed;
  return e;
}

const PluginChoice& Experiment::choice(const std::string& table) const {
  const auto it = choices_.find(table);
  if (it == choices_.end()) throw std::logic_error("the experiment has no plugin table [" + table + "]");
  return it->second;
}

Config Experiment::plugin_config(const std::string& name, const Schema& schema) const {
  const toml::table* t = section(parsed_->root, name, path_);
  Schema s = schema;
  s.set_table(name);
  return check(t, s, path_, t ? position(path_, t->source()) : SourcePosition{path_, 0, 0}, {"plugin"});
}

Config Experiment::kernel_config(const std::string& kernel, const Schema& schema) const {
  const std::string table = plugin_kind(PluginKind::kernel).table;
  const toml::table* k = section(parsed_->root, table, path_);
  const toml::table* t = nullptr;
  if (k)
    if (const toml::node* n = k->get(kernel)) t = n->as_table();
  Schema s = schema;
  s.set_table(table + "." + kernel);
  return check(t, s, path_, t ? position(path_, t->source()) : SourcePosition{path_, 0, 0}, {});
}

void Experiment::override_integer(const std::string& table, const std::string& key, int64_t v) {
  Config& c = table == "run" ? run_ : table == "checkpoint" ? checkpoint_ : eval_;
  c.set(key, v, SourcePosition{"command line", 0, 0});
}

void Experiment::override_string(const std::string& table, const std::string& key, const std::string& v) {
  Config& c = table == "run" ? run_ : attention_;
  c.set(key, v, SourcePosition{"command line", 0, 0});
}

}  // namespace flashdraft
