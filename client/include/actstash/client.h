// actstash C++ client: talks to a node's actstashd over gRPC.
//
//   auto client = actstash::Client::Connect(actstash::ClientOptions{});
//   if (!client.ok()) ...;                        // UNAVAILABLE names the socket
//   auto handle = (*client)->Put(data, nbytes);   // stored in the daemon's pool
//   auto object = (*client)->Get(*handle);        // bytes back
//   (*client)->Delete(*handle);
//
// Thread-safety: a Client may be used from any number of threads at once.
// Every call has a deadline (ClientOptions::rpc_timeout) and returns an
// absl::Status; nothing throws.
#ifndef ACTSTASH_CLIENT_H_
#define ACTSTASH_CLIENT_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "actstash/pinned.h"

// The wire messages that Stats, CopyShare and zero_copy_usage return
// (actstash/v1/stash.proto). Declared, not included: a caller of those
// includes "actstash/v1/stash.pb.h". This header then pulls in no protobuf
// header, so it compiles beside a libtorch from PyPI, whose include folder
// carries its own, older protobuf headers (a translation unit that sees
// both would mix the two versions).
namespace actstash::v1 {
class StatsReply;
class CopyShareReply;
class ClientUsage;
}  // namespace actstash::v1

namespace actstash {

// Whether a client uses the zero-copy data plane (Store/Fetch write straight
// into the daemon's shared memory). It needs the daemon's attach socket, so
// it works only on the daemon's node, with the socket directory shared.
enum class AttachMode {
  kAuto,      // attach when possible, else Store/Fetch use the inline gRPC path
  kRequired,  // Connect fails when attaching fails
  kOff,       // always the inline gRPC path
};

struct ClientOptions {
  // "unix:///path", "/path/to.sock" or "host:port". Empty: $ACTSTASH_ADDRESS,
  // else the default socket (/run/actstash/actstash.sock as root, else
  // $XDG_RUNTIME_DIR/actstash/actstash.sock).
  std::string address;
  std::string client_name;   // shown in the daemon's stats; empty: the program name
  uint64_t quota_bytes = 0;  // 0: the daemon's default quota
  // Deadline of every call, a whole Put or Get stream included.
  std::chrono::milliseconds rpc_timeout{30000};
  // Deadline of Connect (opening the session).
  std::chrono::milliseconds connect_timeout{5000};
  // When the daemon keeps its state across a crash (under a service manager
  // that holds its memory, docs/OPERATIONS.md) and its attach connection
  // ends: how long to try to attach again (calls meanwhile wait, leased
  // memory stays readable) before the session counts as gone. 0: never.
  // A session without an attach connection cannot tell a daemon being
  // replaced or restarted from one that is gone: its calls wait this long
  // (within rpc_timeout) for a daemon that does not answer, then fail
  // UNAVAILABLE.
  std::chrono::milliseconds reattach_timeout{30000};
  AttachMode attach = AttachMode::kAuto;
  // Segments leased at a time by the zero-copy path; up to this many empty
  // segments are kept leased for reuse.
  uint32_t lease_batch = 4;
  // How often the client reports its zero-copy usage to the daemon (Stats).
  std::chrono::milliseconds usage_report_interval{1000};
  // TCP with TLS (host:port addresses): PEM text of the CA that signed the
  // daemon's certificate; for mutual TLS also this client's certificate chain
  // and private key. Empty tls_root_certs: plaintext.
  std::string tls_root_certs;
  std::string tls_cert_chain;
  std::string tls_private_key;
  // Zero-copy path: register each leased segment with CUDA (cudaHostRegister,
  // once per lease while it is mapped), so device copies go straight into the
  // daemon's memory by DMA. kAuto: when this build has CUDA and a device is
  // present, for leases mapped on a thread that has a CUDA context (a thread
  // that runs CUDA work; a CPU-only trainer on a GPU node registers nothing
  // and creates no context); a failed registration (e.g. the driver could not lock the pages)
  // leaves that lease unpinned, which is correct but slower (the driver
  // stages the copies), and is reported by pin_status(). kOn: a failed
  // registration fails the Store/Reserve that needed the lease. kOff: never.
  PinPolicy pin_leases = PinPolicy::kAuto;
  // The CUDA device of this process that imports the daemon's device pools
  // (ReserveOnDevice): their memory is mapped into its context (with peer
  // access when the pool is on another GPU).
  int cuda_device = 0;
  // Spill tier (a daemon started with --spill-dir): when no lease can be had,
  // the client has the daemon write its coldest buffers to disk, and reads
  // them back when they are fetched; reading a buffer also reads back the
  // `restore_ahead` spilled leases stored just before it, in the background,
  // ahead of backward. spill = false never spills (RESOURCE_EXHAUSTED).
  bool spill = true;
  uint32_t restore_ahead = 2;
  // With a spill tier: how long a Store that has nothing of its own left to
  // spill waits for pool memory held by other sessions (which are asked to
  // give back what exceeds their fair share) before RESOURCE_EXHAUSTED.
  std::chrono::milliseconds pool_wait{30000};
  // Zero-copy path with registered (pinned) leases: an emptied lease stays
  // mapped and registered this long for the next buffers (the next training
  // step), instead of going back at once to be leased and registered again,
  // which costs a cudaHostRegister on the storing thread every step. A
  // background thread gives back what stayed empty longer; when the pool is
  // full, retained leases go back before anything spills or waits. 0: back at
  // once, as for unregistered leases.
  std::chrono::milliseconds lease_retain{10000};
  // The NUMA node this client copies from, named when it leases host memory:
  // a daemon whose pool is split per node (actstashd --numa) leases from
  // that node's part first. -1: the node of the leasing thread's CUDA device
  // (a thread with a CUDA context), else of the CPU it runs on.
  int numa_node = -1;
};

// A device pool of the daemon (actstashd --device-pool GPU:SIZE).
struct DevicePoolInfo {
  uint32_t device = 0;  // the daemon's CUDA ordinal
  uint64_t total_bytes = 0;
  uint64_t segment_bytes = 0;
};

// A buffer given to Store: either placed by this client in memory leased from
// the daemon (zero-copy) or stored inline in the daemon. Valid until
// Release, in the Client that made it.
struct Ticket {
  uint64_t id = 0;
  uint64_t nbytes = 0;
};

// Memory placed in leased shared memory by Reserve: the caller writes it.
struct Reservation {
  Ticket ticket;
  void* data = nullptr;
  bool pinned = false;     // registered for CUDA
  bool on_device = false;  // device memory (ReserveOnDevice): only CUDA copies
};

// Where a stored buffer's bytes lie (Locate): the caller reads them.
struct StoredBytes {
  const void* data = nullptr;
  uint64_t nbytes = 0;
  bool pinned = false;
  bool on_device = false;
};

// A stored object, valid in the session that stored it. 0 is never a handle.
struct Handle {
  uint64_t id = 0;
  friend bool operator==(Handle a, Handle b) { return a.id == b.id; }
  friend bool operator!=(Handle a, Handle b) { return a.id != b.id; }
};

struct PutOptions {
  std::string dtype;           // opaque to the daemon, at most 32 bytes
  std::vector<int64_t> shape;  // opaque to the daemon, at most 16 dims
  bool checksum = false;       // the daemon verifies an XXH3-64 of the payload
};

struct ObjectInfo {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  std::optional<uint64_t> checksum_xxh3;  // when it was stored with one
};

struct Object {
  ObjectInfo info;
  std::vector<std::byte> data;
};

class Client {
 public:
  // Opens a session. UNAVAILABLE (naming the address and how to start the
  // daemon) when no daemon answers within connect_timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  // Closes the session (best effort; the daemon frees what it holds).
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Stores `nbytes` bytes from `data` (any size up to the session quota).
  // RESOURCE_EXHAUSTED when the quota or the pool has no room (nothing is
  // stored then).
  absl::StatusOr<Handle> Put(const void* data, size_t nbytes, const PutOptions& options = {});
  // Fetches an object into `dst` of `capacity` bytes. OUT_OF_RANGE (nothing
  // written) when it does not fit; NOT_FOUND for a handle that is not this
  // session's; DATA_LOSS when a stored checksum does not match.
  absl::StatusOr<ObjectInfo> Get(Handle handle, void* dst, size_t capacity);
  // Fetches an object into a new buffer.
  absl::StatusOr<Object> Get(Handle handle);
  // Deletes objects, all or none (NOT_FOUND names an unknown handle).
  absl::Status Delete(absl::Span<const Handle> handles);
  absl::Status Delete(Handle handle) { return Delete(absl::MakeConstSpan(&handle, 1)); }
  // The daemon's numbers, as the wire message (actstash/v1/stash.proto is
  // their schema and documentation): the pools, totals, this session (self)
  // and, when `all_sessions`, every open session. Reports this client's
  // zero-copy usage first, so that `self.client` is current.
  absl::StatusOr<v1::StatsReply> Stats(bool all_sessions = false);
  // The node's copy bandwidth and this session's share of it while the
  // other copying sessions copy too (the wire message: CopyShareReply).
  // `probe_*` are what this client's copies reached alone (bytes per
  // second, 0: unknown). Asking counts this session as copying for the
  // daemon's copy window. INVALID_ARGUMENT for a negative or non-finite
  // rate (checked here and by the daemon).
  absl::StatusOr<v1::CopyShareReply> CopyShare(double probe_store_bytes_per_second,
                                               double probe_fetch_bytes_per_second);

  // Stores a copy of `nbytes` from `src`: placed in leased shared memory
  // when attached (one memcpy, no RPC except when a new segment must be
  // leased), else through Put. RESOURCE_EXHAUSTED past the quota or the
  // pool; UNAVAILABLE when the daemon went away (attached: stored buffers
  // remain fetchable, new ones cannot be stored).
  absl::StatusOr<Ticket> Store(const void* src, size_t nbytes);
  // Copies the ticket's bytes into `dst` (capacity bytes). NOT_FOUND for an
  // unknown or released ticket; OUT_OF_RANGE when it does not fit.
  absl::Status Fetch(const Ticket& ticket, void* dst, size_t capacity);
  // Places `nbytes` in leased shared memory without copying: the caller
  // writes [data, data + nbytes) itself (e.g. a CUDA copy on a stream), and
  // must have finished before the ticket is fetched or located. Only when
  // attached: FAILED_PRECONDITION otherwise (use Store). Store's errors.
  absl::StatusOr<Reservation> Reserve(size_t nbytes);
  // Tells the client that a Reserve'd buffer is fully written (its copy has
  // finished): from then on it may be spilled to the daemon's disk, and read
  // back when it is fetched or located. Buffers never marked written are
  // never spilled. NOT_FOUND for an unknown ticket.
  absl::Status MarkWritten(const Ticket& ticket);
  // Reserve in the daemon's device pool on GPU `device` (its ordinal): `data`
  // is a device pointer in this process (mapped on options.cuda_device), to
  // be filled by a CUDA copy; Locate returns device pointers for its
  // tickets, Fetch refuses them. The same quota as host memory. Only when
  // attached; FAILED_PRECONDITION when the daemon has no pool on `device`
  // (the message lists those it has) or this process cannot import it
  // (no CUDA). Trust: importing maps the whole pool (same-uid trainers).
  // Device tickets die with the session: the daemon zeroes and grants the
  // memory again in place, so once the attach connection is gone Locate
  // fails (UNAVAILABLE) instead of pointing at another session's memory;
  // finish the copies into and out of them before Close.
  absl::StatusOr<Reservation> ReserveOnDevice(size_t nbytes, uint32_t device);
  // Long-lived state in leased memory (an optimizer's moments and master
  // weights), counted apart from activations (ClientUsage.state_bytes,
  // which the daemon's /metrics sums). Reserve'd and never spilled until
  // parked. ReleaseState gives one back (Release's errors).
  absl::StatusOr<Reservation> ReserveState(size_t nbytes);
  absl::Status ReleaseState(const Ticket& ticket);
  // ParkState: the caller keeps no pointer into a state buffer any more (the
  // Reservation's data, or LocateState's): the spill tier may take its block
  // under pool pressure. LocateState: where its bytes are now (read back
  // first when spilled; counted as no fetch), valid until the next
  // ParkState or ReleaseState; the spilled states reserved just after it are
  // read back ahead, in the background (a step goes in reservation order).
  // Both NOT_FOUND for an unknown ticket; LocateState has Locate's errors
  // and a read-back's (DATA_LOSS).
  absl::Status ParkState(const Ticket& ticket);
  absl::StatusOr<void*> LocateState(const Ticket& ticket);
  // The daemon's device pools, as announced when the session opened.
  const std::vector<DevicePoolInfo>& device_pools() const;
  // Where a zero-copy ticket's bytes lie, for the caller to copy them out;
  // valid until Release. FAILED_PRECONDITION for an inline ticket (use
  // Fetch), NOT_FOUND for an unknown or released one.
  absl::StatusOr<StoredBytes> Locate(const Ticket& ticket);
  // Frees the ticket's memory. Fetch or Release of a released ticket is
  // NOT_FOUND; concurrently with its own Release, undefined.
  absl::Status Release(const Ticket& ticket);
  // Whether Store/Fetch use the zero-copy path, and why not if they don't.
  bool attached() const;
  absl::Status attach_status() const;
  // Whether this session's zero-copy host buffers may go to the daemon's
  // spill tier: attached, the daemon has one, and options.spill.
  bool can_spill() const;
  // OK, or why some leased memory is not pinned for CUDA (pin_leases kAuto).
  absl::Status pin_status() const;
  // This client's zero-copy side, all tiers (no RPC): what it reports to
  // the daemon (ClientUsage in actstash/v1/stash.proto). Zero when not
  // attached.
  v1::ClientUsage zero_copy_usage() const;
  // Calls that found the daemon paused (being replaced: actstashd
  // --take-over) and waited for its successor (no RPC).
  uint64_t daemon_pauses() const;
  // Times the attach connection was made again after the daemon restarted
  // with its state (see ClientOptions::reattach_timeout).
  uint64_t daemon_reattaches() const;
  // Closes the session now; later calls fail with FAILED_PRECONDITION.
  absl::Status Close();

  uint64_t session_id() const;
  uint64_t quota_bytes() const;
  const std::string& address() const;  // the gRPC target in use

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct PingResult {
  std::string address;
  bool serving = false;  // the Stash service reports SERVING
  std::chrono::microseconds round_trip{0};
};

// Asks the daemon's gRPC health service about the Stash service (no session
// needed). UNAVAILABLE when no daemon answers within `timeout`.
absl::StatusOr<PingResult> Ping(const std::string& address, std::chrono::milliseconds timeout);
// The same, with the TLS settings of `options` (address and timeout as given).
absl::StatusOr<PingResult> Ping(const std::string& address, std::chrono::milliseconds timeout,
                                const ClientOptions& tls);

}  // namespace actstash

#endif  // ACTSTASH_CLIENT_H_
