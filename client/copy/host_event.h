// HostEvent: a CopyEvent completed by a host thread (HostCopyEngine's
// workers, CudaCopyEngine's completion threads). Private to the client.
//
// Thread-safety: Done, Wait and Complete may be called from any threads;
// Complete is called once.
#ifndef ACTSTASH_CLIENT_COPY_HOST_EVENT_H_
#define ACTSTASH_CLIENT_COPY_HOST_EVENT_H_

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "actstash/copy_engine.h"

namespace actstash::client_internal {

class HostEvent final : public CopyEvent {
 public:
  bool Done() const override {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  absl::Status Wait() const override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return status_;
  }
  // Records the work's outcome and wakes the waiters.
  void Complete(absl::Status status) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
    done_ = true;
  }

 private:
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace actstash::client_internal

#endif  // ACTSTASH_CLIENT_COPY_HOST_EVENT_H_
