// Reading the small text files of /proc, /sys and cgroupfs (under a root
// prefix that tests fake). Thread-safety: a pure function of the file.
#ifndef ACTSTASH_COMMON_TEXT_FILE_H_
#define ACTSTASH_COMMON_TEXT_FILE_H_

#include <string>

namespace actstash {

// The whole of the file at `path` into *out; false (and *out untouched) when
// it cannot be opened.
bool ReadTextFile(const std::string& path, std::string* out);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_TEXT_FILE_H_
