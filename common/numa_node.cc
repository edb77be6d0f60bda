#include "common/numa_node.h"

#include <sched.h>

#include <mutex>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/text_file.h"

#ifdef ACTSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_device_guard.h"
#endif

namespace actstash {

absl::StatusOr<int> ReadPciNumaNode(const std::string& sysfs_root, absl::string_view bus_id) {
  if (bus_id.empty() || bus_id.find('/') != absl::string_view::npos || bus_id == "." ||
      bus_id == "..") {
    return absl::InvalidArgumentError(absl::StrCat("'", bus_id, "' is not a PCI bus id"));
  }
  const std::string path = absl::StrCat(sysfs_root, "/bus/pci/devices/", bus_id, "/numa_node");
  std::string text;
  if (!ReadTextFile(path, &text)) return -1;
  int node = -1;
  const absl::string_view stripped = absl::StripAsciiWhitespace(text);
  if (!absl::SimpleAtoi(stripped, &node) || node < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": '", stripped, "' is not a node number"));
  }
  return node;
}

int CurrentCpuNumaNode() {
  unsigned cpu = 0;
  unsigned node = 0;
  if (getcpu(&cpu, &node) != 0) return -1;
  return static_cast<int>(node);
}

namespace {

#ifdef ACTSTASH_HAVE_CUDA
// The node of CUDA device `device` (an ordinal of this process), or -1.
int CudaDeviceNumaNode(int device) {
  static std::mutex mu;
  static auto* known = new std::unordered_map<int, int>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known->find(device); it != known->end()) return it->second;
  char bus_id[32] = {};
  int node = -1;
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) == cudaSuccess) {
    // CUDA spells the domain in upper-case hex with 8 digits at times;
    // sysfs uses lower case and 4 digits ("0000:17:00.0").
    std::string id = absl::AsciiStrToLower(bus_id);
    if (id.size() > 12) id = id.substr(id.size() - 12);
    absl::StatusOr<int> read = ReadPciNumaNode("/sys", id);
    node = read.ok() ? *read : -1;
  }
  known->emplace(device, node);
  return node;
}
#endif

}  // namespace

int CudaThreadNumaNode() {
#ifdef ACTSTASH_HAVE_CUDA
  int device = 0;
  if (ThreadHasCudaContext() && cudaGetDevice(&device) == cudaSuccess) {
    return CudaDeviceNumaNode(device);
  }
#endif
  return -1;
}

int LeaseNumaNode::Choose(int cuda_node, int cpu_node) {
  if (configured_ >= 0) return configured_;
  if (cuda_node >= 0) {
    remembered_.store(cuda_node, std::memory_order_relaxed);
    return cuda_node;
  }
  int remembered = remembered_.load(std::memory_order_relaxed);
  if (remembered < 0 && cpu_node >= 0 &&
      !remembered_.compare_exchange_strong(remembered, cpu_node, std::memory_order_relaxed)) {
    return remembered;  // another thread remembered one first
  }
  return remembered >= 0 ? remembered : cpu_node;
}

}  // namespace actstash
