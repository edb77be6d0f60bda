// Reading the small text files of /proc, /sys and cgroupfs (under a root
// prefix that tests fake). Thread-safety: a pure function of the file.
#ifndef ACTSTASH_SERVER_TEXT_FILE_H_
#define ACTSTASH_SERVER_TEXT_FILE_H_

#include <string>

namespace actstash::server {

// The whole of the file at `path` into *out; false (and *out untouched) when
// it cannot be opened.
bool ReadTextFile(const std::string& path, std::string* out);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_TEXT_FILE_H_
