// Reactors of the streaming Stash RPCs (Put, Get). Each returns a reactor
// that deletes itself when gRPC calls OnDone; never blocks a gRPC thread.
#ifndef ACTSTASH_SERVER_RPC_STASH_REACTORS_H_
#define ACTSTASH_SERVER_RPC_STASH_REACTORS_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include "actstash/v1/stash.grpc.pb.h"
#include "server/rpc/stash_core.h"

namespace actstash::server {

grpc::ServerReadReactor<v1::PutChunk>* StartPut(StashCore* core, grpc::CallbackServerContext* ctx,
                                                v1::PutReply* reply);
grpc::ServerWriteReactor<v1::GetChunk>* StartGet(StashCore* core, grpc::CallbackServerContext* ctx,
                                                 const v1::GetRequest* request);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_STASH_REACTORS_H_
