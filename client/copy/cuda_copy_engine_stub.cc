// The CUDA entry points of copy_engine.h in a build without CUDA (compiled
// instead of cuda_runtime.cc).
#include <memory>

#include "actstash/copy_engine.h"

namespace actstash {

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(
    const CudaCopyEngineOptions& /*options*/) {
  return absl::FailedPreconditionError("actstash was built without CUDA");
}

bool CudaDeviceAvailable() { return false; }

}  // namespace actstash
