// Checkpoint: torch.utils.checkpoint(use_reentrant=False) for libtorch. The
// forward runs fn under a frame whose saved-variable hooks drop what fn saves
// (keeping an empty holder per saved tensor); the first unpack of any of them
// recomputes fn under a second frame whose hooks fill the holders in save
// order. The boundary inputs go through the offloader when one is given.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "actstash/torch.h"

namespace actstash::torch {
namespace {

using ::torch::autograd::SavedVariableHooks;

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

// One tensor fn saved in forward: its metadata, and its value once recomputed.
struct Holder {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  at::Tensor value;  // filled by the recomputation, taken by the unpack
};

// A boundary input: kept, or saved through an offloader's hooks.
struct BoundaryInput {
  at::Tensor kept;
  std::unique_ptr<SavedVariableHooks> stored;
  bool requires_grad = false;

  at::Tensor Restore() const {
    at::Tensor t = stored != nullptr ? stored->call_unpack_hook() : kept;
    return t.detach().requires_grad_(requires_grad);
  }
};

// Shared by the hooks of the tensors fn saved; lives as long as any of them.
class Frame : public internal::HookSource, public std::enable_shared_from_this<Frame> {
 public:
  Frame(CheckpointFn fn, std::vector<BoundaryInput> inputs)
      : fn_(std::move(fn)), inputs_(std::move(inputs)), rng_state_(GetCpuRngState()) {}

  std::unique_ptr<SavedVariableHooks> MakeHooks() override;

  std::shared_ptr<Holder> NewHolder(const at::Tensor& t) {
    auto holder = std::make_shared<Holder>();
    holder->sizes = t.sizes().vec();
    holder->dtype = t.scalar_type();
    std::lock_guard<std::mutex> lock(mu_);
    holders_.push_back(holder);
    return holder;
  }

  // Runs fn again (grad on, the forward's RNG state) and fills every holder
  // still alive, in save order.
  void Recompute();
  // Held by an unpack from its check through the recomputation to the take:
  // backward may unpack this frame's tensors on several threads (CPU and
  // device threads) at once.
  std::mutex& unpack_mu() { return unpack_mu_; }

 private:
  class Refill;

  const CheckpointFn fn_;
  const std::vector<BoundaryInput> inputs_;
  const at::Tensor rng_state_;
  std::mutex unpack_mu_;
  std::mutex mu_;  // holders_: the forward appends, a backward thread recomputes
  std::vector<std::weak_ptr<Holder>> holders_;
};

// The hooks of a tensor fn saved in forward: nothing is kept but the holder.
class DropHooks final : public SavedVariableHooks {
 public:
  explicit DropHooks(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  void call_pack_hook(const at::Tensor& tensor) override { holder_ = frame_->NewHolder(tensor); }
  at::Tensor call_unpack_hook() override {
    std::lock_guard<std::mutex> lock(frame_->unpack_mu());
    if (!holder_->value.defined()) frame_->Recompute();
    TORCH_CHECK(holder_->value.defined(),
                "actstash::torch::Checkpoint: the recomputation saved fewer tensors than the "
                "forward");
    return std::exchange(holder_->value, at::Tensor());  // a second read recomputes again
  }

 private:
  std::shared_ptr<Frame> frame_;
  std::shared_ptr<Holder> holder_;
};

std::unique_ptr<SavedVariableHooks> Frame::MakeHooks() {
  return std::make_unique<DropHooks>(shared_from_this());
}

// The recomputation's hooks: the i-th tensor saved fills the i-th holder.
class Frame::Refill final : public internal::HookSource {
 public:
  explicit Refill(std::vector<std::weak_ptr<Holder>> holders) : holders_(std::move(holders)) {}
  std::unique_ptr<SavedVariableHooks> MakeHooks() override;
  void Fill(const at::Tensor& t) {
    const size_t index = next_++;
    if (index >= holders_.size()) return;  // saved after the forward's last: unused
    std::shared_ptr<Holder> holder = holders_[index].lock();
    if (holder == nullptr) return;  // that saved variable is gone
    TORCH_CHECK(holder->sizes == t.sizes().vec() && holder->dtype == t.scalar_type(),
                "actstash::torch::Checkpoint: recomputed values differ in metadata from the "
                "forward pass (saved tensor ",
                index, ": recomputed ", t.sizes(), " ", t.scalar_type(), ", forward ",
                at::IntArrayRef(holder->sizes), " ", holder->dtype, ")");
    holder->value = t.detach();
  }

 private:
  class Hooks;
  std::vector<std::weak_ptr<Holder>> holders_;
  size_t next_ = 0;
};

class Frame::Refill::Hooks final : public SavedVariableHooks {
 public:
  explicit Hooks(Refill* refill) : refill_(refill) {}
  void call_pack_hook(const at::Tensor& tensor) override { refill_->Fill(tensor); }
  at::Tensor call_unpack_hook() override {
    TORCH_CHECK(false, "actstash::torch::Checkpoint: backward through a recomputed tensor");
    return at::Tensor();
  }

 private:
  Refill* refill_;  // outlives the recomputed graph, which is dropped at once
};

std::unique_ptr<SavedVariableHooks> Frame::Refill::MakeHooks() {
  return std::make_unique<Hooks>(this);
}

void Frame::Recompute() {
  std::vector<std::weak_ptr<Holder>> holders;
  {
    std::lock_guard<std::mutex> lock(mu_);
    holders = holders_;
  }
  std::vector<at::Tensor> inputs;
  inputs.reserve(inputs_.size());
  for (const BoundaryInput& input : inputs_) inputs.push_back(input.Restore());
  auto refill = std::make_shared<Refill>(std::move(holders));
  ForkCpuRng rng(rng_state_);  // the same dropout masks as in forward
  c10::AutoGradMode grad(true);
  internal::ScopedHookSource scope(refill);
  fn_(inputs);  // its outputs and graph are dropped: only the holders matter
}

}  // namespace

std::vector<at::Tensor> Checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                   std::shared_ptr<Offloader> offloader) {
  if (!c10::GradMode::is_enabled()) return fn(inputs);  // nothing to recompute for
  const absl::Status installed = InstallSavedVariableHooks();
  TORCH_CHECK(installed.ok(), installed.ToString());
  if (offloader == nullptr) offloader = CurrentOffloader();
  std::vector<BoundaryInput> boundary(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "actstash::torch::Checkpoint: undefined input tensor");
    boundary[i].requires_grad = inputs[i].requires_grad();
    if (offloader != nullptr) {
      boundary[i].stored = offloader->MakeBoundaryHooks();
      boundary[i].stored->call_pack_hook(inputs[i]);
    } else {
      boundary[i].kept = inputs[i].detach();
    }
  }
  auto frame = std::make_shared<Frame>(fn, std::move(boundary));
  internal::ScopedHookSource scope(frame);
  return fn(inputs);
}

at::Tensor Checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& input,
                      std::shared_ptr<Offloader> offloader) {
  CheckpointFn wrapped = [fn = std::move(fn)](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{fn(in[0])};
  };
  return Checkpoint(std::move(wrapped), {input}, std::move(offloader)).at(0);
}

}  // namespace actstash::torch
