#include "server/daemon/cuda_probe.h"

#ifdef ACTSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "common/units.h"
#include "kernels/cuda_status.h"
#endif

namespace actstash::server {

std::string DescribeCudaDevices() {
#ifndef ACTSTASH_HAVE_CUDA
  return "built without CUDA";
#else
  int count = 0;
  absl::Status status = ACTSTASH_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!status.ok()) return absl::StrCat("no CUDA device (", status.message(), ")");
  if (count == 0) return "no CUDA device";
  std::string text = absl::StrCat(count, " CUDA device", count == 1 ? "" : "s", ":");
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    status = ACTSTASH_CUDA_STATUS(cudaGetDeviceProperties(&prop, i));
    if (!status.ok()) {
      absl::StrAppend(&text, i == 0 ? " " : ", ", "#", i, " (", status.message(), ")");
      continue;
    }
    absl::StrAppend(&text, i == 0 ? " " : ", ", prop.name, " (sm_", prop.major, prop.minor, ", ",
                    FormatBytes(prop.totalGlobalMem), ")");
  }
  return text;
#endif
}

}  // namespace actstash::server
