// Wire format of the attach channel: a Unix stream socket beside the gRPC
// socket over which the daemon passes segment memfds (SCM_RIGHTS) to the
// local client of a session.
//
//   client → daemon  Hello     payload: the session token
//   daemon → client  Welcome   payload: WelcomePayload + UTF-8 message
//   daemon → client  Segments  payload: SegmentsPayload; ancillary: `count` fds
//
// The same framing serves the take-over channel (HandoverSocketPath), over
// which a serving daemon hands its state to a successor
// (server/restart/take_over.h):
//
//   successor → daemon  TakeOverHello    payload: a v1::TakeOverHello
//   daemon → successor  TakeOverRefused  payload: UTF-8 reason (nothing handed)
//   daemon → successor  TakeOverState    payload: TakeOverStatePayload; fds
//   successor → daemon  TakeOverAdopted  payload: empty (the successor serves)
//
// Every message is a MessageHeader followed by payload_bytes of payload.
// The functions below are thread-compatible: one reader and one writer per
// socket at a time.
// Integers are little-endian (native: both ends are on one host). The open
// connection is the session's liveness signal: when it closes, the daemon
// reclaims everything the session holds.
#ifndef ACTSTASH_COMMON_ATTACH_WIRE_H_
#define ACTSTASH_COMMON_ATTACH_WIRE_H_

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"

namespace actstash::attach {

inline constexpr uint32_t kMagic = 0x54534341;  // "ACST"
inline constexpr uint16_t kVersion = 1;
inline constexpr uint32_t kMaxPayloadBytes = 4096;
// Fewer than the kernel's SCM_MAX_FD (253) fds per message.
inline constexpr uint32_t kMaxFdsPerMessage = 128;

enum class MessageType : uint16_t {
  kHello = 1,
  kWelcome = 2,
  kSegments = 3,
  kTakeOverHello = 4,
  kTakeOverRefused = 5,
  kTakeOverState = 6,
  kTakeOverAdopted = 7,
};

struct MessageHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t type = 0;
  uint32_t payload_bytes = 0;
};
static_assert(sizeof(MessageHeader) == 12);

// WelcomePayload::flags.
// The daemon keeps its state where a restart after a crash finds it (a
// service manager's fd store): a client whose connection ends without the
// socket file going away attaches again, with the same token, instead of
// giving the session up (client/rpc/attach_connection.h).
inline constexpr uint32_t kWelcomeRecoverable = 1;

struct WelcomePayload {
  int32_t status_code = 0;  // absl::StatusCode; 0 = attached
  uint32_t flags = 0;       // kWelcome* bits
  uint64_t session_id = 0;
};

struct SegmentsPayload {
  uint64_t lease_id = 0;
  uint64_t segment_bytes = 0;
  uint32_t first = 0;           // index of the first fd of this message within the lease
  uint32_t count = 0;           // fds in this message
  uint32_t lease_segments = 0;  // segments of the whole lease
  uint32_t reserved = 0;
};

// One of the messages that carry a state's fds (the first holds fd 0, the
// state image): `count` fds of `total`, starting at index `first`.
struct TakeOverStatePayload {
  uint32_t total = 0;
  uint32_t first = 0;
  uint32_t count = 0;
  uint32_t reserved = 0;
};

struct Message {
  MessageType type = MessageType::kHello;
  std::string payload;
  std::vector<UniqueFd> fds;  // arrived with the message (SCM_RIGHTS)
};

// The framing, shared by the blocking functions below (the client) and the
// daemon's non-blocking attach server.

// The bytes of one message: its header, then `payload` (at most
// kMaxPayloadBytes: the caller's contract).
std::string EncodeMessage(MessageType type, absl::string_view payload);

// A payload made of `fixed` (one of the payload structs above) and `tail`.
template <typename Fixed>
std::string PayloadOf(const Fixed& fixed, absl::string_view tail = {}) {
  static_assert(std::is_trivially_copyable_v<Fixed>, "payload structs are copied as bytes");
  std::string payload(reinterpret_cast<const char*>(&fixed), sizeof(fixed));
  payload.append(tail.data(), tail.size());
  return payload;
}

// OK when this version can read a message with `header`: the magic, the
// version, a known type, at most kMaxPayloadBytes. INVALID_ARGUMENT that
// names the fields otherwise (the stream is then unusable).
absl::Status CheckHeader(const MessageHeader& header);

// Ancillary-data room for kMaxFdsPerMessage fds.
inline constexpr size_t kRightsControlBytes = CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage);

// Puts `fds` (1..kMaxFdsPerMessage) into `msg` as one SCM_RIGHTS message
// written to `control` (kRightsControlBytes, aligned as a cmsghdr). Only the
// numbers are copied: the caller still owns the fds, which must stay open
// until the message's first byte is sent.
void AttachRights(absl::Span<const int> fds, char* control, msghdr* msg);

// Sends one message with optional fds, retrying on EINTR and short writes.
// For blocking sockets; on a non-blocking socket EAGAIN is UNAVAILABLE.
// `fds` stay the caller's: they must stay open until this returns.
absl::Status SendMessage(int fd, MessageType type, absl::string_view payload,
                         absl::Span<const int> fds = {});

// Receives one message, waiting at most `timeout` for each part. Rejects a
// bad magic/version/size (INVALID_ARGUMENT; the stream is then unusable).
// End of stream is UNAVAILABLE. Received fds are CLOEXEC.
absl::StatusOr<Message> ReceiveMessage(int fd, std::chrono::milliseconds timeout);

// The attach socket of a gRPC socket path: "x/actstash.sock" →
// "x/actstash.attach.sock"; a path without ".sock" gets ".attach" appended.
std::string AttachSocketPath(absl::string_view grpc_socket_path);

// The take-over socket: "x/actstash.sock" → "x/actstash.handover.sock"
// (".handover" appended to a path without ".sock").
std::string HandoverSocketPath(absl::string_view grpc_socket_path);

}  // namespace actstash::attach

#endif  // ACTSTASH_COMMON_ATTACH_WIRE_H_
