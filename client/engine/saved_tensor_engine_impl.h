// SavedTensorEngine::Impl (actstash/saved_tensors.h), in three rooms:
// saved_tensor_pack.cc decides and stores (by transport), saved_tensor_engine.cc
// unpacks, releases and reaps, engine_stats.cc names the counters. Every
// saved tensor's state moves only through Move (the table of
// saved_tensor_state.h).
//
// Locking: one mutex (mu_) guards the table of saved tensors, the stats and
// the pending error. Copies run on CopyEngine streams and never touch the
// table. Owners are acquired with mu_ held (a reference count: never
// re-enters) and released only after mu_ is dropped, on the calling thread.
// No method waits for a copy with mu_ held.
#ifndef ACTSTASH_CLIENT_ENGINE_SAVED_TENSOR_ENGINE_IMPL_H_
#define ACTSTASH_CLIENT_ENGINE_SAVED_TENSOR_ENGINE_IMPL_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "actstash/saved_tensors.h"
#include "client/engine/saved_tensor_state.h"

namespace actstash {

class SavedTensorEngine::Impl {
 public:
  Impl(std::shared_ptr<Client> client, EngineOptions options);
  ~Impl();

  // saved_tensor_pack.cc
  uint64_t Pack(const SavedTensorInfo& info, KeepReason keep, uint64_t min_bytes);

  // saved_tensor_engine.cc
  absl::StatusOr<UnpackResult> UnpackBegin(uint64_t id, uint64_t version, int max_prefetch);
  absl::Status FetchInto(uint64_t id, uintptr_t dst, uint64_t capacity, StreamHandle stream);
  absl::Status Prefetch(uint64_t id, uintptr_t dst, uint64_t capacity, void* owner,
                        StreamHandle stream);
  absl::Status Finish(uint64_t id, StreamHandle stream);
  void ViewDone(uint64_t id) { Unuse(id); }
  void Release(uint64_t id);
  absl::Status Reap(bool wait);
  absl::Status TakeError();
  absl::Status TakeNotice();
  void WaitForCopies();
  void Synchronize();
  EngineStats stats() const;
  bool available() const;

 private:
  using Entry = client_internal::SavedEntry;
  using Entries = absl::flat_hash_map<uint64_t, Entry>;
  // A destination whose saved tensor is gone, held until the copy into it ends.
  using Orphan = std::pair<std::shared_ptr<CopyEvent>, void*>;

  // --- saved_tensor_pack.cc: deciding and storing ---------------------------
  // The inline rule: small CPU stores and sync stores into leased memory are
  // copied on the packing thread (no hand-off, never in flight).
  static bool CopiesOnPackingThread(const EngineOptions& options, const SavedTensorInfo& info,
                                    const Entry& e);
  // The reason to keep `info` (`keep`: the front-end's, kCount for none), or
  // kCount to store it (with the engine for its device in *engine).
  KeepReason Decide(const SavedTensorInfo& info, KeepReason keep, uint64_t min_bytes,
                    CopyEngine** engine) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  CopyEngine* CudaEngineLocked(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The in-flight bound (EngineOptions::max_in_flight_bytes): waits for the
  // oldest stores until `info` fits. True when it waited.
  bool WaitForRoom(const SavedTensorInfo& info) ABSL_LOCKS_EXCLUDED(mu_);
  // The store events of the oldest stores in flight, oldest first, until
  // what would remain (bytes and count) leaves room for `nbytes` more under
  // `max_bytes` and fewer than `max_stores` stores. max_stores 0: every
  // event; UINT64_MAX: no bound.
  std::vector<std::shared_ptr<CopyEvent>> StoreEvents(uint64_t max_bytes, uint64_t nbytes,
                                                      uint64_t max_stores) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for `events` with the caller's locks let go (EngineOptions::
  // unlock_caller); no engine lock held, no owner touched.
  void WaitUnlocked(const std::vector<std::shared_ptr<CopyEvent>>& events) ABSL_LOCKS_EXCLUDED(mu_);
  // Fills `e` (Transport::kLeased): reserves (after the stores in flight
  // when the pool is full), then copies on this thread (small CPU tensors,
  // sync stores) or enqueues the copy. *kept: the tensor is kept after all
  // with that reason (no error). Nothing reserved stays behind an error.
  absl::Status StoreLeased(const SavedTensorInfo& info, CopyEngine* engine, Entry& e,
                           KeepReason* kept) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Reservation> ReserveFor(const SavedTensorInfo& info, const Entry& e)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Fills `e` (Transport::kRpc): Client::Store on the engine's store stream.
  absl::Status StoreByRpc(const SavedTensorInfo& info, CopyEngine* engine, Entry& e);
  // Enters a stored (or storing) tensor in the table; its id.
  uint64_t Admit(const SavedTensorInfo& info, Entry e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteUnpinnedDeviceStore() ABSL_LOCKS_EXCLUDED(mu_);

  // --- saved_tensor_engine.cc: unpacking, releasing, reaping ----------------
  // The one place a state changes (CHECKs the edge is in the table).
  static void Move(Entry& e, client_internal::SavedEvent event);
  bool ServedAsView(const Entry& e) const;
  Entry* Find(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // null when gone or released
  void Acquire(void* owner) const;
  void ReleaseOwners(const std::vector<void*>& owners) const ABSL_LOCKS_EXCLUDED(mu_);
  bool StoresInFlight() ABSL_LOCKS_EXCLUDED(mu_);
  void ReapNoError(bool wait = false) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<CopyEngine*> Engines() ABSL_LOCKS_EXCLUDED(mu_);
  void CountKept(uint64_t nbytes, KeepReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleFailureLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The fetch's event, and the engine it runs on in *engine.
  absl::StatusOr<std::shared_ptr<CopyEvent>> StartFetch(uint64_t id, uintptr_t dst,
                                                        uint64_t capacity, StreamHandle stream,
                                                        CopyEngine** engine);
  // A CPU tensor whose store is done: copied (or converted) into `dst` on
  // the calling thread. False when it must go through the engine.
  absl::StatusOr<bool> CopyOutNow(uint64_t id, uintptr_t dst, uint64_t capacity);
  absl::Status WaitFetch(uint64_t id, CopyEngine* engine, const CopyEvent& event,
                         StreamHandle stream);
  void OfferPrefetch(uint64_t id, int depth, UnpackResult* result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A view or a fetch of `id` no longer uses its bytes.
  void Unuse(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Erases a released entry nobody uses; gives its bytes back if it has any.
  void EraseLocked(Entries::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the entry's reservation back to the daemon, behind any fetch of it.
  void FreeTicketLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<Client> client_;
  mutable absl::Mutex mu_;
  const EngineOptions options_;  // host_engine always set
  std::vector<std::shared_ptr<CopyEngine>> cuda_engines_ ABSL_GUARDED_BY(mu_);  // by device
  bool cuda_tried_[64] ABSL_GUARDED_BY(mu_) = {};
  bool cuda_failed_[64] ABSL_GUARDED_BY(mu_) = {};    // tried, and creation failed
  absl::Status notice_ ABSL_GUARDED_BY(mu_);          // for TakeNotice
  bool unpinned_noted_ ABSL_GUARDED_BY(mu_) = false;  // its notice was given
  Entries entries_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> in_flight_ ABSL_GUARDED_BY(mu_);  // ids whose store runs, oldest first
  std::vector<Orphan> orphans_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool available_ ABSL_GUARDED_BY(mu_) = true;
  absl::Status pending_error_ ABSL_GUARDED_BY(mu_);
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash

#endif  // ACTSTASH_CLIENT_ENGINE_SAVED_TENSOR_ENGINE_IMPL_H_
