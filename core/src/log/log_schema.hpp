// The run log's columns, declared once: the writer declares exactly these before step
// 0, and `flashdraft inspect` reads its summaries from the same list.
#pragma once

#include "dispatch/ledger.hpp"
#include "log/run_log.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

struct LogColumn {
  std::string name;  // "group/name"
  RunLog::Type type;
  int64_t width = 0;    // values per row (0: one scalar)
  int64_t str_len = 0;  // str columns: bytes per row
  std::string doc;
};

// What the widths depend on: the drafter's attention layers, per-position metrics and
// extra scalars (zero widths give the names only, as `inspect` needs them).
struct LogShape {
  LedgerColumns columns;                    // the kernel ledger's groups: /kernels/* widths
  std::vector<std::string> position_names;  // the per-position metric's columns
  std::vector<std::string> scalar_names;
  bool target = false;       // an online target: its forward time per step
  int64_t ranks = 1;         // processes of a data-parallel run: ranks/* columns when > 1
  int64_t accumulate = 1;    // micro-batches per step (with ranks: where each batch comes from)
  int64_t served_width = 0;  // served validation: max_proposals + 2 (its histogram), 0 = off
};

std::vector<LogColumn> log_columns(const LogShape& shape);
// The columns of one group ("memory", "eval", ...), in declaration order.
std::vector<LogColumn> log_columns(const std::string& group);
void declare_log_columns(RunLog& log, const LogShape& shape);

}  // namespace flashdraft
