#include "testing/built_binary.h"

#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace actstash::testing {

// POSIX only, no std::filesystem: a test that links libtorch from PyPI gets
// that libtorch's exported copy of std::filesystem (see daemon_process.cc).
std::string BuiltBinary(const char* env_name, const char* relative) {
  const char* from_env = std::getenv(env_name);
  if (from_env != nullptr && from_env[0] != '\0') return from_env;
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return relative;
  std::string dir(exe, static_cast<size_t>(n));
  for (int up = 0; up <= 4; ++up) {
    const size_t slash = dir.rfind('/');
    if (slash == std::string::npos) break;
    dir.resize(slash);  // the executable's folder first, then its parents
    const std::string candidate = (dir.empty() ? "" : dir) + "/" + relative;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    if (dir.empty()) break;
  }
  return relative;
}

}  // namespace actstash::testing
