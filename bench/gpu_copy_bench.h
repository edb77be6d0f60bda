// Internal to gpu_copy_bench: the compute kernel of its overlap measurement,
// launched from gpu_copy_bench.cu (kept free of absl, like kernels/*.cu).
#ifndef ACTSTASH_BENCH_GPU_COPY_BENCH_H_
#define ACTSTASH_BENCH_GPU_COPY_BENCH_H_

#include <cuda_runtime_api.h>

namespace actstash::bench {

// Enqueues a compute-bound kernel on `stream`: `blocks` x `threads` threads,
// each running `iters` iterations of four independent FMA chains in registers
// (no memory traffic besides one float per thread written to `out`, which
// holds blocks * threads floats of device memory). Its run time grows
// linearly with `iters`. Returns this launch's error.
cudaError_t LaunchSpin(float* out, unsigned blocks, unsigned threads, long long iters,
                       cudaStream_t stream);

}  // namespace actstash::bench

#endif  // ACTSTASH_BENCH_GPU_COPY_BENCH_H_
