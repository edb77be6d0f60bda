#include "client/store/device_import.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

#ifdef ACTSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_device_guard.h"
#include "common/status_macros.h"
#include "kernels/cuda_status.h"
#endif

namespace actstash::client_internal {
namespace {

#ifdef ACTSTASH_HAVE_CUDA
static_assert(sizeof(cudaIpcMemHandle_t) == kDeviceIpcHandleBytes, "IPC handle size changed");

// Runs `body` with `device` current on this thread, then gives the thread
// back its own context (none is created on GPU 0: cuda_device_guard.h).
template <typename Body>
auto OnDevice(int device, Body body) -> decltype(body()) {
  ScopedCudaDevice scoped(device);
  ACTSTASH_RETURN_IF_ERROR(scoped.status());
  return body();
}

class CudaIpcOpener final : public IpcOpener {
 public:
  absl::StatusOr<void*> Open(absl::string_view handle, int local_device) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("IPC handle of ", handle.size(), " bytes"));
    }
    cudaIpcMemHandle_t ipc{};
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    return OnDevice(local_device, [&]() -> absl::StatusOr<void*> {
      void* base = nullptr;
      ACTSTASH_CUDA_RETURN_IF_ERROR(
          cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess));
      return base;
    });
  }
  absl::Status Close(void* base, int local_device) override {
    return OnDevice(local_device, [&]() -> absl::Status {
      return ACTSTASH_CUDA_STATUS(cudaIpcCloseMemHandle(base));
    });
  }
};
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<IpcOpener>> CreateCudaIpcOpener() {
#ifndef ACTSTASH_HAVE_CUDA
  return absl::FailedPreconditionError(
      "cannot import device pool segments: actstash was built without CUDA");
#else
  int count = 0;
  absl::Status status = ACTSTASH_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!status.ok() || count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot import device pool segments: no CUDA device",
                     status.ok() ? std::string() : absl::StrCat(" (", status.message(), ")")));
  }
  return std::unique_ptr<IpcOpener>(new CudaIpcOpener());
#endif
}

DeviceImporter::DeviceImporter(std::unique_ptr<IpcOpener> opener, int local_device)
    : opener_(std::move(opener)), local_device_(local_device) {}

DeviceImporter::~DeviceImporter() {
  absl::MutexLock lock(&mu_);
  for (const auto& [handle, imported] : imported_) {
    opener_->Close(imported.base, local_device_).IgnoreError();  // nothing left to tell
  }
}

absl::StatusOr<void*> DeviceImporter::Resolve(const DeviceGrant& grant) {
  if (grant.ipc_handle.size() != kDeviceIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("device grant with an IPC handle of ",
                                                   grant.ipc_handle.size(), " bytes (expected ",
                                                   kDeviceIpcHandleBytes, ")"));
  }
  if (grant.bytes == 0 || grant.offset > grant.region_bytes ||
      grant.bytes > grant.region_bytes - grant.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("device grant of ", grant.bytes, " bytes at offset ", grant.offset,
                     " does not fit its region of ", grant.region_bytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto it = imported_.find(grant.ipc_handle);
  if (it == imported_.end()) {
    absl::StatusOr<void*> base = opener_->Open(grant.ipc_handle, local_device_);
    if (!base.ok()) return base.status();
    it = imported_.emplace(grant.ipc_handle, Imported{*base, grant.region_bytes}).first;
  } else if (it->second.region_bytes != grant.region_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("device grant says its region has ", grant.region_bytes,
                     " bytes; the same handle was imported with ", it->second.region_bytes));
  }
  return static_cast<void*>(static_cast<std::byte*>(it->second.base) + grant.offset);
}

size_t DeviceImporter::imported() const {
  absl::MutexLock lock(&mu_);
  return imported_.size();
}

}  // namespace actstash::client_internal
