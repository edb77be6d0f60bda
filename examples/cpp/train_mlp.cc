// train_mlp: a small libtorch MLP trained for a few steps with its saved
// activations offloaded to actstashd (actstash::torch::OffloadScope) and its
// middle block checkpointed (actstash::torch::Checkpoint).
//
//   actstashd &                      # or: actstash ... (see README)
//   train_mlp [address] [steps]      # address: else $ACTSTASH_ADDRESS / default
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "actstash/client.h"
#include "actstash/torch.h"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}

  // The middle block, recomputed in backward instead of kept.
  torch::Tensor Block(const torch::Tensor& h) {
    return torch::dropout(torch::gelu(fc2->forward(h)), /*p=*/0.1, is_training());
  }

  torch::Tensor forward(const torch::Tensor& x,
                        const std::shared_ptr<actstash::torch::Offloader>& offloader) {
    torch::Tensor h = torch::relu(fc1->forward(x));
    h = actstash::torch::Checkpoint([this](const torch::Tensor& t) { return Block(t); }, h,
                                    offloader);
    return torch::log_softmax(fc3->forward(h), /*dim=*/1);
  }

  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

}  // namespace

int main(int argc, char** argv) {
  actstash::ClientOptions client_options;
  if (argc > 1) client_options.address = argv[1];
  const int steps = argc > 2 ? std::atoi(argv[2]) : 5;
  client_options.client_name = "train_mlp";

  auto connected = actstash::Client::Connect(client_options);
  if (!connected.ok()) {
    std::fprintf(stderr, "train_mlp: %s\n", connected.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<actstash::Client> client = std::move(*connected);
  actstash::torch::OffloadOptions offload_options;
  offload_options.min_bytes = 16 << 10;
  auto offloader = actstash::torch::Offloader::Create(client, offload_options);
  if (!offloader.ok()) {
    std::fprintf(stderr, "train_mlp: %s\n", offloader.status().ToString().c_str());
    return 1;
  }
  std::printf("connected to %s (zero-copy: %s)\n", client->address().c_str(),
              client->attached() ? "yes" : "no");

  torch::manual_seed(0);
  Mlp model(/*in=*/128, /*hidden=*/512, /*out=*/10);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.2));
  // A fixed synthetic task: labels from a random linear teacher.
  const torch::Tensor x = torch::randn({256, 128});
  const torch::Tensor y = x.matmul(torch::randn({128, 10})).argmax(1);

  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      actstash::torch::OffloadScope scope(*offloader);
      loss = torch::nll_loss(model->forward(x, *offloader), y);
    }
    const uint64_t live = (*offloader)->stats().live_bytes;
    loss.backward();
    optimizer.step();
    const actstash::torch::OffloadStats stats = (*offloader)->stats();
    std::printf(
        "step %d  loss %.4f  in actstashd after forward: %.2f MiB  total offloaded: "
        "%llu tensors, %.2f MiB\n",
        step, loss.item<float>(), live / 1048576.0,
        static_cast<unsigned long long>(stats.tensors_offloaded),
        stats.bytes_offloaded / 1048576.0);
  }
  return 0;
}
