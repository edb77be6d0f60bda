// Get: a server-streaming call that sends the header, then the payload in
// chunks of at most kMaxChunkBytes, straight from pool memory.
#include <algorithm>

#include "common/grpc_status.h"
#include "common/happens_before.h"
#include "common/protocol.h"
#include "server/rpc/object_spill.h"
#include "server/rpc/stash_reactors.h"

namespace actstash::server {
namespace {

// Holds a reference to the object, so a concurrent Delete or CloseSession
// frees its memory only after the last chunk was written. One write is in
// flight at a time; gRPC serializes the callbacks. Write and End are the only
// ways on, and each callback starts with HappensAfter: that order, made by
// gRPC, is marked for TSan (common/happens_before.h; what gRPC does with the
// message and at the call's end stays unchecked: scripts/sanitizers/tsan.supp).
class GetReactor final : public grpc::ServerWriteReactor<v1::GetChunk> {
 public:
  GetReactor(StashCore* core, grpc::CallbackServerContext* ctx, const v1::GetRequest& request)
      : core_(*core) {
    core_.streams_in_flight.fetch_add(1, std::memory_order_acq_rel);
    absl::StatusOr<std::shared_ptr<Session>> session = AuthenticateCall(core_, *ctx);
    if (!session.ok()) {
      End(ToGrpcStatus(session.status()));
      return;
    }
    session_ = *std::move(session);
    absl::StatusOr<std::shared_ptr<const StoredObject>> object =
        core_.catalog.Lookup(session_->id(), request.handle());
    if (!object.ok()) {
      End(ToGrpcStatus(object.status()));
      return;
    }
    object_ = *std::move(object);
    // A spilled object is read back first; the header goes out once it is.
    absl::StatusOr<StoredObject::ReadStart> start = object_->BeginRead([this](absl::Status ready) {
      if (!ready.ok()) {
        object_.reset();
        return End(ToGrpcStatus(ready));
      }
      reading_ = true;
      SendHeader();
    });
    if (!start.ok()) {
      object_.reset();
      End(ToGrpcStatus(start.status()));
      return;
    }
    if (*start == StoredObject::ReadStart::kMustRestore) {
      RestoreObject(core_, session_, object_);
      return;
    }
    if (*start == StoredObject::ReadStart::kWait) return;
    reading_ = true;
    SendHeader();
  }

  void SendHeader() {
    const ObjectMeta& meta = object_->meta();
    v1::ObjectHeader* header = chunk_.mutable_header();
    header->set_dtype(meta.dtype);
    for (int64_t dim : meta.shape) header->add_shape(dim);
    header->set_nbytes(meta.nbytes);
    if (meta.checksum_algorithm != v1::CHECKSUM_ALGORITHM_UNSPECIFIED) {
      header->mutable_checksum()->set_algorithm(
          static_cast<v1::ChecksumAlgorithm>(meta.checksum_algorithm));
      header->mutable_checksum()->set_value(meta.checksum);
    }
    data_ = object_->data();
    Write();
  }

  void OnWriteDone(bool ok) override {
    HappensAfter(this);
    // The object reference is dropped before Finish: once the client sees
    // the call end, a Delete it sent frees the memory at once.
    if (!ok) {  // the client went away or cancelled
      Drop();
      End(grpc::Status(grpc::StatusCode::CANCELLED, "Get stream was cancelled"));
      return;
    }
    const uint64_t nbytes = object_->meta().nbytes;
    if (sent_ == nbytes) {
      session_->RecordFetch(nbytes);
      core_.bytes_fetched.fetch_add(nbytes, std::memory_order_relaxed);
      Drop();
      End(grpc::Status::OK);
      return;
    }
    const uint64_t n = std::min(kMaxChunkBytes, nbytes - sent_);
    chunk_.set_data(reinterpret_cast<const char*>(data_ + sent_), n);
    sent_ += n;
    Write();
  }

  void OnDone() override {
    HappensAfter(this);
    core_.streams_in_flight.fetch_sub(1, std::memory_order_acq_rel);
    delete this;
  }

 private:
  // Sends chunk_ (OnWriteDone follows).
  void Write() {
    HappensBefore(this);
    StartWrite(&chunk_);
  }

  // Ends the call (OnDone follows).
  void End(const grpc::Status& status) {
    HappensBefore(this);
    Finish(status);
  }

  void Drop() {
    if (reading_) object_->EndRead();
    reading_ = false;
    object_.reset();
  }

  StashCore& core_;
  std::shared_ptr<Session> session_;
  std::shared_ptr<const StoredObject> object_;
  const std::byte* data_ = nullptr;  // while reading_
  bool reading_ = false;             // between BeginRead and EndRead
  v1::GetChunk chunk_;
  uint64_t sent_ = 0;
};

}  // namespace

grpc::ServerWriteReactor<v1::GetChunk>* StartGet(StashCore* core, grpc::CallbackServerContext* ctx,
                                                 const v1::GetRequest* request) {
  return new GetReactor(core, ctx, *request);
}

}  // namespace actstash::server
