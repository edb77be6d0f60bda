// Internal to gpu_copy_bench: the entry point of its sections 3 (engine) and
// 4 (strided), actstash's own Client + CudaCopyEngine path next to the
// cudaHostAlloc baseline; defined in gpu_copy_bench_engine.cc.
#ifndef ACTSTASH_BENCH_GPU_COPY_BENCH_ENGINE_H_
#define ACTSTASH_BENCH_GPU_COPY_BENCH_ENGINE_H_

#include <cuda_runtime_api.h>

#include "bench/gpu_copy_bench_common.h"

namespace actstash::bench::gpu_copy {

// Starts an actstashd (unless options.address names one), connects an
// attached client with pinned leases and a CudaCopyEngine on options.device,
// runs section 3 when options.run_engine and section 4 when
// options.run_strided, and tears all of it down again. `m` needs pinned and
// device memory (its segment is not used); `stream` is a non-blocking stream
// for the baseline's copies.
void RunEngineSections(const Options& options, const Memory& m, cudaStream_t stream);

}  // namespace actstash::bench::gpu_copy

#endif  // ACTSTASH_BENCH_GPU_COPY_BENCH_ENGINE_H_
