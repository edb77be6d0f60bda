#include "testing/built_binary.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace actstash::testing {

std::string BuiltBinary(const char* env_name, const char* relative) {
  const char* from_env = std::getenv(env_name);
  if (from_env != nullptr && from_env[0] != '\0') return from_env;
  std::error_code error;
  std::filesystem::path dir = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return relative;
  dir = dir.parent_path();
  for (int up = 0; up <= 4 && !dir.empty(); ++up) {
    const std::filesystem::path candidate = dir / relative;
    if (access(candidate.c_str(), X_OK) == 0) return candidate.string();
    if (dir == dir.parent_path()) break;
    dir = dir.parent_path();
  }
  return relative;
}

}  // namespace actstash::testing
