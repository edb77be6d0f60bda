// The take-over channel: a serving actstashd hands its state and file
// descriptors to a successor started beside it (actstashd --take-over) over
// a private Unix socket (attach::HandoverSocketPath of its gRPC socket, mode
// 0600), framed like the attach channel (common/attach_wire.h):
//
//   successor → serving   TakeOverHello    v1::TakeOverHello
//   serving → successor   TakeOverRefused  reason; the serving daemon goes on
//   serving → successor   TakeOverState    fds: [state image, then the fds it names]
//   successor → serving   TakeOverAdopted  the successor holds everything
//   serving               exits; the successor then serves
//
// A successor that hangs up or times out before TakeOverAdopted leaves the
// serving daemon serving again (Finish(false)). Only the daemon's own uid
// (or root) may take over; one take-over at a time, others are refused while
// it runs.
#ifndef ACTSTASH_SERVER_RESTART_TAKE_OVER_H_
#define ACTSTASH_SERVER_RESTART_TAKE_OVER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "actstash/v1/handover.pb.h"
#include "common/unique_fd.h"

namespace actstash::server {

// Bumped when a successor of this version cannot read what an older daemon
// hands over (or the other way round): the serving daemon refuses it.
inline constexpr uint32_t kTakeOverProtocol = 2;

// What the serving daemon hands over: the state image and the fds its state
// names by index (index i of the state is fds[i]).
struct HandoverPackage {
  UniqueFd state_image;
  std::vector<UniqueFd> fds;
};

// The serving side. Callbacks run on the listener's thread, one take-over
// at a time:
//   prepare(hello): quiesce and export, or an error that refuses the
//     take-over (the daemon must then be serving as before);
//   finish(adopted): the successor confirmed (the daemon exits) or did not
//     (the daemon serves again).
class HandoverListener {
 public:
  using Prepare = std::function<absl::StatusOr<HandoverPackage>(const v1::TakeOverHello&)>;
  using Finish = std::function<void(bool adopted)>;

  // Listens on `path` (claimed like the daemon's other sockets), or on
  // `handed` when given (a listener the successor received).
  static absl::StatusOr<std::unique_ptr<HandoverListener>> Start(const std::string& path,
                                                                 UniqueFd handed, Prepare prepare,
                                                                 Finish finish);
  ~HandoverListener();  // stops and joins; removes the socket file if it is ours
  HandoverListener(const HandoverListener&) = delete;
  HandoverListener& operator=(const HandoverListener&) = delete;

  // A duplicate of the listening socket (handed to the successor).
  absl::StatusOr<UniqueFd> DupListener() const;
  // After a successful hand-over: the socket file is the successor's now.
  void KeepSocketFile() { keep_file_.store(true); }
  const std::string& path() const { return path_; }

 private:
  HandoverListener(std::string path, UniqueFd listener, ino_t inode, Prepare prepare,
                   Finish finish);
  void Run();
  void Serve(UniqueFd connection);

  const std::string path_;
  const UniqueFd listener_;
  const ino_t inode_;
  const Prepare prepare_;
  const Finish finish_;
  UniqueFd stop_read_;
  UniqueFd stop_write_;
  std::atomic<bool> keep_file_{false};
  std::thread thread_;
};

// The successor's side of a take-over in progress: what it received, and
// the connection on which it confirms.
struct TakenOver {
  v1::DaemonState state;
  std::vector<UniqueFd> fds;  // index i of the state
  UniqueFd connection;
};

// Connects to the serving daemon of `grpc_socket_path`, asks with `hello`,
// and receives its state. FAILED_PRECONDITION with the serving daemon's
// reason when it refuses; UNAVAILABLE when none answers; DATA_LOSS /
// FAILED_PRECONDITION when the state image is not one this version trusts
// (ReadStateImage), INVALID_ARGUMENT when it names fds that did not come.
absl::StatusOr<TakenOver> RequestTakeOver(const std::string& grpc_socket_path,
                                          const v1::TakeOverHello& hello,
                                          std::chrono::milliseconds timeout);

// Tells the serving daemon that the successor holds everything, then waits
// (at most `timeout`; 0: not at all) until it has exited (its end of the
// connection closes), so that the addresses it still holds are free.
absl::Status ConfirmTakeOver(TakenOver* taken, std::chrono::milliseconds timeout);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RESTART_TAKE_OVER_H_
