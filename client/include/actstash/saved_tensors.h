// SavedTensorEngine: the whole life of a saved activation, without torch.
//
// Autograd front-ends (the Python hooks, the libtorch adapter) call it with
// plain values: where a tensor's bytes are, their size, layout, device and
// stream. The engine decides whether to offload it, stores it (a copy,
// gather or bf16 conversion into memory leased from actstashd, on the
// calling thread for small CPU tensors, else on a CopyEngine stream after the
// producer's stream), tracks stores in flight and drops the sources it held
// once they are done, prefetches in reverse save order, serves unpacks
// (a view of the leased bytes for CPU tensors, or a copy into a destination
// the front-end allocates), checks the saved version, releases the bytes
// when autograd drops the saved variable and the last view is gone, applies
// the failure policy, and keeps the counters behind stats().
//
// Sources and destinations are kept alive through owner references: opaque
// pointers the front-end hands in, which the engine acquires and releases
// through the two functions of EngineOptions. The engine calls them only on
// threads that are inside one of its own calls (Pack, UnpackBegin, Release,
// Reap; never on a copy thread, never while holding its lock), so a
// front-end whose owners need a lock held by its callers (Python's GIL)
// holds it around those calls.
//
// Thread-safety: every method may be called from any thread concurrently.
// Release may run re-entrantly from inside an owner release (a dropped
// source that frees a graph that frees a saved variable).
#ifndef ACTSTASH_SAVED_TENSORS_H_
#define ACTSTASH_SAVED_TENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"

namespace actstash {

// Why a saved tensor stayed where it was (counted per reason).
enum class KeepReason : int {
  kSmall = 0,        // below the scope's min_bytes
  kParameter = 1,    // a leaf that requires grad, or a view of one
  kKeepListed = 2,   // Stash.keep() / wrap(): a parameter or buffer of a kept module
  kLayout = 3,       // not strided, or its elements overlap (and no gather applies)
  kDevice = 4,       // on a device the engine does not copy (CUDA off, other GPU, no attach)
  kFailed = 5,       // offload is off after a failure (policy keep) or an error is pending
  kUnavailable = 6,  // no daemon
  // On a GPU whose CUDA copy engine could not be created: the CUDA error is
  // held for TakeError (kRaise) or given once by TakeNotice (kKeep).
  kNoCopyEngine = 7,
  kCount = 8,
};

// What the front-end knows about a tensor to save. Pointers must stay valid
// for the call only.
struct SavedTensorInfo {
  uintptr_t data = 0;    // address of element (0, ..., 0)
  uint64_t nbytes = 0;   // numel * element_size
  int element_size = 1;  // 1, 2, 4, 8
  bool is_fp32 = false;  // eligible for the bf16 downcast
  bool dense = true;     // elements fill [data, data + nbytes) exactly, any dim order
  int ndim = 0;          // sizes/strides in elements; needed when !dense
  const int64_t* sizes = nullptr;
  const int64_t* strides = nullptr;
  int device = -1;         // -1: CPU; else a CUDA ordinal
  StreamHandle stream;     // the producer's stream (CUDA), ignored on the CPU
  uint64_t version = 0;    // the tensor's version counter when saved
  void* owner = nullptr;   // reference to the source; acquired while the engine reads it
  void* cookie = nullptr;  // the front-end's saved object (prefetch candidates name it)
  // The caller may change the tensor in place right after Pack returns (a
  // checkpointed function's input): the store completes before that — CPU:
  // on the calling thread; CUDA: the producer's stream waits for the copy.
  bool sync = false;
};

// Saved tensors smaller than this stay where they are unless a scope says
// otherwise (Python's offload() and wrap(), the libtorch adapter's
// OffloadOptions::min_bytes; exported by actstash_describe_json): below it a
// copy and its bookkeeping cost more than the memory is worth.
inline constexpr uint64_t kDefaultMinBytes = 64 << 10;

enum class FailurePolicy { kRaise, kKeep };

struct EngineOptions {
  // CPU stores at most this large are copied on the calling thread (no
  // thread hand-off); larger ones go to the host engine's store stream.
  uint64_t inline_store_bytes = 1 << 20;
  // Unpacks of CPU tensors hand back a view of the leased bytes (no copy)
  // when the bytes are exact (not downcast); false: copied into a
  // destination the front-end allocates.
  bool cpu_views = true;
  // With cpu_views, CPU tensors smaller than this are copied into a
  // destination on the unpacking thread instead (a copy of a few KiB costs
  // less than a view's bookkeeping). CPU tensors are never prefetched: their
  // copies run on the unpacking thread, where a prefetch would only add a
  // thread hand-off.
  uint64_t view_min_bytes = 32 << 10;
  // Unpacks start fetches of the next `prefetch` CUDA tensors (in reverse
  // save order) into destinations the front-end allocates.
  int prefetch = 2;
  bool cuda = true;            // offload CUDA tensors (attached client, CUDA build)
  int device_pool = -1;        // a GPU ordinal of the daemon's device pool, or -1
  int pool_importer = -1;      // only tensors on this device go to the pool
  bool downcast_bf16 = false;  // dense fp32 stored as bf16 (lossy)
  // > 0: a test knob that gives a CPU run a GPU's link (bytes per second in
  // each direction): the host engine the engine creates simulates that link
  // (HostCopyEngineOptions::link_bytes_per_second), and CPU tensors then
  // take the paths CUDA tensors take: every store and every fetch goes
  // through the copy engine (none on the calling thread, no views), and
  // fetches are prefetched. A host_engine given here is used as it is.
  uint64_t simulated_link_bytes_per_second = 0;
  FailurePolicy on_failure = FailurePolicy::kRaise;
  // Host copy engine (CPU tensors). Null: the engine creates one.
  std::shared_ptr<CopyEngine> host_engine;
  // CUDA copy engine per device, created on first use (CreateCudaCopyEngine)
  // unless given here (device index → engine).
  std::vector<std::shared_ptr<CopyEngine>> cuda_engines;
  // Owner references: acquire when the engine starts holding one, release
  // when it lets go. Null functions: owners are not counted (the front-end
  // keeps sources alive itself until Synchronize).
  void (*acquire_owner)(void* owner) = nullptr;
  void (*release_owner)(void* owner) = nullptr;
  // Stores in flight: a source stays alive (held through its owner) until
  // its copy is seen complete, so a producer faster than the copies (a GPU
  // ahead of PCIe) would pile up sources and the memory saving would vanish.
  // Pack first waits for the oldest stores while the sources in flight plus
  // the new one would exceed `max_in_flight_bytes`, or `max_in_flight_stores`
  // stores are in flight (below the CUDA engine's own per-stream bound, so
  // that a store never blocks inside the copy engine). A single store larger
  // than the bound still goes, alone. Counted in EngineStats
  // (in_flight_waits, in_flight_wait_ns). 0: no bound.
  uint64_t max_in_flight_bytes = uint64_t{1} << 30;
  uint32_t max_in_flight_stores = 48;
  // Called around every wait for copies inside Pack (the in-flight bound, a
  // full pool waiting for stores to become spillable): `unlock_caller`
  // before the wait, returning a token, `relock_caller(token)` after. The
  // engine holds none of its locks then, and acquires or releases no owner
  // in between, so a front-end whose callers hold a lock (Python's GIL:
  // PyEval_SaveThread / PyEval_RestoreThread) lets other threads run while
  // the device works. Null: the caller's locks stay held while it waits.
  void* (*unlock_caller)() = nullptr;
  void (*relock_caller)(void* token) = nullptr;
};

// The options an engine runs with: a simulated link turns inline CPU stores
// and CPU views off (CPU tensors then take CUDA tensors' paths). The engine
// applies it itself; a front-end that reports its settings calls it too.
inline EngineOptions EffectiveEngineOptions(EngineOptions options) {
  if (options.simulated_link_bytes_per_second > 0) {
    options.inline_store_bytes = 0;
    options.cpu_views = false;
  }
  return options;
}

// The counters behind stats(); one schema, named by kEngineStatNames.
struct EngineStats {
  uint64_t tensors_offloaded = 0;
  uint64_t bytes_offloaded = 0;  // bytes stored (half of the tensor's when downcast)
  uint64_t tensors_kept = 0;
  uint64_t bytes_kept = 0;
  uint64_t kept_by_reason[static_cast<int>(KeepReason::kCount)] = {};
  uint64_t tensors_fetched = 0;  // unpacks served from stored bytes (views or copies)
  uint64_t bytes_fetched = 0;
  uint64_t views = 0;  // of those, served as views (no copy)
  uint64_t prefetch_issued = 0;
  uint64_t prefetch_hits = 0;         // unpacks whose fetch had been started ahead
  uint64_t unpacked_from_source = 0;  // unpacks served by the source (store still in flight)
  uint64_t store_failures = 0;
  uint64_t live_tensors = 0;  // stored and not yet released
  uint64_t live_bytes = 0;
  uint64_t peak_live_bytes = 0;
  uint64_t in_flight = 0;             // stores whose source the engine still holds
  uint64_t inline_stores = 0;         // stores done on the calling thread
  uint64_t wait_ns = 0;               // time unpacks waited for copies
  uint64_t in_flight_bytes = 0;       // source bytes of the stores in flight
  uint64_t peak_in_flight_bytes = 0;  // the most in_flight_bytes reached
  uint64_t in_flight_waits = 0;       // Packs that waited for the in-flight bound
  uint64_t in_flight_wait_ns = 0;     // time they waited
  // Device tensors copied into leased host memory that is not registered
  // with CUDA: such a copy is synchronous (the driver stages it), so the
  // producer waits for it. Also given once as a notice (TakeNotice).
  uint64_t unpinned_device_stores = 0;
};

// What UnpackBegin found.
enum class UnpackKind : int {
  kSource = 0,       // the source is still held (store in flight or failed): use `owner`
  kView = 1,         // read the bytes in place: `data`, `nbytes`; call ViewDone when done
  kDestination = 2,  // allocate a tensor and call FetchInto (then Finish)
  kPrefetched = 3,   // a prefetch filled `owner` (a destination): wait with Finish
};

struct UnpackResult {
  UnpackKind kind = UnpackKind::kSource;
  void* owner = nullptr;  // kSource/kPrefetched: an acquired reference, now the caller's
  const void* data = nullptr;
  uint64_t nbytes = 0;  // bytes of the restored tensor (fp32 bytes when downcast)
  bool downcast = false;
  // Saved tensors worth fetching now (fetch-into mode): their cookies; the
  // front-end allocates each and calls Prefetch.
  std::vector<void*> prefetch_cookies;
  std::vector<uint64_t> prefetch_ids;
};

class SavedTensorEngine {
 public:
  // `client` may be null (no daemon: everything is kept, KeepReason::kUnavailable).
  static absl::StatusOr<std::unique_ptr<SavedTensorEngine>> Create(std::shared_ptr<Client> client,
                                                                   EngineOptions options);
  // Waits for all copies, then releases every owner still held.
  ~SavedTensorEngine();
  SavedTensorEngine(const SavedTensorEngine&) = delete;
  SavedTensorEngine& operator=(const SavedTensorEngine&) = delete;

  // Saves a tensor. Returns its id (> 0) when offloaded, 0 when kept (the
  // front-end keeps the tensor as autograd would). `keep` is the front-end's
  // reason to keep it (kCount: none); `min_bytes` is the scope's threshold.
  // The reason counted is the first that applies of: small (below
  // min_bytes; info.nbytes is all the engine reads then), `keep`, no daemon,
  // offload off after a failure, layout, device.
  // Errors from reserving memory are not returned: with kRaise they are held
  // for TakeError, with kKeep offload turns off; either way the tensor is kept.
  uint64_t Pack(const SavedTensorInfo& info, KeepReason keep, uint64_t min_bytes);

  // Starts an unpack of `id`. `version` is the saved tensor's version now
  // (kUnknownVersion when the front-end cannot see it). FAILED_PRECONDITION
  // when it changed in place after saving; a fetch error otherwise.
  static constexpr uint64_t kUnknownVersion = ~uint64_t{0};
  // At most `max_prefetch` candidates are offered (see UnpackResult).
  absl::StatusOr<UnpackResult> UnpackBegin(uint64_t id, uint64_t version,
                                           int max_prefetch = 1 << 20);
  // Copies `id`'s bytes into `dst` (capacity bytes; the front-end keeps it
  // alive) after `stream`, then orders `stream` after the copy (CPU: waits;
  // CUDA: no host wait).
  absl::Status FetchInto(uint64_t id, uintptr_t dst, uint64_t capacity, StreamHandle stream);
  // Starts a fetch of `id` into `dst` whose `owner` the engine holds until
  // the unpack of `id` takes it (kPrefetched) or `id` is released.
  absl::Status Prefetch(uint64_t id, uintptr_t dst, uint64_t capacity, void* owner,
                        StreamHandle stream);
  // Orders `stream` after the prefetch of `id` (CPU: waits for it).
  absl::Status Finish(uint64_t id, StreamHandle stream);
  // A view handed out by UnpackBegin is gone.
  void ViewDone(uint64_t id);
  // Autograd dropped the saved variable: its bytes are freed once no copy
  // and no view uses them.
  void Release(uint64_t id);

  // Drops the sources of finished stores (and, with `wait`, waits for all
  // stores first). With kRaise, returns the first store failure since the
  // last TakeError.
  absl::Status Reap(bool wait);
  // The first failure held for the front-end (a failed store or
  // reservation with kRaise), cleared.
  absl::Status TakeError();
  // Something the front-end should warn about once, without failing (the
  // CUDA copy engine of a GPU could not be created under kKeep: its tensors
  // stay on the GPU), cleared; OK when there is none.
  absl::Status TakeNotice();
  // Waits for every copy and release in flight; drops held sources.
  void Synchronize();
  // Waits for every copy and release submitted so far, and releases no owner
  // (a front-end calls it without the lock its owners need, then Reap).
  void WaitForCopies();

  EngineStats stats() const;
  // False once offload was turned off (kKeep after a failure, or no client).
  bool available() const;

 private:
  class Impl;
  explicit SavedTensorEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "small", "parameter", "keep_listed", ...: a KeepReason as stats and the C
// ABI's description name it; "" for kCount or an unknown value.
const char* KeepReasonName(KeepReason reason);

// The names of EngineStats' fields, in declaration order (kept_by_reason
// expands to "kept_" + KeepReasonName per reason), as stats dictionaries show
// them. Names and values come from one table in saved_tensor_engine.cc.
const std::vector<std::string>& EngineStatNames();
// EngineStats' fields in the order of EngineStatNames().
std::vector<uint64_t> EngineStatValues(const EngineStats& stats);

}  // namespace actstash

#endif  // ACTSTASH_SAVED_TENSORS_H_
