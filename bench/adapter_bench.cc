// adapter_bench: training-step time of an MLP through the libtorch adapter
// (actstash::torch::Offloader on the SavedTensorEngine), with and without
// injected copy delays, next to plain libtorch autograd measured in the same
// run. bench/adapter_compare.py runs the same model through the Python
// front-end and prints both (docs/RESULTS.md).
//
//   adapter_bench [--steps N] [--rounds R] [--delay-us D] [--json] [--quick]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "actstash/torch.h"
#include "bench/bench_util.h"

namespace actstash::bench {
namespace {

// The model adapter_compare.py builds in Python: `layers` blocks of
// Linear(width, width) -> GELU -> Dropout(0.1), then a sum, batch x width input.
struct Mlp {
  Mlp(int layers, int width) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(0);
    }
    for (int i = 0; i < layers; ++i) {
      weights.push_back((at::randn({width, width}) * 0.02).requires_grad_());
      biases.push_back(at::zeros({width}).requires_grad_());
    }
  }
  at::Tensor Loss(const at::Tensor& x) const {
    at::Tensor h = x;
    for (size_t i = 0; i < weights.size(); ++i) {
      h = at::dropout(at::gelu(at::linear(h, weights[i], biases[i])), 0.1, true);
    }
    return h.sum();
  }
  std::vector<at::Tensor> weights, biases;
};

struct Options {
  int steps = 10;
  int rounds = 3;
  int delay_us = 300;
  int layers = 8;
  int width = 1024;
  int batch = 256;
  bool json = false;
};

double Step(const Mlp& mlp, const at::Tensor& x, const std::shared_ptr<torch::Offloader>& off) {
  const Clock::time_point start = Clock::now();
  at::Tensor loss;
  {
    std::unique_ptr<torch::OffloadScope> scope;
    if (off) scope = std::make_unique<torch::OffloadScope>(off);
    loss = mlp.Loss(x);
  }
  loss.backward();
  return Since(start) * 1e3;
}

int Main(int argc, char** argv) {
  Options o;
  bool quick = false;
  std::string address;
  CLI::App app{"actstash libtorch adapter: step time against plain autograd"};
  app.add_option("--steps", o.steps, "timed steps per variant and round");
  app.add_option("--rounds", o.rounds, "rounds (variants interleaved)");
  app.add_option("--delay-us", o.delay_us, "injected delay per copy, delayed variant");
  app.add_option("--layers", o.layers);
  app.add_option("--width", o.width);
  app.add_option("--batch", o.batch);
  app.add_option("--address", address, "an actstashd to use (default: start one)");
  app.add_flag("--json", o.json, "one JSON line");
  app.add_flag("--quick", quick, "smoke run");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    o.steps = 2;
    o.rounds = 1;
    o.layers = 2;
    o.width = 256;
    o.batch = 64;  // 64 KiB activations: at min_bytes
  }
  at::set_num_threads(1);
  auto daemon = StartDaemonUnless(&address, "2GiB");
  ClientOptions client_options;
  client_options.address = address;
  auto client = Client::Connect(client_options);
  Check(client.status(), "connecting");
  std::shared_ptr<Client> shared(std::move(*client));

  auto make = [&](int delay_us) {
    torch::OffloadOptions options;
    options.min_bytes = 64 << 10;
    HostCopyEngineOptions engine;
    engine.max_injected_delay = std::chrono::microseconds(delay_us);
    engine.seed = 1;
    options.copy_engine = CreateHostCopyEngine(engine);
    if (delay_us > 0) options.inline_store_bytes = 0;  // every store on the delayed engine
    auto offloader = torch::Offloader::Create(shared, options);
    Check(offloader.status(), "creating the offloader");
    return *offloader;
  };
  const std::vector<std::string> names = {"plain", "offload", "offload-delayed"};
  std::vector<std::shared_ptr<torch::Offloader>> offloaders = {nullptr, make(0), make(o.delay_us)};
  Mlp mlp(o.layers, o.width);
  at::Tensor x = at::randn({o.batch, o.width});
  std::vector<std::vector<double>> ratios(names.size()), times(names.size());
  for (int round = 0; round < o.rounds; ++round) {
    std::vector<double> medians(names.size());
    for (size_t v = 0; v < names.size(); ++v) {
      Step(mlp, x, offloaders[v]);  // warm-up (leases, allocator)
      std::vector<double> t;
      for (int s = 0; s < o.steps; ++s) t.push_back(Step(mlp, x, offloaders[v]));
      medians[v] = Median(t);
      times[v].push_back(medians[v]);
    }
    for (size_t v = 0; v < names.size(); ++v) ratios[v].push_back(medians[v] / medians[0]);
  }
  const torch::OffloadStats delayed = offloaders[2]->stats();
  if (delayed.tensors_offloaded == 0 ||
      delayed.tensors_fetched + delayed.unpacked_from_source != delayed.tensors_offloaded) {
    Die("the delayed offloader did not move the tensors through the daemon");
  }
  if (o.json) {
    std::printf("{\"front_end\": \"libtorch\", \"delay_us\": %d", o.delay_us);
    for (size_t v = 0; v < names.size(); ++v) {
      std::printf(", \"%s_ms\": %.3f, \"%s_x_plain\": %.4f", names[v].c_str(), Median(times[v]),
                  names[v].c_str(), Median(ratios[v]));
    }
    std::printf(
        ", \"offloaded_per_step\": %llu}\n",
        static_cast<unsigned long long>(delayed.tensors_offloaded / (o.rounds * (o.steps + 1))));
  } else {
    std::printf("adapter_bench: MLP %dx%d, batch %d, %d rounds x %d steps, delay %d us\n", o.layers,
                o.width, o.batch, o.rounds, o.steps, o.delay_us);
    for (size_t v = 0; v < names.size(); ++v) {
      std::printf("  %-16s %8.2f ms  %.3fx plain\n", names[v].c_str(), Median(times[v]),
                  Median(ratios[v]));
    }
  }
  offloaders.clear();
  shared.reset();
  StopDaemon(daemon.get());
  return 0;
}

}  // namespace
}  // namespace actstash::bench

int main(int argc, char** argv) {
  actstash::bench::g_program = "adapter_bench";
  return actstash::bench::Main(argc, argv);
}
