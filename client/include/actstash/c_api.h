/* actstash's stable C ABI: the client and the saved-tensor engine
 * (actstash/saved_tensors.h) behind opaque handles, for front-ends that load
 * a shared library instead of linking C++ (the Python package, through
 * ctypes: one library serves every CPython version and any torch).
 *
 * Conventions: functions returning int return 0 on success, else an
 * absl::StatusCode value (3 INVALID_ARGUMENT, 5 NOT_FOUND, 8
 * RESOURCE_EXHAUSTED, 9 FAILED_PRECONDITION, 11 OUT_OF_RANGE, 14
 * UNAVAILABLE, ...), with the message in actstash_last_error() of the same
 * thread until its next failing call. Strings returned as char* are the
 * caller's, freed with actstash_free_string. Every function may be called
 * from any thread; handles are freed once, after every other call on them.
 * A null handle is INVALID_ARGUMENT (void functions ignore it; pack returns
 * 0), never a crash.
 * Calls that wait (connect, close, stats, fetch_into, finish, reap with
 * wait, synchronize, wait, and unpack of a downcast tensor still being
 * stored) may block; the others do not wait for copies. The
 * engine calls the owner functions given at creation only inside
 * actstash_engine_pack, _unpack, _release, _view_done, _reap and _free, on the
 * calling thread. */
#ifndef ACTSTASH_C_API_H_
#define ACTSTASH_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: the stats and zero_copy dictionaries are the proto messages'.
 * 4: connect and engine_create take their settings as one JSON object;
 * actstash_describe_json exports the constants, defaults and counter names;
 * actstash_parse_size.
 * 5: actstash_client_copy_share_json.
 * 6: actstash_client_reserve/release, actstash_adamw_step.
 * 7: actstash_adamw_step_bf16.
 * 8: actstash_client_park/locate. */
#define ACTSTASH_C_API_VERSION 8

#if defined(__GNUC__)
#define ACTSTASH_API __attribute__((visibility("default")))
#else
#define ACTSTASH_API
#endif

typedef struct actstash_client actstash_client;
typedef struct actstash_engine actstash_engine;

ACTSTASH_API int actstash_c_api_version(void);
ACTSTASH_API const char* actstash_last_error(void);
ACTSTASH_API void actstash_free_string(char* s);
/* Whether this build has CUDA and a usable device. */
ACTSTASH_API int actstash_cuda_available(void);

/* What a front-end would otherwise re-declare, as one JSON object (the
 * caller's string): "c_api_version"; "pack_flags" and "unpack_kinds" (the
 * #defines below, by lower-case name without the prefix); "keep_reasons"
 * (names in KeepReason order); "engine_stats" (counter names in the order
 * actstash_engine_stats writes them); "client_options" and
 * "engine_options": every setting actstash_client_connect and
 * actstash_engine_create accept, with its default. */
ACTSTASH_API char* actstash_describe_json(void);

/* The project's one size parser (common/units.h): "512MiB", "4G" (binary:
 * KiB..TiB and the bare letters), "1.5GB" (decimal: KB..TB), a number of
 * bytes, or "25%" of percent_base when that is not 0. */
ACTSTASH_API int actstash_parse_size(const char* text, uint64_t percent_base, uint64_t* out);

/* options_json: a JSON object of ClientOptions settings by name (NULL or
 * "{}": all defaults; names and defaults: describe's "client_options"), e.g.
 * {"address": "unix:///run/actstash.sock", "quota_bytes": "8GiB",
 *  "attach": "auto", "pin_leases": "auto", "lease_retain_ms": 10000}.
 * Sizes take a number of bytes or a size string; durations whole
 * milliseconds (microseconds for copy_delay_us). An unknown name, a wrong
 * type or a value out of range is INVALID_ARGUMENT naming the setting. */
ACTSTASH_API int actstash_client_connect(const char* options_json, actstash_client** out);
ACTSTASH_API int actstash_client_close(actstash_client* client);
ACTSTASH_API void actstash_client_free(actstash_client* client);
/* JSON object: session_id, quota, address, attached, can_spill, attach_error, pin_error,
 * device_pools [{device, total_bytes, segment_bytes}], zero_copy (the
 * ClientUsage message of actstash/v1/stash.proto, every field). No RPC. */
ACTSTASH_API char* actstash_client_info_json(actstash_client* client);
/* The daemon's stats as JSON (*out, the caller's): the StatsReply message of
 * actstash/v1/stash.proto with every field under its proto name, 64-bit
 * integers as numbers, unset messages as null; all_sessions fills
 * "all_sessions". */
ACTSTASH_API int actstash_client_stats_json(actstash_client* client, int all_sessions, char** out);
/* The node's copy bandwidth and this session's share (Client::CopyShare): the
 * CopyShareReply message as JSON, like stats. The probe rates are what this
 * client's copies reached alone, in bytes per second (0: unknown). */
ACTSTASH_API int actstash_client_copy_share_json(actstash_client* client, double probe_store_bps,
                                                 double probe_fetch_bps, char** out);

/* Long-lived buffers in the session's leased pool memory (optimizer state):
 * reserve places nbytes (attached clients only: FAILED_PRECONDITION
 * otherwise; RESOURCE_EXHAUSTED past the quota or the pool) and gives its
 * ticket and writable address, valid until released or parked; the buffer
 * is never spilled unless parked. release gives it back (NOT_FOUND for an unknown ticket). */
ACTSTASH_API int actstash_client_reserve(actstash_client* client, uint64_t nbytes, uint64_t* ticket,
                                         uintptr_t* data);
ACTSTASH_API int actstash_client_release(actstash_client* client, uint64_t ticket, uint64_t nbytes);
/* park: the caller keeps no pointer into a reserved buffer any more; under
 * pool pressure it may be spilled to the daemon's disk. locate: its address
 * now (read back first when spilled), valid until the next park or release.
 * NOT_FOUND for an unknown ticket; locate: DATA_LOSS when a spilled copy
 * cannot be read back. Client::ParkState / LocateState. */
ACTSTASH_API int actstash_client_park(actstash_client* client, uint64_t ticket);
ACTSTASH_API int actstash_client_locate(actstash_client* client, uint64_t ticket, uintptr_t* data);

/* One AdamW step on the CPU over `count` fp32 tensors in place
 * (kernels/adamw.h: each operation rounded on its own, the same bits for
 * any thread count): tensor i has sizes[i] elements at params[i], grads[i],
 * exp_avgs[i], exp_avg_sqs[i] (addresses). step counts from 1. threads < 1
 * means 1. INVALID_ARGUMENT for a null array or step 0. */
ACTSTASH_API int actstash_adamw_step(uint64_t count, const uintptr_t* params,
                                     const uintptr_t* grads, const uintptr_t* exp_avgs,
                                     const uintptr_t* exp_avg_sqs, const uint64_t* sizes, double lr,
                                     double beta1, double beta2, double eps, double weight_decay,
                                     uint64_t step, int threads);
/* The same step for bf16 parameters with fp32 master weights: tensor i's
 * fp32 master at masters[i] and moments are updated with the bf16 gradient
 * at grads_bf16[i] (read as fp32, exactly), and the bf16 parameter at
 * params_bf16[i] gets the new master rounded to nearest even: the bits of
 * actstash_adamw_step on the cast gradient followed by a cast. */
ACTSTASH_API int actstash_adamw_step_bf16(uint64_t count, const uintptr_t* masters,
                                          const uintptr_t* grads_bf16, const uintptr_t* exp_avgs,
                                          const uintptr_t* exp_avg_sqs,
                                          const uintptr_t* params_bf16, const uint64_t* sizes,
                                          double lr, double beta1, double beta2, double eps,
                                          double weight_decay, uint64_t step, int threads);

/* Flags of actstash_engine_pack. */
#define ACTSTASH_ELEMENT_SIZE_MASK 0xF /* bits 0-3: element size in bytes */
#define ACTSTASH_FP32 (1 << 4)         /* the tensor is float32 (downcast eligible) */
#define ACTSTASH_DENSE (1 << 5)        /* elements fill [data, data + nbytes) */
#define ACTSTASH_SYNC (1 << 6)         /* SavedTensorInfo::sync: stored before pack returns */
#define ACTSTASH_KEEP_SHIFT 8          /* bits 8-11: a keep reason + 1, 0 for none */
#define ACTSTASH_NDIM_SHIFT 12         /* bits 12-15: ndim (sizes/strides when not dense) */
#define ACTSTASH_DEVICE_SHIFT 16       /* bits 16-31: CUDA ordinal + 1, 0 for the CPU */

/* Keep reasons (actstash::KeepReason), also the order of kept_* stats. */
#define ACTSTASH_KEEP_SMALL 0
#define ACTSTASH_KEEP_PARAMETER 1
#define ACTSTASH_KEEP_LISTED 2
#define ACTSTASH_KEEP_LAYOUT 3
#define ACTSTASH_KEEP_DEVICE 4
#define ACTSTASH_KEEP_NO_COPY_ENGINE 7

/* Functions the engine calls on the caller's behalf (all optional, in
 * pairs). acquire/release: owner references (the engine holds a source's
 * owner while it copies). unlock/relock: called around the waits inside
 * actstash_engine_pack (Python: PyEval_SaveThread and PyEval_RestoreThread,
 * so the GIL is free while the device works). */
typedef struct actstash_engine_callbacks {
  void (*acquire)(void*);
  void (*release)(void*);
  void* (*unlock)(void);
  void (*relock)(void*);
} actstash_engine_callbacks;

/* client may be NULL (no daemon: everything is kept). options_json: the
 * engine's settings by name, as for actstash_client_connect (names and
 * defaults: describe's "engine_options"): inline_store_bytes, cpu_views,
 * view_min_bytes, prefetch, cuda, device_pool, pool_importer, downcast_bf16,
 * on_failure ("raise" or "keep"), max_in_flight_bytes, max_in_flight_stores,
 * and for tests copy_delay_us (> 0: random delays before each host copy, and
 * every CPU store goes through the copy engine: inline_store_bytes becomes
 * 0), seed, and simulated_link_bytes_per_second (> 0: every host copy takes
 * at least its bytes / this, one direction at a time, and CPU tensors are
 * stored, fetched and prefetched through the copy engine as CUDA tensors
 * are: EngineOptions). callbacks may be NULL (none). */
ACTSTASH_API int actstash_engine_create(actstash_client* client, const char* options_json,
                                        const actstash_engine_callbacks* callbacks,
                                        actstash_engine** out);
/* The settings the engine runs with, as describe's "engine_options" (the
 * caller's string; NULL for a null handle). */
ACTSTASH_API char* actstash_engine_settings_json(actstash_engine* engine);
/* Waits for every copy, releases every owner it holds. */
ACTSTASH_API void actstash_engine_free(actstash_engine* engine);
/* The saved tensor's id (> 0), or 0 when kept. Never fails: errors are held
 * for actstash_engine_take_error. */
ACTSTASH_API uint64_t actstash_engine_pack(actstash_engine* engine, uintptr_t data, uint64_t nbytes,
                                           uint64_t flags, const int64_t* sizes,
                                           const int64_t* strides, uintptr_t stream,
                                           uint64_t version, void* owner, void* cookie,
                                           uint64_t min_bytes);
/* actstash_engine_pack for a dense CPU tensor the front-end already found at
 * least min_bytes large (flags: element size and ACTSTASH_FP32; the device
 * bits must be 0): fewer arguments for the common case. */
ACTSTASH_API uint64_t actstash_engine_pack_dense_cpu(actstash_engine* engine, uintptr_t data,
                                                     uint64_t nbytes, uint64_t flags,
                                                     uint64_t version, void* owner, void* cookie);
/* Kinds of answer of actstash_engine_unpack (actstash::UnpackKind). */
#define ACTSTASH_UNPACK_SOURCE 0
#define ACTSTASH_UNPACK_VIEW 1
#define ACTSTASH_UNPACK_DESTINATION 2
#define ACTSTASH_UNPACK_PREFETCHED 3
/* out[0] kind (ACTSTASH_UNPACK_*); out[1] the
 * owner (source/prefetched, a reference now the caller's) or the view's
 * address; out[2] bytes of the restored tensor; out[3] 1 when downcast;
 * out[4] n prefetch candidates, then n pairs (id, cookie; each cookie an
 * acquired reference, now the caller's). out_len >= 5 + 2 * prefetch.
 * version: the saved tensor's version now, or UINT64_MAX when unknown. */
ACTSTASH_API int actstash_engine_unpack(actstash_engine* engine, uint64_t id, uint64_t version,
                                        uint64_t* out, int out_len);
/* actstash_engine_unpack, and when the answer is "destination" and dst is
 * not 0, actstash_engine_fetch_into(dst, capacity, stream 0) at once: out[0]
 * is then ACTSTASH_UNPACK_COPIED. For CPU tensors small enough to be copied
 * back (one call instead of two); other answers leave dst untouched. */
#define ACTSTASH_UNPACK_COPIED 4
ACTSTASH_API int actstash_engine_unpack_into(actstash_engine* engine, uint64_t id, uint64_t version,
                                             uintptr_t dst, uint64_t capacity, uint64_t* out,
                                             int out_len);
ACTSTASH_API int actstash_engine_fetch_into(actstash_engine* engine, uint64_t id, uintptr_t dst,
                                            uint64_t capacity, uintptr_t stream);
ACTSTASH_API int actstash_engine_prefetch(actstash_engine* engine, uint64_t id, uintptr_t dst,
                                          uint64_t capacity, void* owner, uintptr_t stream);
ACTSTASH_API int actstash_engine_finish(actstash_engine* engine, uint64_t id, uintptr_t stream);
ACTSTASH_API void actstash_engine_view_done(actstash_engine* engine, uint64_t id);
ACTSTASH_API void actstash_engine_release(actstash_engine* engine, uint64_t id);
ACTSTASH_API int actstash_engine_reap(actstash_engine* engine, int wait);
ACTSTASH_API int actstash_engine_take_error(actstash_engine* engine);
/* 0, or a notice to warn about once (its message: actstash_last_error). */
ACTSTASH_API int actstash_engine_take_notice(actstash_engine* engine);
/* Waits for all copies, then drops the sources they held (releases owners). */
ACTSTASH_API void actstash_engine_synchronize(actstash_engine* engine);
/* Waits for all copies and releases, releasing no owner: call it without the
 * lock the owner functions need, then actstash_engine_reap. */
ACTSTASH_API void actstash_engine_wait(actstash_engine* engine);
ACTSTASH_API int actstash_engine_available(actstash_engine* engine);
/* Writes up to n counters (named by describe's "engine_stats"); returns how
 * many there are. */
ACTSTASH_API int actstash_engine_stats(actstash_engine* engine, uint64_t* values, int n);

#ifdef __cplusplus
}
#endif

#endif /* ACTSTASH_C_API_H_ */
