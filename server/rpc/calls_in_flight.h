// A server interceptor that counts the calls in flight (any method, from
// their start until gRPC destroys them), so that a daemon can stop serving
// once they have finished instead of cancelling them (a take-over, where a
// cancelled call would be an error for a client that only saw a pause).
#ifndef ACTSTASH_SERVER_RPC_CALLS_IN_FLIGHT_H_
#define ACTSTASH_SERVER_RPC_CALLS_IN_FLIGHT_H_

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace actstash::server {

// `counter` (not owned) must outlive the server the factory is given to.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CountCallsInFlight(
    std::atomic<int64_t>* counter);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_CALLS_IN_FLIGHT_H_
