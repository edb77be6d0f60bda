#include "server/pool/numa_topology.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/numa_node.h"
#include "common/text_file.h"
#include "common/units.h"

namespace actstash::server {
namespace {

namespace fs = std::filesystem;

// The file's text without surrounding whitespace; nullopt when it cannot be read.
std::optional<std::string> ReadText(const fs::path& path) {
  std::string text;
  if (!ReadTextFile(path.string(), &text)) return std::nullopt;
  return std::string(absl::StripAsciiWhitespace(text));
}

absl::Status Malformed(const fs::path& path, absl::string_view text, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path.string(), ": '", text, "' is not ", what));
}

// "Node 0 MemTotal:  23292120 kB" -> bytes; 0 when absent.
uint64_t MemTotal(const std::string& meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    const size_t at = line.find("MemTotal:");
    if (at == absl::string_view::npos) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line.substr(at + 9), ' ', absl::SkipWhitespace());
    uint64_t kib = 0;
    if (!words.empty() && absl::SimpleAtoi(words[0], &kib)) return kib << 10;
  }
  return 0;
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseIdList(absl::string_view text) {
  std::vector<int> ids;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::vector<absl::string_view> range = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int first = 0;
    bool ok = absl::SimpleAtoi(range[0], &first) && first >= 0;
    int last = first;
    if (ok && range.size() == 2) ok = absl::SimpleAtoi(range[1], &last) && last >= first;
    // A bound on the list's size: ids come from a file anyone may fake.
    if (!ok || last - first > (1 << 20)) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a list like 0-3,8"));
    }
    for (int id = first; id <= last; ++id) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

std::string FormatIdList(const std::vector<int>& ids) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(ids[i]) : absl::StrCat(ids[i], "-", ids[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

int NumaTopology::NodeOfCpu(int cpu) const {
  for (const NumaNode& node : nodes) {
    if (std::binary_search(node.cpus.begin(), node.cpus.end(), cpu)) return node.id;
  }
  return -1;
}

std::string NumaTopology::Describe() const {
  if (nodes.empty()) return "no NUMA nodes in sysfs";
  std::vector<std::string> each;
  for (const NumaNode& node : nodes) {
    each.push_back(absl::StrCat(
        node.id, ": cpus ", FormatIdList(node.cpus),
        node.memory_bytes > 0 ? absl::StrCat(", ", FormatBytes(node.memory_bytes)) : ""));
  }
  std::string out = absl::StrCat(nodes.size(), " NUMA node", nodes.size() == 1 ? "" : "s", " (",
                                 absl::StrJoin(each, "; "), ")");
  if (gpus.empty()) return absl::StrCat(out, "; no NVIDIA GPU on the PCI bus");
  std::vector<std::string> placed;
  for (const GpuPlacement& gpu : gpus) {
    placed.push_back(gpu.node >= 0 ? absl::StrCat(gpu.bus_id, " on node ", gpu.node)
                                   : absl::StrCat(gpu.bus_id, " on no node (firmware)"));
  }
  return absl::StrCat(out, "; GPUs ", absl::StrJoin(placed, ", "));
}

absl::StatusOr<NumaSetting> ParseNumaSetting(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  NumaSetting setting;
  if (lower == "auto") return setting;
  if (lower == "off") {
    setting.mode = NumaSetting::Mode::kOff;
    return setting;
  }
  if (lower == "interleave") {
    setting.mode = NumaSetting::Mode::kInterleave;
    return setting;
  }
  if (lower == "split") {
    setting.mode = NumaSetting::Mode::kSplit;
    return setting;
  }
  if (absl::SimpleAtoi(lower, &setting.node) && setting.node >= 0 && setting.node < 1024) {
    setting.mode = NumaSetting::Mode::kNode;
    return setting;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is not auto, off, split, interleave or a NUMA node number"));
}

absl::StatusOr<PoolPlacement> ChoosePoolPlacement(const NumaSetting& setting,
                                                  const NumaTopology& topology) {
  std::vector<int> all;
  for (const NumaNode& node : topology.nodes) all.push_back(node.id);
  PoolPlacement placement;
  switch (setting.mode) {
    case NumaSetting::Mode::kOff:
      placement.why = "off: the kernel places the pool";
      return placement;
    case NumaSetting::Mode::kNode:
      if (!std::binary_search(all.begin(), all.end(), setting.node)) {
        return absl::InvalidArgumentError(
            absl::StrCat("NUMA node ", setting.node, " is not one of this machine's (",
                         all.empty() ? "none" : FormatIdList(all), ")"));
      }
      placement.nodes = {setting.node};
      placement.why = absl::StrCat("the pool is bound to node ", setting.node, " (--numa)");
      return placement;
    case NumaSetting::Mode::kInterleave:
      placement.nodes = all;
      placement.why =
          absl::StrCat("the pool is interleaved over nodes ", FormatIdList(all), " (--numa)");
      return placement;
    case NumaSetting::Mode::kSplit:
      if (all.empty()) {
        return absl::FailedPreconditionError(
            "--numa split: the kernel reports no NUMA nodes (no devices/system/node in sysfs)");
      }
      placement.nodes = all;
      placement.split = true;
      placement.why = absl::StrCat("the pool is split over nodes ", FormatIdList(all),
                                   ", each part bound to its node (--numa)");
      return placement;
    case NumaSetting::Mode::kAuto:
      break;
  }
  if (all.size() <= 1) {
    placement.why = "one NUMA node: the kernel places the pool";
    return placement;
  }
  std::vector<int> gpu_nodes;
  for (const GpuPlacement& gpu : topology.gpus) {
    if (gpu.node >= 0) gpu_nodes.push_back(gpu.node);
  }
  std::sort(gpu_nodes.begin(), gpu_nodes.end());
  gpu_nodes.erase(std::unique(gpu_nodes.begin(), gpu_nodes.end()), gpu_nodes.end());
  if (gpu_nodes.empty()) {
    placement.why = "no GPU's node is known: the kernel places the pool";
  } else if (gpu_nodes.size() == 1) {
    placement.nodes = gpu_nodes;
    placement.why =
        absl::StrCat("the pool is bound to node ", gpu_nodes[0], ", the node of every GPU");
  } else {
    placement.nodes = gpu_nodes;
    placement.split = true;
    placement.why = absl::StrCat("the pool is split over nodes ", FormatIdList(gpu_nodes),
                                 ", the GPUs' nodes: each part is bound to its node and a "
                                 "session leases from the part on its GPU's node first");
  }
  return placement;
}

absl::StatusOr<NumaTopology> ReadNumaTopology(const std::string& sysfs_root) {
  NumaTopology topology;
  const fs::path node_dir = fs::path(sysfs_root) / "devices/system/node";
  if (std::optional<std::string> online = ReadText(node_dir / "online")) {
    absl::StatusOr<std::vector<int>> ids = ParseIdList(*online);
    if (!ids.ok()) return Malformed(node_dir / "online", *online, "a node list");
    for (int id : *ids) {
      NumaNode node;
      node.id = id;
      const fs::path dir = node_dir / absl::StrCat("node", id);
      const fs::path cpulist = dir / "cpulist";
      if (std::optional<std::string> text = ReadText(cpulist)) {
        absl::StatusOr<std::vector<int>> cpus = ParseIdList(*text);
        if (!cpus.ok()) return Malformed(cpulist, *text, "a cpu list");
        node.cpus = *std::move(cpus);
      }
      if (std::optional<std::string> meminfo = ReadText(dir / "meminfo")) {
        node.memory_bytes = MemTotal(*meminfo);
      }
      topology.nodes.push_back(std::move(node));
    }
  }
  const fs::path pci = fs::path(sysfs_root) / "bus/pci/devices";
  std::error_code error;
  for (fs::directory_iterator it(pci, error), end; !error && it != end; it.increment(error)) {
    const fs::path dev = it->path();
    const std::optional<std::string> vendor = ReadText(dev / "vendor");
    const std::optional<std::string> pci_class = ReadText(dev / "class");
    if (!vendor || !pci_class || absl::AsciiStrToLower(*vendor) != "0x10de") continue;
    if (pci_class->rfind("0x0300", 0) != 0 && pci_class->rfind("0x0302", 0) != 0) continue;
    GpuPlacement gpu;
    gpu.bus_id = dev.filename().string();
    absl::StatusOr<int> node = ReadPciNumaNode(sysfs_root, gpu.bus_id);
    if (!node.ok()) return node.status();
    gpu.node = *node;
    topology.gpus.push_back(std::move(gpu));
  }
  std::sort(topology.gpus.begin(), topology.gpus.end(),
            [](const GpuPlacement& a, const GpuPlacement& b) { return a.bus_id < b.bus_id; });
  return topology;
}

}  // namespace actstash::server
