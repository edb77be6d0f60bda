// StateTable: the state a daemon restarted after a crash needs, written as
// it changes into a memfd that the service manager keeps for the next start
// (server/restart/service_manager.h): the sessions (id, token, name, quota,
// peer), the host leases (id, session, segment run), which free segments
// have a memfd no client ever mapped ("clean"), whose current memfd the
// service manager holds ("kept"), the spill files of leases and inline
// objects (id, session, size, checksum; their fds are in the service
// manager's store), the inline objects (handle, session, metadata, pool
// offset or spill file), and floors under which every id and handle given
// so far lies. The same schema as a take-over's (v1::SessionState,
// v1::LeaseState, v1::SpillFileState, v1::ObjectState in
// proto/actstash/v1/handover.proto).
//
// Layout (format kTableFormat; integers native, both ends on one host):
//
//   0       TableHeader: magic "ACTSTABL", format, geometry, XXH3 of those;
//           then single words written atomically: retired, restarts, the
//           four id floors and how many object slots were ever used
//   4096    one byte per segment: bit 0 "clean" (free, its memfd fresh),
//           bit 1 "kept" (the service manager holds its current memfd)
//   S       session slots (kSessionSlotBytes each, session_slots of them)
//   L       lease slots (kLeaseSlotBytes each, one per segment: the slot of
//           the lease's first segment)
//   F       spill file slots (kSpillSlotBytes each, spill_slots of them)
//   O       object slots (kObjectSlotBytes each, object_slots of them)
//
// A slot is a word (0: free; else body length << 1 | 1), the body's XXH3
// and the body (a serialized proto). A slot is written while its word says
// free and published by storing the word last (release order), so a process
// killed mid-write leaves the slot free, never half-written: only damage
// from outside makes a used slot fail its checksum.
//
// Thread-safety: the StateJournal calls from any thread; a lease slot is
// written only by the grant or release of the lease that owns its segment,
// which the lease manager serializes; session, spill and object slots are
// assigned under mu_; an object's slot is written by whoever holds that
// object's own lock (StoredObject), or the catalog's when it is added or
// removed.
#ifndef ACTSTASH_SERVER_RESTART_STATE_TABLE_H_
#define ACTSTASH_SERVER_RESTART_STATE_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "actstash/v1/handover.pb.h"
#include "common/unique_fd.h"
#include "server/base/state_journal.h"

namespace actstash::server {

inline constexpr uint32_t kTableFormat = 3;
inline constexpr size_t kSessionSlotBytes = 512;
inline constexpr size_t kLeaseSlotBytes = 64;
inline constexpr size_t kSpillSlotBytes = 64;
inline constexpr size_t kObjectSlotBytes = 128;

struct TableGeometry {
  uint64_t segment_bytes = 0;
  uint32_t segments = 0;
  uint32_t session_slots = 0;  // the daemon's max_sessions
  uint32_t spill_slots = 0;    // spill files kept at most (0: no spill tier)
  uint32_t object_slots = 0;   // inline objects kept at most
};

// What a table says a crashed daemon held.
struct RecoveredState {
  std::vector<v1::SessionState> sessions;
  std::vector<v1::LeaseState> leases;
  std::vector<v1::SpillFileState> spill_files;  // fd unset: matched by id
  std::vector<v1::ObjectState> objects;         // of recovered sessions
  std::vector<bool> clean;                      // per segment: free, fresh and kept
  std::vector<bool> kept;                       // per segment: its kept memfd is the current one
  uint64_t next_session_id = 1;
  uint64_t next_lease_id = 0;  // 0: none recorded
  uint64_t next_object_handle = 1;
  uint64_t next_spill_id = 1;
  uint64_t restarts = 0;  // recoveries before this one
};

class StateTable final : public StateJournal {
 public:
  // A new, empty table in a sealed-size memfd; no segment is clean or kept
  // until SegmentsRenewed says so.
  // INTERNAL / RESOURCE_EXHAUSTED with errno text when the kernel refuses.
  static absl::StatusOr<std::unique_ptr<StateTable>> Create(const TableGeometry& geometry);
  // The table in `fd`, left by a daemon that did not retire it; `out` gets
  // what it holds, and the table goes on recording into the same memory.
  // FAILED_PRECONDITION: another format or geometry, a retired table (the
  // daemon shut down cleanly), a file whose size is not sealed. DATA_LOSS:
  // a header or a used slot fails its checksum, or the slots contradict one
  // another (overlapping runs, a run outside the pool, a repeated id):
  // nothing of such a table is trusted. A lease, spill file or object whose
  // session is gone (it was closing) is dropped from the table.
  // `count_restart`: false when the table is not a crashed daemon's (Copy),
  // so that RecoveredState::restarts counts only restarts.
  static absl::StatusOr<std::unique_ptr<StateTable>> Recover(UniqueFd fd,
                                                             const TableGeometry& geometry,
                                                             RecoveredState* out,
                                                             bool count_restart = true);
  // A copy, in a new memfd, of the table in `fd` (a serving daemon's, handed
  // over in a take-over), read as Recover reads it: the successor records
  // into the copy, so that the original stays exactly as its daemon left it
  // should the take-over fail. Recover's errors; FAILED_PRECONDITION too
  // when the file's size is not that of `geometry`.
  static absl::StatusOr<std::unique_ptr<StateTable>> Copy(int fd, const TableGeometry& geometry,
                                                          RecoveredState* out);
  ~StateTable() override;
  StateTable(const StateTable&) = delete;
  StateTable& operator=(const StateTable&) = delete;

  int fd() const { return fd_.get(); }
  // The daemon stops cleanly: the next start finds nothing to recover.
  void Retire();

  // StateJournal.
  void SessionOpened(const v1::SessionState& session) override ABSL_LOCKS_EXCLUDED(mu_);
  void SessionClosed(uint64_t session_id) override ABSL_LOCKS_EXCLUDED(mu_);
  void LeaseGranted(const v1::LeaseState& lease) override;
  void LeaseReleased(uint64_t lease_id, uint32_t first_segment) override;
  // Marks the segments clean and kept (their memfds are the fresh ones the
  // service manager keeps: the caller stored them first).
  void SegmentsRenewed(uint32_t first, uint32_t count) override;
  // Marks the segments kept, not clean (the caller stored their memfds).
  void LeasedSegmentsRenewed(uint32_t first, uint32_t count) override;
  // The service manager may not hold the segments' current memfds (a store
  // failed): a lease on them cannot be recovered.
  void SegmentsNotKept(uint32_t first, uint32_t count);
  void ObjectHandleIssued(uint64_t handle) override;
  // Records the file in a free spill slot (none free: logged, and the file
  // does not survive a crash). `fd` is the caller's to keep.
  void SpillFileKept(const v1::SpillFileState& file, int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  void SpillFileGone(uint64_t spill_id) override ABSL_LOCKS_EXCLUDED(mu_);
  // Records the object in its slot, or a free one (none free, or a shape
  // too long for a slot: logged, and the object does not survive a crash).
  void ObjectStored(const v1::ObjectState& object) override ABSL_LOCKS_EXCLUDED(mu_);
  void ObjectGone(uint64_t handle) override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  StateTable(UniqueFd fd, std::byte* base, size_t bytes, const TableGeometry& geometry);
  // A sealed-size memfd of `bytes`, zero-filled.
  static absl::StatusOr<UniqueFd> NewTableFd(size_t bytes);
  std::byte* SessionSlot(uint32_t index) const;
  std::byte* LeaseSlot(uint32_t index) const;
  std::byte* SpillSlot(uint32_t index) const;
  std::byte* ObjectSlot(uint32_t index) const;
  uint8_t* CleanFlags() const;
  // Raises a floor word to `id` + a step when `id` reached it.
  void RaiseFloor(size_t word_offset, uint64_t id);

  // Which slot of a region (sessions, spill files, objects) holds which id,
  // and which are free: those freed first (the lowest last), then the never
  // used ones from `fresh` on.
  struct SlotIndex {
    absl::flat_hash_map<uint64_t, uint32_t> slot_of;
    std::vector<uint32_t> free;
    uint32_t fresh = 0;
    uint32_t count = 0;
    // All of `count` slots free and never used.
    void Reset(uint32_t slots);
    // `id`'s slot, assigned a free one when it has none; nullopt when none
    // is free.
    std::optional<uint32_t> Assign(uint64_t id);
    // Frees `id`'s slot and returns it; nullopt when it has none.
    std::optional<uint32_t> Release(uint64_t id);
  };

  const UniqueFd fd_;
  std::byte* const base_;
  const size_t bytes_;
  const TableGeometry geometry_;
  absl::Mutex mu_;
  SlotIndex sessions_ ABSL_GUARDED_BY(mu_);
  SlotIndex spills_ ABSL_GUARDED_BY(mu_);
  SlotIndex objects_ ABSL_GUARDED_BY(mu_);
  bool spill_slots_full_logged_ ABSL_GUARDED_BY(mu_) = false;
  bool object_slots_full_logged_ ABSL_GUARDED_BY(mu_) = false;
};

// The table's size for `geometry`, in bytes (a multiple of the page size).
size_t StateTableBytes(const TableGeometry& geometry);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RESTART_STATE_TABLE_H_
