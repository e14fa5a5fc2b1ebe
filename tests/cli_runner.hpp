// Test helper: runs the flashdraft CLI in a child process and captures its output.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint.hpp"

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

// Starts `flashdraft args...` with stdout and stderr sent to `output_file`.
inline Child start_cli(const std::vector<std::string>& args, const std::string& output_file) {
  Child c;
  c.output_file = output_file;
  c.pid = fork();
  if (c.pid == 0) {
    FILE* f = std::fopen(output_file.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
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

inline int run_cli(const std::vector<std::string>& args, std::string* output) {
  static int counter = 0;
  const std::string file = (std::filesystem::temp_directory_path() /
                            ("flashdraft-cli-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + ".txt"))
                               .string();
  Child c = start_cli(args, file);
  const int rc = c.wait();
  if (output) *output = c.output();
  std::filesystem::remove(file);
  return rc;
}

inline std::string temp_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("flashdraft-test-" + name + "-" + std::to_string(getpid()));
  flashdraft::checkpoint::remove_tree(p);  // not fs::remove_all (see checkpoint.hpp)
  std::filesystem::create_directories(p);
  return p.string();
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

}  // namespace test
