#include "server/restart/state_image.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/errno_status.h"

namespace actstash::server {
namespace {

constexpr uint64_t kMagic = 0x4554415453544341;  // "ACTSTATE", little-endian

struct Header {
  uint64_t magic = kMagic;
  uint32_t format = kStateFormat;
  uint32_t reserved = 0;
  uint64_t body_bytes = 0;
  uint64_t checksum = 0;
};
static_assert(sizeof(Header) == 32);

absl::Status WriteAll(int fd, const char* data, size_t size, off_t at) {
  while (size > 0) {
    const ssize_t n = pwrite(fd, data, size, at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("writing the state image", errno);
    data += n;
    size -= static_cast<size_t>(n);
    at += n;
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* out, size_t size, off_t at) {
  while (size > 0) {
    const ssize_t n = pread(fd, out, size, at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("reading the state image", errno);
    if (n == 0) return absl::DataLossError("the state image ends early");
    out += n;
    size -= static_cast<size_t>(n);
    at += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<UniqueFd> WriteStateImage(const v1::DaemonState& state) {
  std::string body;
  if (!state.SerializeToString(&body)) {
    return absl::InternalError("the daemon state does not serialize");
  }
  if (body.size() + sizeof(Header) > kMaxStateBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon state is ", body.size(), " bytes; an image holds at most ", kMaxStateBytes));
  }
  UniqueFd fd(memfd_create("actstash-state", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus("memfd_create for the state image", errno);
  Header header;
  header.body_bytes = body.size();
  header.checksum = Xxh3(body.data(), body.size());
  if (absl::Status s =
          WriteAll(fd.get(), reinterpret_cast<const char*>(&header), sizeof(header), 0);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = WriteAll(fd.get(), body.data(), body.size(), sizeof(header)); !s.ok()) {
    return s;
  }
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return ErrnoStatus("sealing the state image", errno);
  }
  return fd;
}

absl::StatusOr<v1::DaemonState> ReadStateImage(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoStatus("fstat of the state image", errno);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < sizeof(Header)) {
    return absl::DataLossError(
        absl::StrCat("the state image is ", file_bytes, " bytes, shorter than its header"));
  }
  Header header;
  if (absl::Status s = ReadAll(fd, reinterpret_cast<char*>(&header), sizeof(header), 0); !s.ok()) {
    return s;
  }
  if (header.magic != kMagic) {
    return absl::FailedPreconditionError("not an actstash state image (bad magic)");
  }
  if (header.format != kStateFormat) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state image format ", header.format, "; this actstashd reads format ", kStateFormat));
  }
  if (header.body_bytes > file_bytes - sizeof(Header) ||
      header.body_bytes > kMaxStateBytes - sizeof(Header)) {
    return absl::DataLossError(absl::StrCat("the state image says ", header.body_bytes,
                                            " bytes of state; the file holds ",
                                            file_bytes - sizeof(Header)));
  }
  std::string body(header.body_bytes, '\0');
  if (absl::Status s = ReadAll(fd, body.data(), body.size(), sizeof(Header)); !s.ok()) return s;
  if (Xxh3(body.data(), body.size()) != header.checksum) {
    return absl::DataLossError("the state image fails its checksum");
  }
  v1::DaemonState state;
  if (!state.ParseFromString(body)) {
    return absl::DataLossError("the state image's body does not parse");
  }
  return state;
}

}  // namespace actstash::server
