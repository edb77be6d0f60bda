// The daemon's view of a session, for the libtorch adapter's tests, behind a
// header without protobuf: a test that includes libtorch from PyPI must not
// see a protobuf header (that libtorch's include folder carries its own,
// older copy), so the wire message is read in session_counts.cc, which is
// compiled without torch.
#ifndef ACTSTASH_TESTS_TORCH_SESSION_COUNTS_H_
#define ACTSTASH_TESTS_TORCH_SESSION_COUNTS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "actstash/client.h"

namespace actstash::torch {

struct SessionCounts {
  uint64_t zero_copy_objects = 0;  // stored through leased memory (self.client.objects)
  uint64_t inline_objects = 0;     // stored through Put (self.objects)
  uint64_t used_bytes = 0;         // self.used_bytes
  uint64_t state_bytes = 0;        // the client's own count (ClientUsage.state_bytes)
};

// client.Stats(), reduced to what the tests compare.
absl::StatusOr<SessionCounts> CountSession(Client& client);

}  // namespace actstash::torch

#endif  // ACTSTASH_TESTS_TORCH_SESSION_COUNTS_H_
