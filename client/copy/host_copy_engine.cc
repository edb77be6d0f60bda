// HostCopyEngine: each stream is a worker thread draining a FIFO of work.
// Copies, gathers and scatters are work items that first wait for their deps.
// With a simulated link, such an item lasts at least its bytes / the rate
// from when its deps are done: the stream's thread is the link's lane, so
// copies queue on it as on a real one.
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "actstash/copy_engine.h"
#include "client/copy/host_event.h"
#include "client/copy/tensor_layout.h"
#include "common/status_macros.h"
#include "kernels/bf16.h"
#include "kernels/strided_copy.h"

namespace actstash {
namespace {

// One stream: a thread and its queue. The delay RNG is used by the worker only.
class Stream {
 public:
  Stream(std::chrono::microseconds max_delay, uint64_t seed)
      : max_delay_(max_delay), rng_(seed), thread_([this] { Run(); }) {}
  ~Stream() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  std::shared_ptr<CopyEvent> Submit(std::function<absl::Status()> work) {
    auto event = std::make_shared<client_internal::HostEvent>();
    absl::MutexLock lock(&mu_);
    queue_.emplace_back(std::move(work), event);
    return event;
  }

  void Drain() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Stream* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->queue_.empty() && !s->busy_; },
        this));
  }

 private:
  void Run() {
    while (true) {
      std::pair<std::function<absl::Status()>, std::shared_ptr<client_internal::HostEvent>> item;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Stream* s)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->stopping_ || !s->queue_.empty(); },
            this));
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      if (max_delay_.count() > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng_() % (max_delay_.count() + 1)));
      }
      item.second->Complete(item.first());
      absl::MutexLock lock(&mu_);
      busy_ = false;
    }
  }

  const std::chrono::microseconds max_delay_;
  std::mt19937_64 rng_;
  absl::Mutex mu_;
  std::deque<std::pair<std::function<absl::Status()>, std::shared_ptr<client_internal::HostEvent>>>
      queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the members it uses
};

class HostCopyEngine final : public CopyEngine {
 public:
  explicit HostCopyEngine(const HostCopyEngineOptions& options)
      : link_bytes_per_second_(options.link_bytes_per_second) {
    for (uint64_t i = 0; i < 2; ++i) {
      streams_.push_back(std::make_unique<Stream>(options.max_injected_delay, options.seed + i));
    }
  }
  std::shared_ptr<CopyEvent> SubmitAsync(CopyStream stream,
                                         std::function<absl::Status()> work) override {
    return streams_[static_cast<size_t>(stream)]->Submit(std::move(work));
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> CopyAsync(CopyStream stream, void* dst,
                                                       const void* src, size_t nbytes,
                                                       StreamHandle /*after*/,
                                                       CopyDeps deps) override {
    if (nbytes > 0 && (dst == nullptr || src == nullptr)) {
      return absl::InvalidArgumentError("CopyAsync: null pointer with a non-empty copy");
    }
    return SubmitAfter(stream, deps, nbytes, [dst, src, nbytes] {
      if (nbytes > 0) std::memcpy(dst, src, nbytes);
      return absl::OkStatus();
    });
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> GatherAsync(CopyStream stream, void* dst,
                                                         size_t dst_bytes, const void* src,
                                                         const TensorLayout& layout,
                                                         StreamHandle /*after*/,
                                                         CopyDeps deps) override {
    ACTSTASH_ASSIGN_OR_RETURN(const kernels::StridedLayout strided,
                              client_internal::CheckGather(src, layout, dst, dst_bytes));
    return SubmitAfter(stream, deps, dst_bytes, [dst, dst_bytes, src, strided] {
      return kernels::GatherCpu(src, strided, dst, dst_bytes);
    });
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> ScatterAsync(CopyStream stream, void* dst,
                                                          const TensorLayout& layout,
                                                          const void* src, size_t src_bytes,
                                                          StreamHandle /*after*/,
                                                          CopyDeps deps) override {
    ACTSTASH_ASSIGN_OR_RETURN(const kernels::StridedLayout strided,
                              client_internal::CheckScatter(src, src_bytes, dst, layout));
    return SubmitAfter(stream, deps, src_bytes, [dst, src, src_bytes, strided] {
      return kernels::ScatterCpu(src, src_bytes, dst, strided);
    });
  }

  absl::StatusOr<std::shared_ptr<CopyEvent>> ConvertAsync(CopyStream stream, void* dst,
                                                          const void* src, size_t elements,
                                                          Conversion conversion,
                                                          StreamHandle /*after*/,
                                                          CopyDeps deps) override {
    ACTSTASH_RETURN_IF_ERROR(client_internal::CheckConversion(dst, src, elements, conversion));
    const uint64_t written = elements * (conversion == Conversion::kFp32ToBf16 ? 2 : 4);
    return SubmitAfter(stream, deps, written, [dst, src, elements, conversion] {
      if (conversion == Conversion::kFp32ToBf16) {
        kernels::Fp32ToBf16Cpu(static_cast<const float*>(src), static_cast<uint16_t*>(dst),
                               elements);
      } else {
        kernels::Bf16ToFp32Cpu(static_cast<const uint16_t*>(src), static_cast<float*>(dst),
                               elements);
      }
      return absl::OkStatus();
    });
  }

  // The caller's thread is its stream: waiting here orders it.
  absl::Status OrderAfterAsync(StreamHandle /*stream*/, const CopyEvent& event) override {
    return event.Wait();
  }

  int device() const override { return -1; }
  void Synchronize() override {
    for (auto& stream : streams_) stream->Drain();
  }

 private:
  // Runs `copy` on `stream` once every dep is done; the first failed dep's
  // status fails the work and `copy` does not run. With a simulated link the
  // item then lasts at least `link_bytes` / the rate.
  std::shared_ptr<CopyEvent> SubmitAfter(CopyStream stream, CopyDeps deps, uint64_t link_bytes,
                                         std::function<absl::Status()> copy) {
    std::vector<std::shared_ptr<CopyEvent>> waits(deps.begin(), deps.end());
    const std::chrono::nanoseconds on_link(
        link_bytes_per_second_ == 0
            ? 0
            : static_cast<int64_t>(1e9 * static_cast<double>(link_bytes) /
                                   static_cast<double>(link_bytes_per_second_)));
    return SubmitAsync(stream, [waits = std::move(waits), copy = std::move(copy), on_link] {
      for (const auto& dep : waits) {
        if (dep == nullptr) continue;
        ACTSTASH_RETURN_IF_ERROR(dep->Wait());
      }
      const auto start = std::chrono::steady_clock::now();
      absl::Status status = copy();
      if (on_link.count() > 0) std::this_thread::sleep_until(start + on_link);
      return status;
    });
  }

  const uint64_t link_bytes_per_second_;
  std::vector<std::unique_ptr<Stream>> streams_;
};

}  // namespace

std::unique_ptr<CopyEngine> CreateHostCopyEngine(const HostCopyEngineOptions& options) {
  return std::make_unique<HostCopyEngine>(options);
}

}  // namespace actstash
