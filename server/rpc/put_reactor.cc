// Put: a client-streaming call that writes chunks straight into pool memory.
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/grpc_status.h"
#include "common/happens_before.h"
#include "common/protocol.h"
#include "server/base/work_queue.h"
#include "server/rpc/object_spill.h"
#include "server/rpc/stash_reactors.h"

namespace actstash::server {
namespace {

// Reactor state machine: header expected → data until nbytes → stream end.
// gRPC serializes the callbacks of one call, so no lock is needed: at most
// one read is pending, and only the callback it brings (or the work queue or
// spill worker this reactor handed itself to meanwhile) touches the state.
// That order is marked for TSan (common/happens_before.h): Read and
// FinishOnce are the only ways on, and each callback starts with
// HappensAfter (what gRPC does with the message and at the call's end stays
// unchecked: scripts/sanitizers/tsan.supp). The reactor is finished exactly
// once (finished_) and deleted in OnDone.
class PutReactor final : public grpc::ServerReadReactor<v1::PutChunk> {
 public:
  PutReactor(StashCore* core, grpc::CallbackServerContext* ctx, v1::PutReply* reply)
      : core_(*core), reply_(reply) {
    core_.streams_in_flight.fetch_add(1, std::memory_order_acq_rel);
    absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(core_, *ctx);
    if (!session.ok()) {
      FinishOnce(session.status());
      return;
    }
    session_ = *std::move(session);
    Read();
  }

  void OnReadDone(bool ok) override {
    HappensAfter(this);
    if (finished_) return;
    if (!ok) {  // the stream ended: Complete finishes the call when it succeeds
      if (absl::Status status = Complete(); !status.ok()) FinishOnce(status);
      return;
    }
    if (absl::Status status = Consume(); !status.ok()) {
      FinishOnce(status);
    } else if (finished_) {  // a Put sent again: answered at its header
      return;
    } else if (waiting_for_spill_) {
      SpillAndRetry();
    } else if (waiting_for_memory_) {
      // The pool is short while returned leases are being renewed: retry
      // behind those renewals (the work queue runs in order). No read is
      // pending meanwhile, so nothing else touches this reactor.
      core_.work->Post([this] {
        waiting_for_memory_ = false;
        absl::StatusOr<Allocation> memory = core_.pool.Allocate(meta_.nbytes);
        if (!memory.ok()) return FinishOnce(memory.status());
        memory_ = *std::move(memory);
        Read();
      });
    } else {
      Read();
    }
  }

  void OnDone() override {
    HappensAfter(this);
    core_.streams_in_flight.fetch_sub(1, std::memory_order_acq_rel);
    delete this;
  }

 private:
  // Asks gRPC for the next chunk (OnReadDone).
  void Read() {
    HappensBefore(this);
    StartRead(&chunk_);
  }

  absl::Status Consume() {
    if (!have_header_) {
      if (chunk_.payload_case() != v1::PutChunk::kHeader) {
        return absl::InvalidArgumentError("the first Put chunk must carry the header");
      }
      return Begin(chunk_.header());
    }
    if (chunk_.payload_case() != v1::PutChunk::kData) {
      return absl::InvalidArgumentError("only the first Put chunk may carry a header");
    }
    const std::string& data = chunk_.data();
    if (data.size() > kMaxChunkBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Put chunk of ", data.size(), " bytes exceeds the limit of ", kMaxChunkBytes, " bytes"));
    }
    if (data.size() > meta_.nbytes - received_) {
      return absl::InvalidArgumentError(absl::StrCat("Put sent more than the header's nbytes (",
                                                     meta_.nbytes, "): ", received_ + data.size(),
                                                     " bytes so far"));
    }
    // The hash reads the pool's copy: the message's bytes are gRPC's (see
    // CopyFromLibraryBuffer).
    CopyFromLibraryBuffer(memory_.data() + received_, data.data(), data.size());
    if (hash_) hasher_.Update(memory_.data() + received_, data.size());
    received_ += data.size();
    return absl::OkStatus();
  }

  absl::Status Begin(const v1::ObjectHeader& header) {
    if (absl::Status valid = ValidateObjectHeader(header); !valid.ok()) return valid;
    have_header_ = true;
    meta_.dtype = header.dtype();
    meta_.shape.assign(header.shape().begin(), header.shape().end());
    meta_.nbytes = header.nbytes();
    meta_.checksum_algorithm = header.checksum().algorithm();
    meta_.checksum = header.checksum().value();
    meta_.put_id = header.put_id();
    hash_ = meta_.checksum_algorithm == v1::CHECKSUM_ALGORITHM_XXH3_64;
    if (std::optional<uint64_t> stored = core_.catalog.FindPut(session_->id(), meta_.put_id)) {
      absl::StatusOr<bool> answered = AnswerStored(*stored);
      if (!answered.ok() || *answered) return answered.status();
    }
    absl::Status status = TakeMemory();
    if (status.code() == absl::StatusCode::kResourceExhausted && core_.spill != nullptr) {
      waiting_for_spill_ = true;  // the session's older objects make room
      return absl::OkStatus();
    }
    if (status.code() == absl::StatusCode::kResourceExhausted && core_.work != nullptr &&
        reservation_.bytes() == meta_.nbytes && core_.leases.renewals_pending() > 0) {
      waiting_for_memory_ = true;
      return absl::OkStatus();
    }
    return status;
  }

  // Quota first, so a session over its quota never takes pool memory.
  absl::Status TakeMemory() {
    if (reservation_.bytes() < meta_.nbytes || meta_.nbytes == 0) {
      absl::StatusOr<QuotaReservation> reservation = session_->Reserve(meta_.nbytes);
      if (!reservation.ok()) return reservation.status();
      reservation_ = *std::move(reservation);
    }
    absl::StatusOr<Allocation> memory = core_.pool.Allocate(meta_.nbytes);
    if (!memory.ok()) return memory.status();
    memory_ = *std::move(memory);
    return absl::OkStatus();
  }

  // Spills the session's oldest unread objects, then takes the memory again;
  // as long as spilling frees something. No read is pending meanwhile, so
  // nothing else touches this reactor; the callbacks run on spill workers.
  void SpillAndRetry() {
    waiting_for_spill_ = false;
    SpillObjects(core_, session_, meta_.nbytes, nullptr, [this](uint64_t spilled) {
      absl::Status status = TakeMemory();
      if (status.ok()) return Read();
      if (status.code() == absl::StatusCode::kResourceExhausted && spilled > 0) {
        return SpillAndRetry();
      }
      if (status.code() == absl::StatusCode::kResourceExhausted) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            status.message(), "; no more objects of this session could be spilled to disk"));
      }
      FinishOnce(status);
    });
  }

  absl::Status Complete() {
    if (!have_header_) {
      return absl::InvalidArgumentError("Put stream ended without a header chunk");
    }
    if (received_ != meta_.nbytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Put stream ended after ", received_, " bytes; the header announced ", meta_.nbytes));
    }
    if (hash_ && hasher_.Digest() != meta_.checksum) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checksum mismatch: the header says xxh3_64=", absl::Hex(meta_.checksum),
          ", the data received hashes to ", absl::Hex(hasher_.Digest()), "; nothing stored"));
    }
    const uint64_t nbytes = meta_.nbytes;
    auto object = std::make_shared<StoredObject>(session_->id(), std::move(meta_),
                                                 std::move(memory_), std::move(reservation_));
    bool stored_before = false;  // the same Put, sent again, finished first
    absl::StatusOr<uint64_t> handle =
        core_.catalog.Insert(*session_, std::move(object), &stored_before);
    if (!handle.ok()) return handle.status();
    if (!stored_before) {
      session_->RecordStore(nbytes);
      core_.bytes_stored.fetch_add(nbytes, std::memory_order_relaxed);
    }
    reply_->set_handle(*handle);
    reply_->set_nbytes(nbytes);
    FinishOnce(absl::OkStatus());
    return absl::OkStatus();
  }

  // A Put whose object the session holds already (sent again after a
  // restart that lost its answer): that object's handle, nothing stored
  // (true). The client's remaining chunks are refused with the call's end.
  // False: the object went meanwhile (its session is closing, or it was
  // deleted), so this Put stores it anew.
  absl::StatusOr<bool> AnswerStored(uint64_t handle) {
    absl::StatusOr<std::shared_ptr<const StoredObject>> object =
        core_.catalog.Lookup(session_->id(), handle);
    if (!object.ok()) return false;
    if ((*object)->meta().nbytes != meta_.nbytes || (*object)->meta().checksum != meta_.checksum) {
      return absl::InvalidArgumentError(absl::StrCat(
          "put id ", meta_.put_id, " names object ", handle, " of this session, of ",
          (*object)->meta().nbytes, " bytes; this Put's header differs: nothing stored"));
    }
    reply_->set_handle(handle);
    reply_->set_nbytes(meta_.nbytes);
    FinishOnce(absl::OkStatus());
    return true;
  }

  // Dropping memory_ and reservation_ on error is what makes a failed Put
  // leave nothing behind.
  void FinishOnce(const absl::Status& status) {
    if (finished_) return;
    finished_ = true;
    if (!status.ok()) {
      memory_.Reset();
      reservation_.Reset();
    }
    HappensBefore(this);
    Finish(ToGrpcStatus(status));
  }

  StashCore& core_;
  v1::PutReply* const reply_;
  std::shared_ptr<Session> session_;
  v1::PutChunk chunk_;
  bool finished_ = false;
  bool have_header_ = false;
  bool hash_ = false;
  bool waiting_for_memory_ = false;  // Begin found the pool short; see OnReadDone
  bool waiting_for_spill_ = false;   // Begin found no room; spilling makes some
  ObjectMeta meta_;
  QuotaReservation reservation_;
  Allocation memory_;
  uint64_t received_ = 0;
  Xxh3Hasher hasher_;
};

}  // namespace

grpc::ServerReadReactor<v1::PutChunk>* StartPut(StashCore* core, grpc::CallbackServerContext* ctx,
                                                v1::PutReply* reply) {
  return new PutReactor(core, ctx, reply);
}

}  // namespace actstash::server
