// Schema and Config: declared keys and the typed view plugins read.
#include <flashdraft/config.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace flashdraft {

const char* to_string(ValueType type) {
  switch (type) {
    case ValueType::integer: return "integer";
    case ValueType::real: return "float";
    case ValueType::boolean: return "boolean";
    case ValueType::string: return "string";
    case ValueType::integer_list: return "array of integers";
    case ValueType::real_list: return "array of floats";
    case ValueType::string_list: return "array of strings";
  }
  return "?";
}

namespace {
std::string number(double x) {
  std::ostringstream os;
  if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 1e15)
    os << static_cast<int64_t>(x);
  else
    os << x;
  return os.str();
}
template <class T>
std::string join(const std::vector<T>& v, const std::string& sep, bool quote) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) os << sep;
    if (quote) os << '"';
    if constexpr (std::is_floating_point_v<T>)
      os << number(v[i]);
    else
      os << v[i];
    if (quote) os << '"';
  }
  return os.str();
}
}  // namespace

std::string to_string(const Value& value) {
  struct Visitor {
    std::string operator()(int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const { return number(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return "\"" + x + "\""; }
    std::string operator()(const std::vector<int64_t>& x) const { return "[" + join(x, ", ", false) + "]"; }
    std::string operator()(const std::vector<double>& x) const { return "[" + join(x, ", ", false) + "]"; }
    std::string operator()(const std::vector<std::string>& x) const { return "[" + join(x, ", ", true) + "]"; }
  };
  return std::visit(Visitor{}, value);
}

std::string SourcePosition::str() const {
  std::ostringstream os;
  os << (file.empty() ? "<experiment>" : file);
  if (line > 0) os << ':' << line << ':' << column;
  return os.str();
}

std::string KeySpec::accepted() const {
  std::ostringstream os;
  const bool list = type == ValueType::integer_list || type == ValueType::real_list || type == ValueType::string_list;
  os << (list ? "an " : (type == ValueType::integer ? "an " : "a ")) << to_string(type);
  if (list && (min_items || max_items)) {
    if (min_items && max_items && *min_items == *max_items)
      os << " of exactly " << *min_items << " item" << (*min_items == 1 ? "" : "s");
    else if (min_items && max_items)
      os << " of " << *min_items << " to " << *max_items << " items";
    else if (min_items)
      os << " of at least " << *min_items << " item" << (*min_items == 1 ? "" : "s");
    else
      os << " of at most " << *max_items << " items";
  }
  const char* each = list ? " (each)" : "";
  if (min && max)
    os << each << " in [" << number(*min) << ", " << number(*max) << "]";
  else if (min)
    os << each << " >= " << number(*min);
  else if (max)
    os << each << " <= " << number(*max);
  if (!choices.empty()) os << each << ", one of " << join(choices, ", ", true);
  return os.str();
}

KeySpec& Schema::add(const std::string& name, ValueType type, const std::string& doc) {
  for (const auto& k : keys_)
    if (k.name == name) throw std::logic_error("schema [" + table_ + "] declares key '" + name + "' twice");
  keys_.push_back(KeySpec{});
  keys_.back().name = name;
  keys_.back().type = type;
  keys_.back().doc = doc;
  return keys_.back();
}
KeySpec& Schema::integer(const std::string& n, const std::string& d) { return add(n, ValueType::integer, d); }
KeySpec& Schema::real(const std::string& n, const std::string& d) { return add(n, ValueType::real, d); }
KeySpec& Schema::boolean(const std::string& n, const std::string& d) { return add(n, ValueType::boolean, d); }
KeySpec& Schema::string(const std::string& n, const std::string& d) { return add(n, ValueType::string, d); }
KeySpec& Schema::integers(const std::string& n, const std::string& d) { return add(n, ValueType::integer_list, d); }
KeySpec& Schema::reals(const std::string& n, const std::string& d) { return add(n, ValueType::real_list, d); }
KeySpec& Schema::strings(const std::string& n, const std::string& d) { return add(n, ValueType::string_list, d); }

const KeySpec* Schema::find(const std::string& name) const {
  for (const auto& k : keys_)
    if (k.name == name) return &k;
  return nullptr;
}

int64_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<int64_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int64_t>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int64_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string Schema::closest(const std::string& name) const {
  std::string best;
  int64_t best_d = 0;
  for (const auto& k : keys_) {
    const int64_t d = edit_distance(name, k.name);
    if (best.empty() || d < best_d) {
      best = k.name;
      best_d = d;
    }
  }
  // Close means: at most a third of the longer name changed (and at most 3 edits).
  const int64_t limit =
      std::min<int64_t>(3, std::max<int64_t>(1, static_cast<int64_t>(std::max(name.size(), best.size())) / 3));
  if (!best.empty() && best_d <= limit) return best;
  // A truncated or extended spelling ("warn" for "warning", and back) is close too.
  for (const auto& k : keys_)
    if (name.size() >= 3 && k.name.size() >= 3 && (k.name.rfind(name, 0) == 0 || name.rfind(k.name, 0) == 0))
      return k.name;
  return std::string();
}

std::string Schema::describe() const {
  std::ostringstream os;
  os << "[" << table_ << "]\n";
  for (const auto& k : keys_) {
    os << "  " << k.name << " : " << to_string(k.type);
    os << (k.fallback ? " = " + to_string(*k.fallback) : std::string(" (required)"));
    const std::string acc = k.accepted();
    const std::string plain = std::string(k.type == ValueType::integer ? "an " : "a ") + to_string(k.type);
    if (acc != plain && acc != std::string("an ") + to_string(k.type)) os << "  accepts " << acc;
    os << "\n      " << k.doc << "\n";
  }
  return os.str();
}

// ---------------------------------------------------------------------------
void Config::set(const std::string& key, Value value, std::optional<SourcePosition> where) {
  entries_[key] = Entry{std::move(value), std::move(where)};
}

bool Config::given(const std::string& key) const {
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.where.has_value();
}

SourcePosition Config::where(const std::string& key) const {
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second.where) return *it->second.where;
  return where_;
}

void Config::fail(const std::string& key, const std::string& message) const {
  throw ConfigError(where(key).str() + ": [" + table_ + "] " + key + ": " + message);
}

const Value& Config::get(const std::string& key, ValueType type) const {
  auto it = entries_.find(key);
  if (it == entries_.end())
    throw std::logic_error("[" + table_ + "] has no declared key '" + key +
                           "' (a plugin read a key its schema does not declare)");
  const size_t want = static_cast<size_t>(type);
  if (it->second.value.index() != want)
    throw std::logic_error("[" + table_ + "] key '" + key + "' read as " + to_string(type) + " but declared otherwise");
  return it->second.value;
}

int64_t Config::integer(const std::string& k) const { return std::get<int64_t>(get(k, ValueType::integer)); }
double Config::real(const std::string& k) const { return std::get<double>(get(k, ValueType::real)); }
bool Config::boolean(const std::string& k) const { return std::get<bool>(get(k, ValueType::boolean)); }
const std::string& Config::string(const std::string& k) const {
  return std::get<std::string>(get(k, ValueType::string));
}
const std::vector<int64_t>& Config::integers(const std::string& k) const {
  return std::get<std::vector<int64_t>>(get(k, ValueType::integer_list));
}
const std::vector<double>& Config::reals(const std::string& k) const {
  return std::get<std::vector<double>>(get(k, ValueType::real_list));
}
const std::vector<std::string>& Config::strings(const std::string& k) const {
  return std::get<std::vector<std::string>>(get(k, ValueType::string_list));
}

}  // namespace flashdraft
