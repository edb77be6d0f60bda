// Where a LocalStore block's bytes are: its states, the one table of legal
// moves between them, and the events that make them. A block is the set of
// buffers placed in one lease's bytes, wherever those bytes are now: in a
// mapped lease, on the daemon's disk, or on their way between the two.
// Private to LocalStore.
//
// Thread-safety: pure functions over plain values; LocalStore guards each
// block's state with its mutex.
#ifndef ACTSTASH_CLIENT_STORE_BLOCK_STATE_H_
#define ACTSTASH_CLIENT_STORE_BLOCK_STATE_H_

#include <cstdint>
#include <optional>

namespace actstash::client_internal {

//   kResident --spill--> kSpilling --spill done--> kSpilled --restore--> kRestoring
//       ^                    |                        ^                     |
//       +----spill failed----+                        +--restore failed-----+
//       +-----------------------restore done--------------------------------+
//                                                     kLost <--spill gone---+
//
// kSpilling and kRestoring are an RPC in flight (a Spill or Restore of the
// block's lease): readers wait for the block to leave them, and the block is
// never deleted in them. kSpilled and kRestoring hold bytes on the daemon's
// disk (ClientUsage.spilled_leases/spilled_bytes count them). kLost is final:
// the daemon dropped the spill, and reading any buffer of the block fails.
enum class BlockState : uint8_t {
  kResident,   // in a mapped lease of this client
  kSpilling,   // being written to the daemon's disk
  kSpilled,    // on the daemon's disk, the lease reused for other buffers
  kRestoring,  // being read back into a lease (by a reader or ahead of one)
  kLost,       // its spill is gone: its buffers cannot be read
};

enum class BlockEvent : uint8_t {
  kSpill,          // chosen to spill (cold, written, not in use)
  kSpillDone,      // the daemon answered a spill id
  kSpillFailed,    // the Spill RPC failed: the bytes never changed
  kRestore,        // a reader (or the read-ahead) reads it back
  kRestoreDone,    // the bytes are in a lease again
  kRestoreFailed,  // no lease to read into, or a Restore RPC that may be retried
  kSpillGone,      // the daemon no longer has the spill (DATA_LOSS, NOT_FOUND)
};

// The state `event` leads to from `state`; nullopt when the table above has
// no such edge.
std::optional<BlockState> NextBlockState(BlockState state, BlockEvent event);
const char* BlockStateName(BlockState state);
const char* BlockEventName(BlockEvent event);

// An RPC on the block's bytes is in flight: wait, do not delete.
constexpr bool InFlight(BlockState s) {
  return s == BlockState::kSpilling || s == BlockState::kRestoring;
}
// Its bytes are on the daemon's disk (counted as spilled).
constexpr bool OnDisk(BlockState s) {
  return s == BlockState::kSpilled || s == BlockState::kRestoring;
}

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_STORE_BLOCK_STATE_H_
