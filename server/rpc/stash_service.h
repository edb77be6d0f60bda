// StashService: the actstash.v1.Stash gRPC service (callback API).
#ifndef ACTSTASH_SERVER_RPC_STASH_SERVICE_H_
#define ACTSTASH_SERVER_RPC_STASH_SERVICE_H_

#include "actstash/v1/stash.grpc.pb.h"
#include "server/rpc/stash_core.h"

namespace grpc {
class ServerUnaryReactor;
}

namespace actstash::server {

// Handlers run on gRPC's callback threads and never block on I/O. `core`
// must outlive the gRPC server that serves this service.
// Finishes a unary call's default reactor with `status`.
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx, const absl::Status& status);

class StashService final : public v1::Stash::CallbackService {
 public:
  explicit StashService(StashCore* core) : core_(core) {}

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const v1::OpenSessionRequest* request,
                                        v1::OpenSessionReply* reply) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionReply* reply) override;
  grpc::ServerReadReactor<v1::PutChunk>* Put(grpc::CallbackServerContext* ctx,
                                             v1::PutReply* reply) override;
  grpc::ServerWriteReactor<v1::GetChunk>* Get(grpc::CallbackServerContext* ctx,
                                              const v1::GetRequest* request) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx,
                                   const v1::DeleteRequest* request,
                                   v1::DeleteReply* reply) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
                                  v1::StatsReply* reply) override;
  // Zero-copy data plane; in lease_handlers.cc.
  grpc::ServerUnaryReactor* Lease(grpc::CallbackServerContext* ctx, const v1::LeaseRequest* request,
                                  v1::LeaseReply* reply) override;
  grpc::ServerUnaryReactor* Return(grpc::CallbackServerContext* ctx,
                                   const v1::ReturnRequest* request,
                                   v1::ReturnReply* reply) override;
  grpc::ServerUnaryReactor* ConfirmLeases(grpc::CallbackServerContext* ctx,
                                          const v1::ConfirmLeasesRequest* request,
                                          v1::ConfirmLeasesReply* reply) override;
  grpc::ServerUnaryReactor* ReportUsage(grpc::CallbackServerContext* ctx,
                                        const v1::ClientUsage* request,
                                        v1::ReportUsageReply* reply) override;
  // spill_handlers.cc
  grpc::ServerUnaryReactor* Spill(grpc::CallbackServerContext* ctx, const v1::SpillRequest* request,
                                  v1::SpillReply* reply) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* ctx,
                                    const v1::RestoreRequest* request,
                                    v1::RestoreReply* reply) override;
  grpc::ServerUnaryReactor* DropSpilled(grpc::CallbackServerContext* ctx,
                                        const v1::DropSpilledRequest* request,
                                        v1::DropSpilledReply* reply) override;
  // copy_share_handler.cc
  grpc::ServerUnaryReactor* CopyShare(grpc::CallbackServerContext* ctx,
                                      const v1::CopyShareRequest* request,
                                      v1::CopyShareReply* reply) override;

 private:
  StashCore* const core_;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_STASH_SERVICE_H_
