#include "common/text_file.h"

#include <fstream>
#include <sstream>

namespace actstash {

bool ReadTextFile(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream buffer;
  buffer << in.rdbuf();
  *out = buffer.str();
  return true;
}

}  // namespace actstash
