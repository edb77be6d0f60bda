// The one place where absl::Status and grpc::Status are converted into each
// other. Codes map one to one; messages are kept.
#ifndef ACTSTASH_COMMON_GRPC_STATUS_H_
#define ACTSTASH_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace actstash {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace actstash

#endif  // ACTSTASH_COMMON_GRPC_STATUS_H_
