#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/input-archive.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "actstash/torch_optim.h"

namespace actstash::torch {
namespace {

using ::torch::optim::AdamWParamState;

// The key of a parameter's state in libtorch's Optimizer::state(): the
// TensorImpl's address, printed (libtorch 1.13) or as a pointer (2.x).
template <typename Key>
Key StateKeyOf(const at::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return key.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

// A zeroed fp32 tensor shaped as `param` over a ReserveState'd buffer, given
// back when the last tensor viewing it goes.
absl::StatusOr<at::Tensor> PoolTensor(const std::shared_ptr<Client>& client,
                                      const at::Tensor& param) {
  const size_t nbytes = std::max<size_t>(static_cast<size_t>(param.numel()) * sizeof(float), 1);
  absl::StatusOr<Reservation> reserved = client->ReserveState(nbytes);
  if (!reserved.ok()) return reserved.status();
  const Ticket ticket = reserved->ticket;
  at::Tensor tensor = at::from_blob(
      reserved->data, param.sizes(),
      [client, ticket](void*) { (void)client->ReleaseState(ticket); },
      at::TensorOptions().dtype(at::kFloat));
  return tensor.zero_();
}

absl::Status CheckParams(const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const std::string where = absl::StrCat("OffloadAdamW: parameter ", i);
    if (!p.defined()) return absl::InvalidArgumentError(absl::StrCat(where, " is undefined"));
    const std::string what = absl::StrCat(where, " (", p.toString(), ", ", p.device().str(), ")");
    if (p.layout() != at::kStrided) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is sparse: not supported"));
    }
    if (!p.device().is_cpu()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is not on the CPU: the GPU path is not built"));
    }
    if (p.scalar_type() != at::kFloat) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is not fp32 (bf16/fp16 with master weights: the Python package only)"));
    }
    if (!p.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is not contiguous"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOptions(const ::torch::optim::AdamWOptions& o) {
  const auto [beta1, beta2] = o.betas();
  if (!(o.lr() >= 0) || !(o.eps() >= 0) || !(o.weight_decay() >= 0) || !(beta1 >= 0) ||
      !(beta1 < 1) || !(beta2 >= 0) || !(beta2 < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OffloadAdamW: lr ", o.lr(), ", eps ", o.eps(), ", weight_decay ", o.weight_decay(),
        " must be >= 0 and betas (", beta1, ", ", beta2, ") in [0, 1)"));
  }
  return absl::OkStatus();
}

}  // namespace

::torch::optim::AdamWParamState* AdamWStateOf(::torch::optim::Optimizer& optimizer,
                                              const at::Tensor& param) {
  using Key = std::decay_t<decltype(optimizer.state().begin()->first)>;
  auto it = optimizer.state().find(StateKeyOf<Key>(param));
  return it == optimizer.state().end() ? nullptr : static_cast<AdamWParamState*>(it->second.get());
}

absl::StatusOr<std::unique_ptr<OffloadAdamW>> OffloadAdamW::Create(
    std::shared_ptr<Client> client, std::vector<at::Tensor> params,
    ::torch::optim::AdamWOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("OffloadAdamW: a null client");
  if (absl::Status s = CheckParams(params); !s.ok()) return s;
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  if (!client->attached()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OffloadAdamW: the states go to leased pool memory, which needs an attached client "
        "(a local daemon on a Unix socket): ",
        client->attach_status().message()));
  }
  std::unique_ptr<OffloadAdamW> opt(new OffloadAdamW(params, options));
  using Key = std::decay_t<decltype(opt->state().begin()->first)>;
  uint64_t elements = 0;
  for (const at::Tensor& p : params) elements += static_cast<uint64_t>(p.numel());
  const uint64_t needed = (options.amsgrad() ? 3 : 2) * sizeof(float) * elements;
  uint64_t bytes = 0;
  for (const at::Tensor& p : params) {
    PoolStates pool{p, {}, {}, {}};
    for (at::Tensor* state : {&pool.exp_avg, &pool.exp_avg_sq, &pool.max_exp_avg_sq}) {
      if (state == &pool.max_exp_avg_sq && !options.amsgrad()) break;
      absl::StatusOr<at::Tensor> tensor = PoolTensor(client, p);
      if (!tensor.ok()) {
        // `opt` and every buffer reserved so far go back on return.
        return absl::Status(
            tensor.status().code(),
            absl::StrCat("OffloadAdamW: the states need ", needed, " bytes of pool memory; after ",
                         bytes, " the session cannot hold more (", tensor.status().message(),
                         "); nothing was kept"));
      }
      bytes += static_cast<uint64_t>(p.numel()) * sizeof(float);
      *state = *std::move(tensor);
    }
    auto state = std::make_unique<AdamWParamState>();
    state->step(0);
    state->exp_avg(pool.exp_avg);
    state->exp_avg_sq(pool.exp_avg_sq);
    if (options.amsgrad()) state->max_exp_avg_sq(pool.max_exp_avg_sq);
    opt->state()[StateKeyOf<Key>(p)] = std::move(state);
    opt->pooled_.push_back(std::move(pool));
  }
  return opt;
}

void OffloadAdamW::load(::torch::serialize::InputArchive& archive) {
  AdamW::load(archive);
  using Key = std::decay_t<decltype(state().begin()->first)>;
  for (PoolStates& pool : pooled_) {
    AdamWParamState* found = AdamWStateOf(*this, pool.param);
    if (found == nullptr) {  // not stepped when saved: fresh states, in the pool
      auto fresh = std::make_unique<AdamWParamState>();
      fresh->step(0);
      found = fresh.get();
      state()[StateKeyOf<Key>(pool.param)] = std::move(fresh);
    }
    AdamWParamState& loaded = *found;
    auto into = [](at::Tensor& view, const at::Tensor& from) {
      if (!view.defined()) return;
      if (from.defined()) {
        view.copy_(from);
      } else {
        view.zero_();
      }
    };
    into(pool.exp_avg, loaded.exp_avg());
    into(pool.exp_avg_sq, loaded.exp_avg_sq());
    into(pool.max_exp_avg_sq, loaded.max_exp_avg_sq());
    loaded.exp_avg(pool.exp_avg);
    loaded.exp_avg_sq(pool.exp_avg_sq);
    if (pool.max_exp_avg_sq.defined()) loaded.max_exp_avg_sq(pool.max_exp_avg_sq);
  }
}

uint64_t OffloadAdamW::offloaded_bytes() const {
  uint64_t bytes = 0;
  for (const PoolStates& pool : pooled_) {
    for (const at::Tensor* t : {&pool.exp_avg, &pool.exp_avg_sq, &pool.max_exp_avg_sq}) {
      if (t->defined()) bytes += static_cast<uint64_t>(t->numel()) * sizeof(float);
    }
  }
  return bytes;
}

}  // namespace actstash::torch
