// The life of one saved tensor inside SavedTensorEngine: its states, the
// one table of legal transitions, and the record the engine keeps per tensor.
// Private to the engine.
//
// Thread-safety: plain values. The engine guards every SavedEntry with its
// mutex; NextState and the predicates are pure.
#ifndef ACTSTASH_CLIENT_ENGINE_SAVED_TENSOR_STATE_H_
#define ACTSTASH_CLIENT_ENGINE_SAVED_TENSOR_STATE_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "actstash/client.h"
#include "actstash/copy_engine.h"

namespace actstash::client_internal {

// Where a saved tensor's bytes are, and whether autograd still needs them.
// A tensor enters as kStoring (a copy on a CopyEngine stream reads its
// source, which the engine holds) or kStored (copied on the packing thread).
//
//   kStoring ---store done---> kStored ---release---> kReleasedStored
//      |  \---store failed---> kFailed ---release---> kReleasedFailed
//      release                                              ^
//      v                                                    |
//   kReleasedStoring ---store done---> kReleasedStored      |
//                   \---store failed--------------------------/
//
// Nothing else is legal: a stored tensor never fails later, a released one
// is never unreleased. A released tensor's record is erased once no store
// runs and no view or fetch uses it; its bytes are given back to the daemon
// then (kReleasedStored) or were given back when the store failed.
enum class SavedState : uint8_t {
  kStoring,          // the store runs; the source is held and serves unpacks
  kStored,           // the daemon holds the bytes; no source is held
  kFailed,           // the store failed: nothing stored, the source serves unpacks
  kReleasedStoring,  // released while its store runs: erased when the store ends
  kReleasedStored,   // released: erased (bytes freed) when no view or fetch uses it
  kReleasedFailed,   // released after its store failed: erased when unused
};

enum class SavedEvent : uint8_t {
  kStoreDone,    // the store's copy completed successfully (seen by a reap)
  kStoreFailed,  // the store's copy or its enqueue failed
  kRelease,      // autograd dropped the saved variable
};

// The state `event` leads to from `state`; nullopt when the table above has
// no such edge.
std::optional<SavedState> NextState(SavedState state, SavedEvent event);
const char* SavedStateName(SavedState state);
const char* SavedEventName(SavedEvent event);

constexpr bool IsReleased(SavedState s) {
  return s == SavedState::kReleasedStoring || s == SavedState::kReleasedStored ||
         s == SavedState::kReleasedFailed;
}
constexpr bool StoreRunning(SavedState s) {
  return s == SavedState::kStoring || s == SavedState::kReleasedStoring;
}
// The engine holds a reference to the source (SavedEntry::owner).
constexpr bool HoldsSource(SavedState s) { return StoreRunning(s) || s == SavedState::kFailed; }
constexpr bool IsFailed(SavedState s) {
  return s == SavedState::kFailed || s == SavedState::kReleasedFailed;
}
// Counted in EngineStats::live_tensors/live_bytes: stored or being stored,
// and still needed.
constexpr bool IsLive(SavedState s) {
  return s == SavedState::kStoring || s == SavedState::kStored;
}

// A fetch started ahead of its unpack (CUDA tensors only), beside SavedState.
enum class PrefetchState : uint8_t {
  kNone,       // not offered
  kOffered,    // offered in an UnpackResult: the front-end may call Prefetch
  kRunning,    // a fetch into the front-end's destination (held: fetch_owner)
  kHandedOut,  // the unpack took the destination; Finish orders a stream after it
  kDone,       // finished, or dropped with the tensor (the destination is an orphan)
};

// How the bytes reached the daemon.
enum class Transport : uint8_t {
  kLeased,  // copied into leased shared memory (Client::Reserve): attached clients
  kRpc,     // sent through Client::Store on a copy thread: unattached clients
};

// The ticket of a Client::Store on a copy thread, known once its work ran.
struct RpcTicket {
  Ticket ticket;  // written by the store work before its event completes
};

// One saved tensor. The invariant the engine keeps: owner != nullptr exactly
// when HoldsSource(state); store != nullptr whenever the store ran on a
// CopyEngine (kept after it ends: fetches order themselves after it).
struct SavedEntry {
  SavedState state = SavedState::kStored;
  PrefetchState prefetch = PrefetchState::kNone;
  Transport transport = Transport::kLeased;
  uint64_t nbytes = 0;        // bytes of the tensor as restored
  uint64_t stored_bytes = 0;  // bytes held by the daemon (half of nbytes when bf16)
  bool bf16 = false;          // stored as bf16, restored as fp32
  int device = -1;            // -1: CPU; else the CUDA ordinal
  CopyEngine* engine = nullptr;
  Ticket ticket;                          // kLeased
  std::shared_ptr<RpcTicket> rpc_ticket;  // kRpc
  std::shared_ptr<CopyEvent> store;       // null: stored on the packing thread
  void* owner = nullptr;                  // the source's reference (see above)
  void* cookie = nullptr;                 // the front-end's saved object; null once released
  uint64_t version = 0;                   // the tensor's version counter when saved
  bool fetch_queued = false;              // a fetch ran on the engine's fetch stream
  int users = 0;                          // views handed out and fetches being enqueued
  std::shared_ptr<CopyEvent> fetch;       // the prefetch's copy (kRunning, kHandedOut)
  void* fetch_owner = nullptr;            // its destination, held (kRunning only)
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_ENGINE_SAVED_TENSOR_STATE_H_
