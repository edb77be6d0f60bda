#include "server/rpc/object_spill.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/spill/spill_tier.h"

namespace actstash::server {

void SpillObjects(StashCore& core, const std::shared_ptr<Session>& session, uint64_t bytes,
                  const StoredObject* except, std::function<void(uint64_t)> done) {
  std::vector<std::shared_ptr<StoredObject>> chosen =
      core.catalog.BeginSpill(session->id(), bytes, except);
  if (chosen.empty()) return done(0);
  struct Progress {
    absl::Mutex mu;
    size_t pending ABSL_GUARDED_BY(mu) = 0;
    uint64_t spilled ABSL_GUARDED_BY(mu) = 0;
    std::function<void(uint64_t)> done;
  };
  auto progress = std::make_shared<Progress>();
  progress->done = std::move(done);
  {
    absl::MutexLock lock(&progress->mu);
    progress->pending = chosen.size();
  }
  SpillTier* tier = core.spill;
  for (std::shared_ptr<StoredObject>& object : chosen) {
    const std::byte* data = object->data();
    const uint64_t nbytes = object->meta().nbytes;
    StoredObject* raw = object.get();
    tier->SpillBytes(session, data, nbytes, std::move(object),
                     [tier, raw, nbytes, progress,
                      session_id = session->id()](absl::StatusOr<SpillTier::Written> file) {
                       // The tier's job holds the object until this returns.
                       const absl::StatusOr<uint64_t> id =
                           file.ok() ? absl::StatusOr<uint64_t>(file->id) : file.status();
                       const uint64_t drop = raw->FinishSpill(id, tier);
                       if (drop != 0) (void)tier->Drop(session_id, absl::MakeConstSpan(&drop, 1));
                       uint64_t spilled = 0;
                       {
                         absl::MutexLock lock(&progress->mu);
                         if (id.ok() && drop == 0) progress->spilled += nbytes;
                         if (--progress->pending > 0) return;
                         spilled = progress->spilled;
                       }
                       progress->done(spilled);
                     });
  }
}

namespace {

// Quota, then pool memory, for `bytes`.
absl::Status TakeMemory(StashCore& core, Session& session, uint64_t bytes,
                        QuotaReservation* reservation, Allocation* memory) {
  if (reservation->bytes() < bytes) {
    absl::StatusOr<QuotaReservation> reserved = session.Reserve(bytes);
    if (!reserved.ok()) return reserved.status();
    *reservation = *std::move(reserved);
  }
  absl::StatusOr<Allocation> allocated = core.pool.Allocate(bytes);
  if (!allocated.ok()) return allocated.status();
  *memory = *std::move(allocated);
  return absl::OkStatus();
}

struct Restore {
  StashCore* core;
  std::shared_ptr<Session> session;
  std::shared_ptr<const StoredObject> object;
  QuotaReservation reservation;
  Allocation memory;
};

void TryRestore(std::shared_ptr<Restore> r) {
  const uint64_t bytes = r->object->meta().nbytes;
  absl::Status status = TakeMemory(*r->core, *r->session, bytes, &r->reservation, &r->memory);
  if (!status.ok() && status.code() == absl::StatusCode::kResourceExhausted) {
    // Make room among the session's other objects, then try again.
    return SpillObjects(
        *r->core, r->session, bytes, r->object.get(), [r, status](uint64_t spilled) {
          if (spilled > 0) return TryRestore(r);
          r->object->FinishRestore(absl::ResourceExhaustedError(absl::StrCat(
                                       "reading a spilled object back: ", status.message(),
                                       "; no other object of this session could be spilled")),
                                   Allocation(), QuotaReservation());
        });
  }
  if (!status.ok()) return r->object->FinishRestore(status, Allocation(), QuotaReservation());
  std::byte* data = r->memory.data();
  r->core->spill->RestoreBytes(
      r->session, r->object->spill_id(), data, bytes, r, [r](const absl::Status& read) {
        r->object->FinishRestore(read, std::move(r->memory), std::move(r->reservation));
      });
}

}  // namespace

void RestoreObject(StashCore& core, std::shared_ptr<Session> session,
                   std::shared_ptr<const StoredObject> object) {
  auto r = std::make_shared<Restore>();
  r->core = &core;
  r->session = std::move(session);
  r->object = std::move(object);
  TryRestore(std::move(r));
}

}  // namespace actstash::server
