// PinnedRegistrar: page-locks host memory for a GPU's copy engines
// (cudaHostRegister, portable and mapped), so that cudaMemcpyAsync to and
// from it is asynchronous and runs at full bandwidth, and kernels (the
// strided gather) can write it directly. Memory that is not registered still
// works with every copy, but the driver stages it through its own pinned
// buffers: slower, and the copy no longer overlaps with the caller.
//
// Thread-safety: Register and Unregister may be called from any thread; a
// range must be unregistered before it is unmapped.
#ifndef ACTSTASH_COMMON_PINNED_REGISTRAR_H_
#define ACTSTASH_COMMON_PINNED_REGISTRAR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tristate.h"

namespace actstash {

class PinnedRegistrar {
 public:
  virtual ~PinnedRegistrar() = default;
  // Registers [ptr, ptr + bytes). Errors carry the CUDA error and file:line
  // (RESOURCE_EXHAUSTED when the driver could not lock the pages).
  virtual absl::Status Register(void* ptr, size_t bytes) = 0;
  // Unregisters a range that Register accepted, by its start.
  virtual absl::Status Unregister(void* ptr) = 0;
  // False when registering now would be pointless: a registrar made with
  // `only_in_cuda_threads` whose calling thread has no CUDA context (a CPU
  // trainer on a GPU node); registering would create one on GPU 0.
  virtual bool Ready() const { return true; }
};

// A registrar that uses the CUDA runtime. FAILED_PRECONDITION when this build
// has no CUDA or no device can be used (the message says which). With
// `only_in_cuda_threads`, Ready() is whether the calling thread has a CUDA
// context.
absl::StatusOr<std::unique_ptr<PinnedRegistrar>> CreateCudaPinnedRegistrar(
    bool only_in_cuda_threads = false);

// The registrar `policy` asks for: null for kOff, and for kAuto when no
// device is present (`why_not`, when given, gets the reason); kOn without a
// device is the error of CreateCudaPinnedRegistrar.
// `only_in_cuda_threads` applies to kAuto.
absl::StatusOr<std::unique_ptr<PinnedRegistrar>> RegistrarForPolicy(
    Tristate policy, std::string* why_not = nullptr, bool only_in_cuda_threads = false);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_PINNED_REGISTRAR_H_
