// The HDF5 run log: one file per run, written in SWMR mode so that a reader can
// follow a run while it trains and a crash leaves every finished step readable.
// Every dataset is declared before the first step (SWMR forbids creating objects
// later), chunked and extendable along its first axis; append() adds one row and
// flush() makes the step durable.
#pragma once

#include <flashdraft/export.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace flashdraft {

class FLASHDRAFT_API RunLog {
 public:
  enum class Type { f64, i64, i32, str };

  // Creates (truncates) the file; attributes go on the root group.
  RunLog(const std::string& path, const std::map<std::string, std::string>& attributes);
  // Opens an existing log to append to it (resumed runs): declare() skips datasets that
  // exist, truncate() cuts them back to a checkpoint's rows, start() resumes SWMR. A log
  // left by a killed writer opens too (its "open for writing" flags are cleared).
  static std::unique_ptr<RunLog> reopen(const std::string& path);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  // Declares a dataset "group/name" of rows of `width` values (width 0 = scalars,
  // a 1-D dataset). str rows are fixed-length strings of `str_len` bytes.
  void declare(const std::string& name, Type type, int64_t width = 0, int64_t str_len = 0, const std::string& doc = "");
  void set_group_attribute(const std::string& group, const std::string& key, const std::string& value);
  // After this, no more datasets or attributes: the file is in SWMR mode.
  void start();

  void append(const std::string& name, const std::vector<double>& row);
  void append(const std::string& name, const std::vector<int64_t>& row);
  void append(const std::string& name, const std::vector<int32_t>& row);
  void append(const std::string& name, const std::string& text);
  void append(const std::string& name, double v) { append(name, std::vector<double>{v}); }
  void append(const std::string& name, int64_t v) { append(name, std::vector<int64_t>{v}); }
  // Overwrites the trailing rows of all datasets of a group down to `rows` (resume).
  void truncate(const std::string& name, int64_t rows);
  int64_t rows(const std::string& name) const;
  // Every dataset, "group/name" (for checkpoints: rows per dataset at a step).
  std::vector<std::string> names() const;
  bool has(const std::string& name) const;
  int64_t width(const std::string& name) const;  // values per row (0: scalars); -1: no such dataset
  void flush();
  const std::string& path() const { return path_; }

 private:
  RunLog() = default;
  struct Dataset;
  int64_t file_ = -1;
  std::string path_;
  bool started_ = false;
  std::map<std::string, std::unique_ptr<Dataset>> datasets_;
  std::map<std::string, int64_t> groups_;
  int64_t group(const std::string& name);
  Dataset& get(const std::string& name, Type type);
};

// Read side (for `flashdraft inspect` and tests): opens a log read-only in SWMR mode
// (works for a log being written and for one left by a crashed run).
struct FLASHDRAFT_API LogReader {
  explicit LogReader(const std::string& path);
  ~LogReader();
  std::map<std::string, std::string> attributes(const std::string& object = "/") const;
  bool exists(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  std::vector<double> f64(const std::string& name) const;  // flattened, any numeric type
  std::vector<std::string> strings(const std::string& name) const;
  std::vector<std::string> members(const std::string& group) const;
  int64_t file_ = -1;
};

}  // namespace flashdraft
