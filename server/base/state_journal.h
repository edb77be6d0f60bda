// StateJournal: where the session and lease managers record, as it changes,
// the state a daemon restarted after a crash needs to serve its clients
// again (server/restart/state_table.h keeps it in a memfd that outlives the
// process). Every call returns before the change it records is visible to
// a client: a grant is recorded before its fds are sent, a release before
// its reply. Implementations never fail (they write mapped memory) and are
// called from any thread, possibly under the caller's locks: they take no
// lock that calls back into a manager.
#ifndef ACTSTASH_SERVER_BASE_STATE_JOURNAL_H_
#define ACTSTASH_SERVER_BASE_STATE_JOURNAL_H_

#include <cstdint>

#include "actstash/v1/handover.pb.h"

namespace actstash::server {

class StateJournal {
 public:
  virtual ~StateJournal() = default;

  // A session opened (or was adopted): its id, token, name, quota and peer.
  virtual void SessionOpened(const v1::SessionState& session) = 0;
  virtual void SessionClosed(uint64_t session_id) = 0;
  // A host lease was granted (or adopted), and was released. `lease` holds
  // its id, session and segment run.
  virtual void LeaseGranted(const v1::LeaseState& lease) = 0;
  virtual void LeaseReleased(uint64_t lease_id, uint32_t first_segment) = 0;
  // Segments [first, first + count) have fresh memfds (a returned lease's
  // renewal), before they can be leased again.
  virtual void SegmentsRenewed(uint32_t first, uint32_t count) = 0;
  // A granted lease's segments [first, first + count) got fresh memfds
  // before its fds left the daemon (a scrub: they held inline objects): a
  // restart must map these, not the ones they replaced. Still leased, so
  // not free to reuse.
  virtual void LeasedSegmentsRenewed(uint32_t first, uint32_t count) = 0;
  // An inline object handle was issued: handles after a restart stay above.
  virtual void ObjectHandleIssued(uint64_t handle) = 0;
  // An inline object is stored, or moved (spilled, read back): `object`
  // holds its handle, session, metadata and residence (pool offset or spill
  // id), recorded before the handle is answered and before the memory or
  // file it no longer uses is given back. Gone: deleted (or its session
  // closed), before its memory or file is given back. A journal that has no
  // room for it records nothing: that object does not survive a crash.
  virtual void ObjectStored(const v1::ObjectState& object) = 0;
  virtual void ObjectGone(uint64_t handle) = 0;
  // A spilled lease's file was written, before its id is answered: `file`
  // holds its id, session, size and checksum (no fd index), `fd` is the
  // unlinked file (its only name; the journal keeps what it needs before
  // returning). Gone: a
  // file left the spill tier (read back, dropped, its session closed); one
  // the journal does not hold is ignored.
  virtual void SpillFileKept(const v1::SpillFileState& file, int fd) = 0;
  virtual void SpillFileGone(uint64_t spill_id) = 0;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_BASE_STATE_JOURNAL_H_
