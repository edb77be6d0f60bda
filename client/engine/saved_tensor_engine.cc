// SavedTensorEngine (actstash/saved_tensors.h): unpacking, releasing and
// reaping, and the public class. Packing is in saved_tensor_pack.cc; the
// locking rules are in saved_tensor_engine_impl.h.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/engine/saved_tensor_engine_impl.h"
#include "common/check.h"
#include "common/mutex_mode.h"
#include "kernels/bf16.h"

namespace actstash {
namespace {

using client_internal::PrefetchState;
using client_internal::SavedEvent;
using client_internal::SavedState;
using client_internal::Transport;
using Clock = std::chrono::steady_clock;

EngineOptions WithHostEngine(EngineOptions options) {
  if (options.host_engine == nullptr) {
    HostCopyEngineOptions host;
    host.link_bytes_per_second = options.simulated_link_bytes_per_second;
    options.host_engine = CreateHostCopyEngine(host);
  }
  return EffectiveEngineOptions(std::move(options));
}

absl::Status Gone(uint64_t id) {
  return absl::NotFoundError(absl::StrCat("saved tensor ", id, " is gone"));
}

absl::Status NotStored(uint64_t id) {
  return absl::FailedPreconditionError(
      absl::StrCat("saved tensor ", id, " was not stored (its store failed)"));
}

}  // namespace

SavedTensorEngine::Impl::Impl(std::shared_ptr<Client> client, EngineOptions options)
    : client_(std::move(client)),
      options_(WithHostEngine(std::move(options))),
      cuda_engines_(options_.cuda_engines) {
  available_ = client_ != nullptr;
}

SavedTensorEngine::Impl::~Impl() {
  Synchronize();
  std::vector<void*> owners;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, e] : entries_) {
      owners.push_back(e.owner);
      owners.push_back(e.fetch_owner);
    }
    for (auto& [event, owner] : orphans_) owners.push_back(owner);
    entries_.clear();
    orphans_.clear();
  }
  ReleaseOwners(owners);
}

void SavedTensorEngine::Impl::Move(Entry& e, SavedEvent event) {
  const std::optional<SavedState> next = client_internal::NextState(e.state, event);
  ACTSTASH_CHECK(next.has_value(), absl::StrCat("saved tensor: no transition from ",
                                                client_internal::SavedStateName(e.state), " on ",
                                                client_internal::SavedEventName(event))
                                       .c_str());
  e.state = *next;
}

absl::StatusOr<UnpackResult> SavedTensorEngine::Impl::UnpackBegin(uint64_t id, uint64_t version,
                                                                  int max_prefetch) {
  ReapNoError();
  UnpackResult result;
  // Until the bytes are known stored: the source serves the unpack while the
  // engine holds it (in flight, or kept after a failure), except a downcast
  // tensor, which must come back rounded whatever the timing (and a store
  // with no source to serve): those wait for their store. A store that ended
  // well counts as stored even before a reap sees it.
  for (;;) {
    std::shared_ptr<CopyEvent> wait_for;
    {
      absl::MutexLock lock(&mu_);
      Entry* e = Find(id);
      if (e == nullptr) return Gone(id);
      if (version != kUnknownVersion && version != e->version) {
        return absl::FailedPreconditionError(absl::StrCat(
            "one of the variables needed for gradient computation has been modified by an "
            "inplace operation: saved at version ",
            e->version, ", is at version ", version, " (tensor saved with actstash hooks)"));
      }
      if (e->state == SavedState::kStored) break;
      const bool failed = e->state == SavedState::kFailed;
      const bool done = failed || e->store->Done();
      if (!failed && done && e->store->Wait().ok()) break;  // Wait: done, returns at once
      if (e->owner != nullptr && (done || !e->bf16)) {
        Acquire(e->owner);
        result.kind = UnpackKind::kSource;
        result.owner = e->owner;
        stats_.unpacked_from_source += 1;
        return result;
      }
      if (done) {
        return NotStored(id);
      }
      wait_for = e->store;
    }
    (void)wait_for->Wait();
  }
  absl::MutexLock lock(&mu_);
  Entry* e = Find(id);
  if (e == nullptr) return Gone(id);
  result.nbytes = e->nbytes;
  result.downcast = e->bf16;
  if (e->prefetch == PrefetchState::kRunning) {
    result.kind = UnpackKind::kPrefetched;
    result.owner =
        std::exchange(e->fetch_owner, nullptr);  // the engine's reference, now the caller's
    e->prefetch = PrefetchState::kHandedOut;
    stats_.prefetch_hits += 1;
  } else if (ServedAsView(*e)) {
    absl::StatusOr<StoredBytes> where = client_->Locate(e->ticket);
    if (!where.ok()) return where.status();
    e->users += 1;
    result.kind = UnpackKind::kView;
    result.data = where->data;
    stats_.views += 1;
    stats_.tensors_fetched += 1;
    stats_.bytes_fetched += e->nbytes;
  } else {
    result.kind = UnpackKind::kDestination;
  }
  OfferPrefetch(id, std::min(max_prefetch, options_.prefetch), &result);
  return result;
}

absl::Status SavedTensorEngine::Impl::FetchInto(uint64_t id, uintptr_t dst, uint64_t capacity,
                                                StreamHandle stream) {
  absl::StatusOr<bool> copied = CopyOutNow(id, dst, capacity);
  if (!copied.ok() || *copied) return copied.status();
  CopyEngine* engine = nullptr;
  absl::StatusOr<std::shared_ptr<CopyEvent>> event = StartFetch(id, dst, capacity, stream, &engine);
  if (!event.ok()) return event.status();
  return WaitFetch(id, engine, **event, stream);
}

absl::Status SavedTensorEngine::Impl::Prefetch(uint64_t id, uintptr_t dst, uint64_t capacity,
                                               void* owner, StreamHandle stream) {
  CopyEngine* engine = nullptr;
  absl::StatusOr<std::shared_ptr<CopyEvent>> event = StartFetch(id, dst, capacity, stream, &engine);
  if (!event.ok()) return event.status();
  absl::MutexLock lock(&mu_);
  Entry* e = Find(id);
  Acquire(owner);
  if (e == nullptr) {
    orphans_.emplace_back(*event, owner);  // the copy may still write it
    return absl::OkStatus();
  }
  if (e->prefetch == PrefetchState::kRunning) {
    orphans_.emplace_back(std::move(e->fetch), e->fetch_owner);  // a second prefetch
  }
  e->fetch = *event;
  e->fetch_owner = owner;
  e->prefetch = PrefetchState::kRunning;
  stats_.prefetch_issued += 1;
  return absl::OkStatus();
}

absl::Status SavedTensorEngine::Impl::Finish(uint64_t id, StreamHandle stream) {
  std::shared_ptr<CopyEvent> event;
  CopyEngine* engine = nullptr;
  {
    absl::MutexLock lock(&mu_);
    Entry* e = Find(id);
    if (e == nullptr ||
        (e->prefetch != PrefetchState::kRunning && e->prefetch != PrefetchState::kHandedOut)) {
      return absl::FailedPreconditionError(
          absl::StrCat("saved tensor ", id, " has no prefetch to finish"));
    }
    event = std::move(e->fetch);
    engine = e->engine;
    if (e->fetch_owner != nullptr) orphans_.emplace_back(event, e->fetch_owner);  // never taken
    e->fetch_owner = nullptr;
    e->prefetch = PrefetchState::kDone;
  }
  return WaitFetch(id, engine, *event, stream);
}

void SavedTensorEngine::Impl::Release(uint64_t id) {
  std::vector<void*> owners;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || IsReleased(it->second.state)) return;
    Entry& e = it->second;
    if (IsLive(e.state)) {
      stats_.live_tensors -= 1;
      stats_.live_bytes -= e.stored_bytes;
    }
    Move(e, SavedEvent::kRelease);
    e.cookie = nullptr;
    if (e.prefetch == PrefetchState::kRunning) {
      orphans_.emplace_back(std::move(e.fetch), e.fetch_owner);  // outlives its copy
      e.fetch_owner = nullptr;
    }
    e.prefetch = PrefetchState::kDone;
    if (e.state == SavedState::kReleasedStoring) return;  // the store reads it: reaped later
    owners.push_back(std::exchange(e.owner, nullptr));    // kReleasedFailed: the source
    if (e.users == 0) EraseLocked(it);
  }
  ReleaseOwners(owners);
}

absl::Status SavedTensorEngine::Impl::Reap(bool wait) {
  std::vector<std::pair<uint64_t, std::shared_ptr<CopyEvent>>> done;
  std::vector<Orphan> finished_orphans;
  std::vector<void*> owners;
  {
    absl::MutexLock lock(&mu_);
    // The common case of the hot path (every store so far copied on the
    // packing thread): nothing to reap, one lock.
    if (in_flight_.empty() && orphans_.empty()) return absl::OkStatus();
    std::vector<uint64_t> still;
    for (uint64_t id : in_flight_) {
      const Entry& e = entries_.at(id);  // never erased while its store runs
      if (wait || e.store->Done()) {
        done.emplace_back(id, e.store);
      } else {
        still.push_back(id);
      }
    }
    in_flight_ = std::move(still);
    std::vector<Orphan> keep;
    for (Orphan& orphan : orphans_) {
      if (orphan.first == nullptr || wait || orphan.first->Done()) {
        finished_orphans.push_back(std::move(orphan));
      } else {
        keep.push_back(std::move(orphan));
      }
    }
    orphans_ = std::move(keep);
  }
  for (auto& [event, owner] : finished_orphans) {
    if (event != nullptr) (void)event->Wait();  // the copy into it is over
    owners.push_back(owner);
  }
  std::vector<absl::Status> statuses;
  statuses.reserve(done.size());
  for (auto& [id, event] : done) statuses.push_back(event->Wait());
  absl::Status first;
  std::vector<Ticket> written;  // copies finished: spillable from now on
  if (!done.empty()) {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < done.size(); ++i) {
      auto it = entries_.find(done[i].first);
      Entry& e = it->second;
      stats_.in_flight -= 1;
      stats_.in_flight_bytes -= e.nbytes;
      if (statuses[i].ok()) {
        Move(e, SavedEvent::kStoreDone);
        owners.push_back(std::exchange(e.owner, nullptr));  // the daemon has the bytes
        if (e.state == SavedState::kStored && e.transport == Transport::kLeased) {
          written.push_back(e.ticket);
        }
        if (e.state == SavedState::kReleasedStored && e.users == 0) EraseLocked(it);
        continue;
      }
      stats_.store_failures += 1;
      if (IsLive(e.state)) {
        stats_.live_tensors -= 1;
        stats_.live_bytes -= e.stored_bytes;
      }
      Move(e, SavedEvent::kStoreFailed);
      // The reservation exists; nothing good is in it.
      if (e.transport == Transport::kLeased) FreeTicketLocked(e);
      if (e.state == SavedState::kReleasedFailed) {
        owners.push_back(std::exchange(e.owner, nullptr));
        if (e.users == 0) EraseLocked(it);
        continue;  // nobody needs that tensor any more
      }
      HandleFailureLocked(statuses[i]);  // e.owner stays: unpacks get the source
      if (first.ok()) first = statuses[i];
    }
  }
  // A concurrent Release of one of these is answered NOT_FOUND: harmless.
  for (const Ticket& ticket : written) (void)client_->MarkWritten(ticket);
  ReleaseOwners(owners);
  return options_.on_failure == FailurePolicy::kRaise ? first : absl::OkStatus();
}

absl::Status SavedTensorEngine::Impl::TakeError() {
  absl::MutexLock lock(&mu_);
  return std::exchange(pending_error_, absl::OkStatus());
}

absl::Status SavedTensorEngine::Impl::TakeNotice() {
  absl::MutexLock lock(&mu_);
  return std::exchange(notice_, absl::OkStatus());
}

void SavedTensorEngine::Impl::WaitForCopies() {
  for (CopyEngine* engine : Engines()) engine->Synchronize();
}

void SavedTensorEngine::Impl::Synchronize() {
  for (int round = 0; round < 2; ++round) {  // 2nd: the releases the 1st queued
    WaitForCopies();
    (void)Reap(/*wait=*/true);
  }
}

EngineStats SavedTensorEngine::Impl::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

bool SavedTensorEngine::Impl::available() const {
  absl::MutexLock lock(&mu_);
  return available_;
}

bool SavedTensorEngine::Impl::ServedAsView(const Entry& e) const {
  return e.transport == Transport::kLeased && e.device < 0 && options_.cpu_views && !e.bf16 &&
         e.nbytes >= options_.view_min_bytes;
}

SavedTensorEngine::Impl::Entry* SavedTensorEngine::Impl::Find(uint64_t id) {
  auto it = entries_.find(id);
  return it == entries_.end() || IsReleased(it->second.state) ? nullptr : &it->second;
}

void SavedTensorEngine::Impl::Acquire(void* owner) const {
  if (owner != nullptr && options_.acquire_owner != nullptr) options_.acquire_owner(owner);
}

void SavedTensorEngine::Impl::ReleaseOwners(const std::vector<void*>& owners) const {
  if (options_.release_owner == nullptr) return;
  for (void* owner : owners) {
    if (owner != nullptr) options_.release_owner(owner);
  }
}

bool SavedTensorEngine::Impl::StoresInFlight() {
  absl::MutexLock lock(&mu_);
  return !in_flight_.empty();
}

void SavedTensorEngine::Impl::ReapNoError(bool wait) {
  absl::Status status = Reap(wait);
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    if (pending_error_.ok()) pending_error_ = status;
  }
}

std::vector<CopyEngine*> SavedTensorEngine::Impl::Engines() {
  absl::MutexLock lock(&mu_);
  std::vector<CopyEngine*> engines{options_.host_engine.get()};
  for (const auto& engine : cuda_engines_) {
    if (engine != nullptr) engines.push_back(engine.get());
  }
  return engines;
}

void SavedTensorEngine::Impl::CountKept(uint64_t nbytes, KeepReason reason) {
  stats_.tensors_kept += 1;
  stats_.bytes_kept += nbytes;
  stats_.kept_by_reason[static_cast<int>(reason)] += 1;
}

void SavedTensorEngine::Impl::HandleFailureLocked(const absl::Status& status) {
  if (options_.on_failure == FailurePolicy::kKeep) {
    available_ = false;
  } else if (pending_error_.ok()) {
    pending_error_ = status;
  }
}

absl::StatusOr<std::shared_ptr<CopyEvent>> SavedTensorEngine::Impl::StartFetch(
    uint64_t id, uintptr_t dst, uint64_t capacity, StreamHandle stream, CopyEngine** engine) {
  Entry copy;
  {
    absl::MutexLock lock(&mu_);
    Entry* e = Find(id);
    if (e == nullptr) return Gone(id);
    if (IsFailed(e->state)) {
      return NotStored(id);
    }
    if (capacity < e->nbytes) {
      return absl::OutOfRangeError(absl::StrCat("saved tensor ", id, " holds ", e->nbytes,
                                                " bytes; the destination holds ", capacity));
    }
    e->users += 1;
    e->fetch_queued = true;
    copy.transport = e->transport;
    copy.bf16 = e->bf16;
    copy.engine = e->engine;
    copy.ticket = e->ticket;
    copy.rpc_ticket = e->rpc_ticket;
    copy.store = e->store;
    copy.stored_bytes = e->stored_bytes;
    *engine = e->engine;
  }
  // Behind the store when it still runs (the fetch stream waits for it).
  absl::StatusOr<std::shared_ptr<CopyEvent>> event;
  void* out = reinterpret_cast<void*>(dst);
  if (copy.transport == Transport::kLeased) {
    absl::StatusOr<StoredBytes> where = client_->Locate(copy.ticket);
    if (!where.ok()) {
      event = where.status();
    } else {
      std::vector<std::shared_ptr<CopyEvent>> deps;
      if (copy.store != nullptr) deps.push_back(copy.store);
      event = copy.bf16 ? copy.engine->ConvertAsync(CopyStream::kFetch, out, where->data,
                                                    copy.stored_bytes / 2, Conversion::kBf16ToFp32,
                                                    stream, deps)
                        : copy.engine->CopyAsync(CopyStream::kFetch, out, where->data,
                                                 copy.stored_bytes, stream, deps);
    }
  } else {
    event = copy.engine->SubmitAsync(CopyStream::kFetch,
                                     [client = client_, ticket = copy.rpc_ticket,
                                      store = copy.store, out, capacity]() -> absl::Status {
                                       if (absl::Status s = store->Wait(); !s.ok()) return s;
                                       return client->Fetch(ticket->ticket, out, capacity);
                                     });
  }
  Unuse(id);
  return event;
}

absl::StatusOr<bool> SavedTensorEngine::Impl::CopyOutNow(uint64_t id, uintptr_t dst,
                                                         uint64_t capacity) {
  Ticket ticket;
  uint64_t nbytes = 0;
  uint64_t stored_bytes = 0;
  bool bf16 = false;
  {
    absl::MutexLock lock(&mu_);
    Entry* e = Find(id);
    if (e == nullptr || e->state != SavedState::kStored || e->device >= 0 ||
        e->transport != Transport::kLeased || options_.simulated_link_bytes_per_second > 0) {
      return false;
    }
    if (capacity < e->nbytes) {
      return absl::OutOfRangeError(absl::StrCat("saved tensor ", id, " holds ", e->nbytes,
                                                " bytes; the destination holds ", capacity));
    }
    e->users += 1;
    ticket = e->ticket;
    nbytes = e->nbytes;
    stored_bytes = e->stored_bytes;
    bf16 = e->bf16;
  }
  absl::StatusOr<StoredBytes> where = client_->Locate(ticket);
  if (where.ok()) {
    if (bf16) {
      kernels::Bf16ToFp32Cpu(static_cast<const uint16_t*>(where->data),
                             reinterpret_cast<float*>(dst), stored_bytes / 2);
    } else {
      std::memcpy(reinterpret_cast<void*>(dst), where->data, stored_bytes);
    }
  }
  Unuse(id);
  if (!where.ok()) return where.status();
  absl::MutexLock lock(&mu_);
  stats_.tensors_fetched += 1;
  stats_.bytes_fetched += nbytes;
  return true;
}

absl::Status SavedTensorEngine::Impl::WaitFetch(uint64_t id, CopyEngine* engine,
                                                const CopyEvent& event, StreamHandle stream) {
  // Ordered (CPU: waited for) even if `id` was released meanwhile: the
  // caller's destination must not be freed under the copy.
  const Clock::time_point start = Clock::now();
  absl::Status status = engine->OrderAfterAsync(stream, event);
  const uint64_t waited =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  absl::MutexLock lock(&mu_);
  stats_.wait_ns += waited;
  auto it = entries_.find(id);
  if (status.ok() && it != entries_.end()) {
    stats_.tensors_fetched += 1;
    stats_.bytes_fetched += it->second.nbytes;
  }
  return status;
}

void SavedTensorEngine::Impl::OfferPrefetch(uint64_t id, int depth, UnpackResult* result) {
  if (depth <= 0) return;
  const uint64_t lowest = id > 8u * depth ? id - 8u * depth : 1;  // bounded scan
  int offered = 0;
  for (uint64_t i = id - 1; i >= lowest && i > 0 && offered < depth; --i) {
    Entry* e = Find(i);
    // CPU tensors are read in place or copied on the unpacking thread when
    // needed: a prefetch on a copy thread would only add a hand-off (unless
    // a simulated link makes them cross it as CUDA tensors do).
    if (e == nullptr || e->state != SavedState::kStored || e->prefetch != PrefetchState::kNone ||
        e->cookie == nullptr || (e->device < 0 && options_.simulated_link_bytes_per_second == 0)) {
      continue;
    }
    e->prefetch = PrefetchState::kOffered;
    Acquire(e->cookie);
    result->prefetch_cookies.push_back(e->cookie);
    result->prefetch_ids.push_back(i);
    ++offered;
  }
}

void SavedTensorEngine::Impl::Unuse(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  e.users -= 1;
  if (e.users == 0 && IsReleased(e.state) && !StoreRunning(e.state)) EraseLocked(it);
}

void SavedTensorEngine::Impl::EraseLocked(Entries::iterator it) {
  Entry& e = it->second;
  if (e.state == SavedState::kReleasedStored) FreeTicketLocked(e);
  entries_.erase(it);
}

void SavedTensorEngine::Impl::FreeTicketLocked(Entry& e) {
  if (e.transport == Transport::kLeased && !e.fetch_queued && e.device < 0) {
    (void)client_->Release(e.ticket);  // no copy uses it: an arena free
    return;
  }
  // Behind the fetches of it (FIFO fetch stream), so no copy still reads it.
  if (e.transport == Transport::kLeased) {
    e.engine->SubmitAsync(CopyStream::kFetch, [client = client_, ticket = e.ticket]() {
      return client->Release(ticket);
    });
  } else {
    e.engine->SubmitAsync(CopyStream::kFetch,
                          [client = client_, ticket = e.rpc_ticket, store = e.store]() {
                            if (!store->Wait().ok()) return absl::OkStatus();
                            return client->Release(ticket->ticket);
                          });
  }
}

// --- SavedTensorEngine -----------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SavedTensorEngine>> SavedTensorEngine::Create(
    std::shared_ptr<Client> client, EngineOptions options) {
  ConfigureMutexes();  // a client-less engine (everything kept) too
  if (options.prefetch < 0) return absl::InvalidArgumentError("prefetch must be >= 0");
  if (options.device_pool >= 0 && options.pool_importer < 0) {
    return absl::InvalidArgumentError("a device pool needs the importing device (pool_importer)");
  }
  if ((options.acquire_owner == nullptr) != (options.release_owner == nullptr)) {
    return absl::InvalidArgumentError("give both owner functions or neither");
  }
  return std::unique_ptr<SavedTensorEngine>(
      new SavedTensorEngine(std::make_unique<Impl>(std::move(client), std::move(options))));
}

SavedTensorEngine::SavedTensorEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SavedTensorEngine::~SavedTensorEngine() = default;

uint64_t SavedTensorEngine::Pack(const SavedTensorInfo& info, KeepReason keep, uint64_t min_bytes) {
  return impl_->Pack(info, keep, min_bytes);
}
absl::StatusOr<UnpackResult> SavedTensorEngine::UnpackBegin(uint64_t id, uint64_t version,
                                                            int max_prefetch) {
  return impl_->UnpackBegin(id, version, max_prefetch);
}
absl::Status SavedTensorEngine::FetchInto(uint64_t id, uintptr_t dst, uint64_t capacity,
                                          StreamHandle stream) {
  return impl_->FetchInto(id, dst, capacity, stream);
}
absl::Status SavedTensorEngine::Prefetch(uint64_t id, uintptr_t dst, uint64_t capacity, void* owner,
                                         StreamHandle stream) {
  return impl_->Prefetch(id, dst, capacity, owner, stream);
}
absl::Status SavedTensorEngine::Finish(uint64_t id, StreamHandle stream) {
  return impl_->Finish(id, stream);
}
void SavedTensorEngine::ViewDone(uint64_t id) { impl_->ViewDone(id); }
void SavedTensorEngine::Release(uint64_t id) { impl_->Release(id); }
absl::Status SavedTensorEngine::Reap(bool wait) { return impl_->Reap(wait); }
absl::Status SavedTensorEngine::TakeError() { return impl_->TakeError(); }
absl::Status SavedTensorEngine::TakeNotice() { return impl_->TakeNotice(); }
void SavedTensorEngine::Synchronize() { impl_->Synchronize(); }
void SavedTensorEngine::WaitForCopies() { impl_->WaitForCopies(); }
EngineStats SavedTensorEngine::stats() const { return impl_->stats(); }
bool SavedTensorEngine::available() const { return impl_->available(); }

}  // namespace actstash
