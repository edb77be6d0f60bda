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
#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "actstash/saved_tensors.h"
#include "actstash/v1/stash.pb.h"
#include "client/capi/json_writer.h"
#include "client/capi/message_json.h"
#include "client/capi/options_json.h"
#include "common/address.h"
#include "common/units.h"
#include "kernels/adamw.h"

struct actstash_client {
  std::shared_ptr<actstash::Client> client;
};

struct actstash_engine {
  std::unique_ptr<actstash::SavedTensorEngine> engine;
  actstash::capi::EngineSettings settings;  // as created (callbacks and copy engines aside)
};

namespace {

// The C ABI's numbers are the engine's enums.
constexpr int Of(actstash::KeepReason r) { return static_cast<int>(r); }
static_assert(ACTSTASH_KEEP_SMALL == Of(actstash::KeepReason::kSmall));
static_assert(ACTSTASH_KEEP_PARAMETER == Of(actstash::KeepReason::kParameter));
static_assert(ACTSTASH_KEEP_LISTED == Of(actstash::KeepReason::kKeepListed));
static_assert(ACTSTASH_KEEP_LAYOUT == Of(actstash::KeepReason::kLayout));
static_assert(ACTSTASH_KEEP_DEVICE == Of(actstash::KeepReason::kDevice));
static_assert(ACTSTASH_KEEP_NO_COPY_ENGINE == Of(actstash::KeepReason::kNoCopyEngine));
constexpr int Of(actstash::UnpackKind k) { return static_cast<int>(k); }
static_assert(ACTSTASH_UNPACK_SOURCE == Of(actstash::UnpackKind::kSource));
static_assert(ACTSTASH_UNPACK_VIEW == Of(actstash::UnpackKind::kView));
static_assert(ACTSTASH_UNPACK_DESTINATION == Of(actstash::UnpackKind::kDestination));
static_assert(ACTSTASH_UNPACK_PREFETCHED == Of(actstash::UnpackKind::kPrefetched));

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

}  // namespace

extern "C" {

int actstash_c_api_version(void) { return ACTSTASH_C_API_VERSION; }
const char* actstash_last_error(void) { return last_error.c_str(); }
void actstash_free_string(char* s) { std::free(s); }
int actstash_cuda_available(void) { return actstash::CudaDeviceAvailable() ? 1 : 0; }

char* actstash_describe_json(void) {
  actstash::capi::JsonWriter w;
  w.Begin();
  w.Field("c_api_version", uint64_t{ACTSTASH_C_API_VERSION});
  w.Field("default_min_bytes", uint64_t{actstash::kDefaultMinBytes});
  // Where a client without an address looks for the node's daemon.
  w.Field("default_socket", actstash::DefaultSocketPath());
  w.Key("pack_flags");
  w.Begin();
  w.Field("element_size_mask", uint64_t{ACTSTASH_ELEMENT_SIZE_MASK});
  w.Field("fp32", uint64_t{ACTSTASH_FP32});
  w.Field("dense", uint64_t{ACTSTASH_DENSE});
  w.Field("sync", uint64_t{ACTSTASH_SYNC});
  w.Field("keep_shift", uint64_t{ACTSTASH_KEEP_SHIFT});
  w.Field("ndim_shift", uint64_t{ACTSTASH_NDIM_SHIFT});
  w.Field("device_shift", uint64_t{ACTSTASH_DEVICE_SHIFT});
  w.End();
  w.Key("unpack_kinds");
  w.Begin();
  w.Field("source", uint64_t{ACTSTASH_UNPACK_SOURCE});
  w.Field("view", uint64_t{ACTSTASH_UNPACK_VIEW});
  w.Field("destination", uint64_t{ACTSTASH_UNPACK_DESTINATION});
  w.Field("prefetched", uint64_t{ACTSTASH_UNPACK_PREFETCHED});
  w.Field("copied", uint64_t{ACTSTASH_UNPACK_COPIED});
  w.End();
  w.Key("keep_reasons");
  w.BeginArray();
  for (int i = 0; i < static_cast<int>(actstash::KeepReason::kCount); ++i) {
    w.StringValue(actstash::KeepReasonName(static_cast<actstash::KeepReason>(i)));
  }
  w.EndArray();
  w.Key("engine_stats");
  w.BeginArray();
  for (const std::string& name : actstash::EngineStatNames()) w.StringValue(name);
  w.EndArray();
  w.Key("client_options");
  w.Begin();
  actstash::capi::WriteClientOptions(w, actstash::ClientOptions{});
  w.End();
  w.Key("engine_options");
  w.Begin();
  actstash::capi::WriteEngineSettings(w, actstash::capi::EngineSettings{});
  w.End();
  w.End();
  return Dup(w.str());
}

int actstash_parse_size(const char* text, uint64_t percent_base, uint64_t* out) {
  if (text == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError("text and out must not be null"));
  }
  absl::StatusOr<uint64_t> bytes = actstash::ParseByteSize(text, percent_base);
  if (!bytes.ok()) return Fail(bytes.status());
  *out = *bytes;
  return 0;
}

int actstash_client_connect(const char* options_json, actstash_client** out) {
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out must not be null"));
  actstash::ClientOptions options;
  if (options_json != nullptr) {
    if (absl::Status s = actstash::capi::ReadClientOptions(options_json, options); !s.ok()) {
      return Fail(s);
    }
  }
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
  w.Field("can_spill", client.can_spill());
  w.Field("daemon_pauses", client.daemon_pauses());
  w.Field("daemon_reattaches", client.daemon_reattaches());
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

int actstash_client_copy_share_json(actstash_client* c, double probe_store_bps,
                                    double probe_fetch_bps, char** out) {
  if (c == nullptr || out == nullptr) return NullHandle();
  absl::StatusOr<actstash::v1::CopyShareReply> share =
      c->client->CopyShare(probe_store_bps, probe_fetch_bps);
  if (!share.ok()) return Fail(share.status());
  actstash::capi::JsonWriter w;
  actstash::capi::WriteMessage(w, *share);
  *out = Dup(w.str());
  return 0;
}

int actstash_client_reserve(actstash_client* c, uint64_t nbytes, uint64_t* ticket,
                            uintptr_t* data) {
  if (c == nullptr || ticket == nullptr || data == nullptr) return NullHandle();
  absl::StatusOr<actstash::Reservation> reserved = c->client->ReserveState(nbytes);
  if (!reserved.ok()) return Fail(reserved.status());
  *ticket = reserved->ticket.id;
  *data = reinterpret_cast<uintptr_t>(reserved->data);
  return 0;
}

int actstash_client_release(actstash_client* c, uint64_t ticket, uint64_t nbytes) {
  if (c == nullptr) return NullHandle();
  if (absl::Status s = c->client->ReleaseState(actstash::Ticket{ticket, nbytes}); !s.ok()) {
    return Fail(s);
  }
  return 0;
}

int actstash_client_park(actstash_client* c, uint64_t ticket) {
  if (c == nullptr) return NullHandle();
  // The size is not part of a ticket's identity.
  if (absl::Status s = c->client->ParkState(actstash::Ticket{ticket, 0}); !s.ok()) return Fail(s);
  return 0;
}

int actstash_client_locate(actstash_client* c, uint64_t ticket, uintptr_t* data) {
  if (c == nullptr || data == nullptr) return NullHandle();
  absl::StatusOr<void*> located = c->client->LocateState(actstash::Ticket{ticket, 0});
  if (!located.ok()) return Fail(located.status());
  *data = reinterpret_cast<uintptr_t>(*located);
  return 0;
}

namespace {

// Both AdamW entry points; `params_bf16` null for the fp32 one.
int AdamWStep(const char* what, uint64_t count, const uintptr_t* params, const uintptr_t* grads,
              const uintptr_t* exp_avgs, const uintptr_t* exp_avg_sqs, const uintptr_t* params_bf16,
              bool bf16, const uint64_t* sizes, double lr, double beta1, double beta2, double eps,
              double weight_decay, uint64_t step, int threads) {
  if (count > 0 &&
      (params == nullptr || grads == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr ||
       sizes == nullptr || (bf16 && params_bf16 == nullptr))) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(what, ": a null array")));
  }
  if (step == 0) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(what, ": steps count from 1")));
  }
  std::vector<actstash::kernels::AdamWTensor> tensors(count);
  for (uint64_t i = 0; i < count; ++i) {
    actstash::kernels::AdamWTensor& t = tensors[i];
    t.param = reinterpret_cast<float*>(params[i]);
    t.exp_avg = reinterpret_cast<float*>(exp_avgs[i]);
    t.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sqs[i]);
    t.n = static_cast<size_t>(sizes[i]);
    if (bf16) {
      t.grad_bf16 = reinterpret_cast<const uint16_t*>(grads[i]);
      t.param_bf16 = reinterpret_cast<uint16_t*>(params_bf16[i]);
    } else {
      t.grad = reinterpret_cast<const float*>(grads[i]);
    }
  }
  actstash::kernels::AdamWHyper hyper{lr, beta1, beta2, eps, weight_decay, step};
  actstash::kernels::AdamWStepCpu(tensors.data(), tensors.size(), hyper, threads);
  return 0;
}

}  // namespace

int actstash_adamw_step(uint64_t count, const uintptr_t* params, const uintptr_t* grads,
                        const uintptr_t* exp_avgs, const uintptr_t* exp_avg_sqs,
                        const uint64_t* sizes, double lr, double beta1, double beta2, double eps,
                        double weight_decay, uint64_t step, int threads) {
  return AdamWStep("adamw_step", count, params, grads, exp_avgs, exp_avg_sqs, nullptr, false, sizes,
                   lr, beta1, beta2, eps, weight_decay, step, threads);
}

int actstash_adamw_step_bf16(uint64_t count, const uintptr_t* masters, const uintptr_t* grads_bf16,
                             const uintptr_t* exp_avgs, const uintptr_t* exp_avg_sqs,
                             const uintptr_t* params_bf16, const uint64_t* sizes, double lr,
                             double beta1, double beta2, double eps, double weight_decay,
                             uint64_t step, int threads) {
  return AdamWStep("adamw_step_bf16", count, masters, grads_bf16, exp_avgs, exp_avg_sqs,
                   params_bf16, true, sizes, lr, beta1, beta2, eps, weight_decay, step, threads);
}

int actstash_engine_create(actstash_client* client, const char* options_json,
                           const actstash_engine_callbacks* callbacks, actstash_engine** out) {
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out must not be null"));
  actstash::capi::EngineSettings settings;
  if (options_json != nullptr) {
    if (absl::Status s = actstash::capi::ReadEngineSettings(options_json, settings); !s.ok()) {
      return Fail(s);
    }
  }
  // Injected delays are for tests of ordering: every CPU store then takes
  // the delayed path instead of being copied on the calling thread.
  if (settings.host.max_injected_delay.count() > 0) settings.engine.inline_store_bytes = 0;
  // A simulated link is the host engine's to keep; the settings read back are
  // the ones the engine runs with.
  settings.host.link_bytes_per_second = settings.engine.simulated_link_bytes_per_second;
  settings.engine = actstash::EffectiveEngineOptions(std::move(settings.engine));
  actstash::EngineOptions options = settings.engine;
  if (callbacks != nullptr) {
    if ((callbacks->acquire == nullptr) != (callbacks->release == nullptr) ||
        (callbacks->unlock == nullptr) != (callbacks->relock == nullptr)) {
      return Fail(absl::InvalidArgumentError(
          "acquire/release and unlock/relock come in pairs: both or neither"));
    }
    options.acquire_owner = callbacks->acquire;
    options.release_owner = callbacks->release;
    options.unlock_caller = callbacks->unlock;
    options.relock_caller = callbacks->relock;
  }
  options.host_engine = actstash::CreateHostCopyEngine(settings.host);
  absl::StatusOr<std::unique_ptr<actstash::SavedTensorEngine>> engine =
      actstash::SavedTensorEngine::Create(client != nullptr ? client->client : nullptr,
                                          std::move(options));
  if (!engine.ok()) return Fail(engine.status());
  *out = new actstash_engine{std::move(*engine), settings};
  return 0;
}

void actstash_engine_free(actstash_engine* e) { delete e; }

char* actstash_engine_settings_json(actstash_engine* e) {
  if (e == nullptr) return nullptr;
  actstash::capi::JsonWriter w;
  w.Begin();
  actstash::capi::WriteEngineSettings(w, e->settings);
  w.End();
  return Dup(w.str());
}

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
  info.stream = actstash::StreamHandle{stream};
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
  const int fetched = Code(e->engine->FetchInto(id, dst, capacity, actstash::StreamHandle{}));
  if (fetched == 0) out[0] = ACTSTASH_UNPACK_COPIED;
  return fetched;
}

int actstash_engine_fetch_into(actstash_engine* e, uint64_t id, uintptr_t dst, uint64_t capacity,
                               uintptr_t stream) {
  return e == nullptr
             ? NullHandle()
             : Code(e->engine->FetchInto(id, dst, capacity, actstash::StreamHandle{stream}));
}

int actstash_engine_prefetch(actstash_engine* e, uint64_t id, uintptr_t dst, uint64_t capacity,
                             void* owner, uintptr_t stream) {
  return e == nullptr
             ? NullHandle()
             : Code(e->engine->Prefetch(id, dst, capacity, owner, actstash::StreamHandle{stream}));
}

int actstash_engine_finish(actstash_engine* e, uint64_t id, uintptr_t stream) {
  return e == nullptr ? NullHandle() : Code(e->engine->Finish(id, actstash::StreamHandle{stream}));
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

int actstash_engine_stats(actstash_engine* e, uint64_t* values, int n) {
  if (e == nullptr) return 0;
  const std::vector<uint64_t> all = actstash::EngineStatValues(e->engine->stats());
  for (int i = 0; i < n && i < static_cast<int>(all.size()); ++i) values[i] = all[i];
  return static_cast<int>(all.size());
}

}  // extern "C"
