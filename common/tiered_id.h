// The layout of the 64-bit ids that name stored bytes by tier: the daemon's
// lease ids and the client's tickets. One codec, so that the daemon, the
// client and its stores agree on the bits:
//
//   bit 63       inline: the daemon stores the bytes and the rest is a Put
//                handle (client tickets only; never set in a lease id)
//   bits 56..62  tier: 0 the host pool, 1 + i the device pool of index i
//   bits 0..55   the serial within its tier (a lease's number, a store's
//                ticket), never 0 for a lease
//
// An id from a client is checked by whoever decodes it: a tier or serial
// that names nothing is NOT_FOUND there, never an index out of range.
//
// Thread-safety: constants and pure functions.
#ifndef ACTSTASH_COMMON_TIERED_ID_H_
#define ACTSTASH_COMMON_TIERED_ID_H_

#include <cstdint>

namespace actstash::tiered_id {

inline constexpr int kTierShift = 56;
inline constexpr uint64_t kInlineBit = uint64_t{1} << 63;
inline constexpr uint64_t kTierMask = uint64_t{0x7f} << kTierShift;
inline constexpr uint64_t kSerialMask = (uint64_t{1} << kTierShift) - 1;
inline constexpr uint32_t kMaxTier = 0x7f;

// `serial` (< 2^56) in tier `tier` (<= kMaxTier).
constexpr uint64_t Make(uint32_t tier, uint64_t serial) {
  return (uint64_t{tier} << kTierShift) | (serial & kSerialMask);
}
constexpr uint32_t TierOf(uint64_t id) {
  return static_cast<uint32_t>((id & kTierMask) >> kTierShift);
}
constexpr uint64_t SerialOf(uint64_t id) { return id & kSerialMask; }

// The ticket of bytes the daemon stores under Put handle `handle` (< 2^63).
constexpr uint64_t MakeInline(uint64_t handle) { return handle | kInlineBit; }
constexpr bool IsInline(uint64_t id) { return (id & kInlineBit) != 0; }
constexpr uint64_t HandleOf(uint64_t inline_id) { return inline_id & ~kInlineBit; }

}  // namespace actstash::tiered_id

#endif  // ACTSTASH_COMMON_TIERED_ID_H_
