// The state image: a daemon's state (v1::DaemonState, proto/actstash/v1/
// handover.proto) in a sealed memfd, framed so that a reader can tell a
// complete image of its format from anything else:
//
//   offset 0   u64 magic "ACTSTATE"
//          8   u32 format (kStateFormat)
//         12   u32 reserved (0)
//         16   u64 body bytes
//         24   u64 XXH3-64 of the body
//         32   body: the serialized DaemonState
//
// Integers are native (both ends run on one host). A successor trusts an
// image only when all of it checks out; otherwise it takes nothing over.
#ifndef ACTSTASH_SERVER_RESTART_STATE_IMAGE_H_
#define ACTSTASH_SERVER_RESTART_STATE_IMAGE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "actstash/v1/handover.pb.h"
#include "common/unique_fd.h"

namespace actstash::server {

inline constexpr uint32_t kStateFormat = 1;
// An image larger than this is refused unread (a state of a full node is a
// few MiB: 1024 sessions, a lease per segment).
inline constexpr uint64_t kMaxStateBytes = uint64_t{256} << 20;

// A new memfd holding `state`'s image, sealed against any change (write,
// grow, shrink), positioned at 0. INTERNAL with errno text when the kernel
// refuses; RESOURCE_EXHAUSTED when the state exceeds kMaxStateBytes.
absl::StatusOr<UniqueFd> WriteStateImage(const v1::DaemonState& state);

// The state in the image `fd` refers to (read with pread; the fd's offset is
// unchanged). DATA_LOSS when the image is truncated, its checksum fails or
// its body does not parse; FAILED_PRECONDITION for another magic or format;
// INTERNAL when it cannot be read. Never trusts a size it did not check
// against the file's.
absl::StatusOr<v1::DaemonState> ReadStateImage(int fd);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RESTART_STATE_IMAGE_H_
