// Where the tests and benchmarks find the project's other binaries (the
// daemon, the CLI, the workers) without a path of the build machine compiled
// in: they lie at the same place relative to the running binary in the build
// tree and in a GPU kit (scripts/gpu-kit), which keeps the build tree's
// layout. Thread-safe.
#ifndef ACTSTASH_TESTING_BUILT_BINARY_H_
#define ACTSTASH_TESTING_BUILT_BINARY_H_

#include <string>

namespace actstash::testing {

// The binary at `relative` (its path under the build root, e.g.
// "server/actstashd"): $`env_name` when set and not empty; else the first
// `<dir>/<relative>` that exists, for <dir> the running executable's folder
// and up to four of its parents. When none exists, `relative` itself (exec
// then fails with a message that names it).
std::string BuiltBinary(const char* env_name, const char* relative);

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTING_BUILT_BINARY_H_
