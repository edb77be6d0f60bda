// The device pool against a real actstashd on a GPU (ctest label `gpu`;
// skips without a device or without CUDA): lease a device segment, import
// its IPC handle here and in a second process, check that bytes written by
// one are seen by the other, and that a returned segment is zeroed.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "actstash/v1/stash.grpc.pb.h"
#include "client/rpc/attach_connection.h"
#include "client/store/device_import.h"
#include "common/attach_wire.h"
#include "common/protocol.h"
#include "tests/integration/test_util.h"

#ifdef ACTSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace actstash::testing {
namespace {

namespace pb = ::actstash::v1;

#ifdef ACTSTASH_HAVE_CUDA
uint8_t TestByte(uint64_t i) { return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ 0x5a); }
uint8_t WorkerByte(uint64_t i) { return static_cast<uint8_t>(~TestByte(i)); }

// Runs the worker; its exit code (its stdout goes to ours).
int RunWorker(const std::vector<std::string>& args) {
  std::vector<std::string> strings = {
      testing::BuiltBinary("ACTSTASH_DEVICE_WORKER_BINARY", ACTSTASH_DEVICE_WORKER_RELPATH)};
  strings.insert(strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
#endif

TEST(DevicePoolGpuTest, BytesWrittenByOneProcessAreSeenByAnother) {
#ifndef ACTSTASH_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device";
  }
  DaemonProcessOptions options;
  options.pool_size = "128MiB";
  options.segment_size = "64MiB";
  options.extra_args = {"--device-pool", "0:256MiB", "--allow-uid", std::to_string(getuid())};
  std::unique_ptr<DaemonProcess> daemon = StartDaemonOrDie(options);
  ASSERT_NE(daemon, nullptr);
  auto stub = pb::Stash::NewStub(
      grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials()));
  pb::OpenSessionReply open;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, pb::OpenSessionRequest(), &open).ok());
  }
  ASSERT_EQ(open.device_pools_size(), 1);
  auto attach = client_internal::AttachConnection::Connect(
      attach::AttachSocketPath(daemon->socket_path()), open.token(), std::chrono::seconds(5));
  ASSERT_TRUE(attach.ok()) << attach.status();

  pb::LeaseRequest request;
  request.set_count(2);
  request.set_tier(pb::LEASE_TIER_DEVICE);
  pb::LeaseReply reply;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kTokenMetadataKey, open.token());
    grpc::Status status = stub->Lease(&ctx, request, &reply);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_EQ(reply.leases_size(), 2);
  const pb::LeaseGrant& lease = reply.leases(1);  // not at offset 0
  client_internal::DeviceGrant grant{lease.ipc_handle(), lease.region_bytes(), lease.offset(),
                                     lease.bytes()};

  auto opener = client_internal::CreateCudaIpcOpener();
  ASSERT_TRUE(opener.ok()) << opener.status();
  client_internal::DeviceImporter importer(*std::move(opener), 0);
  absl::StatusOr<void*> ptr = importer.Resolve(grant);
  ASSERT_TRUE(ptr.ok()) << ptr.status();
  std::vector<uint8_t> host(grant.bytes);
  ASSERT_EQ(cudaMemcpy(host.data(), *ptr, grant.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint64_t i = 0; i < grant.bytes; i += 4096) ASSERT_EQ(host[i], 0) << "not zeroed at " << i;
  for (uint64_t i = 0; i < grant.bytes; ++i) host[i] = TestByte(i);
  ASSERT_EQ(cudaMemcpy(*ptr, host.data(), grant.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  ASSERT_EQ(RunWorker({absl::BytesToHexString(grant.ipc_handle), std::to_string(grant.region_bytes),
                       std::to_string(grant.offset), std::to_string(grant.bytes)}),
            0);
  ASSERT_EQ(cudaMemcpy(host.data(), *ptr, grant.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint64_t i = 0; i < grant.bytes; ++i) ASSERT_EQ(host[i], WorkerByte(i)) << i;

  // Returned: the daemon zeroes it (this trusted process still maps it).
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kTokenMetadataKey, open.token());
    pb::ReturnRequest back;
    back.add_lease_ids(lease.lease_id());
    pb::ReturnReply returned;
    ASSERT_TRUE(stub->Return(&ctx, back, &returned).ok());
  }
  bool zeroed = false;
  for (int attempt = 0; attempt < 200 && !zeroed; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(cudaMemcpy(host.data(), *ptr, grant.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    zeroed = true;
    for (uint64_t i = 0; i < grant.bytes && zeroed; i += 512) zeroed = host[i] == 0;
  }
  EXPECT_TRUE(zeroed) << "a returned device segment was not scrubbed";
#endif
}

}  // namespace
}  // namespace actstash::testing
