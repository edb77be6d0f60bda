#include "kernels/checksum64.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/checksum64.cuh"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "Checksum64 reads words little-endian with plain loads");

namespace actstash::kernels {
namespace {

constexpr uint32_t kWordsPerBlock = kChecksumBlockBytes / 8;

// block_hash(b) of a full 4096-byte block. Same value as ChecksumBlock (the
// lane-by-lane form the GPU uses; the tests compare them), but the 32 lane
// chains advance together, which lets a CPU overlap their multiplies.
uint64_t FullBlockInterleaved(const unsigned char* block, uint64_t block_index) {
  uint64_t lanes[kChecksumLanes];
  for (int l = 0; l < kChecksumLanes; ++l) {
    lanes[l] = ChecksumMix64(kChecksumK3 + block_index * kChecksumLanes + static_cast<uint64_t>(l));
  }
  for (uint32_t j = 0; j < kWordsPerBlock; j += kChecksumLanes) {
    for (int l = 0; l < kChecksumLanes; ++l) {
      uint64_t word;
      std::memcpy(&word, block + 8 * (j + static_cast<uint32_t>(l)), 8);
      lanes[l] = ChecksumStep(lanes[l], word);
    }
  }
  uint64_t fold = kChecksumFoldInit;
  for (int l = 0; l < kChecksumLanes; ++l) fold = ChecksumFoldLane(fold, lanes[l]);
  return ChecksumFoldFinish(fold);
}

}  // namespace

uint64_t Checksum64PartialSum(const void* chunk, size_t chunk_bytes, uint64_t first_block) {
  const auto* bytes = static_cast<const unsigned char*>(chunk);
  uint64_t sum = 0;
  const size_t full_blocks = chunk_bytes / kChecksumBlockBytes;
  for (size_t b = 0; b < full_blocks; ++b) {
    sum += FullBlockInterleaved(bytes + b * kChecksumBlockBytes, first_block + b);
  }
  const size_t tail = chunk_bytes % kChecksumBlockBytes;
  if (tail > 0) {
    sum += ChecksumBlock(bytes + full_blocks * kChecksumBlockBytes, static_cast<uint32_t>(tail),
                         first_block + full_blocks);
  }
  return sum;
}

uint64_t Checksum64Finish(uint64_t block_sum, uint64_t total_bytes) {
  return ChecksumFinish(block_sum, total_bytes);
}

uint64_t Checksum64Cpu(const void* data, size_t size, int num_threads) {
  const uint64_t blocks = (size + kChecksumBlockBytes - 1) / kChecksumBlockBytes;
  constexpr uint64_t kMinBlocksPerThread = (1u << 20) / kChecksumBlockBytes;
  const uint64_t threads = std::clamp<uint64_t>(blocks / kMinBlocksPerThread, 1,
                                                static_cast<uint64_t>(std::max(num_threads, 1)));
  if (threads == 1) return ChecksumFinish(Checksum64PartialSum(data, size, 0), size);
  const auto* bytes = static_cast<const unsigned char*>(data);
  const uint64_t per_thread = (blocks + threads - 1) / threads;
  std::vector<uint64_t> sums(threads, 0);
  auto work = [&](uint64_t t) {
    const uint64_t first = t * per_thread;
    if (first >= blocks) return;
    const uint64_t begin = first * kChecksumBlockBytes;
    const uint64_t end = std::min<uint64_t>(size, (first + per_thread) * kChecksumBlockBytes);
    sums[t] = Checksum64PartialSum(bytes + begin, end - begin, first);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (uint64_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (std::thread& thread : pool) thread.join();
  uint64_t sum = 0;
  for (uint64_t s : sums) sum += s;
  return ChecksumFinish(sum, size);
}

}  // namespace actstash::kernels
