// Diagnostic: does a plain libtorch CUDA backward work in a C++ process here?
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/cuda/CUDAFunctions.h>
#include <sys/wait.h>
#include <torch/csrc/autograd/autograd.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "plain";
  std::printf("mode %s\n", mode);
  if (std::strstr(mode, "fork")) {
    pid_t p = fork();
    if (p == 0) {
      execl("/bin/true", "true", (char*)nullptr);
      _exit(1);
    }
    waitpid(p, nullptr, 0);
  }
  if (std::strstr(mode, "lazy")) at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  std::printf("c10::cuda::device_count %d is_available %d\n", (int)c10::cuda::device_count(),
              (int)at::cuda::is_available());
  auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  std::printf("guard impl %p deviceCount %d\n", (void*)impl, impl ? (int)impl->deviceCount() : -1);
  for (int i = 0; i < (int)c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES; ++i) {
    auto* im = c10::impl::device_guard_impl_registry[i].load();
    if (im)
      std::printf("registry[%d] type %d count %d\n", i, (int)im->type(), (int)im->deviceCount());
  }
  try {
    at::Tensor x = at::randn({4, 4}, at::TensorOptions().device(at::kCUDA)).requires_grad_();
    std::printf("x device %s\n", x.device().str().c_str());
    at::Tensor loss = (x * x).sum();
    std::printf("loss device %s\n", loss.device().str().c_str());
    loss.backward();
    std::printf("backward ok, grad sum %f\n", x.grad().sum().item<float>());
  } catch (const std::exception& e) {
    std::printf("backward FAILED: %.300s\n", e.what());
    return 1;
  }
  return 0;
}
