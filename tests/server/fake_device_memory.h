// FakeDeviceMemory: a DeviceMemory whose "device memory" is host memory, so
// that device-pool logic (leases, scrubbing, reclaim) runs in CPU tests and
// the tests can look at the bytes. Records every call; failures can be
// injected.
#ifndef ACTSTASH_TESTS_SERVER_FAKE_DEVICE_MEMORY_H_
#define ACTSTASH_TESTS_SERVER_FAKE_DEVICE_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/happens_before.h"
#include "server/pool/device_memory.h"

namespace actstash::server::testing {

// Thread-safe. A shared State outlives the fake itself (the daemon owns the
// fake; the test keeps the state to inspect it).
class FakeDeviceMemory final : public DeviceMemory {
 public:
  struct Call {
    std::string op;  // "allocate", "export", "zero", "free"
    int device = -1;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  struct State {
    absl::Mutex mu;
    int devices = 1;
    std::vector<Call> calls ABSL_GUARDED_BY(mu);
    // address -> the host memory standing in for the device's
    std::map<uint64_t, std::unique_ptr<std::byte[]>> live ABSL_GUARDED_BY(mu);
    absl::Status fail_allocate ABSL_GUARDED_BY(mu);
    absl::Status fail_export ABSL_GUARDED_BY(mu);
    absl::Status fail_zero ABSL_GUARDED_BY(mu);

    std::vector<Call> Calls() {
      absl::MutexLock lock(&mu);
      return calls;
    }
    size_t Count(const std::string& op) {
      absl::MutexLock lock(&mu);
      size_t n = 0;
      for (const Call& c : calls) n += c.op == op;
      return n;
    }
    size_t LiveRegions() {
      absl::MutexLock lock(&mu);
      return live.size();
    }
    // A real device orders its users itself: a client's writes come before
    // the scrub its Return asks for, the scrub before the next reader. Here
    // that order runs through a socket and gRPC, which TSan cannot follow, so
    // whoever touches the fake's bytes marks it: after writing and before
    // reading them (the fake's Zero does both around its memset).
    void Handover() {
      HappensBefore(this);
      HappensAfter(this);
    }
  };

  explicit FakeDeviceMemory(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // The host bytes behind a device address (valid while the region lives).
  static std::byte* Host(uint64_t address) { return reinterpret_cast<std::byte*>(address); }
  // The bytes of the handle the fake exports for a region.
  static std::string HandleFor(uint64_t address) {
    std::string handle(kIpcHandleBytes, '\0');
    std::memcpy(handle.data(), &address, sizeof(address));
    handle[kIpcHandleBytes - 1] = 'F';
    return handle;
  }

  int device_count() const override { return state_->devices; }
  std::string Describe(int device) const override { return absl::StrCat("fake GPU ", device); }

  absl::StatusOr<DeviceRegion> Allocate(int device, uint64_t bytes) override {
    absl::MutexLock lock(&state_->mu);
    state_->calls.push_back({"allocate", device, 0, bytes});
    if (!state_->fail_allocate.ok()) return state_->fail_allocate;
    auto memory = std::make_unique<std::byte[]>(bytes);
    std::memset(memory.get(), 0xee, bytes);  // "another process's data"
    DeviceRegion region;
    region.device = device;
    region.address = reinterpret_cast<uint64_t>(memory.get());
    region.bytes = bytes;
    state_->live.emplace(region.address, std::move(memory));
    return region;
  }
  absl::StatusOr<std::string> ExportIpcHandle(const DeviceRegion& region) override {
    absl::MutexLock lock(&state_->mu);
    state_->calls.push_back({"export", region.device, 0, region.bytes});
    if (!state_->fail_export.ok()) return state_->fail_export;
    return HandleFor(region.address);
  }
  absl::Status Zero(const DeviceRegion& region, uint64_t offset, uint64_t bytes) override {
    absl::MutexLock lock(&state_->mu);
    state_->calls.push_back({"zero", region.device, offset, bytes});
    if (!state_->fail_zero.ok()) return state_->fail_zero;
    if (state_->live.count(region.address) == 0 || offset > region.bytes ||
        bytes > region.bytes - offset) {
      return absl::InternalError("fake: zero outside a live region");
    }
    state_->Handover();
    std::memset(Host(region.address) + offset, 0, bytes);
    state_->Handover();
    return absl::OkStatus();
  }
  absl::Status Free(const DeviceRegion& region) override {
    absl::MutexLock lock(&state_->mu);
    state_->calls.push_back({"free", region.device, 0, region.bytes});
    if (state_->live.erase(region.address) == 0) return absl::InternalError("fake: double free");
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<State> state_;
};

}  // namespace actstash::server::testing

#endif  // ACTSTASH_TESTS_SERVER_FAKE_DEVICE_MEMORY_H_
