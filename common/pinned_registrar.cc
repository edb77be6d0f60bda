#include "common/pinned_registrar.h"

#include <string>

#ifdef ACTSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_device_guard.h"
#include "kernels/cuda_status.h"
#endif

namespace actstash {
namespace {

#ifdef ACTSTASH_HAVE_CUDA
class CudaPinnedRegistrar final : public PinnedRegistrar {
 public:
  explicit CudaPinnedRegistrar(bool only_in_cuda_threads)
      : only_in_cuda_threads_(only_in_cuda_threads) {}
  bool Ready() const override { return !only_in_cuda_threads_ || ThreadHasCudaContext(); }
  absl::Status Register(void* ptr, size_t bytes) override {
    // Portable: usable from every device's context; mapped: kernels may
    // address it (with the same pointer on every GPU actstash supports).
    return ACTSTASH_CUDA_STATUS(
        cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  }
  absl::Status Unregister(void* ptr) override {
    return ACTSTASH_CUDA_STATUS(cudaHostUnregister(ptr));
  }

 private:
  const bool only_in_cuda_threads_;
};
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<PinnedRegistrar>> CreateCudaPinnedRegistrar(
    [[maybe_unused]] bool only_in_cuda_threads) {
#ifndef ACTSTASH_HAVE_CUDA
  return absl::FailedPreconditionError(
      "cannot pin memory for CUDA: actstash was built without CUDA");
#else
  int count = 0;
  absl::Status status = ACTSTASH_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot pin memory for CUDA: no usable device (", status.message(), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("cannot pin memory for CUDA: no CUDA device");
  }
  return std::unique_ptr<PinnedRegistrar>(new CudaPinnedRegistrar(only_in_cuda_threads));
#endif
}

absl::StatusOr<std::unique_ptr<PinnedRegistrar>> RegistrarForPolicy(Tristate policy,
                                                                    std::string* why_not,
                                                                    bool only_in_cuda_threads) {
  if (policy == Tristate::kOff) {
    if (why_not != nullptr) *why_not = "pinning for CUDA is off";
    return std::unique_ptr<PinnedRegistrar>();
  }
  absl::StatusOr<std::unique_ptr<PinnedRegistrar>> registrar =
      CreateCudaPinnedRegistrar(only_in_cuda_threads && policy == Tristate::kAuto);
  if (registrar.ok() || policy == Tristate::kOn) return registrar;
  if (why_not != nullptr) *why_not = std::string(registrar.status().message());
  return std::unique_ptr<PinnedRegistrar>();
}

}  // namespace actstash
