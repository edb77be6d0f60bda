// The state table's memory layout (state_table.h describes it), shared by
// the code that writes it (state_table.cc) and the code that reads it back
// after a crash (state_table_recover.cc). Private to server/handover.
#ifndef ACTSTASH_SERVER_RESTART_STATE_TABLE_LAYOUT_H_
#define ACTSTASH_SERVER_RESTART_STATE_TABLE_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/restart/state_table.h"

namespace actstash::server::table_layout {

inline constexpr uint64_t kMagic = 0x4c42415453544341;  // "ACTSTABL", little-endian
inline constexpr size_t kHeaderBytes = 4096;
// A floor is raised this far past the id that reached it: one table write
// per this many ids.
inline constexpr uint64_t kFloorStep = 1 << 16;
// Floors are not checksummed (single words): one beyond this is damage.
inline constexpr uint64_t kMaxFloor = uint64_t{1} << 56;
// Per-segment flag bits.
inline constexpr uint8_t kClean = 1;  // free, and its memfd fresh: no client mapped it
inline constexpr uint8_t kKept = 2;   // the service manager holds its current memfd

struct TableHeader {
  uint64_t magic = kMagic;
  uint32_t format = kTableFormat;
  uint32_t session_slots = 0;
  uint64_t segment_bytes = 0;
  uint32_t segments = 0;
  uint32_t spill_slots = 0;
  uint32_t object_slots = 0;
  uint32_t reserved = 0;
  uint64_t checksum = 0;  // XXH3 of the fields above
  // Not checksummed: single words, each stored atomically.
  uint64_t retired = 0;
  uint64_t restarts = 0;
  uint64_t session_id_floor = 1;
  uint64_t lease_id_floor = 0;
  uint64_t object_handle_floor = 1;
  uint64_t spill_id_floor = 1;
  // Object slots at or above this were never used: a recovery reads only
  // those below (a table sized for a large pool is mostly never touched).
  uint64_t object_slots_used = 0;
};
inline constexpr size_t kChecksummedBytes = offsetof(TableHeader, checksum);
static_assert(sizeof(TableHeader) <= kHeaderBytes);

struct SlotHeader {
  uint64_t word = 0;  // 0: free; else body bytes << 1 | 1
  uint64_t checksum = 0;
};
inline constexpr size_t kSessionBodyBytes = kSessionSlotBytes - sizeof(SlotHeader);
inline constexpr size_t kLeaseBodyBytes = kLeaseSlotBytes - sizeof(SlotHeader);
inline constexpr size_t kSpillBodyBytes = kSpillSlotBytes - sizeof(SlotHeader);
inline constexpr size_t kObjectBodyBytes = kObjectSlotBytes - sizeof(SlotHeader);

size_t RoundUp(size_t n, size_t to);
size_t CleanOffset();
size_t SessionsOffset(const TableGeometry& g);
size_t LeasesOffset(const TableGeometry& g);
size_t SpillsOffset(const TableGeometry& g);
size_t ObjectsOffset(const TableGeometry& g);

uint64_t HeaderChecksum(const TableHeader& header);
inline TableHeader* HeaderOf(std::byte* base) { return reinterpret_cast<TableHeader*>(base); }

uint64_t LoadWord(const std::byte* at);
void StoreWord(std::byte* at, uint64_t value);
// Writes `body` into the free-or-overwritten slot at `slot` and publishes it.
// A slot that holds `body` already is left alone (recovery rewrites what it
// read: a crash then must not find it free).
void WriteSlot(std::byte* slot, const std::string& body);
// The body of the used slot at `slot`, or "" for a free one; DATA_LOSS for
// a damaged one.
absl::StatusOr<std::string> ReadSlot(const std::byte* slot, size_t capacity, const char* what,
                                     uint32_t index);
// Maps `fd` (of `bytes`) shared, read-write.
absl::StatusOr<std::byte*> MapTable(int fd, size_t bytes);

}  // namespace actstash::server::table_layout

#endif  // ACTSTASH_SERVER_RESTART_STATE_TABLE_LAYOUT_H_
