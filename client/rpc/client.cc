#include "actstash/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "client/rpc/channel.h"
#include "client/rpc/client_impl.h"
#include "common/address.h"
#include "common/checksum.h"
#include "common/grpc_status.h"
#include "common/happens_before.h"
#include "common/mutex_mode.h"
#include "common/protocol.h"
#include "common/tiered_id.h"
#include "common/units.h"
#include "common/unix_socket.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace actstash {
namespace {

ObjectInfo InfoFromHeader(const v1::ObjectHeader& header) {
  ObjectInfo info;
  info.dtype = header.dtype();
  info.shape.assign(header.shape().begin(), header.shape().end());
  info.nbytes = header.nbytes();
  if (header.checksum().algorithm() == v1::CHECKSUM_ALGORITHM_XXH3_64) {
    info.checksum_xxh3 = header.checksum().value();
  }
  return info;
}

}  // namespace

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  if (!impl_->closed.load()) {
    impl_->StopReporter();  // before anything else calls
    impl_->rpc->ShortenDeadline(std::chrono::milliseconds(2000));
    (void)Close();
  }
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  ConfigureMutexes();
  if (options.numa_node < -1 || options.numa_node > 1023) {
    return absl::InvalidArgumentError(absl::StrCat(
        "numa_node: ", options.numa_node, " is not -1 (the caller's) or a node in 0..1023"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  const std::string target = ResolveClientAddress(options.address);
  impl->rpc = std::make_unique<client_internal::SessionRpc>(
      target, client_internal::MakeChannel(target, options), options.rpc_timeout);

  v1::OpenSessionRequest request;
  request.set_client_name(options.client_name.empty() ? std::string(program_invocation_short_name)
                                                      : options.client_name);
  request.set_quota_bytes(options.quota_bytes);
  request.set_client_pid(static_cast<uint32_t>(getpid()));
  v1::OpenSessionReply reply;
  const auto deadline = std::chrono::system_clock::now() + options.connect_timeout;
  grpc::Status status;
  for (bool again = false;; again = true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    // A daemon that accepts on its socket but failed the call is one that
    // just (re)started: gRPC shares a connection that failed a moment ago
    // among the channels of a process. Sent again, waiting for the channel,
    // until the deadline. Nothing listening (no socket, or a stale one)
    // fails at once.
    ctx.set_wait_for_ready(again);
    status = impl->rpc->stub().OpenSession(&ctx, request, &reply);
    const std::string path = UnixSocketPath(target);
    if (status.ok() || again || status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        path.empty() || !ConnectUnixSocket(path, /*wait_for_room=*/false).ok()) {
      break;
    }
  }
  if (!status.ok()) {
    return client_internal::AnnotateRpcError(status, target, "OpenSession",
                                             options.connect_timeout);
  }
  impl->session_id = reply.session_id();
  impl->rpc->SetToken(reply.token());
  impl->rpc->SetUnattachedPauseLimit(options.reattach_timeout);
  impl->quota_bytes = reply.quota_bytes();
  if (reply.max_chunk_bytes() != 0) {
    impl->max_chunk_bytes = std::min<uint64_t>(reply.max_chunk_bytes(), kMaxChunkBytes);
  }
  impl->segment_bytes = reply.segment_bytes();
  impl->spill_enabled = reply.spill_enabled();
  std::vector<DevicePoolInfo> pools;
  for (const v1::DevicePoolInfo& pool : reply.device_pools()) {
    pools.push_back(DevicePoolInfo{pool.device(), pool.total_bytes(), pool.segment_bytes()});
  }
  impl->device_tiers = std::make_unique<client_internal::DeviceTiers>(
      impl->rpc.get(), std::move(pools), options.lease_batch, options.cuda_device);
  std::unique_ptr<Client> client(new Client(std::move(impl)));
  if (options.attach != AttachMode::kOff) {
    absl::Status attached = client->impl_->Attach(reply.attach_socket_name());
    if (!attached.ok() && options.attach == AttachMode::kRequired) return attached;
  }
  return client;
}

absl::StatusOr<Handle> Client::Put(const void* data, size_t nbytes, const PutOptions& options) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  if (nbytes > 0 && data == nullptr) {
    return absl::InvalidArgumentError("Put: null data with a non-zero size");
  }
  v1::PutReply reply;
  const uint64_t put_id = impl_->next_put_id.fetch_add(1, std::memory_order_relaxed);
  absl::Status status = impl_->rpc->Retrying("Put", [&](grpc::ClientContext* ctx) {
    std::unique_ptr<grpc::ClientWriter<v1::PutChunk>> writer = impl_->rpc->stub().Put(ctx, &reply);
    v1::PutChunk chunk;
    v1::ObjectHeader* header = chunk.mutable_header();
    header->set_dtype(options.dtype);
    for (int64_t dim : options.shape) header->add_shape(dim);
    header->set_nbytes(nbytes);
    header->set_put_id(put_id);
    if (options.checksum) {
      header->mutable_checksum()->set_algorithm(v1::CHECKSUM_ALGORITHM_XXH3_64);
      header->mutable_checksum()->set_value(Xxh3(data, nbytes));
    }
    // A failed Write means the daemon ended the call early; Finish says why.
    bool writing = writer->Write(chunk);
    const auto* bytes = static_cast<const char*>(data);
    for (size_t sent = 0; writing && sent < nbytes;) {
      const size_t n = std::min<size_t>(impl_->max_chunk_bytes, nbytes - sent);
      chunk.set_data(bytes + sent, n);
      writing = writer->Write(chunk);
      sent += n;
    }
    if (writing) writer->WritesDone();
    return writer->Finish();
  });
  if (!status.ok()) return status;
  return Handle{reply.handle()};
}

absl::StatusOr<ObjectInfo> Client::Impl::Fetch(
    Handle handle, const std::function<absl::StatusOr<std::byte*>(const ObjectInfo&)>& on_header) {
  if (absl::Status s = CheckOpen(); !s.ok()) return s;
  v1::GetRequest request;
  request.set_handle(handle.id);
  absl::Status error;  // this side's, never retried
  ObjectInfo info;
  uint64_t received = 0;
  Xxh3Hasher hasher;
  absl::Status status = rpc->Retrying("Get", [&](grpc::ClientContext* ctx) {
    std::unique_ptr<grpc::ClientReader<v1::GetChunk>> reader = rpc->stub().Get(ctx, request);
    v1::GetChunk chunk;
    if (!reader->Read(&chunk)) return reader->Finish();
    std::byte* dst = nullptr;
    if (chunk.payload_case() != v1::GetChunk::kHeader) {
      error = absl::InternalError("Get: the daemon's first chunk carried no header");
    } else {
      info = InfoFromHeader(chunk.header());
      absl::StatusOr<std::byte*> buffer = on_header(info);
      if (buffer.ok()) {
        dst = *buffer;
      } else {
        error = buffer.status();
      }
    }
    received = 0;
    hasher = Xxh3Hasher();
    while (error.ok() && reader->Read(&chunk)) {
      const std::string& data = chunk.data();
      if (chunk.payload_case() != v1::GetChunk::kData || data.size() > info.nbytes - received) {
        error = absl::InternalError("Get: the daemon sent more data than its header announced");
        break;
      }
      CopyFromLibraryBuffer(dst + received, data.data(), data.size());
      if (info.checksum_xxh3.has_value()) hasher.Update(dst + received, data.size());
      received += data.size();
    }
    if (!error.ok()) {
      ctx->TryCancel();
      (void)reader->Finish();
      return grpc::Status::OK;
    }
    return reader->Finish();
  });
  if (!error.ok()) return error;
  if (!status.ok()) return status;
  if (received != info.nbytes) {
    return absl::InternalError(absl::StrCat("Get: the daemon sent ", received,
                                            " bytes; its header announced ", info.nbytes));
  }
  if (info.checksum_xxh3.has_value() && hasher.Digest() != *info.checksum_xxh3) {
    return absl::DataLossError(absl::StrCat("Get: checksum mismatch on handle ", handle.id));
  }
  return info;
}

absl::StatusOr<ObjectInfo> Client::Get(Handle handle, void* dst, size_t capacity) {
  return impl_->Fetch(handle, [&](const ObjectInfo& info) -> absl::StatusOr<std::byte*> {
    if (info.nbytes > capacity) {
      return absl::OutOfRangeError(absl::StrCat("Get: object ", handle.id, " has ", info.nbytes,
                                                " bytes; the buffer holds ", capacity));
    }
    return static_cast<std::byte*>(dst);
  });
}

absl::StatusOr<Object> Client::Get(Handle handle) {
  Object object;
  absl::StatusOr<ObjectInfo> info =
      impl_->Fetch(handle, [&](const ObjectInfo& header) -> absl::StatusOr<std::byte*> {
        object.data.resize(header.nbytes);
        return object.data.data();
      });
  if (!info.ok()) return info.status();
  object.info = *std::move(info);
  return object;
}

absl::Status Client::Delete(absl::Span<const Handle> handles) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  v1::DeleteRequest request;
  for (Handle h : handles) request.add_handles(h.id);
  v1::DeleteReply reply;
  return impl_->rpc->Call(&v1::Stash::Stub::Delete, request, &reply, "Delete");
}

absl::StatusOr<v1::StatsReply> Client::Stats(bool all_sessions) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  // So that the daemon's numbers include this client's latest placements.
  if (impl_->local != nullptr && !impl_->rpc->Lost()) {
    if (absl::Status s = impl_->ReportUsage(); !s.ok()) return s;
  }
  v1::StatsRequest request;
  request.set_per_session(all_sessions);
  v1::StatsReply reply;
  if (absl::Status s = impl_->rpc->Call(&v1::Stash::Stub::Stats, request, &reply, "Stats");
      !s.ok()) {
    return s;
  }
  return reply;
}

absl::StatusOr<v1::CopyShareReply> Client::CopyShare(double probe_store_bytes_per_second,
                                                     double probe_fetch_bytes_per_second) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  for (auto [name, rate] :
       {std::pair{"probe_store_bytes_per_second", probe_store_bytes_per_second},
        std::pair{"probe_fetch_bytes_per_second", probe_fetch_bytes_per_second}}) {
    if (absl::Status s = CheckBytesPerSecond(name, rate); !s.ok()) return s;
  }
  v1::CopyShareRequest request;
  request.set_probe_store_bytes_per_second(probe_store_bytes_per_second);
  request.set_probe_fetch_bytes_per_second(probe_fetch_bytes_per_second);
  v1::CopyShareReply reply;
  if (absl::Status s = impl_->rpc->Call(&v1::Stash::Stub::CopyShare, request, &reply, "CopyShare");
      !s.ok()) {
    return s;
  }
  return reply;
}

absl::Status Client::Close() {
  if (impl_->closed.exchange(true)) return absl::OkStatus();
  impl_->StopReporter();
  // The local store and the channel stay alive (calls racing with Close may
  // still be using them) until the Client goes; they are unmapped then.
  // Hanging up after CloseSession has the daemon drop the attach connection.
  struct HangUp {
    Impl* impl;
    ~HangUp() {
      if (impl->attach != nullptr) impl->attach->Shutdown();
    }
  } hang_up{impl_.get()};
  v1::CloseSessionReply reply;
  return impl_->rpc->Call(&v1::Stash::Stub::CloseSession, v1::CloseSessionRequest(), &reply,
                          "CloseSession");
}

absl::StatusOr<Ticket> Client::Store(const void* src, size_t nbytes) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  if (impl_->local != nullptr) {
    absl::StatusOr<uint64_t> id = impl_->local->Store(src, nbytes);
    if (!id.ok()) return id.status();
    return Ticket{*id, nbytes};
  }
  absl::StatusOr<Handle> handle = Put(src, nbytes);
  if (!handle.ok()) return handle.status();
  return Ticket{tiered_id::MakeInline(handle->id), nbytes};
}

absl::StatusOr<Reservation> Client::Reserve(size_t nbytes) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  if (impl_->local == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Reserve needs the zero-copy path (", impl_->attach_status.message(), ")"));
  }
  absl::StatusOr<client_internal::Placed> placed = impl_->local->Reserve(nbytes);
  if (!placed.ok()) return placed.status();
  return Reservation{Ticket{placed->ticket, nbytes}, placed->data, placed->pinned};
}

absl::StatusOr<Reservation> Client::ReserveState(size_t nbytes) {
  absl::StatusOr<Reservation> reserved = Reserve(nbytes);
  if (reserved.ok()) impl_->state_bytes.fetch_add(nbytes, std::memory_order_relaxed);
  return reserved;
}

absl::Status Client::ReleaseState(const Ticket& ticket) {
  absl::Status released = Release(ticket);
  if (released.ok()) impl_->state_bytes.fetch_sub(ticket.nbytes, std::memory_order_relaxed);
  return released;
}

absl::Status Client::ParkState(const Ticket& ticket) {
  uint64_t id = 0;
  client_internal::LocalStore* store =
      tiered_id::IsInline(ticket.id) ? nullptr : impl_->StoreOf(ticket.id, &id);
  if (store == nullptr) return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket.id));
  return store->Park(id);
}

absl::StatusOr<void*> Client::LocateState(const Ticket& ticket) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  uint64_t id = 0;
  client_internal::LocalStore* store =
      tiered_id::IsInline(ticket.id) ? nullptr : impl_->StoreOf(ticket.id, &id);
  if (store == nullptr) return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket.id));
  absl::StatusOr<client_internal::Located> located =
      store->Locate(id, client_internal::ReadKind::kState);
  if (!located.ok()) return located.status();
  return const_cast<std::byte*>(located->data);  // the caller's own state buffer
}

absl::StatusOr<Reservation> Client::ReserveOnDevice(size_t nbytes, uint32_t device) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  size_t index = 0;
  absl::StatusOr<client_internal::LocalStore*> store = impl_->DeviceStore(device, &index);
  if (!store.ok()) return store.status();
  absl::StatusOr<client_internal::Placed> placed = (*store)->Reserve(nbytes);
  if (!placed.ok()) return placed.status();
  return Reservation{Ticket{Impl::DeviceTicket(index, placed->ticket), nbytes}, placed->data, false,
                     true};
}

const std::vector<DevicePoolInfo>& Client::device_pools() const {
  return impl_->device_tiers->pools();
}

absl::StatusOr<StoredBytes> Client::Locate(const Ticket& ticket) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  if (tiered_id::IsInline(ticket.id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("ticket ", ticket.id, " is stored inline in the daemon: use Fetch"));
  }
  uint64_t id = 0;
  client_internal::LocalStore* store = impl_->StoreOf(ticket.id, &id);
  if (store == nullptr) return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket.id));
  absl::StatusOr<client_internal::Located> located = store->Locate(id);
  if (!located.ok()) return located.status();
  return StoredBytes{located->data, located->size, located->pinned, located->on_device};
}

absl::Status Client::MarkWritten(const Ticket& ticket) {
  if (tiered_id::IsInline(ticket.id)) return absl::OkStatus();  // stored by the daemon
  uint64_t id = 0;
  client_internal::LocalStore* store = impl_->StoreOf(ticket.id, &id);
  if (store == nullptr) return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket.id));
  return store->MarkWritten(id);
}

absl::Status Client::Fetch(const Ticket& ticket, void* dst, size_t capacity) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  if (!tiered_id::IsInline(ticket.id)) {
    uint64_t id = 0;
    client_internal::LocalStore* store = impl_->StoreOf(ticket.id, &id);
    if (store == nullptr) return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket.id));
    return store->Fetch(id, dst, capacity);
  }
  absl::StatusOr<ObjectInfo> info = Get(Handle{tiered_id::HandleOf(ticket.id)}, dst, capacity);
  return info.status();
}

absl::Status Client::Release(const Ticket& ticket) {
  if (absl::Status s = impl_->CheckOpen(); !s.ok()) return s;
  if (!tiered_id::IsInline(ticket.id)) {
    uint64_t id = 0;
    client_internal::LocalStore* store = impl_->StoreOf(ticket.id, &id);
    if (store == nullptr) return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket.id));
    return store->Release(id);
  }
  return Delete(Handle{tiered_id::HandleOf(ticket.id)});
}

bool Client::attached() const { return impl_->local != nullptr; }
bool Client::can_spill() const {
  return attached() && impl_->spill_enabled && impl_->options.spill;
}
absl::Status Client::attach_status() const { return impl_->attach_status; }

absl::Status Client::pin_status() const {
  return impl_->local == nullptr ? absl::OkStatus() : impl_->local->pin_status();
}

v1::ClientUsage Client::zero_copy_usage() const {
  if (impl_->local == nullptr) return {};
  return impl_->TotalUsage();
}

uint64_t Client::daemon_pauses() const { return impl_->rpc->paused_calls(); }

uint64_t Client::daemon_reattaches() const {
  return impl_->attach == nullptr ? 0 : impl_->attach->reattaches();
}

uint64_t Client::session_id() const { return impl_->session_id; }
uint64_t Client::quota_bytes() const { return impl_->quota_bytes; }
const std::string& Client::address() const { return impl_->rpc->target(); }

absl::StatusOr<PingResult> Ping(const std::string& address, std::chrono::milliseconds timeout) {
  return Ping(address, timeout, ClientOptions{});
}

absl::StatusOr<PingResult> Ping(const std::string& address, std::chrono::milliseconds timeout,
                                const ClientOptions& tls) {
  PingResult result;
  result.address = ResolveClientAddress(address);
  auto stub = grpc::health::v1::Health::NewStub(client_internal::MakeChannel(result.address, tls));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(kStashServiceName);
  grpc::health::v1::HealthCheckResponse response;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status status = stub->Check(&ctx, request, &response);
  result.round_trip = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::steady_clock::now() - start);
  if (!status.ok())
    return client_internal::AnnotateRpcError(status, result.address, "Ping", timeout);
  result.serving = response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  return result;
}

}  // namespace actstash
