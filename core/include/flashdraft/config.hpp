// Experiment tables: a Schema declares each key once (type, default, range or
// choices, one-line meaning); the engine checks a TOML table against it and hands the
// plugin a Config, a typed view in which every declared key has a value. Errors name
// the file, line and column, the key, the value found and what is accepted.
#pragma once

#include <flashdraft/export.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace flashdraft {

enum class ValueType { integer, real, boolean, string, integer_list, real_list, string_list };
FLASHDRAFT_API const char* to_string(ValueType type);

using Value = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<double>,
                           std::vector<std::string>>;
FLASHDRAFT_API std::string to_string(const Value& value);

// Where a value came from: "experiments/x.toml:12:5".
struct FLASHDRAFT_API SourcePosition {
  std::string file;
  int64_t line = 0;
  int64_t column = 0;
  std::string str() const;
};

class FLASHDRAFT_API ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct FLASHDRAFT_API KeySpec {
  std::string name;
  ValueType type = ValueType::integer;
  std::string doc;
  std::optional<Value> fallback;                // the default; none = required
  std::optional<double> min, max;               // for numbers and each list element
  std::vector<std::string> choices;             // for strings and each list element
  std::optional<int64_t> min_items, max_items;  // for lists

  KeySpec& def(Value v) {
    fallback = std::move(v);
    return *this;
  }
  KeySpec& range(double lo, double hi) {
    min = lo;
    max = hi;
    return *this;
  }
  KeySpec& at_least(double lo) {
    min = lo;
    return *this;
  }
  KeySpec& one_of(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  KeySpec& items(int64_t lo, int64_t hi) {
    min_items = lo;
    max_items = hi;
    return *this;
  }
  std::string accepted() const;  // "an integer in [1, 64]", "one of \"a\", \"b\"", ...
};

class FLASHDRAFT_API Schema {
 public:
  explicit Schema(std::string table = "") : table_(std::move(table)) {}
  KeySpec& integer(const std::string& name, const std::string& doc);
  KeySpec& real(const std::string& name, const std::string& doc);
  KeySpec& boolean(const std::string& name, const std::string& doc);
  KeySpec& string(const std::string& name, const std::string& doc);
  KeySpec& integers(const std::string& name, const std::string& doc);
  KeySpec& reals(const std::string& name, const std::string& doc);
  KeySpec& strings(const std::string& name, const std::string& doc);

  const std::string& table() const { return table_; }
  void set_table(std::string t) { table_ = std::move(t); }
  const std::vector<KeySpec>& keys() const { return keys_; }
  const KeySpec* find(const std::string& name) const;
  // Closest declared key by edit distance (for "did you mean"), or "" if none is close.
  std::string closest(const std::string& name) const;
  // The reference text `flashdraft schema` prints: one line per key.
  std::string describe() const;

 private:
  KeySpec& add(const std::string& name, ValueType type, const std::string& doc);
  std::string table_;
  std::vector<KeySpec> keys_;
};

// A checked table: every declared key has a value (given or default).
class FLASHDRAFT_API Config {
 public:
  Config() = default;
  Config(std::string table, SourcePosition where) : table_(std::move(table)), where_(std::move(where)) {}

  int64_t integer(const std::string& key) const;
  double real(const std::string& key) const;
  bool boolean(const std::string& key) const;
  const std::string& string(const std::string& key) const;
  const std::vector<int64_t>& integers(const std::string& key) const;
  const std::vector<double>& reals(const std::string& key) const;
  const std::vector<std::string>& strings(const std::string& key) const;
  bool given(const std::string& key) const;  // set in the file (not defaulted)

  // For checks across keys that a schema cannot express: throws ConfigError naming
  // the key's position (or the table's, if the key was defaulted) and the message.
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;
  const std::string& table() const { return table_; }
  const SourcePosition& where() const { return where_; }
  SourcePosition where(const std::string& key) const;

  // Engine side: filled by the checker.
  void set(const std::string& key, Value value, std::optional<SourcePosition> where);

 private:
  const Value& get(const std::string& key, ValueType type) const;
  struct Entry {
    Value value;
    std::optional<SourcePosition> where;
  };
  std::string table_;
  SourcePosition where_;
  std::map<std::string, Entry> entries_;
};

// Edit distance (for suggestions).
FLASHDRAFT_API int64_t edit_distance(const std::string& a, const std::string& b);

}  // namespace flashdraft
