// actstash verify: stores a volume of patterned data through a running
// daemon, reads every byte back and compares it, and says what the spill tier
// did meanwhile. With more data than the session's quota or the pool, a
// daemon started with --spill-dir must write the oldest objects to disk and
// read them back; an operator (or an image's smoke test) sees that the whole
// data path works, not only that the daemon answers. Main thread only.
#ifndef ACTSTASH_TOOLS_VERIFY_COMMAND_H_
#define ACTSTASH_TOOLS_VERIFY_COMMAND_H_

#include <cstdint>

#include "tools/cli_common.h"

namespace actstash::cli {

struct VerifyOptions {
  uint64_t total_bytes = 64ull << 20;
  uint64_t object_bytes = 8ull << 20;
  bool zero_copy = false;      // the attached path; default the inline (gRPC) path
  bool require_spill = false;  // fail unless the spill tier wrote and read back
};

// Returns the CLI's exit code (0: every byte came back as stored).
int RunVerify(const Common& common, const VerifyOptions& options);

}  // namespace actstash::cli

#endif  // ACTSTASH_TOOLS_VERIFY_COMMAND_H_
