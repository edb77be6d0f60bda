// ACTSTASH_HD marks functions that run on both the host and a CUDA device.
// Headers that use it (*.cuh in kernels/) compile as plain C++17 too, so the
// CPU implementation and its tests exercise the exact math the GPU runs.
#ifndef ACTSTASH_KERNELS_HD_CUH_
#define ACTSTASH_KERNELS_HD_CUH_

#if defined(__CUDACC__)
#define ACTSTASH_HD __host__ __device__
#else
#define ACTSTASH_HD
#endif

#endif  // ACTSTASH_KERNELS_HD_CUH_
