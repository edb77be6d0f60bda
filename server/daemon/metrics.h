// Metrics: Prometheus exposition of the daemon (prometheus-cpp), served on
// --metrics-address. Pool, sessions and counters are read from StashCore at
// scrape time; RPC latencies and errors are recorded by a gRPC server
// interceptor, so every method (health and reflection included) is counted
// in one place.
#ifndef ACTSTASH_SERVER_DAEMON_METRICS_H_
#define ACTSTASH_SERVER_DAEMON_METRICS_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/rpc/stash_core.h"

namespace actstash::server {

// Thread-safe. `core` must outlive it (the Daemon owns both).
class Metrics {
 public:
  // Serves /metrics over HTTP at `address` ("127.0.0.1:9464"; port 0 picks a
  // free one). FAILED_PRECONDITION when it cannot listen there.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(const std::string& address,
                                                        StashCore* core);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  int port() const;
  // For grpc::ServerBuilder::experimental().SetInterceptorCreators.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();
  void ObserveRpc(const std::string& method, grpc::StatusCode code, double seconds);

 private:
  struct State;
  explicit Metrics(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_DAEMON_METRICS_H_
