// Checksum64: the block-parallel 64-bit checksum of kernels/checksum64.h,
// element math shared by the CPU (checksum64.cc) and the GPU
// (checksum64_kernels.cu). Definition (all arithmetic modulo 2^64):
//
//   mix64(x)         = x ^= x >> 30; x *= 0xBF58476D1CE4E5B9;
//                      x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31
//                      (the SplitMix64 finalizer)
//   step(s, w)       = t = (s ^ w) * K2; t ^ (t >> 29)
//   K1 = 0x9E3779B97F4A7C15, K2 = 0xC2B2AE3D27D4EB4F, K3 = 0x165667B19E3779F9
//
//   The n input bytes are cut into blocks of 4096 bytes (the last one may be
//   shorter); block b holds bytes [4096 b, min(n, 4096 (b + 1))). Its bytes
//   are read as 8-byte little-endian words w_0 .. w_{m-1}, m = ceil(len/8),
//   the last word zero-padded.
//   Lane l (0..31) of block b:  s = mix64(K3 + 32 b + l);
//                               for j = l, l + 32, l + 64, ... < m: s = step(s, w_j)
//   Block hash:                 h = K1; for l = 0..31: h = step(h, mix64(s_l));
//                               block_hash(b) = mix64(h)
//   Checksum64(data, n)       = mix64(S ^ mix64(n + K3)),
//                               S = wrapping sum of block_hash(b) over all blocks
//
// The sum makes the result independent of the order (and partition) in
// which blocks are reduced. Every step is a bijection in the running state
// and in the word it takes in, so for a fixed length a change confined to one
// 8-byte word (in particular any single-byte change) always changes the
// result; a block's position is in its lane seeds, and n in the finish.
// Not a cryptographic hash: it detects corruption, not tampering.
#ifndef ACTSTASH_KERNELS_CHECKSUM64_CUH_
#define ACTSTASH_KERNELS_CHECKSUM64_CUH_

#include <cstdint>
#include <cstring>

#include "kernels/hd.cuh"

namespace actstash::kernels {

inline constexpr uint64_t kChecksumBlockBytes = 4096;
inline constexpr int kChecksumLanes = 32;
inline constexpr uint64_t kChecksumK1 = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kChecksumK2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kChecksumK3 = 0x165667B19E3779F9ull;

ACTSTASH_HD inline uint64_t ChecksumMix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

ACTSTASH_HD inline uint64_t ChecksumStep(uint64_t state, uint64_t word) {
  const uint64_t t = (state ^ word) * kChecksumK2;
  return t ^ (t >> 29);
}

// Word j of a block of `len` bytes (1..4096), little-endian, zero-padded.
// On a device, reads 8 bytes with one load when they are in range and
// 8-byte aligned (a device is little-endian).
ACTSTASH_HD inline uint64_t ChecksumLoadWord(const unsigned char* block, uint32_t len, uint32_t j) {
  const unsigned char* p = block + 8u * j;
  const uint32_t avail = len - 8u * j;
  if (avail >= 8) {
#if defined(__CUDA_ARCH__)
    if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) return *reinterpret_cast<const uint64_t*>(p);
#else
    uint64_t word;  // hosts are little-endian (checked in checksum64.cc)
    std::memcpy(&word, p, 8);
    return word;
#endif
  }
  uint64_t word = 0;
  const uint32_t count = avail < 8 ? avail : 8;
  for (uint32_t k = 0; k < count; ++k) word |= static_cast<uint64_t>(p[k]) << (8 * k);
  return word;
}

// Lane `lane` of block `block_index` (`block` points at its first byte, `len`
// is 1..4096): the GPU runs one lane per thread of a warp.
ACTSTASH_HD inline uint64_t ChecksumLane(const unsigned char* block, uint32_t len,
                                         uint64_t block_index, int lane) {
  uint64_t s =
      ChecksumMix64(kChecksumK3 + block_index * kChecksumLanes + static_cast<uint64_t>(lane));
  const uint32_t words = (len + 7u) / 8u;
  for (uint32_t j = static_cast<uint32_t>(lane); j < words; j += kChecksumLanes) {
    s = ChecksumStep(s, ChecksumLoadWord(block, len, j));
  }
  return s;
}

// Folds the 32 lane states, in lane order, into the block hash. The GPU
// mixes each lane's state in its own thread (ChecksumMix64) and only folds
// the mixed values serially (ChecksumFoldMixed).
inline constexpr uint64_t kChecksumFoldInit = kChecksumK1;
ACTSTASH_HD inline uint64_t ChecksumFoldMixed(uint64_t fold, uint64_t mixed_lane_state) {
  return ChecksumStep(fold, mixed_lane_state);
}
ACTSTASH_HD inline uint64_t ChecksumFoldLane(uint64_t fold, uint64_t lane_state) {
  return ChecksumFoldMixed(fold, ChecksumMix64(lane_state));
}
ACTSTASH_HD inline uint64_t ChecksumFoldFinish(uint64_t fold) { return ChecksumMix64(fold); }

// block_hash(b) from the definition, computed lane after lane.
ACTSTASH_HD inline uint64_t ChecksumBlock(const unsigned char* block, uint32_t len,
                                          uint64_t block_index) {
  uint64_t fold = kChecksumFoldInit;
  for (int lane = 0; lane < kChecksumLanes; ++lane) {
    fold = ChecksumFoldLane(fold, ChecksumLane(block, len, block_index, lane));
  }
  return ChecksumFoldFinish(fold);
}

// The final value from the wrapping sum S of all block hashes and the length.
ACTSTASH_HD inline uint64_t ChecksumFinish(uint64_t block_sum, uint64_t total_bytes) {
  return ChecksumMix64(block_sum ^ ChecksumMix64(total_bytes + kChecksumK3));
}

}  // namespace actstash::kernels

#endif  // ACTSTASH_KERNELS_CHECKSUM64_CUH_
