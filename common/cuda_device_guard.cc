#include "common/cuda_device_guard.h"

#include <cuda_runtime_api.h>

#include <mutex>

#include "common/cuda_status.h"

namespace actstash {
namespace {

// CUresult cuCtxGetCurrent(CUcontext*), without linking the driver library.
using CtxGetCurrent = int (*)(void**);

CtxGetCurrent ResolveCtxGetCurrent() {
  static CtxGetCurrent fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &symbol, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<CtxGetCurrent>(symbol);
    }
  });
  return fn;
}

}  // namespace

bool ThreadHasCudaContext() {
  if (CtxGetCurrent get = ResolveCtxGetCurrent(); get != nullptr) {
    void* context = nullptr;
    return get(&context) == 0 && context != nullptr;
  }
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess;
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
  int current = 0;
  const bool had_context = ThreadHasCudaContext();
  if (had_context) {
    status_ = ACTSTASH_CUDA_STATUS(cudaGetDevice(&current));
    if (!status_.ok() || current == device) return;
  }
  status_ = ACTSTASH_CUDA_STATUS(cudaSetDevice(device));
  if (status_.ok() && had_context) previous_ = current;
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

}  // namespace actstash
