#include "server/spill/spill_io.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

struct SpillFileIo::Ring {
  io_uring ring;
};

absl::Status SpillIoError(bool write, int err, uint64_t offset) {
  const std::string what = absl::StrCat(write ? "writing" : "reading", " the spill file at offset ",
                                        offset, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(what);
  return absl::InternalError(what);
}

SpillFileIo::SpillFileIo(uint32_t depth, uint64_t chunk_bytes)
    : depth_(std::max<uint32_t>(1, depth)), chunk_bytes_(std::max<uint64_t>(4096, chunk_bytes)) {
  auto ring = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(depth_, &ring->ring, 0);
  if (rc == 0) {
    ring_ = std::move(ring);
    return;
  }
  static std::atomic<bool> logged{false};
  if (!logged.exchange(true)) {
    spdlog::warn("io_uring is not available ({}); spill files are written with pwrite",
                 std::strerror(-rc));
  }
}

SpillFileIo::~SpillFileIo() {
  if (ring_ != nullptr) io_uring_queue_exit(&ring_->ring);
}

const char* SpillFileIo::mode() const { return ring_ != nullptr ? "io_uring" : "pwrite"; }

absl::Status SpillFileIo::Write(int fd, const std::byte* data, uint64_t bytes) {
  return Transfer(true, fd, const_cast<std::byte*>(data), bytes);
}

absl::Status SpillFileIo::Read(int fd, std::byte* data, uint64_t bytes) {
  return Transfer(false, fd, data, bytes);
}

absl::Status SpillFileIo::TransferSync(bool write, int fd, std::byte* data, uint64_t bytes) {
  uint64_t done = 0;
  while (done < bytes) {
    const size_t n = static_cast<size_t>(std::min(chunk_bytes_, bytes - done));
    const ssize_t got = write ? pwrite(fd, data + done, n, static_cast<off_t>(done))
                              : pread(fd, data + done, n, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return SpillIoError(write, errno, done);
    if (got == 0) return SpillIoError(write, write ? ENOSPC : EIO, done);
    done += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

// Keeps up to depth_ chunk requests in flight; a short transfer is resubmitted
// for its remainder (at its new offset), so requests need not be in order.
absl::Status SpillFileIo::Transfer(bool write, int fd, std::byte* data, uint64_t bytes) {
  if ((reinterpret_cast<uintptr_t>(data) | bytes) % kDirectAlignment != 0) {
    // An inline object (256-byte aligned, any size): O_DIRECT would refuse
    // it (EINVAL), so this file does buffered I/O.
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_DIRECT) != 0 && fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) {
      return SpillIoError(write, errno, 0);
    }
  }
  if (ring_ == nullptr) return TransferSync(write, fd, data, bytes);
  io_uring* ring = &ring_->ring;
  struct Request {
    uint64_t offset;
    uint64_t length;
  };
  std::vector<Request> requests(depth_);
  std::vector<uint32_t> free_slots;
  for (uint32_t i = 0; i < depth_; ++i) free_slots.push_back(depth_ - 1 - i);
  uint64_t next = 0;
  uint32_t in_flight = 0;
  absl::Status status;
  auto submit = [&](uint32_t slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(ring);  // never null: at most depth_ in flight
    const Request& r = requests[slot];
    if (write) {
      io_uring_prep_write(sqe, fd, data + r.offset, static_cast<unsigned>(r.length), r.offset);
    } else {
      io_uring_prep_read(sqe, fd, data + r.offset, static_cast<unsigned>(r.length), r.offset);
    }
    io_uring_sqe_set_data64(sqe, slot);
    ++in_flight;
  };
  while (next < bytes || in_flight > 0) {
    while (status.ok() && next < bytes && !free_slots.empty()) {
      const uint32_t slot = free_slots.back();
      free_slots.pop_back();
      requests[slot] = Request{next, std::min(chunk_bytes_, bytes - next)};
      next += requests[slot].length;
      submit(slot);
    }
    if (!status.ok()) next = bytes;  // stop issuing; drain what is in flight
    int rc = io_uring_submit(ring);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // Nothing was queued to the kernel: those requests never complete.
      if (status.ok()) status = SpillIoError(write, -rc, 0);
      break;
    }
    io_uring_cqe* cqe = nullptr;
    rc = io_uring_wait_cqe(ring, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      if (status.ok()) status = SpillIoError(write, -rc, 0);
      break;
    }
    const uint32_t slot = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(ring, cqe);
    --in_flight;
    Request& r = requests[slot];
    if (res < 0 && (res == -EINTR || res == -EAGAIN) && status.ok()) {
      submit(slot);
      continue;
    }
    if (res <= 0) {
      if (status.ok())
        status = SpillIoError(write, res < 0 ? -res : (write ? ENOSPC : EIO), r.offset);
      free_slots.push_back(slot);
      continue;
    }
    r.offset += static_cast<uint64_t>(res);
    r.length -= std::min<uint64_t>(r.length, static_cast<uint64_t>(res));
    if (r.length > 0 && status.ok()) {
      submit(slot);
    } else {
      free_slots.push_back(slot);
    }
  }
  if (in_flight > 0) {
    // The ring failed with requests the kernel may still complete into
    // `data`: fall back to a fresh ring next time, and wait them out here.
    while (in_flight > 0) {
      io_uring_cqe* cqe = nullptr;
      if (io_uring_wait_cqe(ring, &cqe) != 0) break;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
    }
  }
  return status;
}

}  // namespace actstash::server
