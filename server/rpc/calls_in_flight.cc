#include "server/rpc/calls_in_flight.h"

namespace actstash::server {
namespace {

// One per call: gRPC makes it when the call starts and destroys it with the
// call. Any thread.
class CallCounter final : public grpc::experimental::Interceptor {
 public:
  explicit CallCounter(std::atomic<int64_t>* counter) : counter_(*counter) {
    counter_.fetch_add(1, std::memory_order_acq_rel);
  }
  ~CallCounter() override { counter_.fetch_sub(1, std::memory_order_acq_rel); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  std::atomic<int64_t>& counter_;
};

class CallCounterFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallCounterFactory(std::atomic<int64_t>* counter) : counter_(counter) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new CallCounter(counter_);
  }

 private:
  std::atomic<int64_t>* const counter_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CountCallsInFlight(
    std::atomic<int64_t>* counter) {
  return std::make_unique<CallCounterFactory>(counter);
}

}  // namespace actstash::server
