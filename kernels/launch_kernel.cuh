// Internal (CUDA translation units only): launches a kernel through
// cudaLaunchKernel, which returns THIS launch's error. (A <<<>>> launch only
// leaves its error in the thread's last-error slot, where cudaGetLastError
// would also report an unrelated earlier failure of the caller's.)
#ifndef ACTSTASH_KERNELS_LAUNCH_KERNEL_CUH_
#define ACTSTASH_KERNELS_LAUNCH_KERNEL_CUH_

#include <cuda_runtime.h>

namespace actstash::kernels::internal {

template <typename T>
struct NonDeduced {
  using Type = T;
};

// Enqueues kernel<<<grid, threads, 0, stream>>>(args...); the arguments are
// converted to the kernel's parameter types first.
template <typename... Params>
cudaError_t LaunchKernel(void (*kernel)(Params...), unsigned grid, unsigned threads,
                         cudaStream_t stream, typename NonDeduced<Params>::Type... args) {
  void* pointers[] = {static_cast<void*>(&args)..., nullptr};
  return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(threads),
                          pointers, 0, stream);
}

}  // namespace actstash::kernels::internal

#endif  // ACTSTASH_KERNELS_LAUNCH_KERNEL_CUH_
