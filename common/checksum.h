// Payload checksum: XXH3 64-bit with seed 0 (ChecksumAlgorithm XXH3_64 in
// stash.proto), computed incrementally over chunks.
#ifndef ACTSTASH_COMMON_CHECKSUM_H_
#define ACTSTASH_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace actstash {

// Not thread-safe; one instance per stream. Move-only.
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  ~Xxh3Hasher();
  Xxh3Hasher(Xxh3Hasher&&) noexcept;
  Xxh3Hasher& operator=(Xxh3Hasher&&) noexcept;
  Xxh3Hasher(const Xxh3Hasher&) = delete;
  Xxh3Hasher& operator=(const Xxh3Hasher&) = delete;

  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// One-shot XXH3 64 of a buffer.
uint64_t Xxh3(const void* data, size_t size);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_CHECKSUM_H_
