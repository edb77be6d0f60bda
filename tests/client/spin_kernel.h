// Test-only CUDA helpers for cuda_copy_engine_gpu_test: a kernel that keeps a
// stream busy (a deliberately slow "compute stream") and one that fills a
// buffer. Launches are asynchronous on `stream`; they return the launch error.
#ifndef ACTSTASH_TESTS_CLIENT_SPIN_KERNEL_H_
#define ACTSTASH_TESTS_CLIENT_SPIN_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace actstash::testing {

// One thread spins for about `cycles` GPU clock cycles.
cudaError_t LaunchSpin(int64_t cycles, cudaStream_t stream);

// bytes[i] = (seed + i * 7) & 0xff for i < n.
cudaError_t LaunchFill(uint8_t* bytes, size_t n, uint32_t seed, cudaStream_t stream);

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTS_CLIENT_SPIN_KERNEL_H_
