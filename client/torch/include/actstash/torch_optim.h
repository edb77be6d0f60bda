// OffloadAdamW for libtorch (C++) trainers: libtorch's AdamW with Adam's
// moments in the node's pool instead of the trainer's heap.
//
//   std::shared_ptr<actstash::Client> client = std::move(*actstash::Client::Connect({}));
//   std::unique_ptr<actstash::torch::OffloadAdamW> opt = std::move(
//       *actstash::torch::OffloadAdamW::Create(client, model->parameters(),
//                                              torch::optim::AdamWOptions(1e-3)));
//   loss.backward(); opt->step(); opt->zero_grad();
//
// The moments (exp_avg, exp_avg_sq, and amsgrad's max_exp_avg_sq) of every
// parameter are tensors over long-lived buffers of the session's leased
// memory (Client::ReserveState): under the session's quota and the node's
// budget, counted apart from activations (ClientUsage.state_bytes, the
// daemon's actstash_optimizer_state_bytes). Each buffer goes back to the
// pool once no tensor views it. libtorch's own AdamW::step runs on them, so
// parameters are bitwise equal to torch::optim::AdamW's; save() writes
// libtorch's format (torch::save), and load() copies the loaded moments into
// the pool buffers, so a run resumes with or without actstash.
//
// The Python package's OffloadAdamW (actstash.optim) offers more: bf16/fp16
// parameters with fp32 master weights, the C++ "fast" step, `fraction`.
// Here: CPU fp32 parameters, dense and contiguous.
//
// Thread-safety: as torch::optim::AdamW (one thread steps at a time). The
// client must stay attached while the optimizer lives (its buffers are the
// session's).
#ifndef ACTSTASH_TORCH_OPTIM_H_
#define ACTSTASH_TORCH_OPTIM_H_

#include <torch/optim/adamw.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "actstash/client.h"

namespace actstash::torch {

// The AdamW state `optimizer` keeps for `param` (an OffloadAdamW's or
// libtorch's own AdamW's), null when it has none. libtorch keys its state
// table by the parameter's TensorImpl, spelled differently across versions.
::torch::optim::AdamWParamState* AdamWStateOf(::torch::optim::Optimizer& optimizer,
                                              const at::Tensor& param);

class OffloadAdamW final : public ::torch::optim::AdamW {
 public:
  // Every parameter is checked before anything is reserved: INVALID_ARGUMENT
  // for one that is not a CPU, fp32, dense, contiguous tensor; FAILED_-
  // PRECONDITION for a client that is not attached (leased memory needs a
  // local daemon on a Unix socket); RESOURCE_EXHAUSTED when the session's
  // quota or the pool cannot hold the states, with nothing kept.
  static absl::StatusOr<std::unique_ptr<OffloadAdamW>> Create(
      std::shared_ptr<Client> client, std::vector<at::Tensor> params,
      ::torch::optim::AdamWOptions options = {});

  // libtorch's load, then the loaded moments go into this optimizer's pool
  // buffers (libtorch's would replace them with heap tensors).
  void load(::torch::serialize::InputArchive& archive) override;
  // Bytes of this optimizer's states in the pool.
  uint64_t offloaded_bytes() const;

 private:
  OffloadAdamW(std::vector<at::Tensor> params, ::torch::optim::AdamWOptions options)
      : AdamW(std::move(params), options) {}
  // One parameter's states in the pool (max_exp_avg_sq: amsgrad only).
  struct PoolStates {
    at::Tensor param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  };
  std::vector<PoolStates> pooled_;
};

}  // namespace actstash::torch

#endif  // ACTSTASH_TORCH_OPTIM_H_
