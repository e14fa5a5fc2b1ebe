// Test helper: runs the flashdraft CLI in a child process and captures its output.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "train/checkpoint.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace test {

struct Child {
  pid_t pid = -1;
  std::string output_file;
  int wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
  }
  std::string output() const {
    std::ifstream in(output_file);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
};

// Starts `flashdraft args...` with stdout and stderr sent to `output_file` (stderr to
// `error_file` instead when one is given).
inline Child start_cli(const std::vector<std::string>& args, const std::string& output_file,
                       const std::string& error_file = "") {
  Child c;
  c.output_file = output_file;
  c.pid = fork();
  if (c.pid == 0) {
    FILE* f = std::fopen(output_file.c_str(), "w");
    FILE* e = error_file.empty() ? f : std::fopen(error_file.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(e), 2);
    std::vector<char*> argv;
    std::string exe = FLASHDRAFT_CLI;
    argv.push_back(exe.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(exe.c_str(), argv.data());
    _exit(127);
  }
  return c;
}

// Runs the CLI; `output` gets stdout and stderr together, or stdout alone when `errors`
// is given (it gets stderr).
inline int run_cli(const std::vector<std::string>& args, std::string* output, std::string* errors = nullptr) {
  static int counter = 0;
  const std::string stem = (std::filesystem::temp_directory_path() /
                            ("flashdraft-cli-" + std::to_string(getpid()) + "-" + std::to_string(counter++)))
                               .string();
  const std::string file = stem + ".txt", error_file = errors ? stem + ".err.txt" : "";
  Child c = start_cli(args, file, error_file);
  const int rc = c.wait();
  if (output) *output = c.output();
  if (errors) {
    std::ifstream in(error_file);
    std::stringstream ss;
    ss << in.rdbuf();
    *errors = ss.str();
    std::filesystem::remove(error_file);
  }
  std::filesystem::remove(file);
  return rc;
}

inline std::string temp_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("flashdraft-test-" + name + "-" + std::to_string(getpid()));
  flashdraft::checkpoint::remove_tree(p);  // not fs::remove_all (see checkpoint.hpp)
  std::filesystem::create_directories(p);
  return p.string();
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

}  // namespace test
