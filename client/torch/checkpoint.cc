// Checkpoint: a custom autograd Function that saves only fn's inputs and
// recomputes fn in backward (torch.utils.checkpoint, reentrant variant).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <utility>

#include "actstash/torch.h"

namespace actstash::torch {
namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

// Everything backward needs besides the saved inputs (kept in ctx->saved_data
// as a capsule: AutogradContext stores only IValues).
struct CheckpointState : ::torch::CustomClassHolder {
  CheckpointFn fn;
  at::Tensor rng_state;             // the CPU generator's state before fn ran
  std::vector<bool> requires_grad;  // of each input, in forward
};

at::Tensor GetCpuRngState() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetCpuRngState(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Sets the CPU RNG state for its lifetime, then puts back the one it found.
class ForkCpuRng {
 public:
  explicit ForkCpuRng(const at::Tensor& state) : previous_(GetCpuRngState()) {
    SetCpuRngState(state);
  }
  ~ForkCpuRng() { SetCpuRngState(previous_); }
  ForkCpuRng(const ForkCpuRng&) = delete;
  ForkCpuRng& operator=(const ForkCpuRng&) = delete;

 private:
  at::Tensor previous_;
};

class CheckpointFunction : public ::torch::autograd::Function<CheckpointFunction> {
 public:
  // `anchor` is a tensor that requires grad, passed when no input does, so
  // that the graph (and the parameters inside fn) is still reached.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state,
                               at::TensorList inputs, c10::optional<at::Tensor> anchor) {
    ctx->set_materialize_grads(false);  // unused outputs get no gradient, as in plain autograd
    state->rng_state = GetCpuRngState();
    std::vector<at::Tensor> outputs;
    {
      at::NoGradGuard no_grad;  // (Function::apply has already turned grad off)
      outputs = state->fn(inputs.vec());
    }
    ctx->save_for_backward(inputs.vec());  // saved, hooks included, by apply()
    ctx->saved_data["state"] = at::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    // Unpacking fetches offloaded inputs back from the daemon.
    const variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      inputs.push_back(saved[i].detach().requires_grad_(state->requires_grad[i]));
    }
    std::vector<at::Tensor> outputs;
    {
      ForkCpuRng rng(state->rng_state);  // the same dropout masks as in forward
      OffloadScope no_offload(nullptr);  // the recomputation is used right away
      at::AutoGradMode grad(true);
      outputs = state->fn(inputs);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "actstash::torch::Checkpoint: fn returned ",
                outputs.size(), " tensors in recomputation, ", grad_outputs.size(), " in forward");
    variable_list roots;
    variable_list grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) ::torch::autograd::backward(roots, grads);
    // One gradient per forward argument: state, each input, anchor.
    variable_list result;
    result.reserve(inputs.size() + 2);
    result.emplace_back();
    for (const at::Tensor& input : inputs) {
      result.push_back(input.requires_grad() ? input.grad() : at::Tensor());
    }
    result.emplace_back();
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> Checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                   std::shared_ptr<Offloader> offloader) {
  if (!at::GradMode::is_enabled()) return fn(inputs);  // nothing to recompute for
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = std::move(fn);
  bool any_requires_grad = false;
  for (const at::Tensor& input : inputs) {
    TORCH_CHECK(input.defined(), "actstash::torch::Checkpoint: undefined input tensor");
    state->requires_grad.push_back(input.requires_grad());
    any_requires_grad = any_requires_grad || input.requires_grad();
  }
  c10::optional<at::Tensor> anchor;
  if (!any_requires_grad) anchor = at::empty({0}).requires_grad_(true);
  std::optional<OffloadScope> scope;
  if (offloader != nullptr) scope.emplace(std::move(offloader));
  return CheckpointFunction::apply(std::move(state), at::TensorList(inputs), std::move(anchor));
}

at::Tensor Checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& input,
                      std::shared_ptr<Offloader> offloader) {
  CheckpointFn wrapped = [fn = std::move(fn)](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{fn(in[0])};
  };
  return Checkpoint(std::move(wrapped), {input}, std::move(offloader)).at(0);
}

}  // namespace actstash::torch
