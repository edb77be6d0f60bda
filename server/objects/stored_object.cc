// StoredObject's residence: resident in the pool, being spilled, spilled to
// the spill tier, being read back, or lost; it moves only by the table of
// common/residence.h (MoveLocked).
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/protocol.h"
#include "server/objects/catalog.h"
#include "server/spill/spill_tier.h"

namespace actstash::server {

absl::Status ValidateObjectHeader(const v1::ObjectHeader& header) {
  if (header.dtype().size() > kMaxDtypeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype is ", header.dtype().size(), " bytes; at most ", kMaxDtypeBytes));
  }
  if (header.shape_size() > kMaxShapeDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape has ", header.shape_size(), " dimensions; at most ", kMaxShapeDims));
  }
  for (int64_t dim : header.shape()) {
    if (dim < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative dimension ", dim, " in shape"));
    }
  }
  const auto algorithm = header.checksum().algorithm();
  if (algorithm != v1::CHECKSUM_ALGORITHM_UNSPECIFIED &&
      algorithm != v1::CHECKSUM_ALGORITHM_XXH3_64) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported checksum algorithm ", static_cast<int>(algorithm)));
  }
  return absl::OkStatus();
}

StoredObject::~StoredObject() {
  absl::MutexLock lock(&mu_);
  if (spill_id_ != 0 && spill_ != nullptr) {
    (void)spill_->Drop(session_id_, absl::MakeConstSpan(&spill_id_, 1));
  }
}

const std::byte* StoredObject::data() const {
  absl::MutexLock lock(&mu_);
  return memory_.data();
}

bool StoredObject::resident() const {
  absl::MutexLock lock(&mu_);
  return residence_ == Residence::kResident || residence_ == Residence::kSpilling;
}

absl::StatusOr<StoredObject::ReadStart> StoredObject::BeginRead(
    std::function<void(absl::Status)> waiter) const {
  absl::MutexLock lock(&mu_);
  switch (residence_) {
    case Residence::kResident:
    case Residence::kSpilling:  // the memory stays until the spill sees no reader
      ++readers_;
      return ReadStart::kReady;
    case Residence::kSpilled:
      MoveLocked(ResidenceEvent::kRestore);
      ++readers_;
      waiters_.push_back(std::move(waiter));
      return ReadStart::kMustRestore;
    case Residence::kRestoring:
      ++readers_;
      waiters_.push_back(std::move(waiter));
      return ReadStart::kWait;
    case Residence::kLost:
      return lost_;
  }
  return absl::InternalError("unknown residence");
}

void StoredObject::EndRead() const {
  absl::MutexLock lock(&mu_);
  --readers_;
}

uint64_t StoredObject::spill_id() const {
  absl::MutexLock lock(&mu_);
  return spill_id_;
}

void StoredObject::FinishRestore(const absl::Status& status, Allocation memory,
                                 QuotaReservation reservation) const {
  std::vector<std::function<void(absl::Status)>> waiters;
  absl::Status told = status;
  {
    absl::MutexLock lock(&mu_);
    waiters.swap(waiters_);
    if (status.ok()) {
      memory_ = std::move(memory);
      reservation_ = std::move(reservation);
      MoveLocked(ResidenceEvent::kRestoreDone);
      spill_id_ = 0;  // the spill tier deletes the file
      RecordLocked();
    } else {
      readers_ -= static_cast<uint32_t>(waiters.size());  // their reads end here
      if (status.code() == absl::StatusCode::kDataLoss ||
          status.code() == absl::StatusCode::kNotFound) {
        MoveLocked(ResidenceEvent::kSpillGone);
        spill_id_ = 0;
        lost_ = absl::Status(status.code(),
                             absl::StrCat("the object was spilled to disk and cannot be read "
                                          "back: ",
                                          status.message()));
        told = lost_;
        if (journal_ != nullptr) journal_->ObjectGone(handle_);
      } else {
        MoveLocked(ResidenceEvent::kRestoreFailed);
      }
    }
  }
  for (auto& waiter : waiters) waiter(told);
}

absl::StatusOr<bool> StoredObject::ExportState(uint64_t handle, v1::ObjectState* out) const {
  absl::MutexLock lock(&mu_);
  if (residence_ == Residence::kLost) return false;
  if (InFlight(residence_)) {
    return absl::UnavailableError(
        absl::StrCat("object ", handle, " is being spilled or read back; retry"));
  }
  if (readers_ > 0) {
    return absl::UnavailableError(absl::StrCat("object ", handle, " is being read; retry"));
  }
  FillState(handle, out);
  return true;
}

void StoredObject::FillState(uint64_t handle, v1::ObjectState* out) const {
  out->set_handle(handle);
  out->set_session_id(session_id_);
  out->set_dtype(meta_.dtype);
  for (int64_t dim : meta_.shape) out->add_shape(dim);
  out->set_nbytes(meta_.nbytes);
  out->set_checksum_algorithm(meta_.checksum_algorithm);
  out->set_checksum(meta_.checksum);
  out->set_put_id(meta_.put_id);
  if (residence_ == Residence::kSpilled) {
    out->set_spill_id(spill_id_);
  } else {
    out->set_pool_offset(memory_.offset());
  }
}

void StoredObject::RecordLocked() const {
  if (journal_ == nullptr) return;
  v1::ObjectState state;
  FillState(handle_, &state);
  journal_->ObjectStored(state);
}

void StoredObject::Record(StateJournal* journal, uint64_t handle) const {
  absl::MutexLock lock(&mu_);
  journal_ = journal;
  handle_ = handle;
  if (residence_ != Residence::kLost) RecordLocked();
}

void StoredObject::Unrecord() const {
  absl::MutexLock lock(&mu_);
  if (journal_ != nullptr) journal_->ObjectGone(handle_);
  journal_ = nullptr;
}

std::shared_ptr<StoredObject> StoredObject::Spilled(uint64_t session_id, ObjectMeta meta,
                                                    uint64_t spill_id, SpillTier* tier) {
  auto object =
      std::make_shared<StoredObject>(session_id, std::move(meta), Allocation(), QuotaReservation());
  absl::MutexLock lock(&object->mu_);
  object->residence_ = Residence::kSpilled;  // where it starts, not a move
  object->spill_id_ = spill_id;
  object->spill_ = tier;
  return object;
}

void StoredObject::MoveLocked(ResidenceEvent event) const {
  const std::optional<Residence> next = NextResidence(residence_, event);
  ACTSTASH_CHECK(next.has_value(), "an inline object's residence has no such move");
  residence_ = *next;
}

bool StoredObject::TryBeginSpill() const {
  absl::MutexLock lock(&mu_);
  if (residence_ != Residence::kResident || readers_ > 0) return false;
  MoveLocked(ResidenceEvent::kSpill);
  return true;
}

uint64_t StoredObject::FinishSpill(const absl::StatusOr<uint64_t>& spill_id,
                                   SpillTier* tier) const {
  Allocation memory;  // freed outside mu_
  QuotaReservation reservation;
  absl::MutexLock lock(&mu_);
  if (!spill_id.ok() || readers_ > 0) {  // failed, or undone for the readers that came
    MoveLocked(ResidenceEvent::kSpillFailed);
    return spill_id.ok() ? *spill_id : 0;
  }
  MoveLocked(ResidenceEvent::kSpillDone);
  spill_id_ = *spill_id;
  spill_ = tier;
  // Recorded spilled before the memory goes back: a restart never finds
  // the object in memory another holds.
  RecordLocked();
  memory = std::move(memory_);
  reservation = std::move(reservation_);
  return 0;
}

}  // namespace actstash::server
