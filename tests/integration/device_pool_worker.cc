// A second process for device_pool_gpu_test: imports a device pool grant
// through DeviceImporter, checks the bytes the test wrote, writes its own.
// Usage: device_pool_worker HANDLE_HEX REGION_BYTES OFFSET BYTES
// Prints "OK" and exits 0, or prints the problem and exits 1.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "client/store/device_import.h"

namespace {

// The byte the test writes at index i, and the one the worker writes.
uint8_t TestByte(uint64_t i) { return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ 0x5a); }
uint8_t WorkerByte(uint64_t i) { return static_cast<uint8_t>(~TestByte(i)); }

int Fail(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return Fail("usage: HANDLE_HEX REGION_BYTES OFFSET BYTES");
  using actstash::client_internal::DeviceGrant;
  DeviceGrant grant;
  grant.ipc_handle = absl::HexStringToBytes(argv[1]);
  grant.region_bytes = std::strtoull(argv[2], nullptr, 10);
  grant.offset = std::strtoull(argv[3], nullptr, 10);
  grant.bytes = std::strtoull(argv[4], nullptr, 10);
  auto opener = actstash::client_internal::CreateCudaIpcOpener();
  if (!opener.ok()) return Fail(opener.status().ToString());
  actstash::client_internal::DeviceImporter importer(*std::move(opener), 0);
  absl::StatusOr<void*> ptr = importer.Resolve(grant);
  if (!ptr.ok()) return Fail(ptr.status().ToString());
  std::vector<uint8_t> host(grant.bytes);
  if (cudaMemcpy(host.data(), *ptr, grant.bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return Fail("cudaMemcpy D2H");
  }
  for (uint64_t i = 0; i < grant.bytes; ++i) {
    if (host[i] != TestByte(i)) return Fail("byte " + std::to_string(i) + " differs");
  }
  for (uint64_t i = 0; i < grant.bytes; ++i) host[i] = WorkerByte(i);
  if (cudaMemcpy(*ptr, host.data(), grant.bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    return Fail("cudaMemcpy H2D");
  }
  if (cudaDeviceSynchronize() != cudaSuccess) return Fail("cudaDeviceSynchronize");
  std::printf("OK\n");
  return 0;
}
