// SavedTensorEngine::Impl, deciding and storing: Pack, the keep decision,
// the in-flight bound, and the store by transport (leased shared memory when
// attached, Client::Store otherwise). See saved_tensor_engine_impl.h.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/engine/saved_tensor_engine_impl.h"
#include "kernels/bf16.h"
#include "kernels/strided_copy.h"
#include "kernels/strided_layout.h"

namespace actstash {
namespace {

using client_internal::Transport;
using Clock = std::chrono::steady_clock;

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

uint64_t SavedTensorEngine::Impl::Pack(const SavedTensorInfo& info, KeepReason keep,
                                       uint64_t min_bytes) {
  ReapNoError();
  CopyEngine* engine = nullptr;
  {
    absl::MutexLock lock(&mu_);
    const KeepReason reason = Decide(info, keep, min_bytes, &engine);
    if (reason != KeepReason::kCount) {
      CountKept(info.nbytes, reason);
      return 0;
    }
  }
  Entry e;
  e.transport = client_->attached() ? Transport::kLeased : Transport::kRpc;
  e.nbytes = info.nbytes;
  e.device = info.device;
  e.engine = engine;
  e.version = info.version;
  e.cookie = info.cookie;
  e.bf16 =
      options_.downcast_bf16 && info.is_fp32 && info.dense && e.transport == Transport::kLeased;
  e.stored_bytes = e.bf16 ? info.nbytes / 2 : info.nbytes;
  // Only a store that will be in flight waits for room (a store on this
  // thread is done when it returns).
  if (!CopiesOnPackingThread(options_, info, e) && WaitForRoom(info)) {
    ReapNoError();  // the sources of what finished go now
  }
  KeepReason kept = KeepReason::kCount;
  const absl::Status status = e.transport == Transport::kLeased
                                  ? StoreLeased(info, engine, e, &kept)
                                  : StoreByRpc(info, engine, e);
  absl::MutexLock lock(&mu_);
  if (!status.ok()) {
    HandleFailureLocked(status);
    kept = KeepReason::kFailed;
  }
  if (kept != KeepReason::kCount) {
    CountKept(info.nbytes, kept);
    return 0;
  }
  return Admit(info, std::move(e));
}

bool SavedTensorEngine::Impl::CopiesOnPackingThread(const EngineOptions& options,
                                                    const SavedTensorInfo& info, const Entry& e) {
  // A simulated link takes every CPU store (inline_store_bytes is 0 then).
  return e.transport == Transport::kLeased && info.device < 0 &&
         (info.sync ? options.simulated_link_bytes_per_second == 0
                    : e.stored_bytes <= options.inline_store_bytes);
}

KeepReason SavedTensorEngine::Impl::Decide(const SavedTensorInfo& info, KeepReason keep,
                                           uint64_t min_bytes, CopyEngine** engine) {
  // The one order of the reasons, whichever front-end asks: size, then what
  // only the front-end sees, then the engine's own state, layout and device.
  if (info.nbytes == 0 || info.nbytes < std::max<uint64_t>(min_bytes, 1)) {
    return KeepReason::kSmall;
  }
  if (keep != KeepReason::kCount) return keep;
  if (client_ == nullptr) return KeepReason::kUnavailable;
  if (!available_ || !pending_error_.ok()) return KeepReason::kFailed;
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

CopyEngine* SavedTensorEngine::Impl::CudaEngineLocked(int device) {
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

std::vector<std::shared_ptr<CopyEvent>> SavedTensorEngine::Impl::StoreEvents(uint64_t max_bytes,
                                                                             uint64_t nbytes,
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

void SavedTensorEngine::Impl::WaitUnlocked(const std::vector<std::shared_ptr<CopyEvent>>& events) {
  if (events.empty()) return;
  void* token = options_.unlock_caller != nullptr ? options_.unlock_caller() : nullptr;
  for (const std::shared_ptr<CopyEvent>& event : events) event->Wait().IgnoreError();
  if (options_.relock_caller != nullptr) options_.relock_caller(token);
}

bool SavedTensorEngine::Impl::WaitForRoom(const SavedTensorInfo& info) {
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

absl::StatusOr<Reservation> SavedTensorEngine::Impl::ReserveFor(const SavedTensorInfo& info,
                                                                const Entry& e) {
  const bool to_pool =
      info.device >= 0 && options_.device_pool >= 0 && info.device == options_.pool_importer;
  auto reserve = [&] {
    return to_pool ? client_->ReserveOnDevice(e.stored_bytes, options_.device_pool)
                   : client_->Reserve(e.stored_bytes);
  };
  absl::StatusOr<Reservation> reserved = reserve();
  if (!reserved.ok() && reserved.status().code() == absl::StatusCode::kResourceExhausted &&
      StoresInFlight()) {
    // A buffer whose copy still runs cannot be spilled to the daemon's disk:
    // wait for those copies (they become spillable), then try again.
    WaitUnlocked(StoreEvents(/*max_bytes=*/0, /*nbytes=*/0, /*max_stores=*/0));  // all
    ReapNoError();
    reserved = reserve();
  }
  return reserved;
}

absl::Status SavedTensorEngine::Impl::StoreLeased(const SavedTensorInfo& info, CopyEngine* engine,
                                                  Entry& e, KeepReason* kept) {
  absl::StatusOr<Reservation> reserved = ReserveFor(info, e);
  if (reserved.ok() && info.device >= 0 && e.bf16 && !reserved->pinned && !reserved->on_device) {
    // The conversion kernel writes host memory only when it is registered:
    // store the exact bytes instead.
    (void)client_->Release(reserved->ticket);
    e.bf16 = false;
    e.stored_bytes = info.nbytes;
    reserved = client_->Reserve(e.stored_bytes);
  }
  if (!reserved.ok()) return reserved.status();
  e.ticket = reserved->ticket;
  const bool registered = reserved->pinned || reserved->on_device;
  absl::Status status;
  if (CopiesOnPackingThread(options_, info, e)) {
    status = CopyNow(info, e.bf16, reserved->data, e.stored_bytes);
    if (status.ok()) (void)client_->MarkWritten(e.ticket);  // spillable from now on
  } else if (info.device >= 0 && !info.dense && !registered) {
    // A GPU kernel cannot gather into unpinned host memory.
    (void)client_->Release(e.ticket);
    *kept = KeepReason::kLayout;
    return absl::OkStatus();
  } else {
    // Not silent: a device copy into unregistered memory is synchronous
    // (staged by the driver).
    if (info.device >= 0 && !registered) NoteUnpinnedDeviceStore();
    const StreamHandle after = info.stream;
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
  return status;
}

absl::Status SavedTensorEngine::Impl::StoreByRpc(const SavedTensorInfo& info, CopyEngine* engine,
                                                 Entry& e) {
  // CPU tensors only (Decide keeps device tensors of unattached clients).
  auto ticket = std::make_shared<client_internal::RpcTicket>();
  e.rpc_ticket = ticket;
  std::shared_ptr<std::vector<char>> packed;
  const void* src = reinterpret_cast<const void*>(info.data);
  if (!info.dense) {
    packed = std::make_shared<std::vector<char>>(info.nbytes);
    if (absl::Status s = CopyNow(info, false, packed->data(), info.nbytes); !s.ok()) return s;
    src = packed->data();
  }
  e.store = engine->SubmitAsync(
      CopyStream::kStore,
      [client = client_, src, nbytes = info.nbytes, ticket, packed]() -> absl::Status {
        absl::StatusOr<Ticket> stored = client->Store(src, nbytes);
        if (!stored.ok()) return stored.status();
        ticket->ticket = *stored;
        return absl::OkStatus();
      });
  if (info.sync) (void)e.store->Wait();  // a failure is reaped like any other
  return absl::OkStatus();
}

uint64_t SavedTensorEngine::Impl::Admit(const SavedTensorInfo& info, Entry e) {
  const uint64_t id = next_id_++;
  if (e.store != nullptr) {
    e.state = client_internal::SavedState::kStoring;
    e.owner = info.owner;  // read by the copy: held until it is done
    Acquire(e.owner);
    in_flight_.push_back(id);
    stats_.in_flight += 1;
    stats_.in_flight_bytes += e.nbytes;
    stats_.peak_in_flight_bytes = std::max(stats_.peak_in_flight_bytes, stats_.in_flight_bytes);
  } else {
    e.state = client_internal::SavedState::kStored;
    stats_.inline_stores += 1;
  }
  stats_.tensors_offloaded += 1;
  stats_.bytes_offloaded += e.stored_bytes;
  stats_.live_tensors += 1;
  stats_.live_bytes += e.stored_bytes;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  entries_.emplace(id, std::move(e));
  return id;
}

void SavedTensorEngine::Impl::NoteUnpinnedDeviceStore() {
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

}  // namespace actstash
