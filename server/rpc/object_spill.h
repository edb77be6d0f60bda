// Spilling and reading back the inline path's objects (Put/Get): when a
// Put finds no quota or pool memory, the session's oldest objects that no
// Get is reading go to the spill tier; a Get of a spilled object reads it
// back first. The same files, checksums and numbers as spilled leases.
#ifndef ACTSTASH_SERVER_RPC_OBJECT_SPILL_H_
#define ACTSTASH_SERVER_RPC_OBJECT_SPILL_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "server/objects/catalog.h"
#include "server/rpc/stash_core.h"

namespace actstash::server {

// Spills resident, unread objects of `session` (oldest first; never
// `except`) until at least `bytes` are spilled; `done(spilled bytes)` runs on
// a spill worker once all are written (at once with 0 when none can be).
// Needs core.spill.
void SpillObjects(StashCore& core, const std::shared_ptr<Session>& session, uint64_t bytes,
                  const StoredObject* except, std::function<void(uint64_t)> done);

// Reads back an object whose BeginRead answered kMustRestore: takes quota
// and pool memory (spilling the session's other objects when short), reads
// the file, and ends with object->FinishRestore (which tells the waiters).
void RestoreObject(StashCore& core, std::shared_ptr<Session> session,
                   std::shared_ptr<const StoredObject> object);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_OBJECT_SPILL_H_
