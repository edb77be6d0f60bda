// Unit tests of the XXH3 checksum helpers, against libxxhash directly.
#include "common/checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace actstash {
namespace {

std::vector<uint8_t> RandomBytes(size_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(size);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

TEST(Xxh3Test, EmptyInputMatchesReference) {
  EXPECT_EQ(Xxh3(nullptr, 0), XXH3_64bits(nullptr, 0));
  EXPECT_EQ(Xxh3("", 0), 0x2D06800538D394C2ull);  // published XXH3_64 of ""
  Xxh3Hasher hasher;
  EXPECT_EQ(hasher.Digest(), XXH3_64bits(nullptr, 0));
  hasher.Update(nullptr, 0);
  EXPECT_EQ(hasher.Digest(), XXH3_64bits(nullptr, 0));
}

TEST(Xxh3Test, AbcMatchesReference) {
  EXPECT_EQ(Xxh3("abc", 3), XXH3_64bits("abc", 3));
  EXPECT_EQ(Xxh3("abc", 3), 0x78AF5F94892F3950ull);  // published XXH3_64 of "abc"
  Xxh3Hasher hasher;
  hasher.Update("a", 1);
  hasher.Update("bc", 2);
  EXPECT_EQ(hasher.Digest(), XXH3_64bits("abc", 3));
}

TEST(Xxh3Test, OneShotMatchesReferenceAtEverySizeClass) {
  // XXH3 has separate code paths for 0-3, 4-8, 9-16, 17-128, 129-240 and
  // longer inputs (and a stripe/block structure beyond 1 KiB).
  const std::vector<uint8_t> data = RandomBytes(70000, 1);
  for (size_t size : {size_t{1}, size_t{3}, size_t{4}, size_t{8}, size_t{9}, size_t{16}, size_t{17},
                      size_t{128}, size_t{129}, size_t{240}, size_t{241}, size_t{1024},
                      size_t{1025}, size_t{65536}, size_t{70000}}) {
    EXPECT_EQ(Xxh3(data.data(), size), XXH3_64bits(data.data(), size)) << size;
  }
}

TEST(Xxh3Test, IncrementalOverRandomChunkingsEqualsOneShot) {
  std::mt19937_64 rng(42);
  for (size_t size : {size_t{0}, size_t{1}, size_t{15}, size_t{200}, size_t{240}, size_t{1000},
                      size_t{4096}, size_t{100003}}) {
    const std::vector<uint8_t> data = RandomBytes(size, size);
    const uint64_t expected = XXH3_64bits(data.data(), data.size());
    ASSERT_EQ(Xxh3(data.data(), data.size()), expected);
    for (int round = 0; round < 20; ++round) {
      Xxh3Hasher hasher;
      size_t pos = 0;
      // Chunks from 0 bytes up to a size that depends on the round, so some
      // rounds feed byte by byte and others in big pieces.
      const size_t max_chunk = size_t{1} << (round % 18);
      while (pos < size) {
        const size_t chunk = std::min<size_t>(rng() % (max_chunk + 1), size - pos);
        hasher.Update(data.data() + pos, chunk);
        pos += chunk;
      }
      EXPECT_EQ(hasher.Digest(), expected) << "size " << size << " round " << round;
    }
  }
}

TEST(Xxh3Test, DigestDoesNotDisturbTheStream) {
  const std::vector<uint8_t> data = RandomBytes(5000, 7);
  Xxh3Hasher hasher;
  hasher.Update(data.data(), 3000);
  const uint64_t partial = hasher.Digest();
  EXPECT_EQ(partial, XXH3_64bits(data.data(), 3000));
  EXPECT_EQ(hasher.Digest(), partial);  // repeatable
  hasher.Update(data.data() + 3000, 2000);
  EXPECT_EQ(hasher.Digest(), XXH3_64bits(data.data(), 5000));
}

TEST(Xxh3Test, MovedHasherContinuesTheStream) {
  const std::vector<uint8_t> data = RandomBytes(3000, 9);
  Xxh3Hasher first;
  first.Update(data.data(), 1000);
  Xxh3Hasher second(std::move(first));
  second.Update(data.data() + 1000, 1000);
  Xxh3Hasher third;
  third.Update("unrelated", 9);
  third = std::move(second);
  third.Update(data.data() + 2000, 1000);
  EXPECT_EQ(third.Digest(), XXH3_64bits(data.data(), data.size()));
}

TEST(Xxh3Test, DifferentDataHashesDifferently) {
  std::vector<uint8_t> data = RandomBytes(4096, 11);
  const uint64_t before = Xxh3(data.data(), data.size());
  data[2048] ^= 1;
  EXPECT_NE(Xxh3(data.data(), data.size()), before);
  EXPECT_NE(Xxh3(data.data(), data.size() - 1), Xxh3(data.data(), data.size()));
}

}  // namespace
}  // namespace actstash
