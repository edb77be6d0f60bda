#include "common/attach_wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace actstash::attach {
namespace {

absl::Status ErrnoError(absl::string_view what, int error) {
  if (error == EPIPE || error == ECONNRESET) {
    return absl::UnavailableError(absl::StrCat(what, ": the peer closed the attach connection"));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(error)));
}

absl::Status WaitReadable(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  while (true) {
    const int ready = poll(&p, 1, static_cast<int>(timeout.count()));
    if (ready > 0) return absl::OkStatus();
    if (ready == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no message on the attach connection within ", timeout.count(), " ms"));
    }
    if (errno != EINTR) return ErrnoError("poll", errno);
  }
}

// Reads exactly `n` bytes; fds arriving with them are appended to `fds`.
absl::Status ReadExactly(int fd, char* out, size_t n, std::chrono::milliseconds timeout,
                         std::vector<UniqueFd>* fds) {
  size_t done = 0;
  alignas(cmsghdr) char control[kRightsControlBytes];
  while (done < n) {
    if (absl::Status s = WaitReadable(fd, timeout); !s.ok()) return s;
    iovec iov{out + done, n - done};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return ErrnoError("recvmsg", errno);
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const int* received = reinterpret_cast<const int*>(CMSG_DATA(c));
        for (size_t i = 0; i < count; ++i) fds->emplace_back(received[i]);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) {
      return absl::InternalError("attach message carried more fds than allowed");
    }
    if (got == 0) return absl::UnavailableError("the peer closed the attach connection");
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace

std::string EncodeMessage(MessageType type, absl::string_view payload) {
  MessageHeader header;
  header.type = static_cast<uint16_t>(type);
  header.payload_bytes = static_cast<uint32_t>(payload.size());
  std::string bytes(reinterpret_cast<const char*>(&header), sizeof(header));
  bytes.append(payload.data(), payload.size());
  return bytes;
}

absl::Status CheckHeader(const MessageHeader& header) {
  if (header.magic == kMagic && header.version == kVersion &&
      header.payload_bytes <= kMaxPayloadBytes &&
      header.type >= static_cast<uint16_t>(MessageType::kHello) &&
      header.type <= static_cast<uint16_t>(MessageType::kTakeOverAdopted)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("malformed attach message (magic ", absl::Hex(header.magic), ", version ",
                   header.version, ", type ", header.type, ", ", header.payload_bytes, " bytes)"));
}

void AttachRights(absl::Span<const int> fds, char* control, msghdr* msg) {
  msg->msg_control = control;
  msg->msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
  cmsghdr* c = CMSG_FIRSTHDR(msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
}

absl::Status SendMessage(int fd, MessageType type, absl::string_view payload,
                         absl::Span<const int> fds) {
  if (payload.size() > kMaxPayloadBytes || fds.size() > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError("attach message too large");
  }
  std::string bytes = EncodeMessage(type, payload);
  alignas(cmsghdr) char control[kRightsControlBytes];
  size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < bytes.size()) {
    iovec iov{bytes.data() + sent, bytes.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (!fds_sent) AttachRights(fds, control, &msg);  // with the first byte that goes out
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("sendmsg", errno);
    }
    fds_sent = true;
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<Message> ReceiveMessage(int fd, std::chrono::milliseconds timeout) {
  Message message;
  MessageHeader header;
  absl::Status status =
      ReadExactly(fd, reinterpret_cast<char*>(&header), sizeof(header), timeout, &message.fds);
  if (status.ok()) status = CheckHeader(header);
  if (status.ok()) {
    message.type = static_cast<MessageType>(header.type);
    message.payload.resize(header.payload_bytes);
    status = ReadExactly(fd, message.payload.data(), message.payload.size(), timeout, &message.fds);
  }
  if (!status.ok()) return status;  // closes the fds received
  return message;
}

namespace {

std::string SiblingSocketPath(absl::string_view grpc_socket_path, absl::string_view infix) {
  if (absl::EndsWith(grpc_socket_path, ".sock")) {
    grpc_socket_path.remove_suffix(5);
    return absl::StrCat(grpc_socket_path, ".", infix, ".sock");
  }
  return absl::StrCat(grpc_socket_path, ".", infix);
}

}  // namespace

std::string AttachSocketPath(absl::string_view grpc_socket_path) {
  return SiblingSocketPath(grpc_socket_path, "attach");
}

std::string HandoverSocketPath(absl::string_view grpc_socket_path) {
  return SiblingSocketPath(grpc_socket_path, "handover");
}

}  // namespace actstash::attach
