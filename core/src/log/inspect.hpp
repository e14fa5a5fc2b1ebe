// `flashdraft inspect RUN.h5`: a text summary of a run log.
#pragma once

#include <flashdraft/export.hpp>

#include <ostream>
#include <string>

namespace flashdraft {

// Writes the summary; throws std::runtime_error if the file is not a run log.
FLASHDRAFT_API void inspect_log(const std::string& path, std::ostream& out);

}  // namespace flashdraft
