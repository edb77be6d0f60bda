// FdStore: a service manager's notify socket and file-descriptor store, as
// systemd implements them (sd_notify(3): READY=1, FDSTORE=1 with FDNAME=,
// FDSTOREREMOVE=1), for tests of actstashd's restart after a crash where
// systemd does not run. DaemonProcess (options.supervised) points the
// daemon's NOTIFY_SOCKET here and passes the kept fds back at the next start
// (LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID). Private to the project's tests.
//
// Thread-safety: a thread of its own reads the socket; every member may be
// called from any thread.
#ifndef ACTSTASH_TESTING_FD_STORE_H_
#define ACTSTASH_TESTING_FD_STORE_H_

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"

namespace actstash::testing {

class FdStore {
 public:
  static absl::StatusOr<std::unique_ptr<FdStore>> Create();
  ~FdStore();
  FdStore(const FdStore&) = delete;
  FdStore& operator=(const FdStore&) = delete;

  // $NOTIFY_SOCKET for the daemon ("@name": the abstract namespace).
  const std::string& address() const { return address_; }
  // Duplicates of the kept fds with their names, in the order kept, once
  // every notification sent so far is handled.
  std::vector<std::pair<std::string, UniqueFd>> Snapshot() ABSL_LOCKS_EXCLUDED(mu_, receive_mu_);
  // READY=1 notifications so far; waits until more than `after` came.
  bool WaitReady(int after, std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  int ready_count() const ABSL_LOCKS_EXCLUDED(mu_);
  // Writes `bytes` at `offset` into the first kept fd named `name`.
  absl::Status Corrupt(const std::string& name, off_t offset, const std::string& bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Lets go of every kept fd whose name starts with `prefix`, as a service
  // manager that lost them would; how many.
  size_t Forget(const std::string& prefix) ABSL_LOCKS_EXCLUDED(mu_, receive_mu_);

 private:
  FdStore(std::string address, UniqueFd socket, UniqueFd wake);
  void Receive();
  // Handles every queued notification; ReceiveOne one (false: none queued).
  void Drain() ABSL_LOCKS_EXCLUDED(receive_mu_);
  bool ReceiveOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(receive_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string address_;
  const UniqueFd socket_;
  const UniqueFd wake_;
  absl::Mutex receive_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one reader of the socket at a time
  mutable absl::Mutex mu_;
  std::vector<std::pair<std::string, UniqueFd>> kept_ ABSL_GUARDED_BY(mu_);
  int ready_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace actstash::testing

#endif  // ACTSTASH_TESTING_FD_STORE_H_
