// ScopedCudaDevice: makes a CUDA device current on the calling thread for a
// scope, then gives the thread back what it had. Only for translation units
// built with CUDA (ACTSTASH_HAVE_CUDA).
//
// Why not just cudaGetDevice/cudaSetDevice: on a thread with no current
// context cudaGetDevice reports device 0, and cudaSetDevice(0) creates GPU
// 0's primary context (hundreds of MiB, and a failure under exclusive
// compute mode) in a process that may never use GPU 0. The guard restores
// the previous device's primary context where the thread had a context (a
// non-primary context the caller made itself is not restored: actstash
// assumes the runtime API's primary contexts, as torch does), and leaves a
// thread that had none without one. Needs CUDA >= 12.5 (driver entry points
// by version). Thread-safety: per thread, as CUDA's current device.
#ifndef ACTSTASH_COMMON_CUDA_DEVICE_GUARD_H_
#define ACTSTASH_COMMON_CUDA_DEVICE_GUARD_H_

#include "absl/status/status.h"

namespace actstash {

// Whether the calling thread has a current CUDA context (cuCtxGetCurrent,
// reached through the runtime's driver entry points; false when it cannot
// be reached).
bool ThreadHasCudaContext();

class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device);
  ~ScopedCudaDevice();
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;

  // Whether `device` could be made current.
  const absl::Status& status() const { return status_; }

 private:
  bool had_context_ = false;
  int previous_ = -1;    // restored when >= 0
  bool unbind_ = false;  // leave the thread without a context again
  absl::Status status_;
};

}  // namespace actstash

#endif  // ACTSTASH_COMMON_CUDA_DEVICE_GUARD_H_
