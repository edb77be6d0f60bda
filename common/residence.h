// Where bytes that may spill are: the states, the one table of legal moves
// between them, and the events that make them. Two owners follow it: the
// client's LocalStore blocks (the buffers placed in one lease's bytes, client/
// store/block_table.h) and the daemon's inline objects (StoredObject, server/
// objects/catalog.h). Their bytes are in memory (a mapped lease, a range of
// the pool), on the daemon's disk, or on their way between the two.
//
// Thread-safety: pure functions over plain values; each owner guards its
// state with its own mutex.
#ifndef ACTSTASH_COMMON_RESIDENCE_H_
#define ACTSTASH_COMMON_RESIDENCE_H_

#include <cstdint>
#include <optional>

namespace actstash {

//   kResident --spill--> kSpilling --spill done--> kSpilled --restore--> kRestoring
//       ^                    |                        ^                     |
//       +----spill failed----+                        +--restore failed-----+
//       +-----------------------restore done--------------------------------+
//                                                     kLost <--spill gone---+
//
// kSpilling and kRestoring are I/O in flight (for a block, a Spill or Restore
// RPC of its lease: readers wait for the block to leave them, and it is never
// deleted in them; an inline object is read from memory while it spills).
// kSpilled and kRestoring hold bytes on the daemon's disk (for blocks,
// ClientUsage.spilled_leases/spilled_bytes count them). kLost is final: the
// spill is gone, and reading fails.
enum class Residence : uint8_t {
  kResident,   // in memory: a mapped lease of the client, a range of the pool
  kSpilling,   // being written to the daemon's disk
  kSpilled,    // on the daemon's disk, the memory given back or reused
  kRestoring,  // being read back into memory (by a reader or ahead of one)
  kLost,       // its spill is gone: it cannot be read
};

enum class ResidenceEvent : uint8_t {
  kSpill,          // chosen to spill (cold, written, not in use)
  kSpillDone,      // the spill file holds the bytes (a spill id)
  kSpillFailed,    // the spill failed or was undone: the bytes in memory stay
  kRestore,        // a reader (or the read-ahead) reads it back
  kRestoreDone,    // the bytes are in memory again
  kRestoreFailed,  // no memory to read into, or an I/O error that may be retried
  kSpillGone,      // the spill file is gone (DATA_LOSS, NOT_FOUND)
};

// The state `event` leads to from `state`; nullopt when the table above has
// no such edge.
std::optional<Residence> NextResidence(Residence state, ResidenceEvent event);
const char* ResidenceName(Residence state);
const char* ResidenceEventName(ResidenceEvent event);

// An RPC on the block's bytes is in flight: wait, do not delete.
constexpr bool InFlight(Residence s) {
  return s == Residence::kSpilling || s == Residence::kRestoring;
}
// Its bytes are on the daemon's disk (counted as spilled).
constexpr bool OnDisk(Residence s) {
  return s == Residence::kSpilled || s == Residence::kRestoring;
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_RESIDENCE_H_
