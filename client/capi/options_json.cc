#include "client/capi/options_json.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/choice.h"
#include "common/tristate.h"
#include "common/units.h"

namespace actstash::capi {
namespace {

using google::protobuf::Value;

// A row: one setting, how to read it into T and how to write it from T.
template <typename T>
struct Setting {
  absl::string_view name;
  std::function<absl::Status(const Value&, T&)> read;
  std::function<void(JsonWriter&, const T&)> write;
};

absl::Status WrongType(absl::string_view name, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", expected));
}

// Whole numbers travel as JSON numbers (doubles): exact up to 2^53.
constexpr double kLargestExact = 0x1p53;

absl::StatusOr<int64_t> ReadWhole(const Value& v, absl::string_view name, int64_t min,
                                  int64_t max) {
  if (v.kind_case() != Value::kNumberValue) return WrongType(name, "a whole number");
  const double d = v.number_value();
  if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > kLargestExact) {
    return WrongType(name, "a whole number");
  }
  if (d < static_cast<double>(min) || d > static_cast<double>(max)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", static_cast<int64_t>(d), " is outside ", min, "..", max));
  }
  return static_cast<int64_t>(d);
}

// A byte count: a whole number, or a size string for ParseByteSize.
absl::StatusOr<uint64_t> ReadSize(const Value& v, absl::string_view name) {
  if (v.kind_case() == Value::kStringValue) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(v.string_value());
    if (!bytes.ok())
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", bytes.status().message()));
    return *bytes;
  }
  absl::StatusOr<int64_t> whole = ReadWhole(v, name, 0, static_cast<int64_t>(kLargestExact));
  if (!whole.ok()) return WrongType(name, "a number of bytes or a size such as \"512MiB\"");
  return static_cast<uint64_t>(*whole);
}

template <typename T, typename M>
Setting<T> Size(absl::string_view name, M T::*member) {
  return {name,
          [name, member](const Value& v, T& t) -> absl::Status {
            absl::StatusOr<uint64_t> bytes = ReadSize(v, name);
            if (!bytes.ok()) return bytes.status();
            if (*bytes > std::numeric_limits<M>::max()) {
              return absl::InvalidArgumentError(absl::StrCat(name, ": too large"));
            }
            t.*member = static_cast<M>(*bytes);
            return absl::OkStatus();
          },
          [member](JsonWriter& w, const T& t) { w.RawValue(absl::StrCat(t.*member)); }};
}

template <typename T, typename M>
Setting<T> Whole(absl::string_view name, M T::*member, int64_t min, int64_t max) {
  return {name,
          [name, member, min, max](const Value& v, T& t) -> absl::Status {
            absl::StatusOr<int64_t> n = ReadWhole(v, name, min, max);
            if (!n.ok()) return n.status();
            t.*member = static_cast<M>(*n);
            return absl::OkStatus();
          },
          [member](JsonWriter& w, const T& t) { w.RawValue(absl::StrCat(t.*member)); }};
}

// A std::chrono duration member, in whole units of D (milliseconds or
// microseconds, as the name says).
template <typename T, typename D>
Setting<T> Duration(absl::string_view name, D T::*member) {
  return {name,
          [name, member](const Value& v, T& t) -> absl::Status {
            absl::StatusOr<int64_t> n = ReadWhole(v, name, 0, static_cast<int64_t>(kLargestExact));
            if (!n.ok()) return n.status();
            t.*member = D(*n);
            return absl::OkStatus();
          },
          [member](JsonWriter& w, const T& t) { w.RawValue(absl::StrCat((t.*member).count())); }};
}

template <typename T>
Setting<T> Flag(absl::string_view name, bool T::*member) {
  return {name,
          [name, member](const Value& v, T& t) -> absl::Status {
            if (v.kind_case() != Value::kBoolValue) return WrongType(name, "true or false");
            t.*member = v.bool_value();
            return absl::OkStatus();
          },
          [member](JsonWriter& w, const T& t) { w.RawValue(t.*member ? "true" : "false"); }};
}

template <typename T>
Setting<T> Text(absl::string_view name, std::string T::*member) {
  return {name,
          [name, member](const Value& v, T& t) -> absl::Status {
            if (v.kind_case() != Value::kStringValue) return WrongType(name, "a string");
            t.*member = v.string_value();
            return absl::OkStatus();
          },
          [member](JsonWriter& w, const T& t) { w.StringValue(t.*member); }};
}

// One of the names of `choices`; written back by name.
template <typename T, typename E, size_t N>
Setting<T> OneOf(absl::string_view name, E T::*member, const Choice<E> (&choices)[N]) {
  return {name,
          [name, member, &choices](const Value& v, T& t) -> absl::Status {
            if (v.kind_case() != Value::kStringValue) return WrongType(name, "a string");
            absl::StatusOr<E> e = ParseChoice(v.string_value(), name, choices);
            if (!e.ok()) return e.status();
            t.*member = *e;
            return absl::OkStatus();
          },
          [member, &choices](JsonWriter& w, const T& t) {
            for (const Choice<E>& choice : choices) {
              if (choice.value == t.*member) w.StringValue(std::string(choice.name));
            }
          }};
}

constexpr Choice<AttachMode> kAttachNames[] = {
    {"auto", AttachMode::kAuto}, {"required", AttachMode::kRequired}, {"off", AttachMode::kOff}};
// PinPolicy has Tristate's enumerators and values (asserted in the client,
// client/rpc/client_impl.h): it is spelled like every auto/on/off setting.
constexpr Choice<PinPolicy> kPinPolicyNames[] = {
    {kTristateNames[0].name, static_cast<PinPolicy>(kTristateNames[0].value)},
    {kTristateNames[1].name, static_cast<PinPolicy>(kTristateNames[1].value)},
    {kTristateNames[2].name, static_cast<PinPolicy>(kTristateNames[2].value)}};
static_assert(std::size(kPinPolicyNames) == std::size(kTristateNames));
constexpr Choice<FailurePolicy> kFailureNames[] = {{"raise", FailurePolicy::kRaise},
                                                   {"keep", FailurePolicy::kKeep}};

constexpr int64_t kMaxU32 = std::numeric_limits<uint32_t>::max();
constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

const std::vector<Setting<ClientOptions>>& ClientRows() {
  using O = ClientOptions;
  static const auto* rows = new std::vector<Setting<O>>{
      Text("address", &O::address),
      Text("client_name", &O::client_name),
      Size("quota_bytes", &O::quota_bytes),
      Duration("rpc_timeout_ms", &O::rpc_timeout),
      Duration("connect_timeout_ms", &O::connect_timeout),
      Duration("reattach_timeout_ms", &O::reattach_timeout),
      OneOf("attach", &O::attach, kAttachNames),
      Whole("lease_batch", &O::lease_batch, 1, kMaxU32),
      Duration("usage_report_interval_ms", &O::usage_report_interval),
      Text("tls_root_certs", &O::tls_root_certs),
      Text("tls_cert_chain", &O::tls_cert_chain),
      Text("tls_private_key", &O::tls_private_key),
      OneOf("pin_leases", &O::pin_leases, kPinPolicyNames),
      Whole("cuda_device", &O::cuda_device, 0, kMaxInt),
      Flag("spill", &O::spill),
      Whole("restore_ahead", &O::restore_ahead, 0, kMaxU32),
      Duration("pool_wait_ms", &O::pool_wait),
      Duration("lease_retain_ms", &O::lease_retain),
      Whole("numa_node", &O::numa_node, -1, 1023),
  };
  return *rows;
}

// EngineOptions' callbacks and copy engines are not settings: the C ABI
// passes the callbacks separately and creates the host engine from `host`.
const std::vector<Setting<EngineSettings>>& EngineRows() {
  using S = EngineSettings;
  // Rows over a member of a member: read and write through the outer one.
  auto engine = [](Setting<EngineOptions> row) {
    return Setting<S>{row.name,
                      [read = row.read](const Value& v, S& s) { return read(v, s.engine); },
                      [write = row.write](JsonWriter& w, const S& s) { write(w, s.engine); }};
  };
  auto host = [](Setting<HostCopyEngineOptions> row) {
    return Setting<S>{row.name, [read = row.read](const Value& v, S& s) { return read(v, s.host); },
                      [write = row.write](JsonWriter& w, const S& s) { write(w, s.host); }};
  };
  using E = EngineOptions;
  using H = HostCopyEngineOptions;
  static const auto* rows = new std::vector<Setting<S>>{
      engine(Size("inline_store_bytes", &E::inline_store_bytes)),
      engine(Flag("cpu_views", &E::cpu_views)),
      engine(Size("view_min_bytes", &E::view_min_bytes)),
      engine(Whole("prefetch", &E::prefetch, 0, 1024)),
      engine(Flag("cuda", &E::cuda)),
      engine(Whole("device_pool", &E::device_pool, -1, kMaxInt)),
      engine(Whole("pool_importer", &E::pool_importer, -1, kMaxInt)),
      engine(Flag("downcast_bf16", &E::downcast_bf16)),
      engine(OneOf("on_failure", &E::on_failure, kFailureNames)),
      engine(Size("max_in_flight_bytes", &E::max_in_flight_bytes)),
      engine(Size("simulated_link_bytes_per_second", &E::simulated_link_bytes_per_second)),
      engine(Whole("max_in_flight_stores", &E::max_in_flight_stores, 0, kMaxU32)),
      host(Duration("copy_delay_us", &H::max_injected_delay)),
      host(Whole("seed", &H::seed, 0, static_cast<int64_t>(kLargestExact))),
  };
  return *rows;
}

template <typename T>
absl::Status Read(absl::string_view json, const std::vector<Setting<T>>& rows, T& out) {
  if (json.empty()) return absl::OkStatus();
  google::protobuf::Value parsed;
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &parsed);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("options are not JSON: ", std::string(status.message())));
  }
  if (parsed.kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError("options must be a JSON object");
  }
  for (const auto& [name, value] : parsed.struct_value().fields()) {
    const Setting<T>* row = nullptr;
    for (const Setting<T>& candidate : rows) {
      if (candidate.name == name) row = &candidate;
    }
    if (row == nullptr) {
      std::vector<absl::string_view> names;
      for (const Setting<T>& candidate : rows) names.push_back(candidate.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown setting '", name, "' (settings: ", absl::StrJoin(names, ", "), ")"));
    }
    if (absl::Status s = row->read(value, out); !s.ok()) return s;
  }
  return absl::OkStatus();
}

template <typename T>
void Write(JsonWriter& w, const std::vector<Setting<T>>& rows, const T& in) {
  for (const Setting<T>& row : rows) {
    w.Key(std::string(row.name));
    row.write(w, in);
  }
}

}  // namespace

absl::Status ReadClientOptions(absl::string_view json, ClientOptions& options) {
  return Read(json, ClientRows(), options);
}
absl::Status ReadEngineSettings(absl::string_view json, EngineSettings& settings) {
  return Read(json, EngineRows(), settings);
}
void WriteClientOptions(JsonWriter& w, const ClientOptions& options) {
  Write(w, ClientRows(), options);
}
void WriteEngineSettings(JsonWriter& w, const EngineSettings& settings) {
  Write(w, EngineRows(), settings);
}

}  // namespace actstash::capi
