// CopyEngine: asynchronous copies ordered on streams, completed through
// events. HostCopyEngine (worker threads as streams) is always available;
// a CUDA engine with the same interface comes with the GPU path.
//
// Every *Async call returns at once and does not synchronize; work on one
// stream runs in submission order; an event completes when its work has.
#ifndef ACTSTASH_COPY_ENGINE_H_
#define ACTSTASH_COPY_ENGINE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"

namespace actstash {

// Thread-safe. Shared between the engine and whoever waits on it.
class CopyEvent {
 public:
  virtual ~CopyEvent() = default;
  // True once the work finished (successfully or not). Never blocks.
  virtual bool Done() const = 0;
  // Blocks until done; returns the work's status.
  virtual absl::Status Wait() const = 0;
};

enum class CopyStream { kStore = 0, kFetch = 1 };

// Thread-safe: any thread may submit. Destruction finishes queued work first.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Runs `work` on `stream` after everything submitted to it before.
  virtual std::shared_ptr<CopyEvent> SubmitAsync(CopyStream stream,
                                                 std::function<absl::Status()> work) = 0;
  // Blocks until every stream is idle.
  virtual void Synchronize() = 0;
};

struct HostCopyEngineOptions {
  // Before each piece of work, sleep a random time in [0, max_injected_delay]
  // (tests: makes ordering bugs between compute and copies show up).
  std::chrono::microseconds max_injected_delay{0};
  uint64_t seed = 0;
};

// Two worker threads: one per stream.
std::unique_ptr<CopyEngine> CreateHostCopyEngine(const HostCopyEngineOptions& options = {});

}  // namespace actstash

#endif  // ACTSTASH_COPY_ENGINE_H_
