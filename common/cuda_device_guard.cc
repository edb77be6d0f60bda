#include "common/cuda_device_guard.h"

#include <cuda_runtime_api.h>

#include <mutex>

#include "kernels/cuda_status.h"

namespace actstash {
namespace {

// The driver's cuCtxGetCurrent/cuCtxSetCurrent (CUresult f(CUcontext*) and
// CUresult f(CUcontext)), reached without linking the driver library.
using CtxGetCurrent = int (*)(void**);
using CtxSetCurrent = int (*)(void*);

struct DriverCalls {
  CtxGetCurrent get = nullptr;
  CtxSetCurrent set = nullptr;
};

const DriverCalls& Driver() {
  static DriverCalls calls;
  static std::once_flag once;
  std::call_once(once, [] {
    auto resolve = [](const char* name) -> void* {
      void* symbol = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion(name, &symbol, 12000, cudaEnableDefault, &found) ==
              cudaSuccess &&
          found == cudaDriverEntryPointSuccess) {
        return symbol;
      }
      return nullptr;
    };
    calls.get = reinterpret_cast<CtxGetCurrent>(resolve("cuCtxGetCurrent"));
    calls.set = reinterpret_cast<CtxSetCurrent>(resolve("cuCtxSetCurrent"));
  });
  return calls;
}

}  // namespace

bool ThreadHasCudaContext() {
  // Unknown (no driver entry point): say no, so that nothing creates or
  // switches contexts on a guess.
  void* context = nullptr;
  return Driver().get != nullptr && Driver().get(&context) == 0 && context != nullptr;
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
  had_context_ = ThreadHasCudaContext();
  int current = 0;
  if (had_context_) {
    status_ = ACTSTASH_CUDA_STATUS(cudaGetDevice(&current));
    if (!status_.ok() || current == device) return;
  }
  status_ = ACTSTASH_CUDA_STATUS(cudaSetDevice(device));
  if (!status_.ok()) return;
  if (had_context_) {
    previous_ = current;
  } else {
    unbind_ = true;  // the thread had no context: leave it without one
  }
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
  if (unbind_ && Driver().set != nullptr) (void)Driver().set(nullptr);
}

}  // namespace actstash
