// Checksum64 on the CPU: a 64-bit integrity checksum designed to be computed
// block-parallel (4096-byte blocks, 32 lanes per block) with the same value
// on a CPU and a GPU (checksum64_cuda.h). Its exact definition is in
// kernels/checksum64.cuh. Not XXH3 (common/checksum.h): that one is the
// wire checksum of inline Put/Get; this one is for bulk data verified where
// it sits (device or pinned memory, spill restore).
//
// Thread-safety: the functions keep no state; any number of threads may run
// them at once, also over the same input.
#ifndef ACTSTASH_KERNELS_CHECKSUM64_H_
#define ACTSTASH_KERNELS_CHECKSUM64_H_

#include <cstddef>
#include <cstdint>

namespace actstash::kernels {

// Checksum64 of `size` bytes at `data` (may be null when size is 0), on
// `num_threads` threads (values < 1 count as 1; the calling thread is one of
// them; threads are only used for inputs of at least 1 MiB per thread). The
// value does not depend on the thread count.
uint64_t Checksum64Cpu(const void* data, size_t size, int num_threads = 1);

// Incremental use: the wrapping sum S of the block hashes of blocks
// first_block, first_block + 1, ... where `chunk` holds `chunk_bytes` bytes
// starting at byte 4096 * first_block of the whole input. Every chunk but the
// input's last must be a whole number of blocks (chunk_bytes % 4096 == 0);
// the last may end anywhere. Add (wrapping) the partial sums of any partition
// of the input, in any order, and pass the total to Checksum64Finish.
uint64_t Checksum64PartialSum(const void* chunk, size_t chunk_bytes, uint64_t first_block);

// The checksum from the sum of all block hashes and the total input length.
uint64_t Checksum64Finish(uint64_t block_sum, uint64_t total_bytes);

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_CHECKSUM64_H_
