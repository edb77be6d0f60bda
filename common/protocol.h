// Protocol constants shared by the daemon and its clients.
#ifndef ACTSTASH_COMMON_PROTOCOL_H_
#define ACTSTASH_COMMON_PROTOCOL_H_

#include <cstdint>

namespace actstash {

inline constexpr char kVersion[] = "0.1.0";
// gRPC metadata key carrying the session token (lower case, as gRPC requires).
inline constexpr char kTokenMetadataKey[] = "x-actstash-token";
// The fully qualified service name, as registered with the health service.
inline constexpr char kStashServiceName[] = "actstash.v1.Stash";
// Largest data chunk of Put/Get streams.
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 20;
// gRPC message size limit on both ends: a chunk plus its header, with room.
inline constexpr int kMaxMessageBytes = 4 << 20;
inline constexpr uint64_t kMaxDtypeBytes = 32;
inline constexpr int kMaxShapeDims = 16;
inline constexpr uint64_t kMaxClientNameBytes = 128;
inline constexpr int kMaxDeleteHandles = 65536;
// Environment variable naming the daemon address for clients.
inline constexpr char kAddressEnv[] = "ACTSTASH_ADDRESS";

}  // namespace actstash

#endif  // ACTSTASH_COMMON_PROTOCOL_H_
