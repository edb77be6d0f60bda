// The C ABI (actstash/c_api.h) over actstash::Client and SavedTensorEngine.
// Statuses become codes plus a thread-local message here and nowhere else.
#include "actstash/c_api.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "actstash/saved_tensors.h"
#include "client/capi/json_writer.h"
#include "client/capi/message_json.h"
#include "common/choice.h"
#include "common/tristate.h"

struct actstash_client {
  std::shared_ptr<actstash::Client> client;
};

struct actstash_engine {
  std::unique_ptr<actstash::SavedTensorEngine> engine;
};

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return static_cast<int>(status.code());
}

int Code(const absl::Status& status) { return status.ok() ? 0 : Fail(status); }

int NullHandle() { return Fail(absl::InvalidArgumentError("null actstash handle")); }

char* Dup(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// The public PinPolicy has the three meanings of the setting's Tristate.
actstash::PinPolicy PinPolicyOf(actstash::Tristate setting) {
  switch (setting) {
    case actstash::Tristate::kOn:
      return actstash::PinPolicy::kOn;
    case actstash::Tristate::kOff:
      return actstash::PinPolicy::kOff;
    case actstash::Tristate::kAuto:
      break;
  }
  return actstash::PinPolicy::kAuto;
}

}  // namespace

extern "C" {

int actstash_c_api_version(void) { return ACTSTASH_C_API_VERSION; }
const char* actstash_last_error(void) { return last_error.c_str(); }
void actstash_free_string(char* s) { std::free(s); }
int actstash_cuda_available(void) { return actstash::CudaDeviceAvailable() ? 1 : 0; }

int actstash_client_connect(const char* address, uint64_t quota, const char* name,
                            const char* attach, int64_t rpc_timeout_ms, int64_t connect_timeout_ms,
                            uint32_t lease_batch, const char* pin, int cuda_device,
                            actstash_client** out) {
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out must not be null"));
  actstash::ClientOptions options;
  options.address = address != nullptr ? address : "";
  options.quota_bytes = quota;
  options.client_name = name != nullptr ? name : "";
  options.rpc_timeout = std::chrono::milliseconds(rpc_timeout_ms);
  options.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
  options.lease_batch = lease_batch;
  options.cuda_device = cuda_device;
  static constexpr actstash::Choice<actstash::AttachMode> kAttach[] = {
      {"auto", actstash::AttachMode::kAuto},
      {"required", actstash::AttachMode::kRequired},
      {"off", actstash::AttachMode::kOff}};
  // Null means the default: the first name.
  absl::StatusOr<actstash::AttachMode> attach_mode =
      actstash::ParseChoice(attach != nullptr ? attach : "auto", "attach", kAttach);
  if (!attach_mode.ok()) return Fail(attach_mode.status());
  options.attach = *attach_mode;
  // The pin policy is spelled like every auto/on/off setting (common/tristate.h).
  absl::StatusOr<actstash::Tristate> pin_policy =
      actstash::ParseTristate(pin != nullptr ? pin : "auto", "pin");
  if (!pin_policy.ok()) return Fail(pin_policy.status());
  options.pin_leases = PinPolicyOf(*pin_policy);
  absl::StatusOr<std::unique_ptr<actstash::Client>> client = actstash::Client::Connect(options);
  if (!client.ok()) return Fail(client.status());
  *out = new actstash_client{std::shared_ptr<actstash::Client>(std::move(*client))};
  return 0;
}

int actstash_client_close(actstash_client* c) {
  return c == nullptr ? NullHandle() : Code(c->client->Close());
}
void actstash_client_free(actstash_client* c) { delete c; }

char* actstash_client_info_json(actstash_client* c) {
  if (c == nullptr) return nullptr;
  const actstash::Client& client = *c->client;
  actstash::capi::JsonWriter w;
  w.Begin();
  w.Field("session_id", client.session_id());
  w.Field("quota", client.quota_bytes());
  w.Field("address", client.address());
  w.Field("attached", client.attached());
  w.Field("attach_error", std::string(client.attach_status().message()));
  const absl::Status pin = client.pin_status();
  if (pin.ok()) {
    w.NullField("pin_error");
  } else {
    w.Field("pin_error", std::string(pin.message()));
  }
  w.Key("device_pools");
  w.BeginArray();
  for (const actstash::DevicePoolInfo& p : client.device_pools()) {
    w.Begin();
    w.Field("device", p.device);
    w.Field("total_bytes", p.total_bytes);
    w.Field("segment_bytes", p.segment_bytes);
    w.End();
  }
  w.EndArray();
  w.Key("zero_copy");
  actstash::capi::WriteMessage(w, client.zero_copy_usage());
  w.End();
  return Dup(w.str());
}

int actstash_client_stats_json(actstash_client* c, int all_sessions, char** out) {
  if (c == nullptr || out == nullptr) return NullHandle();
  absl::StatusOr<actstash::v1::StatsReply> stats = c->client->Stats(all_sessions != 0);
  if (!stats.ok()) return Fail(stats.status());
  actstash::capi::JsonWriter w;
  actstash::capi::WriteMessage(w, *stats);
  *out = Dup(w.str());
  return 0;
}

int actstash_engine_create(actstash_client* client, uint64_t inline_store_bytes, int cpu_views,
                           uint64_t view_min_bytes, int prefetch, int cuda, int device_pool,
                           int pool_importer, int downcast_bf16, int on_failure,
                           int64_t copy_delay_us, uint64_t seed, void (*acquire)(void*),
                           void (*release)(void*), uint64_t max_in_flight_bytes,
                           uint32_t max_in_flight_stores, void* (*unlock)(void),
                           void (*relock)(void*), actstash_engine** out) {
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out must not be null"));
  if (on_failure != 0 && on_failure != 1) {
    return Fail(absl::InvalidArgumentError("on_failure must be 0 (raise) or 1 (keep)"));
  }
  if (copy_delay_us < 0) return Fail(absl::InvalidArgumentError("copy_delay_us must be >= 0"));
  if ((acquire == nullptr) != (release == nullptr) || (unlock == nullptr) != (relock == nullptr)) {
    return Fail(absl::InvalidArgumentError(
        "acquire/release and unlock/relock come in pairs: both or neither"));
  }
  actstash::EngineOptions options;
  options.inline_store_bytes = inline_store_bytes;
  options.cpu_views = cpu_views != 0;
  options.view_min_bytes = view_min_bytes;
  options.prefetch = prefetch;
  options.cuda = cuda != 0;
  options.device_pool = device_pool;
  options.pool_importer = pool_importer;
  options.downcast_bf16 = downcast_bf16 != 0;
  options.on_failure =
      on_failure == 0 ? actstash::FailurePolicy::kRaise : actstash::FailurePolicy::kKeep;
  actstash::HostCopyEngineOptions host;
  host.max_injected_delay = std::chrono::microseconds(copy_delay_us);
  host.seed = seed;
  options.host_engine = actstash::CreateHostCopyEngine(host);
  options.acquire_owner = acquire;
  options.release_owner = release;
  options.max_in_flight_bytes = max_in_flight_bytes;
  options.max_in_flight_stores = max_in_flight_stores;
  options.unlock_caller = unlock;
  options.relock_caller = relock;
  absl::StatusOr<std::unique_ptr<actstash::SavedTensorEngine>> engine =
      actstash::SavedTensorEngine::Create(client != nullptr ? client->client : nullptr,
                                          std::move(options));
  if (!engine.ok()) return Fail(engine.status());
  *out = new actstash_engine{std::move(*engine)};
  return 0;
}

void actstash_engine_free(actstash_engine* e) { delete e; }

uint64_t actstash_engine_pack(actstash_engine* e, uintptr_t data, uint64_t nbytes, uint64_t flags,
                              const int64_t* sizes, const int64_t* strides, uintptr_t stream,
                              uint64_t version, void* owner, void* cookie, uint64_t min_bytes) {
  if (e == nullptr) return 0;
  actstash::SavedTensorInfo info;
  info.data = data;
  info.nbytes = nbytes;
  info.element_size = static_cast<int>(flags & ACTSTASH_ELEMENT_SIZE_MASK);
  info.is_fp32 = (flags & ACTSTASH_FP32) != 0;
  info.dense = (flags & ACTSTASH_DENSE) != 0;
  info.sync = (flags & ACTSTASH_SYNC) != 0;
  info.ndim = static_cast<int>((flags >> ACTSTASH_NDIM_SHIFT) & 0xF);
  info.sizes = sizes;
  info.strides = strides;
  info.device = static_cast<int>((flags >> ACTSTASH_DEVICE_SHIFT) & 0xFFFF) - 1;
  info.stream = stream;
  info.version = version;
  info.owner = owner;
  info.cookie = cookie;
  const uint64_t keep = (flags >> ACTSTASH_KEEP_SHIFT) & 0xF;
  const actstash::KeepReason reason =
      keep == 0 || keep > static_cast<uint64_t>(actstash::KeepReason::kCount)
          ? actstash::KeepReason::kCount
          : static_cast<actstash::KeepReason>(keep - 1);
  return e->engine->Pack(info, reason, min_bytes);
}

uint64_t actstash_engine_pack_dense_cpu(actstash_engine* e, uintptr_t data, uint64_t nbytes,
                                        uint64_t flags, uint64_t version, void* owner,
                                        void* cookie) {
  return actstash_engine_pack(e, data, nbytes, flags | ACTSTASH_DENSE, nullptr, nullptr, 0, version,
                              owner, cookie, 0);
}

int actstash_engine_unpack(actstash_engine* e, uint64_t id, uint64_t version, uint64_t* out,
                           int out_len) {
  if (e == nullptr) return NullHandle();
  if (out == nullptr || out_len < 5) {
    return Fail(absl::InvalidArgumentError("unpack needs an output array of at least 5"));
  }
  out[4] = 0;  // no candidates handed over unless written below
  absl::StatusOr<actstash::UnpackResult> r = e->engine->UnpackBegin(id, version, (out_len - 5) / 2);
  if (!r.ok()) return Fail(r.status());
  out[0] = static_cast<uint64_t>(r->kind);
  out[1] = r->kind == actstash::UnpackKind::kView ? reinterpret_cast<uintptr_t>(r->data)
                                                  : reinterpret_cast<uintptr_t>(r->owner);
  out[2] = r->nbytes;
  out[3] = r->downcast ? 1 : 0;
  const size_t n = r->prefetch_ids.size();  // at most (out_len - 5) / 2
  out[4] = n;
  for (size_t i = 0; i < n; ++i) {
    out[5 + 2 * i] = r->prefetch_ids[i];
    out[6 + 2 * i] = reinterpret_cast<uintptr_t>(r->prefetch_cookies[i]);
  }
  return 0;
}

int actstash_engine_unpack_into(actstash_engine* e, uint64_t id, uint64_t version, uintptr_t dst,
                                uint64_t capacity, uint64_t* out, int out_len) {
  const int code = actstash_engine_unpack(e, id, version, out, out_len);
  if (code != 0 || dst == 0 ||
      out[0] != static_cast<uint64_t>(actstash::UnpackKind::kDestination)) {
    return code;
  }
  const int fetched = Code(e->engine->FetchInto(id, dst, capacity, 0));
  if (fetched == 0) out[0] = ACTSTASH_UNPACK_COPIED;
  return fetched;
}

int actstash_engine_fetch_into(actstash_engine* e, uint64_t id, uintptr_t dst, uint64_t capacity,
                               uintptr_t stream) {
  return e == nullptr ? NullHandle() : Code(e->engine->FetchInto(id, dst, capacity, stream));
}

int actstash_engine_prefetch(actstash_engine* e, uint64_t id, uintptr_t dst, uint64_t capacity,
                             void* owner, uintptr_t stream) {
  return e == nullptr ? NullHandle() : Code(e->engine->Prefetch(id, dst, capacity, owner, stream));
}

int actstash_engine_finish(actstash_engine* e, uint64_t id, uintptr_t stream) {
  return e == nullptr ? NullHandle() : Code(e->engine->Finish(id, stream));
}

// Null handles are ignored (void) or INVALID_ARGUMENT: a front-end being torn
// down (interpreter exit) may call after it gave its handle back.
void actstash_engine_view_done(actstash_engine* e, uint64_t id) {
  if (e != nullptr) e->engine->ViewDone(id);
}
void actstash_engine_release(actstash_engine* e, uint64_t id) {
  if (e != nullptr) e->engine->Release(id);
}
int actstash_engine_reap(actstash_engine* e, int wait) {
  return e == nullptr ? NullHandle() : Code(e->engine->Reap(wait != 0));
}
int actstash_engine_take_error(actstash_engine* e) {
  return e == nullptr ? NullHandle() : Code(e->engine->TakeError());
}
int actstash_engine_take_notice(actstash_engine* e) {
  return e == nullptr ? NullHandle() : Code(e->engine->TakeNotice());
}
void actstash_engine_synchronize(actstash_engine* e) {
  if (e != nullptr) e->engine->Synchronize();
}
void actstash_engine_wait(actstash_engine* e) {
  if (e != nullptr) e->engine->WaitForCopies();
}
int actstash_engine_available(actstash_engine* e) {
  return e != nullptr && e->engine->available() ? 1 : 0;
}

const char* actstash_engine_stat_names(void) {
  static const std::string names = absl::StrJoin(actstash::EngineStatNames(), ",");
  return names.c_str();
}

int actstash_engine_stats(actstash_engine* e, uint64_t* values, int n) {
  if (e == nullptr) return 0;
  const std::vector<uint64_t> all = actstash::EngineStatValues(e->engine->stats());
  for (int i = 0; i < n && i < static_cast<int>(all.size()); ++i) values[i] = all[i];
  return static_cast<int>(all.size());
}

}  // extern "C"
