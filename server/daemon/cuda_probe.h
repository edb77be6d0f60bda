// What the daemon can see of CUDA, for its start-up log.
#ifndef ACTSTASH_SERVER_DAEMON_CUDA_PROBE_H_
#define ACTSTASH_SERVER_DAEMON_CUDA_PROBE_H_

#include <string>

namespace actstash::server {

// One line: "built without CUDA", "no CUDA device (<CUDA error>)" or
// "2 CUDA devices: NVIDIA H100 (sm_90, 80.0 GiB), ...". Never fails.
// Thread-safe.
std::string DescribeCudaDevices();

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_DAEMON_CUDA_PROBE_H_
