#include "client/store/background_worker.h"

#include <utility>

namespace actstash::client_internal {

void SerialWorker::Post(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  tasks_.push_back(std::move(task));
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void SerialWorker::Stop() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    tasks_.clear();
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void SerialWorker::Run() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !tasks_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void PeriodicWorker::Start() {
  absl::MutexLock lock(&mu_);
  if (!stopping_ && !thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void PeriodicWorker::Stop() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void PeriodicWorker::Run() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_);
      if (stopping_) return;
    }
    tick_();
  }
}

}  // namespace actstash::client_internal
