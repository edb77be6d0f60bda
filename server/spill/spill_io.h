// SpillFileIo: whole-buffer positional writes and reads of a spill file,
// through io_uring (several chunks in flight at once), or pwrite/pread where
// the kernel or a seccomp policy refuses io_uring.
#ifndef ACTSTASH_SERVER_SPILL_SPILL_IO_H_
#define ACTSTASH_SERVER_SPILL_SPILL_IO_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace actstash::server {

// One instance per thread: it owns one ring, and Write/Read block that
// thread until the whole buffer is transferred (the daemon runs them on its
// spill workers, never on gRPC or attach threads). O_DIRECT files need the
// buffer and size 4 KiB aligned (pool segments are): a file given anything
// else has O_DIRECT cleared and is written and read through the page cache.
class SpillFileIo {
 public:
  static constexpr uint64_t kDirectAlignment = 4096;

  // `chunk_bytes` per request, up to `depth` requests in flight.
  SpillFileIo(uint32_t depth, uint64_t chunk_bytes);
  ~SpillFileIo();
  SpillFileIo(const SpillFileIo&) = delete;
  SpillFileIo& operator=(const SpillFileIo&) = delete;

  // Writes/reads all of [data, data + bytes) at file offset 0. An I/O error
  // (ENOSPC, EIO, a short read at the end of the file) is returned with the
  // errno's text; ENOSPC and EDQUOT are RESOURCE_EXHAUSTED.
  absl::Status Write(int fd, const std::byte* data, uint64_t bytes);
  absl::Status Read(int fd, std::byte* data, uint64_t bytes);

  // "io_uring" or "pwrite" (why io_uring was not used is logged once).
  const char* mode() const;

 private:
  struct Ring;
  absl::Status Transfer(bool write, int fd, std::byte* data, uint64_t bytes);
  absl::Status TransferSync(bool write, int fd, std::byte* data, uint64_t bytes);

  const uint32_t depth_;
  const uint64_t chunk_bytes_;
  std::unique_ptr<Ring> ring_;  // null: pwrite/pread
};

// The status of a failed write/read of `bytes` at `offset`.
absl::Status SpillIoError(bool write, int err, uint64_t offset);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SPILL_SPILL_IO_H_
