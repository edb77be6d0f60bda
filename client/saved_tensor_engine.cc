// SavedTensorEngine (actstash/saved_tensors.h). One mutex guards the table of
// saved tensors; copies run on CopyEngine streams and never touch the table;
// owners are released only after the mutex is dropped, on the calling thread.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "actstash/saved_tensors.h"
#include "kernels/bf16.h"
#include "kernels/strided_copy.h"
#include "kernels/strided_layout.h"

namespace actstash {
namespace {

using Clock = std::chrono::steady_clock;

EngineOptions WithHostEngine(EngineOptions options) {
  if (options.host_engine == nullptr) options.host_engine = CreateHostCopyEngine();
  return options;
}

// The ticket of a store through Client::Store, known once its work ran.
struct InlineTicket {
  Ticket ticket;  // written by the store work before its event completes
};

struct Entry {
  uint64_t nbytes = 0;        // bytes of the tensor as restored
  uint64_t stored_bytes = 0;  // bytes held by the daemon
  bool placed = false;        // in leased memory (Reserve); else Client::Store
  bool bf16 = false;
  int device = -1;
  CopyEngine* engine = nullptr;
  Ticket ticket;                                // placed stores
  std::shared_ptr<InlineTicket> inline_ticket;  // Client::Store stores
  std::shared_ptr<CopyEvent> store;             // null: stored on the calling thread
  void* owner = nullptr;  // source, while stored asynchronously or after a failure
  void* cookie = nullptr;
  uint64_t version = 0;
  bool failed = false;
  bool released = false;
  bool fetch_queued = false;  // a copy or Client::Fetch ran on the fetch stream
  bool prefetch_offered = false;
  int busy = 0;                      // views and fetches being enqueued
  std::shared_ptr<CopyEvent> fetch;  // a prefetch not yet finished
  void* fetch_owner = nullptr;       // its destination
};

}  // namespace

class SavedTensorEngine::Impl {
 public:
  Impl(std::shared_ptr<Client> client, EngineOptions options)
      : client_(std::move(client)),
        options_(WithHostEngine(std::move(options))),
        cuda_engines_(options_.cuda_engines) {
    available_ = client_ != nullptr;
  }

  ~Impl() {
    Synchronize();
    std::vector<void*> owners;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [id, e] : entries_) {
        if (e.owner != nullptr) owners.push_back(e.owner);
        if (e.fetch_owner != nullptr) owners.push_back(e.fetch_owner);
      }
      for (auto& [event, owner] : orphans_) owners.push_back(owner);
      entries_.clear();
      orphans_.clear();
    }
    ReleaseOwners(owners);
  }

  uint64_t Pack(const SavedTensorInfo& info, KeepReason keep, uint64_t min_bytes) {
    ReapNoError();
    KeepReason reason = keep;
    CopyEngine* engine = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (reason == KeepReason::kCount) reason = Decide(info, min_bytes, &engine);
      if (reason != KeepReason::kCount) {
        CountKept(info.nbytes, reason);
        return 0;
      }
    }
    // Only a store that will be in flight waits for room (inline CPU stores
    // are done when Store returns).
    const bool in_flight = info.device >= 0 || !client_->attached() ||
                           (!info.sync && info.nbytes > options_.inline_store_bytes);
    if (in_flight && WaitForRoom(info)) ReapNoError();  // the sources of what finished go now
    return Store(info, engine);
  }

  absl::StatusOr<UnpackResult> UnpackBegin(uint64_t id, uint64_t version, int max_prefetch) {
    ReapNoError();
    UnpackResult result;
    // A downcast tensor must come back rounded whatever the timing: wait for
    // its store (a done, successful store counts as stored even before a
    // concurrent reap drops its source).
    for (;;) {
      std::shared_ptr<CopyEvent> wait_for;
      {
        absl::MutexLock lock(&mu_);
        Entry* e = Find(id);
        if (e == nullptr) {
          return absl::NotFoundError(absl::StrCat("saved tensor ", id, " is gone"));
        }
        if (version != kUnknownVersion && version != e->version) {
          return absl::FailedPreconditionError(absl::StrCat(
              "one of the variables needed for gradient computation has been modified by an "
              "inplace operation: saved at version ",
              e->version, ", is at version ", version, " (tensor saved with actstash hooks)"));
        }
        const bool stored_ok =
            e->owner != nullptr && !e->failed && e->store->Done() && e->store->Wait().ok();
        if (e->owner != nullptr && !stored_ok && (!e->bf16 || e->failed || e->store->Done())) {
          // In flight or kept after a failure: the source has the exact bytes.
          Acquire(e->owner);
          result.kind = UnpackKind::kSource;
          result.owner = e->owner;
          stats_.unpacked_from_source += 1;
          return result;
        }
        if (e->owner == nullptr || stored_ok) break;
        wait_for = e->store;  // a downcast store in flight
      }
      (void)wait_for->Wait();
    }
    absl::MutexLock lock(&mu_);
    Entry* e = Find(id);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat("saved tensor ", id, " is gone"));
    result.nbytes = e->nbytes;
    result.downcast = e->bf16;
    if (e->fetch_owner != nullptr) {
      result.kind = UnpackKind::kPrefetched;
      result.owner = e->fetch_owner;  // the engine's reference becomes the caller's
      e->fetch_owner = nullptr;
      stats_.prefetch_hits += 1;
    } else if (ServedAsView(*e)) {
      absl::StatusOr<StoredBytes> where = client_->Locate(e->ticket);
      if (!where.ok()) return where.status();
      e->busy += 1;
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

  absl::Status FetchInto(uint64_t id, uintptr_t dst, uint64_t capacity, uintptr_t stream) {
    absl::StatusOr<bool> copied = CopyOutNow(id, dst, capacity);
    if (!copied.ok() || *copied) return copied.status();
    CopyEngine* engine = nullptr;
    absl::StatusOr<std::shared_ptr<CopyEvent>> event =
        StartFetch(id, dst, capacity, stream, &engine);
    if (!event.ok()) return event.status();
    return WaitFetch(id, engine, **event, stream);
  }

  absl::Status Prefetch(uint64_t id, uintptr_t dst, uint64_t capacity, void* owner,
                        uintptr_t stream) {
    CopyEngine* engine = nullptr;
    absl::StatusOr<std::shared_ptr<CopyEvent>> event =
        StartFetch(id, dst, capacity, stream, &engine);
    if (!event.ok()) return event.status();
    absl::MutexLock lock(&mu_);
    Entry* e = Find(id);
    Acquire(owner);
    if (e == nullptr || e->released) {
      orphans_.emplace_back(*event, owner);  // the copy may still write it
      return absl::OkStatus();
    }
    if (e->fetch_owner != nullptr) orphans_.emplace_back(e->fetch, e->fetch_owner);
    e->fetch = *event;
    e->fetch_owner = owner;
    stats_.prefetch_issued += 1;
    return absl::OkStatus();
  }

  absl::Status Finish(uint64_t id, uintptr_t stream) {
    std::shared_ptr<CopyEvent> event;
    CopyEngine* engine = nullptr;
    {
      absl::MutexLock lock(&mu_);
      Entry* e = Find(id);
      if (e == nullptr || e->fetch == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("saved tensor ", id, " has no prefetch to finish"));
      }
      event = std::move(e->fetch);
      engine = e->engine;
    }
    return WaitFetch(id, engine, *event, stream);
  }

  void ViewDone(uint64_t id) { Unbusy(id); }

  void Release(uint64_t id) {
    std::vector<void*> owners;
    {
      absl::MutexLock lock(&mu_);
      auto it = entries_.find(id);
      if (it == entries_.end() || it->second.released) return;
      Entry& e = it->second;
      e.released = true;
      e.cookie = nullptr;
      if (!e.failed) {
        stats_.live_tensors -= 1;
        stats_.live_bytes -= e.stored_bytes;
      }
      if (e.fetch_owner != nullptr) {
        orphans_.emplace_back(std::move(e.fetch), e.fetch_owner);  // outlives its copy
        e.fetch_owner = nullptr;
      }
      if (e.owner != nullptr && !e.failed) return;  // the store still reads it: reaped later
      if (e.owner != nullptr) owners.push_back(e.owner);
      e.owner = nullptr;
      if (e.busy == 0) FreeLocked(it);
    }
    ReleaseOwners(owners);
  }

  absl::Status Reap(bool wait) {
    std::vector<std::pair<uint64_t, std::shared_ptr<CopyEvent>>> done;
    std::vector<std::pair<std::shared_ptr<CopyEvent>, void*>> finished_orphans;
    std::vector<void*> owners;
    {
      absl::MutexLock lock(&mu_);
      std::vector<uint64_t> still;
      for (uint64_t id : in_flight_) {
        Entry& e = entries_.at(id);
        if (wait || e.store->Done()) {
          done.emplace_back(id, e.store);
        } else {
          still.push_back(id);
        }
      }
      in_flight_ = std::move(still);
      std::vector<std::pair<std::shared_ptr<CopyEvent>, void*>> keep;
      for (auto& orphan : orphans_) {
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
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < done.size(); ++i) {
        auto it = entries_.find(done[i].first);
        Entry& e = it->second;
        stats_.in_flight -= 1;
        stats_.in_flight_bytes -= e.nbytes;
        if (statuses[i].ok()) {
          owners.push_back(e.owner);  // the daemon has the bytes
          e.owner = nullptr;
          if (e.placed && !e.released) written.push_back(e.ticket);
          if (e.released && e.busy == 0) FreeLocked(it);
          continue;
        }
        stats_.store_failures += 1;
        e.failed = true;
        if (!e.released) {
          stats_.live_tensors -= 1;
          stats_.live_bytes -= e.stored_bytes;
        }
        if (e.placed) FreeTicketLocked(e);  // the reservation exists; nothing good in it
        if (e.released) {
          owners.push_back(e.owner);
          entries_.erase(it);
          continue;  // nobody needs that tensor any more
        }
        HandleFailureLocked(statuses[i]);  // e.owner stays: unpack returns the source
        if (first.ok()) first = statuses[i];
      }
    }
    // A concurrent Release of one of these is answered NOT_FOUND: harmless.
    for (const Ticket& ticket : written) (void)client_->MarkWritten(ticket);
    ReleaseOwners(owners);
    return options_.on_failure == FailurePolicy::kRaise ? first : absl::OkStatus();
  }

  absl::Status TakeError() {
    absl::MutexLock lock(&mu_);
    return std::exchange(pending_error_, absl::OkStatus());
  }

  void NoteUnpinnedDeviceStore() {
    const absl::Status pin = client_->pin_status();  // why, when registering failed
    absl::MutexLock lock(&mu_);
    stats_.unpinned_device_stores += 1;
    if (!unpinned_noted_ && notice_.ok()) {
      unpinned_noted_ = true;
      notice_ = absl::FailedPreconditionError(absl::StrCat(
          "CUDA tensors are copied into leased memory that is not registered with CUDA: those "
          "copies are synchronous (staged by the driver), so forward waits for each "
          "(stats: unpinned_device_stores)",
          pin.ok() ? "" : absl::StrCat("; ", pin.message())));
    }
  }

  absl::Status TakeNotice() {
    absl::MutexLock lock(&mu_);
    return std::exchange(notice_, absl::OkStatus());
  }

  void WaitForCopies() {
    for (CopyEngine* engine : Engines()) engine->Synchronize();
  }

  void Synchronize() {
    for (int round = 0; round < 2; ++round) {  // 2nd: the releases the 1st queued
      WaitForCopies();
      (void)Reap(/*wait=*/true);
    }
  }

  EngineStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

  bool available() const {
    absl::MutexLock lock(&mu_);
    return available_;
  }

 private:
  bool ServedAsView(const Entry& e) const {
    return e.placed && e.device < 0 && options_.cpu_views && !e.bf16 &&
           e.nbytes >= options_.view_min_bytes;
  }

  Entry* Find(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = entries_.find(id);
    return it == entries_.end() || it->second.released ? nullptr : &it->second;
  }

  void Acquire(void* owner) const {
    if (owner != nullptr && options_.acquire_owner != nullptr) options_.acquire_owner(owner);
  }

  void ReleaseOwners(const std::vector<void*>& owners) const {
    if (options_.release_owner == nullptr) return;
    for (void* owner : owners) {
      if (owner != nullptr) options_.release_owner(owner);
    }
  }

  bool StoresInFlight() {
    absl::MutexLock lock(&mu_);
    return !in_flight_.empty();
  }

  // The store events of the oldest stores in flight, oldest first, until
  // what would remain (bytes and count) leaves room for `nbytes` more under
  // `max_bytes` and fewer than `max_stores` stores. max_stores 0: every
  // event; UINT64_MAX: no bound.
  std::vector<std::shared_ptr<CopyEvent>> StoreEvents(uint64_t max_bytes, uint64_t nbytes,
                                                      uint64_t max_stores) {
    absl::MutexLock lock(&mu_);
    std::vector<std::shared_ptr<CopyEvent>> events;
    uint64_t bytes = stats_.in_flight_bytes;
    uint64_t stores = in_flight_.size();
    for (uint64_t id : in_flight_) {
      if (bytes + nbytes <= max_bytes && stores < max_stores) break;
      const Entry& e = entries_.at(id);
      events.push_back(e.store);
      bytes -= e.nbytes;
      stores -= 1;
    }
    return events;
  }

  // Waits for `events` with the caller's locks let go (EngineOptions::
  // unlock_caller); no engine lock held, no owner touched.
  void WaitUnlocked(const std::vector<std::shared_ptr<CopyEvent>>& events) {
    if (events.empty()) return;
    void* token = options_.unlock_caller != nullptr ? options_.unlock_caller() : nullptr;
    for (const std::shared_ptr<CopyEvent>& event : events) event->Wait().IgnoreError();
    if (options_.relock_caller != nullptr) options_.relock_caller(token);
  }

  // The in-flight bound (EngineOptions::max_in_flight_bytes): waits for the
  // oldest stores until `info` fits. True when it waited.
  bool WaitForRoom(const SavedTensorInfo& info) {
    const uint64_t max_bytes =
        options_.max_in_flight_bytes == 0 ? ~uint64_t{0} : options_.max_in_flight_bytes;
    const uint64_t max_stores =
        options_.max_in_flight_stores == 0 ? ~uint64_t{0} : options_.max_in_flight_stores;
    // A store larger than the bound goes alone: wait for all before it.
    const uint64_t nbytes = std::min(info.nbytes, max_bytes);
    std::vector<std::shared_ptr<CopyEvent>> oldest = StoreEvents(max_bytes, nbytes, max_stores);
    if (oldest.empty()) return false;
    const Clock::time_point start = Clock::now();
    WaitUnlocked(oldest);
    const auto waited =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    absl::MutexLock lock(&mu_);
    stats_.in_flight_waits += 1;
    stats_.in_flight_wait_ns += static_cast<uint64_t>(waited);
    return true;
  }

  void ReapNoError(bool wait = false) {
    absl::Status status = Reap(wait);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      if (pending_error_.ok()) pending_error_ = status;
    }
  }

  // The reason to keep `info`, or kCount to store it (with the engine for
  // its device in *engine).
  KeepReason Decide(const SavedTensorInfo& info, uint64_t min_bytes, CopyEngine** engine)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (client_ == nullptr) return KeepReason::kUnavailable;
    if (!available_ || !pending_error_.ok()) return KeepReason::kFailed;
    if (info.nbytes == 0 || info.nbytes < std::max<uint64_t>(min_bytes, 1)) {
      return KeepReason::kSmall;
    }
    if (!info.dense &&
        (info.ndim > kernels::kMaxDims || info.sizes == nullptr || info.strides == nullptr)) {
      return KeepReason::kLayout;
    }
    if (info.device < 0) {
      *engine = options_.host_engine.get();
      return KeepReason::kCount;
    }
    if (!options_.cuda || !client_->attached()) return KeepReason::kDevice;
    *engine = CudaEngineLocked(info.device);
    if (*engine != nullptr) return KeepReason::kCount;
    return info.device < 64 && cuda_failed_[info.device] ? KeepReason::kNoCopyEngine
                                                         : KeepReason::kDevice;
  }

  CopyEngine* CudaEngineLocked(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (device >= 64) return nullptr;
    if (static_cast<size_t>(device) >= cuda_engines_.size()) cuda_engines_.resize(device + 1);
    if (cuda_engines_[device] == nullptr && !cuda_tried_[device]) {
      cuda_tried_[device] = true;
      CudaCopyEngineOptions cuda;
      cuda.device = device;
      absl::StatusOr<std::unique_ptr<CopyEngine>> created = CreateCudaCopyEngine(cuda);
      if (created.ok()) {
        cuda_engines_[device] = std::move(*created);
      } else {
        // Not silent: every CUDA tensor of this GPU would stay on it.
        cuda_failed_[device] = true;
        const absl::Status why(
            created.status().code(),
            absl::StrCat("the CUDA copy engine for GPU ", device, " could not be created (",
                         created.status().message(),
                         "): CUDA tensors on that GPU stay there (stats: kept_no_copy_engine)"));
        if (options_.on_failure == FailurePolicy::kRaise) {
          if (pending_error_.ok()) pending_error_ = why;
        } else if (notice_.ok()) {
          notice_ = why;
        }
      }
    }
    return cuda_engines_[device].get();
  }

  std::vector<CopyEngine*> Engines() {
    absl::MutexLock lock(&mu_);
    std::vector<CopyEngine*> engines{options_.host_engine.get()};
    for (const auto& engine : cuda_engines_) {
      if (engine != nullptr) engines.push_back(engine.get());
    }
    return engines;
  }

  void CountKept(uint64_t nbytes, KeepReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stats_.tensors_kept += 1;
    stats_.bytes_kept += nbytes;
    stats_.kept_by_reason[static_cast<int>(reason)] += 1;
  }

  void HandleFailureLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.on_failure == FailurePolicy::kKeep) {
      available_ = false;
    } else if (pending_error_.ok()) {
      pending_error_ = status;
    }
  }

  uint64_t Store(const SavedTensorInfo& info, CopyEngine* engine);
  // The fetch's event, and the engine it runs on in *engine.
  absl::StatusOr<std::shared_ptr<CopyEvent>> StartFetch(uint64_t id, uintptr_t dst,
                                                        uint64_t capacity, uintptr_t stream,
                                                        CopyEngine** engine);
  // A CPU tensor whose store is done: copied (or converted) into `dst` on
  // the calling thread. False when it must go through the engine.
  absl::StatusOr<bool> CopyOutNow(uint64_t id, uintptr_t dst, uint64_t capacity);
  absl::Status WaitFetch(uint64_t id, CopyEngine* engine, const CopyEvent& event, uintptr_t stream);
  void OfferPrefetch(uint64_t id, int depth, UnpackResult* result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unbusy(uint64_t id);
  void FreeLocked(absl::flat_hash_map<uint64_t, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeTicketLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<Client> client_;
  mutable absl::Mutex mu_;
  const EngineOptions options_;  // host_engine always set
  std::vector<std::shared_ptr<CopyEngine>> cuda_engines_ ABSL_GUARDED_BY(mu_);  // by device
  bool cuda_tried_[64] ABSL_GUARDED_BY(mu_) = {};
  bool cuda_failed_[64] ABSL_GUARDED_BY(mu_) = {};    // tried, and creation failed
  absl::Status notice_ ABSL_GUARDED_BY(mu_);          // for TakeNotice
  bool unpinned_noted_ ABSL_GUARDED_BY(mu_) = false;  // its notice was given
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> in_flight_ ABSL_GUARDED_BY(mu_);  // ids of asynchronous stores
  // Destinations of fetches whose saved tensor is gone: held until the copy is done.
  std::vector<std::pair<std::shared_ptr<CopyEvent>, void*>> orphans_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool available_ ABSL_GUARDED_BY(mu_) = true;
  absl::Status pending_error_ ABSL_GUARDED_BY(mu_);
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
};

namespace {

// Copies a CPU tensor into reserved memory on the calling thread.
absl::Status CopyNow(const SavedTensorInfo& info, bool bf16, void* dst, uint64_t dst_bytes) {
  const void* src = reinterpret_cast<const void*>(info.data);
  if (info.dense && !bf16) {
    std::memcpy(dst, src, info.nbytes);
    return absl::OkStatus();
  }
  if (info.dense) {
    kernels::Fp32ToBf16Cpu(static_cast<const float*>(src), static_cast<uint16_t*>(dst),
                           info.nbytes / 4);
    return absl::OkStatus();
  }
  kernels::StridedLayout layout{};
  layout.ndim = info.ndim;
  layout.elem_size = info.element_size;
  for (int d = 0; d < info.ndim; ++d) {
    layout.sizes[d] = info.sizes[d];
    layout.strides[d] = info.strides[d];
  }
  return kernels::GatherCpu(src, layout, dst, dst_bytes);
}

TensorLayout LayoutOf(const SavedTensorInfo& info) {
  TensorLayout layout;
  layout.sizes.assign(info.sizes, info.sizes + info.ndim);
  layout.strides.assign(info.strides, info.strides + info.ndim);
  layout.element_size = info.element_size;
  return layout;
}

}  // namespace

uint64_t SavedTensorEngine::Impl::Store(const SavedTensorInfo& info, CopyEngine* engine) {
  Entry e;
  e.nbytes = info.nbytes;
  e.device = info.device;
  e.engine = engine;
  e.version = info.version;
  e.cookie = info.cookie;
  const bool attached = client_->attached();
  e.bf16 = options_.downcast_bf16 && info.is_fp32 && info.dense && attached;
  e.stored_bytes = e.bf16 ? info.nbytes / 2 : info.nbytes;
  bool inline_store = false;
  absl::Status status;
  if (attached) {
    const bool to_pool =
        info.device >= 0 && options_.device_pool >= 0 && info.device == options_.pool_importer;
    auto reserve = [&] {
      return to_pool ? client_->ReserveOnDevice(e.stored_bytes, options_.device_pool)
                     : client_->Reserve(e.stored_bytes);
    };
    absl::StatusOr<Reservation> reserved = reserve();
    if (!reserved.ok() && reserved.status().code() == absl::StatusCode::kResourceExhausted &&
        StoresInFlight()) {
      // A buffer whose copy still runs cannot be spilled to the daemon's
      // disk: wait for those copies (they become spillable), then try again.
      WaitUnlocked(StoreEvents(/*max_bytes=*/0, /*nbytes=*/0, /*max_stores=*/0));  // all
      ReapNoError();
      reserved = reserve();
    }
    if (reserved.ok() && info.device >= 0 && e.bf16 && !reserved->pinned && !reserved->on_device) {
      // The conversion kernel writes host memory only when it is registered:
      // store the exact bytes instead.
      (void)client_->Release(reserved->ticket);
      e.bf16 = false;
      e.stored_bytes = info.nbytes;
      reserved = client_->Reserve(e.stored_bytes);
    }
    status = reserved.status();
    if (status.ok()) {
      e.placed = true;
      e.ticket = reserved->ticket;
      if (info.device < 0 && (info.sync || e.stored_bytes <= options_.inline_store_bytes)) {
        status = CopyNow(info, e.bf16, reserved->data, e.stored_bytes);
        if (status.ok()) (void)client_->MarkWritten(e.ticket);  // spillable from now on
        inline_store = true;
      } else if (info.device >= 0 && !info.dense && !reserved->pinned && !reserved->on_device) {
        // A GPU kernel cannot gather into unpinned host memory.
        (void)client_->Release(e.ticket);
        absl::MutexLock lock(&mu_);
        CountKept(info.nbytes, KeepReason::kLayout);
        return 0;
      } else {
        if (info.device >= 0 && !reserved->pinned && !reserved->on_device) {
          // Not silent: this copy is synchronous (driver-staged).
          NoteUnpinnedDeviceStore();
        }
        const StreamHandle after{info.stream};
        void* dst = reserved->data;
        const void* src = reinterpret_cast<const void*>(info.data);
        absl::StatusOr<std::shared_ptr<CopyEvent>> event =
            !info.dense ? engine->GatherAsync(CopyStream::kStore, dst, e.stored_bytes, src,
                                              LayoutOf(info), after)
            : e.bf16    ? engine->ConvertAsync(CopyStream::kStore, dst, src, info.nbytes / 4,
                                               Conversion::kFp32ToBf16, after)
                        : engine->CopyAsync(CopyStream::kStore, dst, src, info.nbytes, after);
        status = event.status();
        if (status.ok()) e.store = *std::move(event);
        if (status.ok() && info.sync) {
          // The producer's stream (device: no host wait) goes on after the copy.
          status = engine->OrderAfterAsync(after, *e.store);
          if (!status.ok()) e.store->Wait().IgnoreError();  // the copy still reads it
        }
      }
      if (!status.ok()) (void)client_->Release(e.ticket);  // nothing was written or enqueued
    }
  } else {
    // Through Client::Store (the inline gRPC path): CPU tensors only.
    auto ticket = std::make_shared<InlineTicket>();
    e.inline_ticket = ticket;
    std::shared_ptr<std::vector<char>> packed;
    const void* src = reinterpret_cast<const void*>(info.data);
    if (!info.dense) {
      packed = std::make_shared<std::vector<char>>(info.nbytes);
      status = CopyNow(info, false, packed->data(), info.nbytes);
      src = packed->data();
    }
    if (status.ok()) {
      e.store = engine->SubmitAsync(
          CopyStream::kStore,
          [client = client_, src, nbytes = info.nbytes, ticket, packed]() -> absl::Status {
            absl::StatusOr<Ticket> stored = client->Store(src, nbytes);
            if (!stored.ok()) return stored.status();
            ticket->ticket = *stored;
            return absl::OkStatus();
          });
      if (info.sync) (void)e.store->Wait();  // a failure is reaped like any other
    }
  }
  absl::MutexLock lock(&mu_);
  if (!status.ok()) {
    HandleFailureLocked(status);
    CountKept(info.nbytes, KeepReason::kFailed);
    return 0;
  }
  if (e.store != nullptr) {
    e.owner = info.owner;  // read by the copy: held until it is done
    Acquire(e.owner);
    stats_.in_flight += 1;
    stats_.in_flight_bytes += e.nbytes;
    stats_.peak_in_flight_bytes = std::max(stats_.peak_in_flight_bytes, stats_.in_flight_bytes);
  }
  const uint64_t id = next_id_++;
  if (e.store != nullptr) in_flight_.push_back(id);
  entries_.emplace(id, std::move(e));
  stats_.inline_stores += inline_store ? 1 : 0;
  stats_.tensors_offloaded += 1;
  stats_.bytes_offloaded += entries_[id].stored_bytes;
  stats_.live_tensors += 1;
  stats_.live_bytes += entries_[id].stored_bytes;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  return id;
}

absl::StatusOr<std::shared_ptr<CopyEvent>> SavedTensorEngine::Impl::StartFetch(
    uint64_t id, uintptr_t dst, uint64_t capacity, uintptr_t stream, CopyEngine** engine) {
  Entry copy;
  {
    absl::MutexLock lock(&mu_);
    Entry* e = Find(id);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat("saved tensor ", id, " is gone"));
    if (e->failed) {
      return absl::FailedPreconditionError(
          absl::StrCat("saved tensor ", id, " was not stored (its store failed)"));
    }
    if (capacity < e->nbytes) {
      return absl::OutOfRangeError(absl::StrCat("saved tensor ", id, " holds ", e->nbytes,
                                                " bytes; the destination holds ", capacity));
    }
    e->busy += 1;
    e->fetch_queued = true;
    copy.placed = e->placed;
    copy.bf16 = e->bf16;
    copy.engine = e->engine;
    copy.ticket = e->ticket;
    copy.inline_ticket = e->inline_ticket;
    copy.store = e->store;
    copy.stored_bytes = e->stored_bytes;
    *engine = e->engine;
  }
  absl::StatusOr<std::shared_ptr<CopyEvent>> event;
  void* out = reinterpret_cast<void*>(dst);
  if (copy.placed) {
    absl::StatusOr<StoredBytes> where = client_->Locate(copy.ticket);
    if (!where.ok()) {
      event = where.status();
    } else {
      std::vector<std::shared_ptr<CopyEvent>> deps;
      if (copy.store != nullptr) deps.push_back(copy.store);
      event = copy.bf16 ? copy.engine->ConvertAsync(CopyStream::kFetch, out, where->data,
                                                    copy.stored_bytes / 2, Conversion::kBf16ToFp32,
                                                    StreamHandle{stream}, deps)
                        : copy.engine->CopyAsync(CopyStream::kFetch, out, where->data,
                                                 copy.stored_bytes, StreamHandle{stream}, deps);
    }
  } else {
    event = copy.engine->SubmitAsync(CopyStream::kFetch,
                                     [client = client_, ticket = copy.inline_ticket,
                                      store = copy.store, out, capacity]() -> absl::Status {
                                       if (absl::Status s = store->Wait(); !s.ok()) return s;
                                       return client->Fetch(ticket->ticket, out, capacity);
                                     });
  }
  Unbusy(id);
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
    if (e == nullptr || e->device >= 0 || !e->placed || e->owner != nullptr || e->failed) {
      return false;
    }
    if (capacity < e->nbytes) {
      return absl::OutOfRangeError(absl::StrCat("saved tensor ", id, " holds ", e->nbytes,
                                                " bytes; the destination holds ", capacity));
    }
    e->busy += 1;
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
  Unbusy(id);
  if (!where.ok()) return where.status();
  absl::MutexLock lock(&mu_);
  stats_.tensors_fetched += 1;
  stats_.bytes_fetched += nbytes;
  return true;
}

absl::Status SavedTensorEngine::Impl::WaitFetch(uint64_t id, CopyEngine* engine,
                                                const CopyEvent& event, uintptr_t stream) {
  // Ordered (CPU: waited for) even if `id` was released meanwhile: the
  // caller's destination must not be freed under the copy.
  const Clock::time_point start = Clock::now();
  absl::Status status = engine->OrderAfterAsync(StreamHandle{stream}, event);
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
    if (e == nullptr || e->prefetch_offered || e->owner != nullptr || e->failed ||
        e->fetch_owner != nullptr || e->cookie == nullptr) {
      continue;
    }
    // CPU tensors are read in place or copied on the unpacking thread when
    // needed: a prefetch on a copy thread would only add a hand-off.
    if (e->device < 0) continue;
    e->prefetch_offered = true;
    Acquire(e->cookie);
    result->prefetch_cookies.push_back(e->cookie);
    result->prefetch_ids.push_back(i);
    ++offered;
  }
}

void SavedTensorEngine::Impl::Unbusy(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  e.busy -= 1;
  if (e.busy == 0 && e.released && e.owner == nullptr) FreeLocked(it);
}

void SavedTensorEngine::Impl::FreeLocked(absl::flat_hash_map<uint64_t, Entry>::iterator it) {
  Entry& e = it->second;
  if (!e.failed) FreeTicketLocked(e);
  entries_.erase(it);
}

void SavedTensorEngine::Impl::FreeTicketLocked(Entry& e) {
  if (e.placed && !e.fetch_queued && e.device < 0) {
    (void)client_->Release(e.ticket);  // no copy uses it: an arena free
    return;
  }
  // Behind the fetches of it (FIFO fetch stream), so no copy still reads it.
  if (e.placed) {
    e.engine->SubmitAsync(CopyStream::kFetch, [client = client_, ticket = e.ticket]() {
      return client->Release(ticket);
    });
  } else {
    e.engine->SubmitAsync(CopyStream::kFetch,
                          [client = client_, ticket = e.inline_ticket, store = e.store]() {
                            if (!store->Wait().ok()) return absl::OkStatus();
                            return client->Release(ticket->ticket);
                          });
  }
}

// --- SavedTensorEngine -----------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SavedTensorEngine>> SavedTensorEngine::Create(
    std::shared_ptr<Client> client, EngineOptions options) {
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
                                          uintptr_t stream) {
  return impl_->FetchInto(id, dst, capacity, stream);
}
absl::Status SavedTensorEngine::Prefetch(uint64_t id, uintptr_t dst, uint64_t capacity, void* owner,
                                         uintptr_t stream) {
  return impl_->Prefetch(id, dst, capacity, owner, stream);
}
absl::Status SavedTensorEngine::Finish(uint64_t id, uintptr_t stream) {
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

namespace {

using Counter = uint64_t EngineStats::*;
struct NamedCounter {
  const char* name;
  Counter counter;
};
// EngineStats' scalar counters before and after kept_by_reason, in
// declaration order: the one table behind both EngineStatNames and
// EngineStatValues.
constexpr NamedCounter kCountersBefore[] = {{"tensors_offloaded", &EngineStats::tensors_offloaded},
                                            {"bytes_offloaded", &EngineStats::bytes_offloaded},
                                            {"tensors_kept", &EngineStats::tensors_kept},
                                            {"bytes_kept", &EngineStats::bytes_kept}};
constexpr NamedCounter kCountersAfter[] = {
    {"tensors_fetched", &EngineStats::tensors_fetched},
    {"bytes_fetched", &EngineStats::bytes_fetched},
    {"views", &EngineStats::views},
    {"prefetch_issued", &EngineStats::prefetch_issued},
    {"prefetch_hits", &EngineStats::prefetch_hits},
    {"unpacked_from_source", &EngineStats::unpacked_from_source},
    {"store_failures", &EngineStats::store_failures},
    {"live_tensors", &EngineStats::live_tensors},
    {"live_bytes", &EngineStats::live_bytes},
    {"peak_live_bytes", &EngineStats::peak_live_bytes},
    {"in_flight", &EngineStats::in_flight},
    {"inline_stores", &EngineStats::inline_stores},
    {"wait_ns", &EngineStats::wait_ns},
    {"in_flight_bytes", &EngineStats::in_flight_bytes},
    {"peak_in_flight_bytes", &EngineStats::peak_in_flight_bytes},
    {"in_flight_waits", &EngineStats::in_flight_waits},
    {"in_flight_wait_ns", &EngineStats::in_flight_wait_ns},
    {"unpinned_device_stores", &EngineStats::unpinned_device_stores}};
constexpr const char* kKeepReasonNames[] = {"small",  "parameter", "keep_listed", "layout",
                                            "device", "failed",    "unavailable", "no_copy_engine"};
static_assert(std::size(kKeepReasonNames) == static_cast<size_t>(KeepReason::kCount));
// Every uint64_t of EngineStats is in the table (it holds nothing else).
static_assert(sizeof(EngineStats) ==
              sizeof(uint64_t) * (std::size(kCountersBefore) + std::size(kCountersAfter) +
                                  static_cast<size_t>(KeepReason::kCount)));

}  // namespace

const char* KeepReasonName(KeepReason reason) {
  const int i = static_cast<int>(reason);
  return i >= 0 && i < static_cast<int>(KeepReason::kCount) ? kKeepReasonNames[i] : "";
}

const std::vector<std::string>& EngineStatNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const NamedCounter& c : kCountersBefore) out.emplace_back(c.name);
    for (const char* reason : kKeepReasonNames) out.push_back(absl::StrCat("kept_", reason));
    for (const NamedCounter& c : kCountersAfter) out.emplace_back(c.name);
    return out;
  }();
  return names;
}

std::vector<uint64_t> EngineStatValues(const EngineStats& s) {
  std::vector<uint64_t> values;
  values.reserve(EngineStatNames().size());
  for (const NamedCounter& c : kCountersBefore) values.push_back(s.*c.counter);
  values.insert(values.end(), std::begin(s.kept_by_reason), std::end(s.kept_by_reason));
  for (const NamedCounter& c : kCountersAfter) values.push_back(s.*c.counter);
  return values;
}

}  // namespace actstash
